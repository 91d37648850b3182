"""The BLAS under MLX's CPU matmuls on Linux: which library, loading it into this process
before MLX, and the one thing to tell the user when it is slow.

Linux only: app/core/blas.py imports this module only when `sys.platform == "linux"`
(MLX on macOS uses Accelerate; docs/design.md, "Layout").

MLX's Linux CPU wheel links the reference BLAS (`mlx_cpu.libs/libblas-*.so`), about 30x
slower for fp32 matmuls than OpenBLAS (a 1024² fp32 matmul: 5.6 against 161 GFLOP/s,
measured on a 2-core Xeon). Python loads MLX's extension with local scope, and the dynamic
linker looks a symbol up in the global scope before an object's own dependencies, so a
library that exports `cblas_sgemm` and is loaded with RTLD_GLOBAL *before MLX's first
import* serves every `cblas_*` call MLX makes in this process (`load`). Nothing is compiled,
re-executed or preloaded, and no child inherits anything from it; the engine's child
process loads the same library itself (model/runtime/threads.py, `child_env`).

Which library (`candidates`): `KVCHAT_BLAS=/path` as it is, else the system's OpenBLAS
(distributions build it DYNAMIC_ARCH: it picks kernels for the CPU it finds).
`KVCHAT_NO_OPENBLAS=1`: none. No wheel on PyPI serves: numpy's and scipy-openblas32/64's
symbols are prefixed (`scipy_cblas_sgemm`), cmeel-openblas is a SKYLAKEX build (AVX-512
CPUs only), and the DYNAMIC_ARCH builds with plain symbols (ngsolve-openblas) need a
`libgfortran.so.5` a bare machine lacks (the mlx wheel's copy has a hashed name the loader
does not match). So where nothing is found the advice is the system package.

Which kernels (`fit_kernels`): a DYNAMIC_ARCH OpenBLAS older than the CPU does not know
it and runs its generic Prescott kernels (Debian's 0.3.21 on an Emerald Rapids Xeon: 19
GFLOP/s against 90 with its AVX-512 set, a 1024² fp32 matmul on one thread;
`python -m tests.benchmarks.blas_kernels` measures every set on a machine). OpenBLAS
picks its set once, as it loads, from OPENBLAS_CORETYPE or the CPU; it cannot be told
before loading whether it knows the CPU, so kvchat loads it, reads its pick
(`openblas_get_corename`) and, when that is the generic set on a CPU whose flags
(/proc/cpuinfo) run a better one, closes it and loads it again with OPENBLAS_CORETYPE set
for that load only (model/runtime/threads.py, `reload`): before MLX is imported nothing
points into the first copy, and dlclose unmaps it (checked in /proc/self/maps; Debian's
build is not NODELETE). A user's OPENBLAS_CORETYPE always wins.

`active` says what serves MLX's matmuls in this process and, when that is slow, why and
the one command that would help here (`advice`): never a package that is installed.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvchat.model.runtime import threads

BLAS_ENV = "KVCHAT_BLAS"
OFF_ENV = "KVCHAT_NO_OPENBLAS"
APT_PACKAGE = "libopenblas0-pthread"
SLOW = "matmuls ~30x slower than with OpenBLAS"

# OpenBLAS's kernel sets (OPENBLAS_CORETYPE names), best first, and what each needs.
_AVX512 = frozenset({"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"})
CORES = (("SkylakeX", _AVX512), ("Haswell", frozenset({"avx2", "fma"})),
         ("SandyBridge", frozenset({"avx"})))
# What a DYNAMIC_ARCH OpenBLAS older than the CPU runs: its generic SSE3 kernels.
FALLBACK_CORE = "prescott"
CORETYPE_ENV = "OPENBLAS_CORETYPE"


@dataclass
class LoadReport:
    """What `load` did: the library that serves (`loaded`), those that did not load with
    the loader's reason, or why nothing was tried (`skipped`); and for the generic kernels
    (`fit_kernels`), the set it was loaded again with (`core_chosen`), or why it could not
    be (`core_kept`), or the sets it was asked for and ignored (`core_ignored`)."""

    loaded: str | None = None
    failed: list[tuple[str, str]] = field(default_factory=list)
    skipped: str | None = None
    core_chosen: str | None = None
    core_kept: str | None = None
    core_ignored: tuple[str, ...] = ()


_report = LoadReport()


def system_openblas() -> list[Path]:
    """The system's OpenBLAS where a distribution installs it (Debian/Ubuntu's multiarch
    folder, Fedora's lib64)."""
    triple = sysconfig.get_config_var("MULTIARCH") or "x86_64-linux-gnu"
    paths = (f"/usr/lib/{triple}/libopenblas.so.0", "/usr/lib64/libopenblas.so.0",
             "/usr/lib/libopenblas.so.0")
    return [Path(p) for p in paths if Path(p).is_file()]


