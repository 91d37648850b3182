"""A model is checked against the machine's memory before it loads (app/core/memory.py):
weights as this backend holds them plus the K/V cache at its bound, against MemAvailable.
The machine here is faked (a meminfo file in tmp_path); the figures are computed
independently from the safetensors header and the K/V formula of docs/design.md."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest

from kvchat.app.core import memory
from kvchat.app.main import main
from tests.helpers.paths import STORIES260K
from tests.helpers.scripted_engine import async_test, record_notifications, wait_for

# stories260K: float32 on the CPU; 5 layers, 4 K/V heads of 8, a 512-token context
LAYERS, KV_HEADS, HEAD_DIM, CONTEXT = 5, 4, 8, 512


def _weights() -> int:
    data = (STORIES260K / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    return sum(math.prod(t["shape"]) for t in header.values()) * 4


def _kv(tokens: int) -> int:
    return 2 * LAYERS * KV_HEADS * tokens * HEAD_DIM * 4


WEIGHTS = _weights()


def _kb(n: int) -> int:
    """What MemAvailable reports for n bytes (the kernel counts whole kB)."""
    return n // 1024 * 1024


@pytest.fixture
def meminfo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Set this machine's MemAvailable (bytes, rounded down to kB as the kernel writes it)."""
    path = tmp_path / "meminfo"
    monkeypatch.setattr(memory, "MEMINFO", path)

    def set_available(n: int) -> None:
        path.write_text(f"MemTotal:       99999999 kB\nMemFree:          1234 kB\n"
                        f"MemAvailable:   {n // 1024:>8} kB\nBuffers:           1 kB\n")

    return set_available


def test_meminfo_is_read_and_the_figures_are_the_formulas(meminfo) -> None:
    meminfo(5 * 2**30)
    assert memory.available_memory() == memory.Available(5 * 2**30, "MemAvailable")
    fit = memory.model_fit(STORIES260K)
    assert (fit.weight_bytes, fit.kv_bytes, fit.kv_tokens) == (WEIGHTS, _kv(CONTEXT), CONTEXT)
    assert fit.need == WEIGHTS + _kv(CONTEXT) and fit.fits
    bounded = memory.model_fit(STORIES260K, max_kv_size=64)
    assert bounded.kv_bytes == _kv(64)


