"""`kvchat pull` against a hostile Hub (tests/helpers/fake_hub.py on 127.0.0.1): whatever the
server answers, nothing is written outside the cache, the token stays with the endpoint's
host, and a stalled, cut-short, endless or wrong body ends in one line, bounded."""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path

import pytest

from kvchat.app.core import hub_download
from kvchat.app.core.hub_download import PullError, pull, repo_folder
from tests.helpers.app import folder_app, open_picker, ready
from tests.helpers.fake_hub import FakeHub, FakeRepo
from tests.helpers.paths import MINI, REPO_ROOT
from tests.helpers.scripted_engine import async_test, wait_for

REPO = "kvchat-test/mini"
WEIGHTS = (MINI / "model.safetensors").read_bytes()


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    c = tmp_path / "home" / "hf-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(c))
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(hub_download, "RETRY_WAIT_S", 0.0, raising=False)
    return c


def _files_outside(root: Path, cache: Path) -> list[Path]:
    """Every file or link under `root` (the test's tmp dir) that is not in the cache."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        for n in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            p = Path(dirpath) / n
            if cache not in p.parents:
                out.append(p)
    return out


@pytest.mark.parametrize("etag", ["{victim}", "../../../../victim", "../../victim",
                                  "W/\"zz\"", "a" * 300])
def test_path_shaped_etag_never_names_a_file(cache: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch, etag: str) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    etag = etag.format(victim=victim)
    with FakeHub({REPO: FakeRepo.from_folder(MINI)}, etag=etag) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        snap = pull(REPO)
    assert victim.read_text() == "precious"
    assert _files_outside(tmp_path, cache) == [victim]
    # the blob is named by a hash of the odd ETag, and the snapshot still reads right
    blobs = [p.name for p in (repo_folder(REPO, cache) / "blobs").iterdir()]
    assert hashlib.sha256(etag.strip('"').encode()).hexdigest() in blobs or \
        etag.startswith("W/")
    assert (snap / "model.safetensors").read_bytes() == WEIGHTS


@pytest.mark.parametrize("sha", ["{target}", "../../../target", "..", "0" * 39 + "/",
                                 "ABCDEF0123ABCDEF0123ABCDEF0123ABCDEF0123"])
def test_path_shaped_commit_is_refused(cache: Path, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch, sha: str) -> None:
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text("mine")
    sha = sha.format(target=target)
    with FakeHub({REPO: FakeRepo.from_folder(MINI)}, sha=sha) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        with pytest.raises(PullError, match="not a 40-digit hex hash"):
            pull(REPO)
        assert not [p for m, p, _ in hub.requests if "/resolve/" in p]  # refused first
    assert (target / "config.json").read_text() == "mine"
    assert not (target / "config.json").is_symlink()
    assert _files_outside(tmp_path, cache) == [target / "config.json"]


@pytest.mark.parametrize("revision", ["../../x", "/etc/x", "a/../../x", "..", "main/", "a\\b",
                                      "main\n", ".hidden", "x.lock", "a//b", "a\x00b"])
def test_revision_traversal_is_refused_before_any_request(
        cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, revision: str) -> None:
    with FakeHub({REPO: FakeRepo.from_folder(MINI)}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        with pytest.raises(PullError, match="not a valid revision name"):
            pull(REPO, revision)
        assert hub.requests == []
    assert _files_outside(tmp_path, cache) == []


def test_branch_namespaces_are_valid_revisions() -> None:
    for ok in ("main", "refs/pr/1", "v1.0", "feature/x-y_z", "0" * 40):
        assert hub_download.check_revision(ok) == ok


def test_file_names_and_paths_stay_inside(tmp_path: Path) -> None:
    for bad in ("../x.json", "/etc/passwd", "a/../../b", "", "a\\b.json", "./a.json", "a//b"):
        with pytest.raises(PullError):
            hub_download.check_file_name(bad)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "link").symlink_to(tmp_path)
    with pytest.raises(PullError, match="outside the cache"):
        hub_download.inside(tmp_path / "cache", tmp_path / "cache" / "link" / "x")
    with pytest.raises(PullError, match="outside the cache"):
        hub_download.inside(tmp_path / "cache", tmp_path / "cache" / ".." / "x")
    # a link as the last component is replaced, never written through: allowed
    assert hub_download.inside(tmp_path / "cache", tmp_path / "cache" / "link")


def test_token_goes_only_to_the_endpoint_host(cache: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    repos = {REPO: FakeRepo.from_folder(MINI)}
    with FakeHub(repos) as cdn, FakeHub(repos, cdn_url=cdn.url) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_TOKEN", "hf_secret_token")
        snap = pull(REPO)
        to_hub = [h for _, _, h in hub.requests]
        to_cdn = [h for _, _, h in cdn.requests]
    assert (snap / "model.safetensors").read_bytes() == WEIGHTS
    assert to_cdn, "the LFS file came from the other host"
    assert all("hf_secret_token" in str(h) for h in to_hub)  # the endpoint gets the token
    assert not any("hf_secret_token" in str(h) for h in to_cdn)


def test_stalled_server_gives_one_line_in_bounded_time(cache: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hub_download, "READ_TIMEOUT_S", 1.0)
    with FakeHub({REPO: FakeRepo.from_folder(MINI)}, stall_after=100_000, lifetime_s=30) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        t0 = time.monotonic()
        with pytest.raises(PullError, match="stopped sending for 1 s") as e:
            pull(REPO)
        took = time.monotonic() - t0
    assert took < 10, took
    assert "\n" not in str(e.value)
    assert str(e.value).endswith("; partial files are kept, run it again to resume")
    parts = list((repo_folder(REPO, cache) / "blobs").glob("*.incomplete"))
    assert parts and parts[0].stat().st_size > 0  # kept for the next run


def test_short_bodies_without_range_use_a_bounded_budget(cache: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    with FakeHub({REPO: FakeRepo.from_folder(MINI)}, cut_always=200_000) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        with pytest.raises(PullError, match="gave up after 5 retries"):
            pull(REPO)
        gets = [p for m, p, _ in hub.requests if m == "GET" and p.startswith("/cdn/")]
    assert len(gets) == hub_download.FILE_RETRIES + 1


def test_pull_budget_spans_files(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    r = hub_download.Retries(pull_left=2)
    r.spend("a", "x")
    r.file_left = hub_download.FILE_RETRIES  # the next file
    r.spend("b", "x")
    with pytest.raises(PullError, match="gave up"):
        r.spend("b", "x")


def test_endless_body_stops_at_the_announced_size(cache: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    with FakeHub({REPO: FakeRepo.from_folder(MINI)}, endless=True) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        with pytest.raises(PullError, match="more than the 1,349,713 bytes it announced"):
            pull(REPO)
    # nothing larger than the file itself was kept anywhere
    sizes = [p.stat().st_size for p in tmp_path.rglob("*") if p.is_file()]
    assert max(sizes) <= len(WEIGHTS)
    assert not list((repo_folder(REPO, cache) / "blobs").glob("*.incomplete"))


def test_wrong_sha256_is_deleted_and_reported(cache: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    with FakeHub({REPO: FakeRepo.from_folder(MINI)}, corrupt=True) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        with pytest.raises(PullError, match="model.safetensors: its sha256 does not match"):
            pull(REPO)
    blobs = repo_folder(REPO, cache) / "blobs"
    assert not [p for p in blobs.iterdir() if p.stat().st_size == len(WEIGHTS)]


def test_free_space_is_checked_before_the_first_byte(cache: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    real = shutil.disk_usage
    monkeypatch.setattr(hub_download.shutil, "disk_usage",
                        lambda p: real(p)._replace(free=1000))
    with FakeHub({REPO: FakeRepo.from_folder(MINI)}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        with pytest.raises(PullError, match="not enough disk space"):
            pull(REPO)
        assert not [p for m, p, _ in hub.requests if m == "GET" and "/api/" not in p]



@async_test
async def test_picker_esc_stops_a_stalled_pull_at_once_and_quit_is_not_held(
        models_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The chat's picker, with a server that stalls mid-file and the default (20 s) read
    timeout: Esc says "stopped" at once, and the pull runs on a daemon thread (a Textual
    thread worker would be joined at interpreter exit, holding Ctrl+Q)."""
    import threading

    from textual.widgets import Input, Static

    with FakeHub({REPO: FakeRepo.from_folder(MINI)}, stall_after=100_000, lifetime_s=30) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        app = folder_app(models_env)
        async with app.run_test(size=(120, 40)) as pilot:
            await ready(pilot)
            picker = await open_picker(pilot)
            picker.query_one("#path", Input).value = REPO
            await pilot.press("enter")
            box = picker.query_one("#pull-progress", Static)
            await wait_for(pilot, lambda: any(p.startswith("/cdn/") for _, p, _ in hub.requests),
                           timeout=30)
            await pilot.pause(0.5)  # the server now holds the body
            assert picker.pulling is not None and "✓" not in str(box.render())
            pulls = [t for t in threading.enumerate() if t.name == "kvchat-pull"]
            assert pulls and all(t.daemon for t in pulls)
            t0 = time.monotonic()
            await pilot.press("escape")
            await pilot.pause()
            assert "download stopped" in str(box.render())
            assert time.monotonic() - t0 < 2
            assert picker.pulling is None and app.screen is picker  # still choosing