def candidates() -> list[Path]:
    forced = os.environ.get(BLAS_ENV)
    return [Path(forced)] if forced else system_openblas()


def load() -> LoadReport:
    """Load the first candidate that loads into this process's global scope, before MLX
    is imported (after, MLX may already have bound its calls to its own BLAS: nothing is
    loaded then). A BLAS already serving (the user's LD_PRELOAD) is left as it is."""
    global _report
    if os.environ.get(OFF_ENV) == "1":
        _report = LoadReport(skipped=f"{OFF_ENV}=1")
    elif (serving := serving_library()) is not None and not is_reference(serving):
        threads.bind(serving)
        _report = LoadReport(loaded=serving)
    elif "mlx.core" in sys.modules and candidates():
        _report = LoadReport(skipped="MLX was imported before kvchat could load a BLAS")
    else:
        _report = LoadReport()
        for lib in candidates():
            why = threads.load(str(lib))
            if why is None:
                _report.loaded = str(lib)
                fit_kernels(_report)
                break
            _report.failed.append((str(lib), why))
    active.cache_clear()
    return _report


def falls_back(core: str | None) -> bool:
    """Whether OpenBLAS runs its generic kernels (it did not know the CPU)."""
    return core is not None and core.lower() == FALLBACK_CORE


def fit_kernels(report: LoadReport) -> None:
    """Just after `threads.load`, before MLX is imported: where the library fell back to
    its generic kernels on a CPU that runs better, load it again with the best set the
    CPU's flags allow, then the next (a build may lack one). The user's
    OPENBLAS_CORETYPE stands; a library that is not DYNAMIC_ARCH has one set only."""
    if CORETYPE_ENV in os.environ or not falls_back(_openblas_core()) or not _dynamic():
        return
    fitting = fitting_cores(cpu_flags())
    for core in fitting:
        why = threads.reload(core)
        if why is not None:
            report.core_kept = why
            return
        if not falls_back(_openblas_core()):
            report.core_chosen = core
            return
    if fitting:  # none took: its own pick again, as the engine's child will load it
        report.core_ignored = fitting
        report.core_kept = threads.reload(None)


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def serving_library() -> str | None:
    """The file whose `cblas_sgemm` this process's global scope resolves: the one MLX's
    calls bind to when it was there before MLX (None: MLX's own, in its local scope)."""
    try:
        proc = ctypes.CDLL(None)
        addr = ctypes.cast(proc.cblas_sgemm, ctypes.c_void_p)
        info = _DlInfo()
        if proc.dladdr(addr, ctypes.byref(info)) and info.dli_fname:
            return info.dli_fname.decode(errors="replace")
    except (AttributeError, OSError):
        pass
    return None


def is_reference(path: str) -> bool:
    """MLX's bundled reference BLAS, or netlib's (`libblas.so.3` not pointing elsewhere)."""
    real = Path(path).resolve().name.lower()
    return "mlx_cpu.libs" in path or real.startswith("libblas")


def _mlx_reference() -> str | None:
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    return next((line.split()[-1] for line in maps.splitlines()
                 if "mlx_cpu.libs/libblas" in line), None)


def _name_of(path: str) -> str:
    low = Path(path).resolve().name.lower()
    for key, name in (("openblas", "OpenBLAS"), ("mkl", "MKL"), ("blis", "BLIS")):
        if key in low:
            return name
    return Path(path).name


def _openblas_text(name: str) -> str | None:
    """A string OpenBLAS reports about itself, from this process's global scope."""
    try:
        get = getattr(ctypes.CDLL(None), name)
    except (AttributeError, OSError):
        return None
    get.restype = ctypes.c_char_p
    text = get()
    return text.decode(errors="replace") if text else None


