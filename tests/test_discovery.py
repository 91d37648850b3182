"""Model discovery over fake HF cache / LM Studio / configured trees, and `kvchat models`."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from kvchat.app.cli import models as models_cmd
from kvchat.app.core import discovery
from kvchat.app.core.discovery import (
    DEFAULT_MODEL,
    ModelEntry,
    default_model_dirs,
    find_models,
    human_bytes,
    read_model_folder,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Never look at the real machine's caches: HOME and every HF variable point into tmp."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for var in ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME",
                "OLLAMA_MODELS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("KVCHAT_CONFIG_DIR", str(tmp_path / "config"))
    # the repo may ship assets/kvchat-mini; tests decide what "assets" holds
    monkeypatch.setattr(discovery, "DEFAULT_MODEL", tmp_path / "no-assets" / "kvchat-mini")
    return home


def make_model(
    folder: Path,
    *,
    model_type: str | None = "llama",
    quant: dict | None = None,
    weights: dict[str, int] | None = None,
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    cfg: dict = {"hidden_size": 8}
    if model_type is not None:
        cfg["model_type"] = model_type
    if quant is not None:
        cfg["quantization"] = quant
    (folder / "config.json").write_text(json.dumps(cfg))
    for name, size in (weights if weights is not None else {"model.safetensors": 100}).items():
        (folder / name).write_bytes(b"\0" * size)
    return folder


def make_hf_repo(
    hub: Path, repo_id: str, revs: dict[str, dict[str, int]], main: str | None = None
) -> Path:
    """HF cache layout: blobs hold the bytes; snapshots/<rev>/ holds relative symlinks."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    blobs = repo / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    for rev, files in revs.items():
        snap = repo / "snapshots" / rev
        snap.mkdir(parents=True)
        all_files = {
            "config.json": json.dumps({"model_type": "qwen2"}).encode(),
            **{n: b"\1" * s for n, s in files.items()},
        }
        for name, data in all_files.items():
            blob = blobs / f"{rev}-{name}"
            blob.write_bytes(data)
            (snap / name).symlink_to(os.path.relpath(blob, snap))
    if main:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(main)
    return repo


# --- HF cache ----------------------------------------------------------------------


def test_hf_cache_via_hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hfhome"))
    hub = tmp_path / "hfhome" / "hub"
    make_hf_repo(hub, "org/Tiny-Model", {"abc123": {"model.safetensors": 4096}}, main="abc123")
    (hub / "datasets--org--data").mkdir()  # not a model repo
    (hub / ".locks").mkdir()

    [e] = find_models()
    assert e.name == "org/Tiny-Model"
    assert e.source == "hf-cache"
    assert e.architecture == "qwen2"
    assert e.size_bytes == 4096  # blob size, not the symlink's
    assert e.path == (hub / "models--org--Tiny-Model" / "snapshots" / "abc123").resolve()
    assert e.bits is None


def test_hf_hub_cache_takes_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hfhome"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub2"))
    make_hf_repo(tmp_path / "hfhome" / "hub", "a/ignored", {"r1": {"model.safetensors": 1}})
    make_hf_repo(tmp_path / "hub2", "b/used", {"r1": {"model.safetensors": 1}})
    assert [e.name for e in find_models()] == ["b/used"]
    assert (tmp_path / "hub2", "hf-cache") in default_model_dirs()


def test_hf_default_location_under_home(isolated_home: Path) -> None:
    hub = isolated_home / ".cache" / "huggingface" / "hub"
    make_hf_repo(hub, "org/m", {"r1": {"model.safetensors": 10}})
    assert [(e.name, e.source) for e in find_models()] == [("org/m", "hf-cache")]


def test_hf_refs_main_wins_and_incomplete_snapshot_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    hub = tmp_path / "hub"
    repo = make_hf_repo(
        hub,
        "org/m",
        {"old": {"model.safetensors": 10}, "new": {"model.safetensors": 20}},
        main="old",
    )
    [e] = find_models()
    assert e.path.name == "old" and e.size_bytes == 10

    # break refs/main's snapshot (a blob went missing): fall back to the other one
    (repo / "blobs" / "old-model.safetensors").unlink()
    [e] = find_models()
    assert e.path.name == "new" and e.size_bytes == 20


