"""The BLAS under MLX (app/core/blas.py, app/core/linux_blas.py).

- macOS never imports or runs the Linux layer (simulated: `sys.platform` set to "darwin"
  in a child before kvchat starts).
- On Linux a library loaded in-process before MLX really serves MLX's matmuls: the dynamic
  linker's own trace (LD_DEBUG=bindings) shows `libmlx.so`'s `cblas_sgemm` bound to it,
  in `kvchat`'s process and in the chat's engine process, with nothing left in the
  environment of children and the interpreter's flags kept (no re-exec).
- An OpenBLAS on its generic kernels is closed and loaded again with the best set the CPU
  runs, in-process before MLX: forced here (this CPU's own pick is taken for the generic
  one), the dynamic linker's trace shows the first copy finalised and unmapped and MLX
  bound to the second, `openblas_get_corename` changes, MLX's product is right, and
  nothing is left in the environment. The user's OPENBLAS_CORETYPE wins; where dlclose
  cannot unload the library the advice stays, and following it gives that set.
- The advice fits the machine: simulated CPU flags and installed libraries/packages, and
  the advice is never a package that is installed (nor any pip package).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from kvchat.app.core import blas, linux_blas
from kvchat.app.core.linux_blas import LoadReport
from tests.helpers import processes

REPO = Path(__file__).resolve().parents[1]
AVX2 = frozenset({"sse3", "avx", "avx2", "fma"})
AVX512 = AVX2 | {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}
ENGINE_MODEL = REPO / "tests" / "models" / "stories260K"
# what a preload would leave in the environment of children
_WATCHED = ("LD_PRELOAD", "LD_LIBRARY_PATH", "OPENBLAS_")


def _env(**extra: str) -> dict[str, str]:
    """This environment without a BLAS preloaded from outside (CI preloads one)."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "KVCHAT_NO_OPENBLAS")}
    return {**env, "PYTHONPATH": str(REPO), **extra}


