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
# What a DYNAMIC_ARCH OpenBLAS older than the CPU runs: its generic SSE3 kernels (Debian's
# 0.3.21 on an Emerald Rapids Xeon: 19 GFLOP/s against 90 with its AVX-512 set, measured).
FALLBACK_CORE = "prescott"


@dataclass
class LoadReport:
    """What `load` did: the library that serves (`loaded`), those that did not load with
    the loader's reason, or why nothing was tried (`skipped`)."""

    loaded: str | None = None
    failed: list[tuple[str, str]] = field(default_factory=list)
    skipped: str | None = None


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
                break
            _report.failed.append((str(lib), why))
    active.cache_clear()
    return _report


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


def _openblas_core() -> str | None:
    try:
        get = ctypes.CDLL(None).openblas_get_corename
    except (AttributeError, OSError):
        return None
    get.restype = ctypes.c_char_p
    core = get()
    return core.decode(errors="replace") if core else None


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


def best_core(flags: frozenset[str]) -> str | None:
    """The best OpenBLAS kernel set a CPU with these flags runs (OPENBLAS_CORETYPE)."""
    return next((name for name, needs in CORES if needs <= flags), None)


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


def core_advice(core: str | None, flags: frozenset[str],
                env: dict[str, str]) -> tuple[str, str] | None:
    """For an OpenBLAS that fell back to its generic kernels on a CPU it does not know:
    (why, the command that picks the best set this CPU runs); None otherwise or when
    OPENBLAS_CORETYPE is already the user's choice."""
    best = best_core(flags)
    if core is None or core.lower() != FALLBACK_CORE or best is None:
        return None
    if "OPENBLAS_CORETYPE" in env:
        return None
    return (f"this OpenBLAS does not know this CPU and runs its generic {core} kernels",
            f"export OPENBLAS_CORETYPE={best}")


@functools.cache
def active() -> dict[str, Any]:
    """{"name", "path", "fast", "core", "note", "fix"}: the BLAS that serves MLX's matmuls
    in this process, OpenBLAS's kernel set, and, when it is slow, why (`note`) and the one
    command that would help (`fix`, or None)."""
    path = serving_library()
    if path is not None and not is_reference(path):
        core = _openblas_core()
        tip = core_advice(core, cpu_flags(), dict(os.environ))
        return {"name": _name_of(path), "path": path, "fast": True, "core": core,
                "note": tip[0] if tip else None, "fix": tip[1] if tip else None}
    note, fix = advice(_report, system_openblas(), shutil.which("apt-get") is not None,
                       _root())
    return {"name": "reference BLAS", "path": path or _mlx_reference(), "fast": False,
            "core": None, "note": note, "fix": fix}