def test_hf_sharded_with_missing_shard_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = make_hf_repo(
        tmp_path / "hub", "org/sharded", {"r": {"model-00001-of-00002.safetensors": 5}}
    )
    index = {
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
        }
    }
    (repo / "snapshots" / "r" / "model.safetensors.index.json").write_text(json.dumps(index))
    assert find_models() == []
    (repo / "snapshots" / "r" / "model-00002-of-00002.safetensors").write_bytes(b"x" * 7)
    [e] = find_models()
    assert e.size_bytes == 12


# --- LM Studio ---------------------------------------------------------------------


def test_lmstudio_both_locations(isolated_home: Path) -> None:
    make_model(
        isolated_home / ".lmstudio" / "models" / "mlx-community" / "Qwen-4bit",
        model_type="qwen2",
        quant={"group_size": 64, "bits": 4},
    )
    make_model(isolated_home / ".cache" / "lm-studio" / "models" / "pub" / "Legacy")
    found = find_models()
    assert [(e.name, e.source, e.bits) for e in found] == [
        ("mlx-community/Qwen-4bit", "lm-studio", 4),
        ("pub/Legacy", "lm-studio", None),
    ]


# --- configured folders ------------------------------------------------------------


def test_configured_dirs_nesting_and_depth(tmp_path: Path) -> None:
    root = tmp_path / "models"
    make_model(root / "a")  # depth 1
    make_model(root / "x" / "y" / "z" / "deep4")  # depth 4: found
    make_model(root / "x" / "y" / "z" / "w" / "deep5")  # depth 5: too deep
    make_model(root / ".hidden" / "m")
    found = find_models([str(root)], include_defaults=False)
    assert [e.name for e in found] == ["a", "x/y/z/deep4"]
    assert all(e.source == "configured" for e in found)


def test_configured_dir_that_is_a_model(tmp_path: Path) -> None:
    m = make_model(tmp_path / "mymodel", weights={"a.safetensors": 3, "b.safetensors": 4})
    make_model(m / "nested")  # never descend into a model folder
    [e] = find_models([m])
    assert (e.name, e.size_bytes, e.source) == ("mymodel", 7, "configured")


def test_tilde_in_configured_dir(isolated_home: Path) -> None:
    make_model(isolated_home / "llms" / "m")
    [e] = find_models(["~/llms"])
    assert e.name == "m"


def test_bad_folders_are_skipped(tmp_path: Path) -> None:
    root = tmp_path / "models"
    make_model(root / "good")
    bad_json = make_model(root / "bad_json")
    (bad_json / "config.json").write_text("{not json")
    not_obj = make_model(root / "not_object")
    (not_obj / "config.json").write_text("[1, 2]")
    binary = make_model(root / "binary_config")
    (binary / "config.json").write_bytes(b"\xff\xfe\x00garbage")
    no_weights = root / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text("{}")
    (no_weights / "pytorch_model.bin").write_bytes(b"x")
    broken = make_model(root / "broken_link", weights={})
    (broken / "model.safetensors").symlink_to(tmp_path / "gone")
    bad_index = make_model(root / "bad_index")
    (bad_index / "model.safetensors.index.json").write_text("{}")
    (root / "a_file.safetensors").write_text("stray")
    no_type = make_model(root / "no_type", model_type=None)

    found = find_models([root], include_defaults=False)
    assert sorted(e.name for e in found) == ["good", "no_type"]
    assert {e.name: e.architecture for e in found}["no_type"] == "unknown"
    assert read_model_folder(no_type, "x", "configured").supported is False