@pytest.mark.parametrize("info", [{"sha": "0" * 40}, [1, 2], 5, {"id": REPO, "siblings": 3}])
def test_model_info_of_another_shape_is_one_line_naming_the_hub(
        cache: Path, monkeypatch: pytest.MonkeyPatch, info: object) -> None:
    with FakeHub({REPO: FakeRepo.from_folder(MINI)}, info=info) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        url = hub.url
        with pytest.raises(PullError) as e:
            pull(REPO)
    msg = str(e.value)
    assert url in msg and "\n" not in msg, msg


def test_hostfile_fields_of_the_wrong_type_name_the_host(tmp_path: Path) -> None:
    import json

    from kvchat.app.core.hosts import HostsError, read_hostfile

    f = tmp_path / "hosts.json"
    for hosts, want in (
        ([{"ssh": "a", "ips": ["1"]}, {"ssh": "b", "ips": 5}], r"host 1 \(b\) needs \"ips\""),
        ([{"ssh": "a", "ips": ["1"]}, {"ssh": "b", "ips": ["2"], "model": 3}],
         r"host 1 \(b\): \"model\" is not a path"),
    ):
        f.write_text(json.dumps({"hosts": hosts}))
        with pytest.raises(HostsError, match=want):
            read_hostfile(f)
    f.write_text("[" * 10_000)
    with pytest.raises(HostsError, match="hosts.json: nested deeper"):
        read_hostfile(f)