def _last_json(code: str, env: dict[str, str], timeout: float = 180) -> dict:
    code = f"WATCHED = {_WATCHED!r}\n{code}"
    out = processes.run([sys.executable, "-X", "kvchat_test=1", "-c", code], env=env, cwd=REPO,
                        capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _openblas() -> str:
    """A loadable OpenBLAS here (KVCHAT_BLAS or the system's), else skip."""
    if sys.platform != "linux":
        pytest.skip("the BLAS layer is Linux's")
    found = linux_blas.candidates()
    if not found:
        pytest.skip("no OpenBLAS on this machine (apt-get install libopenblas0-pthread)")
    return str(found[0])


# --- macOS: nothing of the Linux layer -------------------------------------------------

_AS_DARWIN = """
import atexit, json, os, sys
sys.platform = "darwin"  # before anything of kvchat is imported
sys.argv = ["kvchat", "--version"]
def report():
    maps = open("/proc/self/maps").read().split()
    # numpy's own copy (libscipy_openblas64_) is prefixed and serves numpy only
    print(json.dumps({"linux_layer": sorted(m for m in sys.modules if "linux_blas" in m),
                      "openblas_mapped": any(os.path.basename(f).startswith("libopenblas")
                                             for f in maps),
                      "thread_control": sys.modules["kvchat.model.runtime.threads"].bound()}))
atexit.register(report)
from kvchat.app.main import entry
entry()
"""


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc")
def test_darwin_start_up_never_touches_the_linux_layer() -> None:
    """`kvchat --version` as macOS runs it: the start-up path and the BLAS line, with the
    Linux module never imported and no BLAS loaded, whatever this machine has."""
    env = _env()
    if sys.platform == "linux" and linux_blas.candidates():
        env["KVCHAT_BLAS"] = str(linux_blas.candidates()[0])  # tempting: still untouched
    out = processes.run([sys.executable, "-c", _AS_DARWIN], env=env, cwd=REPO,
                        capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("kvchat ") and lines[1].startswith("mlx ")
    assert lines[2] == "BLAS: Accelerate"
    assert json.loads(lines[-1]) == {"linux_layer": [], "openblas_mapped": False,
                                     "thread_control": False}


# --- Linux: loaded in-process, really serving MLX ----------------------------------------

_START = """
import json, os, subprocess, sys
import numpy as np
pid = os.getpid()
from kvchat.app.core import blas
blas.load_fast_blas()  # as `kvchat` starts
import mlx.core as mx
rng = np.random.default_rng(0)
a = rng.standard_normal((96, 64)).astype(np.float32)
b = rng.standard_normal((64, 80)).astype(np.float32)
got = np.array(mx.array(a) @ mx.array(b))
child = subprocess.run(["env"], capture_output=True, text=True).stdout
print(json.dumps({"blas": blas.active_blas(), "same_pid": os.getpid() == pid,
                  "xoptions": sys._xoptions,
                  "err": float(np.abs(got - a.astype(np.float64) @ b).max()),
                  "child_env": [l.split("=")[0] for l in child.splitlines()
                                if l.startswith(WATCHED)]}))
"""


def _bound_to(trace_dir: Path, pid: int | None = None) -> set[str]:
    """The files `libmlx.so`'s `cblas_sgemm` was bound to, from LD_DEBUG=bindings."""
    pat = re.compile(r"binding file \S*libmlx\.so \[0\] to (\S+) \[0\]:"
                     r" normal symbol `cblas_sgemm'")
    found = set()
    for f in trace_dir.iterdir():
        if pid is None or f.name.endswith(f".{pid}"):
            found |= set(pat.findall(f.read_text(errors="replace")))
    return found


def test_loaded_in_process_it_serves_mlx_and_leaves_no_trace(tmp_path: Path) -> None:
    lib = _openblas()
    env = _env(LD_DEBUG="bindings", LD_DEBUG_OUTPUT=str(tmp_path / "ld"))
    r = _last_json(_START, env)
    assert r["blas"]["name"] == "OpenBLAS" and r["blas"]["fast"] is True
    assert Path(r["blas"]["path"]).resolve() == Path(lib).resolve()
    assert {Path(p).resolve() for p in _bound_to(tmp_path)} == {Path(lib).resolve()}
    assert r["err"] < 1e-3  # the product is right (numpy in float64)
    # no re-exec: the same process, its interpreter flags kept; children inherit nothing
    assert r["same_pid"] and r["xoptions"] == {"kvchat_test": "1"}
    assert set(r["child_env"]) == {k for k in env if k.startswith(_WATCHED)}


def test_without_it_mlx_runs_its_reference_blas(tmp_path: Path) -> None:
    """The other side of the check above: not loaded, libmlx binds its own library."""
    if sys.platform != "linux":
        pytest.skip("the reference-BLAS wheel is Linux's")
    env = _env(KVCHAT_NO_OPENBLAS="1", LD_DEBUG="bindings",
               LD_DEBUG_OUTPUT=str(tmp_path / "ld"))
    r = _last_json(_START, env)
    b = r["blas"]
    assert b["name"] == "reference BLAS" and b["fast"] is False and "mlx_cpu.libs" in b["path"]
    assert b["fix"] == "unset KVCHAT_NO_OPENBLAS"
    assert all("mlx_cpu.libs/libblas" in p for p in _bound_to(tmp_path))


_ENGINE = """
import json, os, sys, threading
from kvchat.app.core import blas
blas.load_fast_blas()
from kvchat.model.runtime import threads
threads.configure(None)
from kvchat.model.runtime.engine_process import EngineProcess
done = threading.Event()
seen = []
def on_event(ev):
    seen.append(type(ev).__name__)
    if type(ev).__name__ in ("Loaded", "LoadFailed"):
        done.set()
engine = EngineProcess(on_event, sys.argv[1])
done.wait(120)
pid = engine._proc.pid
env = open(f"/proc/{pid}/environ").read().split("\\0")
engine.close()
print(json.dumps({"pid": pid, "events": seen,
                  "child_env": [e.split("=")[0] for e in env if e.startswith(WATCHED)]}))
"""


def test_the_engine_process_loads_the_same_blas_before_mlx(tmp_path: Path) -> None:
    lib = _openblas()
    env = _env(LD_DEBUG="bindings", LD_DEBUG_OUTPUT=str(tmp_path / "ld"))
    code = _ENGINE.replace("sys.argv[1]", repr(str(ENGINE_MODEL)))
    r = _last_json(code, env)
    assert "Loaded" in r["events"], r
    assert {Path(p).resolve() for p in _bound_to(tmp_path, r["pid"])} == {Path(lib).resolve()}
    assert set(r["child_env"]) == {k for k in env if k.startswith(_WATCHED)}  # none added


# --- generic kernels replaced in-process -------------------------------------------------

_OWN_CORE = """
import ctypes, sys
get = ctypes.CDLL(sys.argv[1]).openblas_get_corename
get.restype = ctypes.c_char_p
print(get().decode())
"""


def _own_core(lib: str) -> str:
    """The kernel set this OpenBLAS picks for this CPU by itself."""
    env = {k: v for k, v in _env().items() if k != "OPENBLAS_CORETYPE"}
    out = processes.run([sys.executable, "-c", _OWN_CORE, lib], env=env, capture_output=True,
                        text=True, timeout=60, check=True)
    return out.stdout.strip()


def _forced(lib: str) -> tuple[str, str]:
    """(this library's own pick, another set this CPU runs): the own pick is taken for the
    generic set, so kvchat must load the library again with the other."""
    own = _own_core(lib)
    runs = linux_blas.fitting_cores(linux_blas.cpu_flags())
    other = [c for c in runs if c.lower() != own.lower()]
    if not other:
        pytest.skip(f"this CPU runs no kernel set but {own}")
    want = "Haswell" if "Haswell" in other else other[0]
    return own, want


_RELOAD = """
import ctypes, json, os, subprocess, sys
import numpy as np
OWN, WANT, HOLD = sys.argv[1:4]
from kvchat.app.core import blas, linux_blas
from kvchat.model.runtime import threads
if HOLD:  # another reference to the library: dlclose cannot unload it
    held = ctypes.CDLL(HOLD)
linux_blas.falls_back = lambda core: core is not None and core.lower() == OWN.lower()
linux_blas.cpu_flags = lambda: dict(linux_blas.CORES)[WANT]  # WANT is the best it runs
blas.load_fast_blas()  # as `kvchat` starts
loaded = linux_blas._openblas_core()
copies = [l for l in open("/proc/self/maps")  # each copy maps its file from offset 0 once
          if "openblas" in l and "scipy_openblas" not in l and l.split()[2] == "00000000"]
import mlx.core as mx
rng = np.random.default_rng(0)
a = rng.standard_normal((96, 64)).astype(np.float32)
b = rng.standard_normal((64, 80)).astype(np.float32)
got = np.array(mx.array(a) @ mx.array(b))
pid = os.fork()  # OpenBLAS's fork handlers went with the first copy
if pid == 0:
    os._exit(0)
forked = os.waitpid(pid, 0)[1]
child = subprocess.run(["env"], capture_output=True, text=True).stdout
print(json.dumps({"blas": blas.active_blas(), "loaded": loaded, "copies": len(copies),
                  "describe": blas.describe(), "report": vars(linux_blas._report),
                  "child_env": threads.child_env(), "forked": forked,
                  "err": float(np.abs(got - a.astype(np.float64) @ b).max()),
                  "watched": [l.split("=")[0] for l in child.splitlines()
                              if l.startswith(WATCHED)]}))
"""


def _lib_events(trace_dir: Path, lib: str) -> list[str]:
    """From LD_DEBUG=files,bindings of the process that loaded MLX, in order until MLX's
    `cblas_sgemm` is bound: "init"/"fini" of the OpenBLAS at `lib`, "mlx" when libmlx.so
    is loaded, "bound" when its `cblas_sgemm` binds to `lib`."""
    pat = re.compile(rf"calling (init|fini): {re.escape(lib)}\s"
                     r"|file=(libmlx)\.so \[0\];  needed"
                     rf"|binding file \S*libmlx\.so \[0\] to {re.escape(lib)} \[0\]:"
                     r" normal symbol `(cblas_sgemm)'")
    names = {"libmlx": "mlx", "cblas_sgemm": "bound"}
    for f in trace_dir.iterdir():
        events = [m.group(1) or names[m.group(2) or m.group(3)]
                  for m in pat.finditer(f.read_text(errors="replace"))]
        if "bound" in events:
            return events[:events.index("bound") + 1]
    return []


def test_generic_kernels_are_replaced_before_mlx_binds(tmp_path: Path) -> None:
    lib = _openblas()
    own, want = _forced(lib)
    env = _env(LD_DEBUG="files,bindings", LD_DEBUG_OUTPUT=str(tmp_path / "ld"))
    env.pop("OPENBLAS_CORETYPE", None)
    r = _last_json(_RELOAD.replace("sys.argv[1:4]", repr([own, want, ""])), env)
    # the first copy (its own pick) finalised and unloaded, a second loaded, MLX bound to it
    assert _lib_events(tmp_path, lib) == ["init", "fini", "init", "mlx", "bound"]
    assert r["copies"] == 1 and r["loaded"].lower() == want.lower()
    b = r["blas"]
    assert b["core"].lower() == want.lower() and b["core_chosen"] == want
    assert b["note"] is None and b["fix"] is None and b["fast"] is True
    assert r["describe"] == (f"OpenBLAS ({lib}), {b['core']} kernels (chosen by kvchat:"
                             " this OpenBLAS does not know this CPU)")
    assert r["err"] < 1e-3 and r["forked"] == 0
    # nothing in the environment; the engine's child is told the set in kvchat's own words
    assert set(r["watched"]) == {k for k in env if k.startswith(_WATCHED)}
    assert r["child_env"]["KVCHAT_BLAS_CORE"] == want


def test_the_users_coretype_wins(tmp_path: Path) -> None:
    """Set by the user, OPENBLAS_CORETYPE is what the library runs, even the generic set:
    kvchat neither loads it again nor advises anything."""
    lib = _openblas()
    own, want = _forced(lib)
    r = _last_json(_RELOAD.replace("sys.argv[1:4]", repr([want, want, ""])),
                   _env(OPENBLAS_CORETYPE=want))
    assert r["report"]["core_chosen"] is None and r["report"]["core_kept"] is None
    assert r["blas"]["core"].lower() == want.lower() and r["blas"]["fix"] is None
    assert r["err"] < 1e-3
    assert set(r["watched"]) == {k for k in _env() if k.startswith(_WATCHED)} | {
        "OPENBLAS_CORETYPE"}
    # the real generic set, asked for: left as it is
    code = _RELOAD.replace("sys.argv[1:4]", repr(["Prescott", want, ""]))
    code = code.replace("linux_blas.falls_back = ", "_ = ")
    r = _last_json(code, _env(OPENBLAS_CORETYPE="Prescott"))
    assert r["blas"]["core"] == "Prescott" and r["blas"]["core_chosen"] is None
    assert r["blas"]["note"] is None and r["blas"]["fix"] is None


def test_when_dlclose_cannot_unload_it_the_advice_stays_and_works() -> None:
    """Another reference holds the library: dlclose leaves it mapped, kvchat says so and
    gives the command; run as it says, the library picks that set."""
    lib = _openblas()
    own, want = _forced(lib)
    env = _env()
    env.pop("OPENBLAS_CORETYPE", None)
    r = _last_json(_RELOAD.replace("sys.argv[1:4]", repr([own, want, lib])), env)
    b = r["blas"]
    assert r["report"]["core_kept"] == f"{lib} stays loaded after dlclose"
    assert b["core"].lower() == own.lower() and b["core_chosen"] is None and r["err"] < 1e-3
    assert b["note"] == (f"this OpenBLAS does not know this CPU and runs its generic {b['core']}"
                         f" kernels (kvchat could not load it again: {lib} stays loaded after"
                         " dlclose)")
    assert b["fix"] == f"export OPENBLAS_CORETYPE={want}"
    name, _, value = b["fix"].removeprefix("export ").partition("=")
    r = _last_json(_RELOAD.replace("sys.argv[1:4]", repr([own, want, lib])),
                   {**env, name: value})
    assert r["blas"]["core"].lower() == want.lower() and r["blas"]["fix"] is None


_CHILD_LOAD = """
import ctypes, json, os
from kvchat.model.runtime import threads
threads.configure_from_env()  # as the engine's child process starts, before MLX
get = ctypes.CDLL(None).openblas_get_corename
get.restype = ctypes.c_char_p
print(json.dumps({"core": get().decode(), "bound": threads.bound(),
                  "watched": [k for k in os.environ if k.startswith(WATCHED)]}))
"""


def test_the_engine_process_loads_the_set_kvchat_chose() -> None:
    """The parent's choice reaches the child in kvchat's own variables (`child_env`);
    the child loads the library with that set, leaving OPENBLAS_CORETYPE unset."""
    lib = _openblas()
    _, want = _forced(lib)
    env = _env(KVCHAT_BLAS_LIB=lib, KVCHAT_BLAS_CORE=want)
    env.pop("OPENBLAS_CORETYPE", None)
    r = _last_json(_CHILD_LOAD, env)
    assert r["core"].lower() == want.lower() and r["bound"] is True
    assert set(r["watched"]) == {k for k in env if k.startswith(_WATCHED)}


def test_the_engine_process_module_imports_no_mlx() -> None:
    """Its `__main__` loads the BLAS first: nothing it imports before may bring MLX."""
    out = processes.run([sys.executable, "-c", "import sys, kvchat.model.runtime.engine_process;"
                         " print('mlx.core' in sys.modules)"], env=_env(), cwd=REPO,
                        capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


# --- advice that fits the machine ---------------------------------------------------------

def _fake_cmeel(tmp_path: Path) -> Path:
    """An installed cmeel-openblas wheel's layout, on sys.path."""
    lib = tmp_path / "site" / "cmeel.prefix" / "lib" / "libopenblas.so.0"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"\x7fELF")
    (tmp_path / "site" / "cmeel_openblas-0.3.31.dist-info").mkdir()
    return tmp_path / "site"


@pytest.fixture
def linux(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """A simulated Linux machine: set `flags`, `installed` (system OpenBLAS files),
    `serving`/`core` (what the global scope resolves), apt and root, then read `active`."""
    monkeypatch.setattr(blas.sys, "platform", "linux")
    monkeypatch.syspath_prepend(str(_fake_cmeel(tmp_path)))  # installed, never advised
    for k in ("KVCHAT_BLAS", "KVCHAT_NO_OPENBLAS", "OPENBLAS_CORETYPE"):
        monkeypatch.delenv(k, raising=False)
    state = {"flags": AVX2, "installed": [], "serving": None, "core": None, "apt": True,
             "root": False, "report": LoadReport(), "dynamic": True}
    monkeypatch.setattr(linux_blas, "cpu_flags", lambda: state["flags"])
    monkeypatch.setattr(linux_blas, "system_openblas", lambda: state["installed"])
    monkeypatch.setattr(linux_blas, "serving_library", lambda: state["serving"])
    monkeypatch.setattr(linux_blas, "_openblas_core", lambda: state["core"])
    monkeypatch.setattr(linux_blas, "_dynamic", lambda: state["dynamic"])
    monkeypatch.setattr(linux_blas, "_mlx_reference", lambda: "/x/mlx_cpu.libs/libblas-1.so")
    monkeypatch.setattr(linux_blas.shutil, "which",
                        lambda name: "/usr/bin/apt-get" if state["apt"] else None)
    monkeypatch.setattr(linux_blas, "_root", lambda: state["root"])

    def read() -> dict:
        monkeypatch.setattr(linux_blas, "_report", state["report"])
        linux_blas.active.cache_clear()
        blas.active_blas.cache_clear()
        return blas.active_blas()

    yield state, read
    linux_blas.active.cache_clear()
    blas.active_blas.cache_clear()


def _no_pip(b: dict) -> None:
    text = f"{b['note']} {b['fix']}"
    assert "pip" not in text and "cmeel" not in text


@pytest.mark.parametrize("flags", [AVX2, AVX512], ids=["avx2-only", "avx512"])
def test_nothing_installed_says_the_system_package(linux, flags) -> None:
    state, read = linux
    state["flags"] = flags
    b = read()
    assert b["fast"] is False and b["name"] == "reference BLAS"
    assert b["fix"] == "sudo apt-get install libopenblas0-pthread"
    _no_pip(b)
    state["root"] = True
    assert read()["fix"] == "apt-get install libopenblas0-pthread"
    state["apt"] = False  # not Debian/Ubuntu: point kvchat at a library
    assert read()["fix"] == "export KVCHAT_BLAS=/path/to/libopenblas.so.0"


@pytest.mark.parametrize("flags", [AVX2, AVX512], ids=["avx2-only", "avx512"])
def test_an_installed_library_that_does_not_load_is_not_advised_again(linux, flags) -> None:
    state, read = linux
    state["flags"] = flags
    lib = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"
    state["installed"] = [Path(lib)]
    state["report"] = LoadReport(failed=[(lib, "libgfortran.so.5: cannot open shared object")])
    b = read()
    assert b["fast"] is False and lib in b["note"] and "libgfortran.so.5" in b["note"]
    assert "apt-get install" not in (b["fix"] or "")
    _no_pip(b)
    # installed but never tried (MLX imported first): said so, nothing to install
    state["report"] = LoadReport()
    b = read()
    assert "was not loaded before MLX" in b["note"] and b["fix"] is None


def test_turned_off_says_how_to_turn_it_on(linux) -> None:
    state, read = linux
    state["report"] = LoadReport(skipped="KVCHAT_NO_OPENBLAS=1")
    assert read()["fix"] == "unset KVCHAT_NO_OPENBLAS"


@pytest.mark.parametrize(("flags", "want"), [(AVX2, "Haswell"), (AVX512, "SkylakeX"),
                                             (frozenset({"sse3"}), None)])
def test_generic_kernels_on_a_better_cpu_name_the_coretype(linux, monkeypatch, flags,
                                                           want) -> None:
    state, read = linux
    state.update(flags=flags, serving="/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
                 core="Prescott")
    b = read()
    assert b["fast"] is True and b["name"] == "OpenBLAS" and b["core"] == "Prescott"
    assert b["fix"] == (f"export OPENBLAS_CORETYPE={want}" if want else None)
    state["core"] = "Haswell"  # the library knew the CPU: nothing to say
    assert read()["fix"] is None
    state["core"] = "Prescott"
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Prescott")  # the user's choice stands
    assert read()["fix"] is None


def test_generic_kernels_advice_follows_what_kvchat_found(linux) -> None:
    """Not loaded again (dlclose could not unload it): the reason and the command; asked
    for every set and ignoring them, or built for one set only: no command would help."""
    state, read = linux
    state.update(serving="/usr/lib/x86_64-linux-gnu/libopenblas.so.0", core="Prescott",
                 flags=AVX512)
    state["report"] = LoadReport(core_kept="/x/libopenblas.so.0 stays loaded after dlclose")
    b = read()
    assert b["note"].endswith("(kvchat could not load it again: /x/libopenblas.so.0 stays"
                              " loaded after dlclose)")
    assert b["fix"] == "export OPENBLAS_CORETYPE=SkylakeX"
    state["report"] = LoadReport(core_ignored=("SkylakeX", "Haswell", "SandyBridge"))
    b = read()
    assert b["note"].endswith("it ignored OPENBLAS_CORETYPE=SkylakeX, Haswell, SandyBridge")
    assert b["fix"] is None
    state.update(report=LoadReport(), dynamic=False)
    b = read()
    assert b["note"] == "this OpenBLAS is built for its generic Prescott kernels only"
    assert b["fix"] is None


@pytest.mark.parametrize(("picks", "reloads", "want"), [
    # (the core after each load, the cores asked for, what the report says)
    (["Haswell"], [], {}),  # it knew the CPU
    (["Prescott", "SkylakeX"], ["SkylakeX"], {"core_chosen": "SkylakeX"}),
    (["Prescott", "Prescott", "Haswell"], ["SkylakeX", "Haswell"], {"core_chosen": "Haswell"}),
    (["Prescott"] * 5, ["SkylakeX", "Haswell", "SandyBridge", None],
     {"core_ignored": ("SkylakeX", "Haswell", "SandyBridge")}),
], ids=["knows-the-cpu", "best", "next-best", "none-took"])
def test_fit_kernels_tries_the_sets_the_cpu_runs_best_first(monkeypatch, picks, reloads,
                                                            want) -> None:
    seen: list[str | None] = []
    monkeypatch.delenv("OPENBLAS_CORETYPE", raising=False)
    monkeypatch.setattr(linux_blas, "cpu_flags", lambda: AVX512)
    monkeypatch.setattr(linux_blas, "_dynamic", lambda: True)
    monkeypatch.setattr(linux_blas, "_openblas_core", lambda: picks[len(seen)])
    monkeypatch.setattr(linux_blas.threads, "reload", lambda core: seen.append(core))
    report = LoadReport()
    linux_blas.fit_kernels(report)
    assert seen == reloads
    assert report == LoadReport(**want)


def test_fit_kernels_stops_where_dlclose_cannot_unload(monkeypatch) -> None:
    monkeypatch.delenv("OPENBLAS_CORETYPE", raising=False)
    monkeypatch.setattr(linux_blas, "cpu_flags", lambda: AVX2)
    monkeypatch.setattr(linux_blas, "_dynamic", lambda: True)
    monkeypatch.setattr(linux_blas, "_openblas_core", lambda: "Prescott")
    seen: list[str | None] = []
    monkeypatch.setattr(linux_blas.threads, "reload",
                        lambda core: seen.append(core) or "/x.so stays loaded after dlclose")
    report = LoadReport()
    linux_blas.fit_kernels(report)
    assert seen == ["Haswell"]
    assert report == LoadReport(core_kept="/x.so stays loaded after dlclose")
    # the user's choice, or a build with one set: nothing is reloaded
    seen.clear()
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Prescott")
    linux_blas.fit_kernels(LoadReport())
    monkeypatch.delenv("OPENBLAS_CORETYPE")
    monkeypatch.setattr(linux_blas, "_dynamic", lambda: False)
    linux_blas.fit_kernels(LoadReport())
    assert seen == []


def test_version_text_carries_the_advice(linux, monkeypatch) -> None:
    """`kvchat --version`'s BLAS line says the advice, in the shape test_package checks."""
    from kvchat.model.runtime import threads

    monkeypatch.setattr(threads, "_policy", threads._policy)
    state, read = linux
    read()
    lines = blas.version_text().splitlines()
    assert lines[0].startswith("kvchat ") and lines[1].startswith("mlx ")
    assert lines[2] == ("BLAS: reference BLAS (/x/mlx_cpu.libs/libblas-1.so); matmuls ~30x"
                        " slower than with OpenBLAS; fix: sudo apt-get install"
                        " libopenblas0-pthread")
    assert blas.short_label() == "reference (slow): sudo apt-get install libopenblas0-pthread"
    state.update(serving="/usr/lib/x86_64-linux-gnu/libopenblas.so.0", core="SkylakeX")
    read()
    monkeypatch.delenv("OPENBLAS_CORETYPE", raising=False)
    assert blas.version_text().splitlines()[2] == (
        "BLAS: OpenBLAS (/usr/lib/x86_64-linux-gnu/libopenblas.so.0), SkylakeX kernels")
    assert blas.short_label() == "OpenBLAS"
    monkeypatch.setenv("OPENBLAS_CORETYPE", "skylakex")  # the environment named the set
    assert blas.version_text().splitlines()[2] == (
        "BLAS: OpenBLAS (/usr/lib/x86_64-linux-gnu/libopenblas.so.0), SkylakeX kernels"
        " (set by OPENBLAS_CORETYPE)")
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")  # named, not taken: nothing to say
    assert blas.version_text().splitlines()[2].endswith("SkylakeX kernels")
    state["report"] = LoadReport(core_chosen="SkylakeX")  # kvchat loaded it again with it
    read()
    assert blas.version_text().splitlines()[2] == (
        "BLAS: OpenBLAS (/usr/lib/x86_64-linux-gnu/libopenblas.so.0), SkylakeX kernels"
        " (chosen by kvchat: this OpenBLAS does not know this CPU)")


def test_macos_reports_accelerate_without_advice(monkeypatch) -> None:
    monkeypatch.setattr(blas.sys, "platform", "darwin")
    blas.active_blas.cache_clear()
    try:
        assert blas.describe() == "Accelerate" and blas.short_label() == "Accelerate"
    finally:
        blas.active_blas.cache_clear()


def test_version_names_mlx_device_and_blas(capsys) -> None:
    from kvchat.app.main import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("kvchat ") and "mlx " in out
    assert f"BLAS: {blas.active_blas()['name']}" in out