def test_unreadable_folder_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # tests may run as root, where chmod 000 does not stop reads: fake the OSError instead
    root = tmp_path / "models"
    make_model(root / "good")
    locked = root / "locked"
    make_model(locked / "inner")
    real_scandir = os.scandir

    def scandir(path):  # type: ignore[no-untyped-def]
        if Path(path) == locked:
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    assert [e.name for e in find_models([root], include_defaults=False)] == ["good"]


def test_symlink_loop_terminates(tmp_path: Path) -> None:
    root = tmp_path / "models"
    make_model(root / "m")
    (root / "loop").symlink_to(root)
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "up").symlink_to(root / "a")
    assert [e.name for e in find_models([root], include_defaults=False)] == ["m"]


def test_missing_and_file_roots(tmp_path: Path) -> None:
    f = tmp_path / "file.txt"
    f.write_text("x")
    assert find_models([tmp_path / "nope", f]) == []


# --- dedup, order, assets ----------------------------------------------------------


def test_dedup_by_resolved_path_and_sort(
    tmp_path: Path, isolated_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lm = isolated_home / ".lmstudio" / "models"
    make_model(lm / "pub" / "Linked")
    make_model(lm / "pub" / "Alpha")
    link = tmp_path / "linked"
    link.symlink_to(lm / "pub" / "Linked")
    other = tmp_path / "other"
    make_model(other / "zeta")
    make_model(other / "Beta")
    assets = make_model(tmp_path / "pkg" / "assets" / "kvchat-mini")
    monkeypatch.setattr(discovery, "DEFAULT_MODEL", assets)

    found = find_models([link, other, other])
    assert [(e.source, e.name) for e in found] == [
        ("configured", "Beta"),
        ("configured", "linked"),  # the configured root wins over the LM Studio copy
        ("configured", "zeta"),
        ("lm-studio", "pub/Alpha"),
        ("assets", "kvchat-mini"),
    ]
    assert len({e.path for e in found}) == len(found)


def test_default_model_is_repo_assets() -> None:
    # DEFAULT_MODEL was imported before the autouse fixture patched the module attribute
    expected = Path(discovery.__file__).resolve().parents[2] / "assets" / "kvchat-mini"
    assert DEFAULT_MODEL == expected
    # the repository's assets, or their copy inside an installed (non-editable) package
    shipped = REPO / "assets" / "kvchat-mini" / "config.json"
    assert (DEFAULT_MODEL / "config.json").read_bytes() == shipped.read_bytes()


def test_default_model_dirs_order(tmp_path: Path, isolated_home: Path) -> None:
    dirs = default_model_dirs([str(tmp_path / "mine")])
    assert [s for _, s in dirs] == ["configured", "hf-cache", "lm-studio", "lm-studio",
                                    "ollama", "assets"]
    assert dirs[0][0] == tmp_path / "mine"
    # folders named on the command line come first, under their own source
    given = default_model_dirs([str(tmp_path / "mine")], given=[str(tmp_path / "cli")])
    assert given[:2] == [(tmp_path / "cli", "--dir"), (tmp_path / "mine", "configured")]
    assert dirs[1][0] == isolated_home / ".cache" / "huggingface" / "hub"
    assert dirs[2][0] == isolated_home / ".lmstudio" / "models"
    assert dirs[3][0] == isolated_home / ".cache" / "lm-studio" / "models"
    assert dirs[4][0] == isolated_home / ".ollama" / "models"
    assert dirs[-1][0] == discovery.DEFAULT_MODEL


def test_real_model(stories260k: Path) -> None:
    e = read_model_folder(stories260k, "stories260K", "configured")
    assert e is not None and e.architecture == "llama" and e.supported
    assert e.size_bytes == (stories260k / "model.safetensors").stat().st_size


# --- human_bytes -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1 KiB"),
        (1536, "1.5 KiB"),
        (int(1.5 * 2**20), "1.5 MiB"),
        (3 * 2**30, "3 GiB"),
    ],
)
def test_human_bytes(n: int, text: str) -> None:
    # discovery re-exports kv_math's formatter rather than keeping a second one
    from kvchat.model.cache import kv_math

    assert human_bytes is kv_math.human_bytes
    assert human_bytes(n) == text


