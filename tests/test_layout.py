"""The package's shape: imports point one way (app/__init__.py's docstring says which) and
nothing imports itself back, lazy imports inside functions included.

The checker walks the source with `ast` (nothing is imported), so it also runs on a small
tree built here with a deliberate cycle or a face importing another face, which proves it
can fail.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "kvchat"
SOURCES = ("app", "model", "metal_kernels")

# Which layer may import which. A face never imports another face; `main` picks one.
# Inside `model` (docs/design.md, "Layout"): `base` (errors, files) under everything, then
# decoder <- cache <- distributed <- runtime <- explain <- training, with `text` beside
# the decoder and the cache. `api` is the package's own lazy front (`kvchat.model`).
FACES = ("cli", "tui", "serve")
MODEL_FLOORS = {
    "model.base": {"model.base"},
    "model.decoder": {"model.base", "model.decoder", "kernels"},
    "model.cache": {"model.base", "model.decoder", "model.cache", "kernels"},
    "model.text": {"model.base", "model.text"},
    "model.distributed": {"model.base", "model.decoder", "model.cache", "model.distributed",
                          "kernels"},
    "model.runtime": {"model.base", "model.decoder", "model.cache", "model.text",
                      "model.distributed", "model.runtime", "kernels"},
    "model.explain": {"model.base", "model.decoder", "model.cache", "model.text",
                      "model.distributed", "model.runtime", "model.explain", "kernels"},
    "model.training": {"model.base", "model.decoder", "model.cache", "model.text",
                       "model.runtime", "model.explain", "model.training", "kernels"},
}
MODEL = {*MODEL_FLOORS, "model.api"}
ALLOWED = {
    "main": {"main", "root", *FACES, "core", *MODEL, "kernels"},
    **{face: {face, "root", "core", *MODEL, "kernels"} for face in FACES},
    "core": {"core", "root", *MODEL, "kernels"},
    "root": {"root"},
    "model.api": {*MODEL, "kernels"},
    **MODEL_FLOORS,
    "kernels": {"kernels"},
    "tests": set(),  # product code never imports the tests
}
TESTS = "tests"  # the node every import of the test suite maps to


def layer(module: str) -> str:
    if module == TESTS:
        return "tests"
    parts = module.split(".")[1:]  # drop "kvchat"
    if parts[:1] == ["metal_kernels"]:
        return "kernels"
    if parts == ["model"]:
        return "model.api"
    if parts[:1] == ["model"]:
        if parts[1] in ("errors", "files", "gguf_file"):
            return "model.base"
        if f"model.{parts[1]}" in MODEL_FLOORS:
            return f"model.{parts[1]}"
    if parts == ["app"]:
        return "root"
    if parts[:2] == ["app", "main"] or parts[:2] == ["app", "__main__"]:
        return "main"
    if parts[:1] == ["app"] and parts[1] in (*FACES, "core"):
        return parts[1]
    raise AssertionError(f"{module}: not in any layer; add it to tests/test_layout.py")


def modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file, for every .py under the source folders (package `kvchat`)."""
    found = {}
    for top in SOURCES:
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root).with_suffix("").parts
            if rel[-1] == "__init__":
                rel = rel[:-1]
            found[".".join((PACKAGE, *rel))] = path
    return found


def imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `module` imports anywhere in its file (functions too). `from a
    import b` names the module a.b when that is a module, else a (as grimp does)."""
    is_pkg = path.name == "__init__.py"
    package = module if is_pkg else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target
                     for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] == TESTS or name.startswith(f"{PACKAGE}.{TESTS}."):
                out.add(TESTS)
                continue
            while name and name not in known:  # `import kvchat.model.x.attr` -> the module
                name = name.rpartition(".")[0]
            if name and name != module:
                out.add(name)
    return out


def graph(root: Path) -> dict[str, set[str]]:
    known = modules(root)
    return {m: imports(m, p, known) for m, p in known.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(g):
        if start in index:
            continue
        work = [(start, iter(sorted(g[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(sorted(g.get(child, ())))))
                elif child in on:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def violations(g: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{m} ({layer(m)}) imports {t} ({layer(t)})"
        for m, targets in g.items() for t in targets if layer(t) not in ALLOWED[layer(m)]
    )


def test_the_package_has_no_import_cycle() -> None:
    assert cycles(graph(ROOT)) == []


def test_imports_point_one_way() -> None:
    assert violations(graph(ROOT)) == []


def test_every_module_belongs_to_a_layer() -> None:
    g = graph(ROOT)
    assert len(g) > 60  # the walk found the package (not an empty folder)
    assert {layer(m) for m in g} == {"main", "root", *FACES, "core", *MODEL, "kernels"}


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for top in SOURCES:
        (tmp_path / top).mkdir(parents=True, exist_ok=True)
        (tmp_path / top / "__init__.py").write_text("")
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.parent != tmp_path and not (p.parent / "__init__.py").exists():
            (p.parent / "__init__.py").write_text("")
        p.write_text(text)
    return tmp_path


def test_a_deliberate_cycle_is_found(tmp_path: Path) -> None:
    # the shape of the cycle this layout removed: a panel importing a launcher that
    # imports the App, inside a function
    root = _tree(tmp_path, {
        "app/tui/app.py": "from kvchat.app.tui.widgets.panel import Panel\n",
        "app/tui/widgets/panel.py": "from kvchat.app.tui import launcher\nclass Panel: ...\n",
        "app/tui/launcher.py": "def run():\n    from .app import App\n",
    })
    assert cycles(graph(root)) == [[
        "kvchat.app.tui.app", "kvchat.app.tui.launcher", "kvchat.app.tui.widgets.panel",
    ]]


def test_a_model_cycle_through_a_relative_import_is_found(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "model/errors.py": "def f():\n    from .files import read\n",
        "model/files.py": "from .errors import f\n",
    })
    assert cycles(graph(root)) == [["kvchat.model.errors", "kvchat.model.files"]]


@pytest.mark.parametrize(("rel", "text", "needle"), [
    ("app/cli/x.py", "from kvchat.app.tui.app import run_tui\n", "(cli) imports"),
    ("app/tui/x.py", "import kvchat.app.serve.api\n", "(tui) imports"),
    ("app/core/x.py", "from kvchat.app.cli import generate\n", "(core) imports"),
    ("model/runtime/x.py", "def f():\n    from kvchat.app.core import text\n",
     "(model.runtime) imports"),
    ("metal_kernels/x.py", "from kvchat.model.decoder import config\n", "(kernels) imports"),
    # the decoder never builds a cache; the runtime never imports the views that explain it
    ("model/decoder/x.py", "from kvchat.model.cache.kv import make_cache\n",
     "(model.decoder) imports"),
    ("model/runtime/x.py", "def f():\n    from ..explain.anatomy import explain\n",
     "(model.runtime) imports"),
    ("model/text/x.py", "from kvchat.model.decoder.config import load_config\n",
     "(model.text) imports"),
    # product code never imports the test suite, not even its helpers
    ("app/serve/x.py", "from tests.helpers.server_process import ServerProcess\n",
     "imports tests (tests)"),
    ("metal_kernels/x.py", "def f():\n    import tests.metal_emulator\n",
     "imports tests (tests)"),
])
def test_an_import_against_the_direction_is_found(tmp_path: Path, rel: str, text: str,
                                                   needle: str) -> None:
    root = _tree(tmp_path, {
        rel: text,
        "app/tui/app.py": "", "app/serve/api.py": "", "app/cli/generate.py": "",
        "app/core/text.py": "", "model/decoder/config.py": "",
    })
    found = violations(graph(root))
    assert len(found) == 1 and needle in found[0], found


# ---- the test suite: no test module imports another ------------------------------------
# What test modules share lives in tests/helpers/ (fixtures in tests/conftest.py): a test
# module imported by another runs its module-level code twice under two names, and drags
# its fixtures and marks along.


def suite_modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file, for every .py under tests/ (package `tests`)."""
    found = {}
    for path in sorted((root / TESTS).rglob("*.py")):
        rel = path.relative_to(root).with_suffix("").parts
        if rel[-1] == "__init__":
            rel = rel[:-1]
        found[".".join(rel)] = path
    return found


def imports_of_test_modules(root: Path) -> list[str]:
    """`file imports module` for each import of a test module (a `test_*.py` under tests/)
    anywhere in a file under tests/, lazy imports inside functions included."""
    known = suite_modules(root)
    test_mods = {m for m in known if m.rpartition(".")[2].startswith("test_")}
    found = []
    for module, path in known.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                target = node.module or ""
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                names = [target, *(f"{target}.{a.name}" for a in node.names)]
            else:
                continue
            found += [f"{path.relative_to(root)} imports {t}" for name in names
                      for t in test_mods if name == t or name.startswith(f"{t}.")]
    return sorted(set(found))


def test_no_test_module_imports_another() -> None:
    assert len(suite_modules(ROOT)) > 60  # the walk found the suite
    assert imports_of_test_modules(ROOT) == []


def test_a_test_module_imported_by_another_is_found(tmp_path: Path) -> None:
    files = {
        "tests/__init__.py": "",
        "tests/helpers/__init__.py": "",
        "tests/helpers/app.py": "from tests.helpers.paths import ROOT\n",
        "tests/helpers/paths.py": "ROOT = 1\n",
        "tests/test_a.py": "from tests.helpers.app import test_like_name\n",
        "tests/test_b.py": "from .test_a import helper\n",
        "tests/test_c.py": "from tests import test_a\n",
        "tests/test_d.py": "def f():\n    import tests.test_a as a\n",
        "tests/test_e.py": "from tests.helpers import app, paths\n",
        "tests/helpers/h.py": "def f():\n    from ..test_a import x\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert imports_of_test_modules(tmp_path) == [
        "tests/helpers/h.py imports tests.test_a",
        "tests/test_b.py imports tests.test_a",
        "tests/test_c.py imports tests.test_a",
        "tests/test_d.py imports tests.test_a",
    ]