def test_free_space_counts_only_what_is_not_cached(cache: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    with FakeHub({REPO: FakeRepo.from_folder(MINI)}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        pull(REPO)  # everything cached; now a disk with room for the small files only
        real = shutil.disk_usage
        monkeypatch.setattr(hub_download.shutil, "disk_usage",
                            lambda p: real(p)._replace(free=len(WEIGHTS) // 2))
        pull(REPO)


def test_a_range_answer_for_other_bytes_starts_over(cache: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A 206 whose Content-Range is not the part asked for is never appended."""
    with FakeHub({REPO: FakeRepo.from_folder(MINI)}, cut_after=100_000, bad_range=True) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        snap = pull(REPO)
        ranges = [h.get("Range") for m, p, h in hub.requests if p.startswith("/cdn/")]
    assert any(r and r != "bytes=0-" for r in ranges)  # it did ask for the rest
    assert (snap / "model.safetensors").read_bytes() == WEIGHTS


def test_an_empty_file_in_the_repo_is_fetched(cache: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    repo = FakeRepo({**FakeRepo.from_folder(MINI).files, "added_tokens.json": b""})
    with FakeHub({REPO: repo}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        snap = pull(REPO)
    assert (snap / "added_tokens.json").read_bytes() == b""


# ---- answers bounded once decoded, and what is refused before any weight ---------------


@pytest.fixture(scope="module")
def gzip_bomb() -> bytes:
    """About 1 MB of gzip that decodes to 1 GiB of zeros."""
    import zlib

    c = zlib.compressobj(9, zlib.DEFLATED, zlib.MAX_WBITS | 16)
    zeros = bytes(2**20)
    body = b"".join(c.compress(zeros) for _ in range(1024)) + c.flush()
    assert 900_000 < len(body) < 1_100_000
    return body


# in a child process, so its peak memory is its own: the growth from just before the pull
_PULL_AND_MEASURE = """
import json, resource, sys
from kvchat.app.core.hub_download import pull
from kvchat.model.errors import KVChatError
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    pull(sys.argv[1])
    error = None
except KVChatError as e:
    error = str(e)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"error": error, "growth_kib": peak - base}))
"""


@pytest.mark.parametrize("where", ["api", "error", "cdn"])
def test_a_gzip_bomb_never_expands_past_the_answer_bound(cache: Path, gzip_bomb: bytes,
                                                         where: str) -> None:
    """1 MB on the wire that decodes to 1 GiB, as the model-info answer, as an error
    answer and as a file: one line, and the pull's peak memory grows by well under the
    bomb (the bound is hub_http.ANSWER_MAX_BYTES; a file is refused before any byte)."""
    import json
    import sys

    from kvchat.app.core.hub_http import ANSWER_MAX_BYTES
    from tests.helpers import processes

    with FakeHub({REPO: FakeRepo.from_folder(MINI)}, bomb=where, bomb_body=gzip_bomb) as hub:
        r = processes.run([sys.executable, "-c", _PULL_AND_MEASURE, REPO],
                          capture_output=True, text=True, cwd=REPO_ROOT, timeout=120,
                          env={**os.environ, "HF_ENDPOINT": hub.url})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["error"] and "\n" not in out["error"]
    if where == "api":
        assert f"sent more than {ANSWER_MAX_BYTES:,} bytes once decompressed" in out["error"]
    if where == "cdn":
        assert "answered in 'gzip' encoding, but it was asked for none" in out["error"]
        part = next((repo_folder(REPO, cache) / "blobs").glob("*.incomplete"))
        assert part.stat().st_size == 0  # nothing decoded was written
    assert out["growth_kib"] * 1024 < 3 * ANSWER_MAX_BYTES + 64 * 2**20, out


def test_an_answer_within_the_bound_decodes_as_usual(cache: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: a gzipped model-info answer (as the Hub sends them) still reads."""
    import gzip
    import json

    repo = FakeRepo.from_folder(MINI)
    siblings = [{"rfilename": n, "size": len(d)} for n, d in repo.files.items()]
    body = gzip.compress(json.dumps({"id": REPO, "sha": repo.sha, "siblings": siblings,
                                     "private": False}).encode())
    with FakeHub({REPO: repo}, bomb="api", bomb_body=body) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        snap = pull(REPO)
    assert (snap / "model.safetensors").read_bytes() == WEIGHTS


def test_a_file_name_too_long_to_store_is_refused_before_any_download(
        cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = FakeRepo.from_folder(MINI)
    long_name = "n" * 300 + ".json"
    repo.files[long_name] = b"{}"
    with FakeHub({REPO: repo}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        with pytest.raises(PullError) as e:
            pull(REPO)
        assert not [p for m, p, _ in hub.requests if "/resolve/" in p or "/cdn/" in p]
    assert "whose name is 305 bytes long ('nnnnn" in str(e.value)
    assert "over the 255 a file system stores" in str(e.value) and "\n" not in str(e.value)


def test_a_quantization_kvchat_cannot_load_is_refused_before_the_weights(
        cache: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """config.json comes first and is checked as the loader checks it: the weights are
    never requested, and the line names the file and the values."""
    import json

    folder = tmp_path / "mini"
    shutil.copytree(MINI, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization"] = {"bits": 3, "group_size": 7}
    (folder / "config.json").write_text(json.dumps(cfg))
    with FakeHub({REPO: FakeRepo.from_folder(folder)}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        with pytest.raises(PullError) as e:
            pull(REPO)
        fetched = [p for m, p, _ in hub.requests if m == "GET" and (
            "/cdn/" in p or p.endswith(".safetensors"))]
    assert fetched == []
    assert str(e.value) == (
        "refusing the pull before its weights: config.json: unsupported quantization bits=3"
        " group_size=7 (kvchat loads bits 2, 3, 4, 5, 6, 8 in groups of 32, 64, 128)")
    # the folder's listing says so too (inspect, models and the picker read these facts)
    from kvchat.model.explain.facts import folder_status

    assert folder_status(folder)[1] == str(e.value).removeprefix(
        "refusing the pull before its weights: ")
