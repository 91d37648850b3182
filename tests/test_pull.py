"""`kvchat pull` against a fake Hub on 127.0.0.1 (tests/helpers/fake_hub.py) serving the shipped
model the way huggingface_hub expects the real Hub to."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvchat.app.core.hub_download import PullCancelled, PullError, pull, repo_folder
from kvchat.model.explain.facts import check_model_folder
from tests.helpers import processes
from tests.helpers.fake_hub import FakeHub, FakeRepo
from tests.helpers.paths import REPO_ROOT

MINI = REPO_ROOT / "assets" / "kvchat-mini"
REPO = "kvchat-test/mini"


def kvchat(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return processes.run(
        [sys.executable, "-m", "kvchat.app", *args], capture_output=True, text=True, cwd=REPO_ROOT,
        env={**os.environ, **env}, timeout=120,
    )


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    c = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(c))
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):  # other modules set them
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("KVCHAT_CONFIG_DIR", str(tmp_path / "config"))
    return c


def _served_files() -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in MINI.iterdir() if p.is_file()}


def test_cli_pull_downloads_verifies_and_lists(cache: Path) -> None:
    with FakeHub({REPO: FakeRepo.from_folder(MINI)}) as hub:
        env = {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(cache)}
        r = kvchat("pull", REPO, env=env)
        methods = {(m, p.split("/")[1] if p.startswith("/api") else p.split("/")[3]
                    if "/resolve/" in p else "cdn") for m, p, _ in hub.requests}
    assert r.returncode == 0, r.stderr
    assert f"{REPO}: ready" in r.stdout
    snap = Path(r.stdout.splitlines()[1])
    assert snap.parent.parent == repo_folder(REPO, cache)
    # every file kvchat reads arrived byte for byte (README.md is not fetched)
    for name, data in _served_files().items():
        if name == "README.md":
            assert not (snap / name).exists()
        else:
            assert (snap / name).read_bytes() == data, name
    assert (repo_folder(REPO, cache) / "refs" / "main").read_text() == snap.name
    # the Hub conversation: model info, HEAD per file, GETs (LFS via the CDN redirect)
    assert ("GET", "api") in methods and ("HEAD", "resolve") in methods
    assert ("GET", "cdn") in methods
    # progress: on a pipe, one total line per finished file, the last at 100 %
    totals = [ln for ln in r.stderr.splitlines() if ln.startswith("total ")]
    assert len(totals) == 7 and "7/7 files" in totals[-1] and "100%" in totals[-1]
    assert "/s" in totals[-1] and "ETA" in totals[-1]
    check_model_folder(snap)
    # the chat names it org/name (the engine's model info), not by its snapshot hash
    from kvchat.model.decoder.weights import load_model
    from kvchat.model.runtime.engine import model_info
    from kvchat.model.text.tokenizer import load_tokenizer

    assert model_info(load_model(snap), load_tokenizer(snap))["name"] == REPO
    listed = json.loads(kvchat("models", "--json", env=env).stdout)["models"]
    mine = [m for m in listed if m["name"] == REPO]
    assert mine and mine[0]["source"] == "hf-cache" and Path(mine[0]["path"]) == snap.resolve()


def test_partial_file_resumes_with_range(cache: Path) -> None:
    files = _served_files()
    weights = files["model.safetensors"]
    stop = threading.Event()

    def stop_midway(p) -> None:  # noqa: ANN001
        if p.file == "model.safetensors" and p.file_done > 200_000:
            stop.set()

    with FakeHub({REPO: FakeRepo.from_folder(MINI)}) as hub:
        os.environ["HF_ENDPOINT"] = hub.url
        try:
            with pytest.raises(PullCancelled):
                pull(REPO, on_progress=stop_midway, cancel=stop)
            parts = list((repo_folder(REPO, cache) / "blobs").glob("*.incomplete"))
            assert len(parts) == 1
            have = parts[0].stat().st_size
            assert 200_000 < have < len(weights)
            n_before = len(hub.requests)
            seen = []
            snap = pull(REPO, on_progress=lambda p: seen.append(p.resumed_bytes))
        finally:
            del os.environ["HF_ENDPOINT"]
        ranges = [h.get("Range") for m, p, h in hub.requests[n_before:]
                  if m == "GET" and p.startswith("/cdn/")]
    assert f"bytes={have}-" in ranges  # asked only for the rest
    assert seen[-1] == have
    assert hashlib.sha256((snap / "model.safetensors").read_bytes()).digest() == \
        hashlib.sha256(weights).digest()
    assert not list((repo_folder(REPO, cache) / "blobs").glob("*.incomplete"))


def test_dropped_connection_resumes_in_the_same_run(cache: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    with FakeHub({REPO: FakeRepo.from_folder(MINI)}, cut_after=100_000) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        snap = pull(REPO)
        ranges = [h.get("Range") for m, p, h in hub.requests if p.startswith("/cdn/")]
    assert any(r and r.startswith("bytes=") and r != "bytes=0-" for r in ranges), ranges
    assert (snap / "model.safetensors").read_bytes() == (MINI / "model.safetensors").read_bytes()


def test_pickle_only_repo_is_refused_before_download(cache: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    files = {"config.json": (MINI / "config.json").read_bytes(),
             "tokenizer.model": (MINI / "tokenizer.model").read_bytes(),
             "pytorch_model.bin": b"\x80\x04pickle"}
    with FakeHub({REPO: FakeRepo(files)}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        with pytest.raises(PullError, match="refusing pickle checkpoint pytorch_model.bin"):
            pull(REPO)
        assert not [p for _, p, _ in hub.requests if "pytorch_model" in p]


def test_repo_without_tokenizer_is_refused(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = {n: (MINI / n).read_bytes() for n in ("config.json", "model.safetensors")}
    with FakeHub({REPO: FakeRepo(files)}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        with pytest.raises(PullError, match="no tokenizer"):
            pull(REPO)


def test_unknown_repo_and_revision_are_one_line(cache: Path) -> None:
    with FakeHub({REPO: FakeRepo.from_folder(MINI)}) as hub:
        env = {"HF_ENDPOINT": hub.url}
        r = kvchat("pull", "nobody/nothing", env=env)
        r2 = kvchat("pull", REPO, "--revision", "v9", env=env)
    assert r.returncode == 1 and r.stderr.strip().count("\n") == 0
    assert r.stderr.startswith("kvchat: error: no model nobody/nothing on http://127.0.0.1")
    assert r2.returncode == 1 and "has no such revision" in r2.stderr


def test_no_network_is_one_line(cache: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    r = kvchat("pull", REPO, env={"HF_ENDPOINT": f"http://127.0.0.1:{port}"})
    assert r.returncode == 1
    assert r.stderr.strip().count("\n") == 0
    assert r.stderr.startswith(f"kvchat: error: cannot reach http://127.0.0.1:{port}")
    assert time.monotonic() - t0 < 60
    assert "partial" not in r.stderr.lower()  # nothing was downloaded: nothing is kept


def test_no_network_says_partial_files_are_kept_only_when_there_are_some(
        cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(PullError) as e:
        pull(REPO)
    assert str(e.value).startswith("cannot reach") and "partial" not in str(e.value)
    blobs = repo_folder(REPO, cache) / "blobs"
    blobs.mkdir(parents=True)
    (blobs / ("0" * 64 + ".incomplete")).write_bytes(b"half a file")  # an earlier pull's
    with pytest.raises(PullError) as e:
        pull(REPO)
    assert str(e.value).endswith("partial files are kept, run it again to resume")


def test_offline_mode_uses_the_cache_or_says_why(cache: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    r = kvchat("pull", REPO, env={"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"})
    assert r.returncode == 1 and "offline mode (HF_HUB_OFFLINE) is on" in r.stderr
    with FakeHub({REPO: FakeRepo.from_folder(MINI)}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        snap = pull(REPO)
        n = len(hub.requests)
        r = kvchat("pull", REPO, env={"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": hub.url})
        assert len(hub.requests) == n  # no request at all
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.splitlines()[1]) == snap


def test_terminal_progress_moves_the_cursor_but_shows_file_names_literally() -> None:
    """Through the CLI's VisibleWriter: the two lines are redrawn in place (its own ESC
    sequences pass), while a file name from the Hub with an escape in it is only shown."""
    import io

    from kvchat.app.cli.pull import TerminalProgress
    from kvchat.app.core.hub_download import PullProgress
    from kvchat.app.core.text import VisibleWriter

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    raw = Tty()
    show = TerminalProgress(VisibleWriter(raw))
    p = PullProgress(REPO, files_total=2, bytes_total=200, file="a\x1b]0;pwned\x07.bin",
                     file_total=100)
    show(p, force=True)
    p.received(100)
    show(p, force=True)
    first, second = raw.getvalue().split("\x1b[2F")  # the second draw moves up two lines
    for draw in (first, second):
        assert draw.count("\x1b[2K") == 2  # each of the two lines cleared, then written
        assert "a␛]0;pwned␇.bin" in draw and "\x07" not in draw and "\x1b]" not in draw
    assert "100%" in second.split("\n")[0]
