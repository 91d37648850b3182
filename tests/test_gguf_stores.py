"""The models people already have: Ollama's store and LM Studio's GGUF files, found,
listed and run in place, and never written.

A fake Ollama store is laid out as Ollama lays it out (manifests/HOST/NAMESPACE/NAME/TAG,
JSON naming layers by digest; blobs/sha256-HEX) with tiny GGUF files converted as
llama.cpp does (tests/helpers/gguf_convert.py), plus the things a store can hold that must
be skipped or refused (a digest that is not one, a missing blob, garbage JSON). LM Studio's
folders hold GGUF files, a vision projector and a later part of a split file.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvchat.app.core import discovery
from kvchat.app.core.discovery import find_models, model_rows, resolve_model
from kvchat.model import load_model, load_tokenizer
from kvchat.model.errors import ModelLoadError
from kvchat.model.explain.facts import check_model_folder

from .helpers.gguf_convert import convert
from .helpers.gguf_models import STORE_SPEC, build

GO_TEMPLATE = "{{ if .System }}{{ .System }}{{ end }}{{ .Prompt }}"


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny llama as GGUF: F32 with its chat template, Q8_0, and one without a template."""
    root = tmp_path_factory.mktemp("store_models")
    folder = root / "hf"
    folder.mkdir()
    build(STORE_SPEC, folder)
    return {
        "f32": convert(folder, root / "tiny-F32.gguf", tokenizer="spm"),
        "q8": convert(folder, root / "tiny-Q8_0.gguf", tokenizer="spm", outtype="Q8_0"),
        "bare": convert(folder, root / "bare.gguf", tokenizer="spm", template=False),
    }


def _blob(store: Path, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    (store / "blobs").mkdir(parents=True, exist_ok=True)
    (store / "blobs" / f"sha256-{digest}").write_bytes(data)
    return f"sha256:{digest}"


def _manifest(store: Path, name: str, tag: str, layers: list[dict[str, Any]],
              host: str = "registry.ollama.ai", namespace: str = "library") -> None:
    path = store / "manifests" / host / namespace / name / tag
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"schemaVersion": 2, "layers": layers}))


def make_ollama_store(store: Path, ggufs: dict[str, Path]) -> None:
    model = {"mediaType": "application/vnd.ollama.image.model",
             "digest": _blob(store, ggufs["f32"].read_bytes())}
    template = {"mediaType": "application/vnd.ollama.image.template",
                "digest": _blob(store, GO_TEMPLATE.encode())}
    params = {"mediaType": "application/vnd.ollama.image.params",
              "digest": _blob(store, b'{"stop": ["<end_of_turn>"]}')}
    _manifest(store, "tiny", "latest", [model, template, params])
    _manifest(store, "tiny", "q8", [model, template])  # the same blob under a second tag
    bare = {"mediaType": "application/vnd.ollama.image.model",
            "digest": _blob(store, ggufs["bare"].read_bytes())}
    _manifest(store, "bare", "latest", [bare, template])
    _manifest(store, "q8model", "v1", [{"mediaType": "application/vnd.ollama.image.model",
                                        "digest": _blob(store, ggufs["q8"].read_bytes())}],
              host="hf.co", namespace="someone")
    # what must be skipped: a digest that would name another path, a missing blob, junk
    _manifest(store, "evil", "latest", [{"mediaType": "application/vnd.ollama.image.model",
                                         "digest": "sha256:../../../../etc/passwd"}])
    _manifest(store, "gone", "latest", [{"mediaType": "application/vnd.ollama.image.model",
                                         "digest": "sha256:" + "0" * 64}])
    junk = store / "manifests" / "registry.ollama.ai" / "library" / "junk" / "latest"
    junk.parent.mkdir(parents=True)
    junk.write_bytes(b"\xff\x00not json")