def _openblas_core() -> str | None:
    """The kernel set OpenBLAS picked as it loaded ("SkylakeX", "Haswell", "Prescott")."""
    return _openblas_text("openblas_get_corename")


def _dynamic() -> bool:
    """Whether it is a DYNAMIC_ARCH build (else OPENBLAS_CORETYPE is not read)."""
    return "DYNAMIC_ARCH" in (_openblas_text("openblas_get_config") or "").split()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's instruction-set flags (/proc/cpuinfo); empty where unreadable."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def fitting_cores(flags: frozenset[str]) -> tuple[str, ...]:
    """The OpenBLAS kernel sets a CPU with these flags runs (OPENBLAS_CORETYPE), best first."""
    return tuple(name for name, needs in CORES if needs <= flags)


def best_core(flags: frozenset[str]) -> str | None:
    """The best OpenBLAS kernel set a CPU with these flags runs."""
    return next(iter(fitting_cores(flags)), None)


def _root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def advice(report: LoadReport, installed: list[Path], apt: bool,
           root: bool) -> tuple[str, str | None]:
    """(why MLX's reference BLAS is slow here, the one shell command that would help or None),
    from what `load` did, the system OpenBLAS files present, whether apt-get is there and
    whether we are root. Never names a package that is installed."""
    pick = f"export {BLAS_ENV}=/path/to/libopenblas.so.0"
    if report.skipped == f"{OFF_ENV}=1":
        return f"{SLOW}, as {OFF_ENV}=1 asks", f"unset {OFF_ENV}"
    if report.failed:
        path, why = report.failed[0]
        return f"{SLOW}: {path} did not load ({why})", pick
    if report.skipped is not None:
        return f"{SLOW}: {report.skipped}", None
    if installed:  # present, yet not tried: load() did not run in this process
        return f"{SLOW}: {installed[0]} was not loaded before MLX", None
    if apt:
        return SLOW, ("" if root else "sudo ") + f"apt-get install {APT_PACKAGE}"
    return SLOW, pick


def core_advice(core: str | None, flags: frozenset[str], env: dict[str, str],
                dynamic: bool = True, report: LoadReport | None = None,
                ) -> tuple[str, str | None] | None:
    """For an OpenBLAS that runs its generic kernels on a CPU that runs better: (why, the
    command that picks the best set, or None where none would help); None otherwise or
    when OPENBLAS_CORETYPE is the user's. `report`: what `fit_kernels` found."""
    best = best_core(flags)
    if not falls_back(core) or best is None or CORETYPE_ENV in env:
        return None
    report = report or LoadReport()
    if not dynamic:
        return f"this OpenBLAS is built for its generic {core} kernels only", None
    why = f"this OpenBLAS does not know this CPU and runs its generic {core} kernels"
    if report.core_ignored:
        sets = ", ".join(report.core_ignored)
        return f"{why}; it ignored {CORETYPE_ENV}={sets}", None
    if report.core_kept:
        why += f" (kvchat could not load it again: {report.core_kept})"
    return why, f"export {CORETYPE_ENV}={best}"


@functools.cache
def active() -> dict[str, Any]:
    """{"name", "path", "fast", "core", "core_chosen", "note", "fix"}: the BLAS that serves
    MLX's matmuls in this process, OpenBLAS's kernel set and whether kvchat chose it (the
    OPENBLAS_CORETYPE it loaded the library with, `fit_kernels`), and, when it is slow, why
    (`note`) and the one command that would help (`fix`, or None)."""
    path = serving_library()
    if path is not None and not is_reference(path):
        core = _openblas_core()
        tip = core_advice(core, cpu_flags(), dict(os.environ), _dynamic(), _report)
        return {"name": _name_of(path), "path": path, "fast": True, "core": core,
                "core_chosen": _report.core_chosen, "note": tip[0] if tip else None,
                "fix": tip[1] if tip else None}
    note, fix = advice(_report, system_openblas(), shutil.which("apt-get") is not None,
                       _root())
    return {"name": "reference BLAS", "path": path or _mlx_reference(), "fast": False,
            "core": None, "core_chosen": None, "note": note, "fix": fix}
