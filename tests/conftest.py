"""Fixtures shared across test modules: tiny random Hugging Face checkpoints (built once
per session, tests/helpers/checkpoints.py), the real model, private folders for the app,
and the end of every process a test started.

Helpers that are not fixtures live in tests/helpers/; a test module never imports another.
"""

from __future__ import annotations

import gc
import shutil
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.helpers import processes
from tests.helpers.checkpoints import TINY_SPECS, build_tiny_checkpoint
from tests.helpers.paths import MINI, STORIES260K


def pytest_configure(config: pytest.Config) -> None:
    """A run started in the background by a script (nohup, `cmd &`) inherits SIGINT
    ignored, and so would every child a test starts; the tests that stop a child with
    SIGINT, as Ctrl+C does, need the default a terminal gives."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`tiny_checkpoint(name) -> folder` for a name in TINY_SPECS; built once per session.
    Treat the folder as read-only (copy it before corrupting it)."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            folder = tmp_path_factory.mktemp(f"tiny_{name}")
            built[name] = build_tiny_checkpoint(TINY_SPECS[name], folder)
        return built[name]

    return get


@pytest.fixture(scope="session")
def mlx_quantized(
    tiny_checkpoint: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., Path]:
    """`mlx_quantized(name, bits, predicate=None) -> folder` made by mlx_lm.convert
    (group size 64; `predicate` is mlx-lm's mixed recipe name, e.g. "mixed_3_6")."""
    built: dict[tuple[str, int, str | None], Path] = {}

    def get(name: str, bits: int, predicate: str | None = None) -> Path:
        key = (name, bits, predicate)
        if key not in built:
            from mlx_lm import convert

            out = tmp_path_factory.mktemp(f"q{bits}_{predicate or 'uniform'}_{name}") / "mlx"
            convert(
                str(tiny_checkpoint(name)),
                str(out),
                quantize=True,
                q_bits=bits,
                q_group_size=64,
                quant_predicate=predicate,
            )
            built[key] = out
        return built[key]

    return get


@pytest.fixture
def copy_checkpoint(
    tiny_checkpoint: Callable[[str], Path], tmp_path: Path
) -> Callable[[str], Path]:
    """A private, writable copy of a tiny checkpoint (for tests that break it)."""

    def get(name: str = "llama") -> Path:
        dst = tmp_path / f"copy_{name}"
        shutil.copytree(tiny_checkpoint(name), dst)
        return dst

    return get


@pytest.fixture(scope="session")
def stories260k() -> Path:
    """The real pretrained stories260K folder (tests/models/stories260K)."""
    return STORIES260K


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Config and data folders in tmp_path: tests never touch the user's files."""
    monkeypatch.setenv("KVCHAT_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("KVCHAT_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("KVCHAT_LOG_DIR", str(tmp_path / "log"))
    return tmp_path


@pytest.fixture
def hermetic_env(env: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """`env`, and the folders the model picker scans (the HF cache, LM Studio's under
    HOME) in tmp_path too."""
    monkeypatch.setenv("HF_HUB_CACHE", str(env / "hf"))
    monkeypatch.setenv("HOME", str(env / "home"))
    return env


@pytest.fixture
def models_env(hermetic_env: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """`hermetic_env` with the Hub reachable (other modules set the offline switches) and
    tmp_path/models holding mini, mini-2 and no-tokenizer (a folder it cannot load)."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    models = hermetic_env / "models"
    shutil.copytree(MINI, models / "mini")
    shutil.copytree(MINI, models / "mini-2")
    no_tok = models / "no-tokenizer"
    shutil.copytree(MINI, no_tok)
    (no_tok / "tokenizer.model").unlink()
    return hermetic_env


@pytest.fixture
def pinned_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stats panel describes the machine it runs on (its BLAS, its cores): pin both,
    so a snapshot is the same on every machine."""
    monkeypatch.setattr("kvchat.app.core.blas.active_blas",
                        lambda: {"name": "OpenBLAS", "path": None, "fast": True})
    from kvchat.model.runtime import threads

    monkeypatch.setattr(threads, "_policy", threads.Policy(cores=2))  # a 2-core automatic policy


@pytest.fixture(scope="module", autouse=True)
def _freeze_the_heap_each_module_starts_with() -> None:
    """Collect, then move what is alive when a module starts (imported modules: torch and
    transformers alone are ~350,000 objects; session fixtures) out of the collector's
    reach. The engine runs a full gc.collect() at every model load and close
    (model/runtime/engine.py): in the app's own process that is quick, in a test process
    holding torch it took 0.5-1.5 s each, most of a UI test's time."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _end_started_processes() -> Iterator[None]:
    """Kill the process group of every child a test started (tests/helpers/processes.py),
    passed or failed, so no child outlives its test."""
    yield
    processes.end_all()