def test_generate_refuses_with_the_numbers_before_loading(
        meminfo, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Room for the weights and 100 tokens of K/V: the full context does not fit; the
    line says what is needed, what is there and what would fit, and nothing loads."""
    from kvchat.app.core.engine_service import EngineService

    room = WEIGHTS + _kv(100) + 1024  # 100 tokens of K/V and less than one more
    meminfo(room)
    built: list[str] = []
    client = EngineService.client
    monkeypatch.setattr(EngineService, "client", lambda self, path, **kw: built.append(path))
    rc = main(["generate", "--model", str(STORIES260K), "--prompt", "Once upon a time"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and built == [] and len(err) == 1
    assert err[0].startswith("kvchat: error: stories260K needs ")
    for shown in (f"{memory.human_bytes(WEIGHTS)} of weights",
                  f"{memory.human_bytes(_kv(CONTEXT))} of K/V at 512 tokens",
                  f"{memory.human_bytes(_kb(room))} is available (MemAvailable)",
                  "--max-kv-size 100 would fit", "--ignore-memory-check loads it anyway"):
        assert shown in err[0], shown
    # what the line suggests fits, and so does the flag (on the same machine)
    monkeypatch.setattr(EngineService, "client", client)
    for extra in (["--max-kv-size", "100"], ["--ignore-memory-check"]):
        rc = main(["generate", "--model", str(STORIES260K), "--prompt", "Once upon a time",
                   "--max-tokens", "2", "--quiet", *extra])
        assert rc == 0, capsys.readouterr().err
        capsys.readouterr()


def test_not_even_the_weights(meminfo, capsys: pytest.CaptureFixture[str]) -> None:
    meminfo(WEIGHTS // 2)
    assert main(["explain", "--model", str(STORIES260K)]) == 1
    err = capsys.readouterr().err
    assert "not even the weights fit" in err and "of K/V" not in err  # explain makes no cache


def test_serve_refuses_before_it_listens(meminfo, capsys: pytest.CaptureFixture[str]) -> None:
    """Its prefix pool counts too: the weights and the cache fit, the pool does not."""
    meminfo(WEIGHTS + _kv(CONTEXT) + 2**20)
    assert main(["serve", "--model", str(STORIES260K), "--port", "0",
                 "--cache-pool-mb", "64"]) == 1
    err = capsys.readouterr().err
    assert "64 MiB of prefix pool" in err and "--ignore-memory-check" in err


def test_inspect_and_models_show_the_verdict(meminfo, capsys: pytest.CaptureFixture[str],
                                             tmp_path: Path) -> None:
    import shutil

    meminfo(WEIGHTS + _kv(200) + 1024)
    assert main(["inspect", "--model", str(STORIES260K)]) == 0
    out = capsys.readouterr().out
    assert "memory: stories260K needs" in out and "does NOT fit; --max-kv-size 200 would" in out
    assert main(["inspect", "--model", str(STORIES260K), "--context", "128", "--json"]) == 0
    m = json.loads(capsys.readouterr().out)["memory"]
    assert m["fits"] and m["need_bytes"] == WEIGHTS + _kv(128)
    assert m["available_bytes"] == _kb(WEIGHTS + _kv(200) + 1024)
    shutil.copytree(STORIES260K, tmp_path / "models" / "stories")
    assert main(["models", "--dir", str(tmp_path / "models")]) == 0
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines()]
    assert rows[0][5] == "FITS" and [r[-3] for r in rows[1:] if r[0] == "stories"] == ["no"]
    assert main(["models", "--dir", str(tmp_path / "models"), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["models"]
    assert [m["memory"]["fits"] for m in listed if m["name"] == "stories"] == [False]


def test_the_chat_refuses_a_model_that_does_not_fit(meminfo, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """--model: refused before the UI starts, as a bad folder; the remembered model: the
    chat starts without it and says why; the flag opens either."""
    from kvchat.app.core.settings import Settings
    from kvchat.app.tui.app import run_tui, startup_model
    from kvchat.model.errors import ModelLoadError

    monkeypatch.setenv("KVCHAT_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("KVCHAT_DATA_DIR", str(tmp_path / "data"))
    meminfo(WEIGHTS)
    with pytest.raises(ModelLoadError, match="stories260K needs .*--ignore-memory-check"):
        run_tui(str(STORIES260K))
    remembered = Settings(last_model=str(STORIES260K.resolve()))
    path, notes = startup_model(None, remembered)
    assert path is None and len(notes) == 1 and "stories260K needs" in notes[0]
    assert startup_model(None, remembered, True) == (str(STORIES260K.resolve()), [])
    assert startup_model(str(STORIES260K), remembered, True)[0] == str(STORIES260K.resolve())
    meminfo(WEIGHTS + _kv(CONTEXT) + 1024)  # the chat's bound: the model's whole context
    assert startup_model(None, remembered) == (str(STORIES260K.resolve()), [])


@async_test
async def test_the_picker_keeps_the_old_model_when_the_new_one_does_not_fit(
        meminfo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.helpers.app import engine, make_app, ready

    monkeypatch.setenv("KVCHAT_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("KVCHAT_DATA_DIR", str(tmp_path / "data"))
    meminfo(WEIGHTS)
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        seen = record_notifications(app)
        await ready(pilot)
        before = list(engine(app).loads)
        app.chat.load_model(str(STORIES260K))
        await wait_for(pilot, lambda: bool(seen))
        assert engine(app).loads == before
        assert seen[-1][1] == "error" and "stories260K needs" in seen[-1][0]
        app.chat.ignore_memory_check = True  # kvchat --ignore-memory-check
        app.chat.load_model(str(STORIES260K))
        await wait_for(pilot, lambda: engine(app).loads != before)
