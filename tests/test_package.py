"""The package's shape: light modules stay light (no MLX, no Textual), imports point one
way, no private Textual imports, and `kvchat --version`."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from kvchat import app as _app
from tests.helpers import processes

REPO = Path(__file__).resolve().parents[1]
# "" in the repository layout, "kvchat." once installed under the kvchat namespace
PREFIX = _app.__name__.removesuffix("app")


def imported_after(statement: str) -> set[str]:
    """Top-level module names imported by a fresh interpreter running `statement`."""
    code = f"import sys\n{statement}\nprint(' '.join(sorted(sys.modules)))"
    out = processes.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                        text=True, check=True, env={"PYTHONPATH": str(REPO)})
    return {m.split(".")[0] for m in out.stdout.split()}


@pytest.mark.parametrize(
    "module", ["model", "model.runtime.events", "model.cache.kv_math", "model.cache.stats",
               "model.cache.layer_kinds",
               "model.decoder.kv_format", "model.files", "model.errors"]
)
def test_light_modules_do_not_import_mlx(module: str) -> None:
    mods = imported_after(f"import {PREFIX}{module}")
    assert "mlx" not in mods and "textual" not in mods


def test_model_names_still_import_lazily() -> None:
    mods = imported_after(f"from {PREFIX}model import load_config")
    assert "mlx" not in mods
    assert "mlx" in imported_after(f"from {PREFIX}model import load_model")


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return [n.removeprefix(PREFIX) for n in names]


def test_imports_point_one_way_and_textual_only_public() -> None:
    for folder, banned in (("model", ("app", "textual")), ("metal_kernels", ("app", "model"))):
        for f in (REPO / folder).rglob("*.py"):
            bad = [n for n in _imports(f) if n.split(".")[0] in banned]
            assert not bad, (f, bad)
    for f in [*(REPO / "app").rglob("*.py"), *(REPO / "tests").rglob("*.py")]:
        private = [n for n in _imports(f) if n.startswith("textual") and "._" in n]
        assert not private, (f, private)


def test_version() -> None:
    from kvchat.app import __version__

    out = processes.run([sys.executable, "-m", f"{PREFIX}app", "--version"], cwd=REPO,
                        capture_output=True, text=True, env={"PYTHONPATH": str(REPO),
                                                              "KVCHAT_NO_OPENBLAS": "1"})
    # first line the version; then MLX, its device and the BLAS in use (diagnostics)
    lines = out.stdout.splitlines()
    assert out.returncode == 0 and lines[0] == f"kvchat {__version__}", out
    assert lines[1].startswith("mlx ") and lines[2].startswith("BLAS: ")
    assert __version__.count(".") == 2