# --- kvchat models -----------------------------------------------------------------


def _run(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    models_cmd.add_arguments(p)
    return models_cmd.run(p.parse_args(argv))


def test_models_cmd_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_model(tmp_path / "m" / "small-model", weights={"model.safetensors": 1536})
    make_model(tmp_path / "m" / "q", model_type="bitnet", quant={"bits": 4})
    assert _run(["--dir", str(tmp_path / "m")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "ARCH", "BITS", "DTYPE", "MEMORY", "FITS", "SOURCE",
                                "PATH"]
    # neither fake folder can be loaded: listed, marked, and the reason is printed
    # a folder named with --dir is listed as such, not as one of the settings' folders
    assert lines[1].split() == [
        "q", "✗", "bitnet", "4", "-", "-", "-", "--dir", str((tmp_path / "m" / "q").resolve()),
    ]
    assert lines[2].split()[:6] == ["small-model", "✗", "llama", "-", "-", "-"]
    # aligned: the PATH column starts at the same offset on every row
    starts = {line.index("/") for line in lines[1:3]}
    assert len(starts) == 1
    assert "cannot load" in lines[4]
    assert lines[5].startswith("  q: unknown architecture 'bitnet'")


def test_models_cmd_json_and_settings_dirs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvchat.app.core.settings import Settings, save_settings

    make_model(tmp_path / "fromsettings" / "m1")
    save_settings(Settings(model_dirs=[str(tmp_path / "fromsettings")]))
    assert _run(["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [m["name"] for m in out["models"]] == ["m1"]
    m = out["models"][0]
    assert set(m) == {"name", "path", "architecture", "size_bytes", "bits", "source", "supported",
                      "loadable", "problem", "weight_bytes", "compute_dtype", "file_dtype",
                      "quantization", "memory"}
    assert m["quantization"] is None  # a folder; a GGUF file's type otherwise
    assert str(tmp_path / "fromsettings") in out["looked_in"]


def test_models_cmd_says_where_each_folder_came_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--dir folders are "--dir", settings' model_dirs "configured"; a folder reachable
    both ways is listed once, as --dir (the command line wins)."""
    from kvchat.app.core.settings import Settings, save_settings

    make_model(tmp_path / "fromsettings" / "m1")
    make_model(tmp_path / "both" / "m2")
    make_model(tmp_path / "cli" / "m3")
    save_settings(Settings(model_dirs=[str(tmp_path / "fromsettings"), str(tmp_path / "both")]))
    assert _run(["--json", "--dir", str(tmp_path / "cli"), "--dir", str(tmp_path / "both")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(m["name"], m["source"]) for m in out["models"]] == [
        ("m2", "--dir"), ("m3", "--dir"), ("m1", "configured")]


def test_a_folder_opened_by_path_is_listed_once(tmp_path: Path) -> None:
    """The model in use, opened by a path no root holds, is listed "by path"; one that a
    root holds keeps that root's source; a folder that is not a model adds nothing."""
    mine = make_model(tmp_path / "somewhere" / "stories")
    listed = make_model(tmp_path / "root" / "listed")
    found = find_models([tmp_path / "root"], include_defaults=False,
                        opened=[mine, listed, tmp_path / "nothing-here"])
    assert [(e.name, e.source, e.path) for e in found] == [
        ("listed", "configured", listed.resolve()), ("stories", "by path", mine.resolve())]
    assert find_models([tmp_path / "root"], include_defaults=False) == found[:1]


def test_models_cmd_none_found(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["--dir", str(tmp_path / "empty")]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "--dir" in captured.err and "not a folder" in captured.err
    assert out.startswith("no local models found; looked in: ")
    assert str(tmp_path / "empty") in out and "huggingface" in out and "lm-studio" in out


def test_model_entry_is_value() -> None:
    e = ModelEntry("n", Path("/x"), "llama", 1, None, "assets")
    assert e.to_dict()["path"] == "/x" and e.supported
    assert DEFAULT_MODEL.name == "kvchat-mini"