def make_lmstudio(models: Path, ggufs: dict[str, Path]) -> None:
    import gguf

    repo = models / "lmstudio-community" / "Tiny-GGUF"
    repo.mkdir(parents=True)
    shutil.copy(ggufs["q8"], repo / "Tiny-Q8_0.gguf")
    shutil.copy(ggufs["f32"], repo / "Tiny-00002-of-00002.gguf")  # a later split part
    w = gguf.GGUFWriter(repo / "mmproj-Tiny-F16.gguf", "clip")  # a vision projector
    w.add_type("mmproj")
    w.add_tensor("v.patch_embd.weight", np.zeros((4, 4), np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def listing(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every entry under root: (size, mtime_ns, mode), folders too."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in [*dirnames, *filenames]:
            p = Path(dirpath) / n
            st = p.lstat()
            out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns, st.st_mode)
    st = root.lstat()
    out["."] = (st.st_size, st.st_mtime_ns, st.st_mode)
    return out


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for var in ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME",
                "OLLAMA_MODELS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("KVCHAT_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("KVCHAT_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setattr(discovery, "DEFAULT_MODEL", tmp_path / "no-assets" / "kvchat-mini")
    return home


def test_stores_are_listed_resolved_and_run_read_only(
        home: Path, ggufs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    from kvchat.app.main import main

    ollama = home / ".ollama" / "models"
    make_ollama_store(ollama, ggufs)
    lms = home / ".lmstudio" / "models"
    make_lmstudio(lms, ggufs)
    before = {"ollama": listing(ollama), "lms": listing(lms)}

    found = [(e.source, e.name, e.architecture, e.quantization) for e in find_models()]
    assert found == [
        ("lm-studio", "lmstudio-community/Tiny-GGUF/Tiny-Q8_0.gguf", "llama", "Q8_0"),
        ("ollama", "bare:latest", "llama", "F32"),
        ("ollama", "hf.co/someone/q8model:v1", "llama", "Q8_0"),
        ("ollama", "tiny:latest", "llama", "F32"),  # tiny:q8 is the same blob
    ]
    rows = {r.entry.name: r for r in model_rows([])}
    assert all(r.loadable for r in rows.values()), {n: r.problem for n, r in rows.items()}
    tiny = rows["tiny:latest"]
    assert tiny.entry.size_bytes == ggufs["f32"].stat().st_size
    assert tiny.facts is not None and tiny.facts.gguf == "F32"
    assert tiny.entry.path.parent == (ollama / "blobs").resolve()

    # ollama:NAME[:TAG] -> the blob, read where it is
    for spec in ("ollama:tiny", "ollama:tiny:latest", "ollama:tiny:q8",
                 "ollama:library/tiny:latest"):
        r = resolve_model(spec)
        assert Path(r.path) == tiny.entry.path and r.notices == ()
    assert resolve_model("ollama:hf.co/someone/q8model:v1").path == str(
        rows["hf.co/someone/q8model:v1"].entry.path)
    bare = resolve_model("ollama:bare")
    assert len(bare.notices) == 1 and "Go template" in bare.notices[0]
    with pytest.raises(ModelLoadError, match=r"no Ollama model nope:latest in .*; it has: "
                       r"bare:latest, hf.co/someone/q8model:v1, tiny:latest, tiny:q8$"):
        resolve_model("ollama:nope")
    for bad in ("ollama:../../etc:passwd", "ollama:a/b/c/d", "ollama:evil", "ollama:gone"):
        with pytest.raises(ModelLoadError):
            resolve_model(bad)

    # run them: the loaders, the checks, the commands
    model = load_model(tiny.entry.path)
    tok = load_tokenizer(tiny.entry.path)
    assert model.source_info == {"name": "hf", "gguf": "F32"}  # general.name of a blob
    assert tok.chat_template is not None
    check_model_folder(rows["lmstudio-community/Tiny-GGUF/Tiny-Q8_0.gguf"].entry.path)
    assert main(["models"]) == 0
    table = capsys.readouterr().out
    assert "tiny:latest" in table and "Q8_0" in table and "ollama" in table
    assert main(["generate", "--model", "ollama:bare", "--prompt", "hi", "--max-tokens", "3",
                 "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["finish_reason"] in ("length", "eos")
    assert captured.err.count("kvchat: note: ollama:bare:latest has only") == 1
    assert main(["inspect", "--model", "ollama:tiny:q8"]) == 0
    assert "from GGUF F32" in capsys.readouterr().out
    assert main(["generate", "--model", "ollama:nope", "--prompt", "hi", "--json"]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["finish_reason"] == "error"
    assert captured.err.startswith("kvchat: error: no Ollama model nope:latest")

    assert {"ollama": listing(ollama), "lms": listing(lms)} == before


def test_ollama_models_env_and_legacy_lmstudio(home: Path, tmp_path: Path,
                                               ggufs: dict[str, Path],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    store = tmp_path / "elsewhere"
    make_ollama_store(store, ggufs)
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    legacy = home / ".cache" / "lm-studio" / "models" / "pub" / "repo"
    legacy.mkdir(parents=True)
    shutil.copy(ggufs["f32"], legacy / "tiny.gguf")
    names = [(e.source, e.name) for e in find_models()]
    assert ("ollama", "tiny:latest") in names and ("lm-studio", "pub/repo/tiny.gguf") in names
    assert resolve_model("ollama:tiny").path.startswith(str(store.resolve()))
    assert discovery.ollama_dir() == store


def test_gguf_repos_in_the_hugging_face_cache(home: Path, ggufs: dict[str, Path]) -> None:
    """huggingface-cli's layout: snapshot files are links to blobs."""
    repo = home / ".cache" / "huggingface" / "hub" / "models--org--Tiny-GGUF"
    blob = repo / "blobs" / "abc123"
    blob.parent.mkdir(parents=True)
    shutil.copy(ggufs["q8"], blob)
    snap = repo / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (snap / "tiny-Q8_0.gguf").symlink_to(blob)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    [entry] = find_models()
    assert (entry.source, entry.name, entry.quantization) == (
        "hf-cache", "org/Tiny-GGUF/tiny-Q8_0.gguf", "Q8_0")
    assert load_model(entry.path).source_info["gguf"] == "Q8_0"
