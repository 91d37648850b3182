"""The wheel holds the product and nothing of the test suite: built from a copy of the
checkout the way `pip install .` builds it, it has every module of app/, model/ and
metal_kernels/ (under kvchat/) and the files they read, and no tests, benchmarks or
Metal emulator (those stay in the repository)."""

from __future__ import annotations

import shutil
import sys
import zipfile
from collections.abc import Iterator

import pytest

from tests.helpers import processes
from tests.helpers.paths import REPO_ROOT

# a build takes tens of seconds, and may fetch setuptools into an isolated environment
pytestmark = pytest.mark.slow

PRODUCT = ("app", "model", "metal_kernels")
# what pyproject's package-data ships beside the modules
DATA = ("assets/kvchat-mini/*", "app/core/*.c", "app/tui/*.tcss", "metal_kernels/*.metal")
NOT_SOURCE = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info",
                                    "__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[zipfile.ZipFile]:
    src = tmp_path_factory.mktemp("checkout") / "kvchat"
    shutil.copytree(REPO_ROOT, src, ignore=NOT_SOURCE)
    out = src.parent / "dist"
    argv = [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "-q", "-w", str(out)]
    # the environment's own setuptools first (no download); one older than
    # pyproject's build-system asks for fails, and pip builds in isolation instead
    built = processes.run([*argv, "--no-build-isolation"], capture_output=True, text=True,
                          timeout=600)
    if built.returncode != 0:
        built = processes.run(argv, capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    (path,) = out.glob("kvchat-*.whl")
    with zipfile.ZipFile(path) as whl:
        yield whl


def product_files() -> set[str]:
    """The checkout's product files as the wheel names them (kvchat/...)."""
    files = {p for top in PRODUCT for p in (REPO_ROOT / top).rglob("*.py")
             if "__pycache__" not in p.parts}
    files |= {p for pattern in DATA for p in REPO_ROOT.glob(pattern) if p.is_file()}
    return {f"kvchat/{p.relative_to(REPO_ROOT).as_posix()}" for p in files}


def test_the_wheel_holds_no_test_or_benchmark_code(wheel: zipfile.ZipFile) -> None:
    names = wheel.namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"kvchat"}
    suite = [n for n in names if n.startswith(("kvchat/tests/", "tests/"))
             or {"benchmarks", "metal_emulator"} & set(n.split("/"))]
    assert suite == []


def test_the_wheel_holds_every_product_module(wheel: zipfile.ZipFile) -> None:
    want = product_files()
    assert len(want) > 80  # the walk found the product
    # e.g. the decoder, the caches, the faces, the `kvchat bench` command (product code)
    assert {"kvchat/model/decoder/transformer.py", "kvchat/model/cache/kv.py",
            "kvchat/app/tui/app.py", "kvchat/app/cli/bench.py",
            "kvchat/metal_kernels/rope.metal"} <= want
    assert sorted(want - set(wheel.namelist())) == []
