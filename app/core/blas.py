"""Which BLAS serves MLX's CPU matmuls, and finding a fast one on Linux without root.

MLX's Linux CPU wheel links the reference BLAS (its `mlx_cpu.libs/libblas-*.so`), about
30x slower for fp32 matmuls than OpenBLAS. Preloading a library that exports the same
unprefixed `cblas_*` symbols replaces it. Found in this order:

1. `KVCHAT_BLAS=/path/to/libopenblas.so.0` (any library exporting `cblas_sgemm`);
2. the system's OpenBLAS (Debian/Ubuntu: `apt-get install libopenblas0-pthread`);
3. pip's `cmeel-openblas` wheel (a Linux dependency of kvchat). It needs
   `libgfortran.so.5`, which a bare machine lacks; the mlx wheel ships one under a hashed
   name, so a folder of symlinks to it (`libgfortran.so.5` included) goes on
   LD_LIBRARY_PATH. numpy's bundled OpenBLAS cannot serve: its symbols are prefixed
   (`scipy_cblas_sgemm64_`, 64-bit ints).

`active_blas()` answers from the running process (the library that resolves
`cblas_sgemm`), so the side panel, `bench` and `kvchat --version` say what is really used.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import functools
import os
import sys
import sysconfig
from pathlib import Path
from typing import Any

HINT = ("reference BLAS in use (matmuls ~30x slower): pip install cmeel-openblas"
        " or apt-get install libopenblas0-pthread")
_REEXEC_MARK = "KVCHAT_BLAS_PRELOADED"
THREAD_TIMEOUT = 14  # OpenBLAS idle threads spin 2^14 cycles (a few µs), then sleep


def _system_openblas() -> list[Path]:
    triple = sysconfig.get_config_var("MULTIARCH") or "x86_64-linux-gnu"
    return [Path(f"/usr/lib/{triple}/libopenblas.so.0"), Path("/usr/lib64/libopenblas.so.0"),
            Path("/usr/lib/libopenblas.so.0")]


def _site_dirs() -> list[Path]:
    return [Path(p) for p in sys.path if p and Path(p).is_dir()]


def _pip_openblas() -> Path | None:
    for d in _site_dirs():
        lib = d / "cmeel.prefix" / "lib" / "libopenblas.so.0"
        if lib.is_file():
            return lib
    return None


def _gfortran_shim() -> Path | None:
    """A folder where `libgfortran.so.5` (and its hashed siblings) resolve to the copy
    the mlx or numpy wheel ships; None when none is found."""
    for d in _site_dirs():
        for libs in (d / "mlx_cpu.libs", d / "numpy.libs"):
            gfortran = sorted(libs.glob("libgfortran-*.so.5*")) if libs.is_dir() else []
            if not gfortran:
                continue
            cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
            shim = cache / "kvchat" / "blas-shim" / libs.name
            try:
                shim.mkdir(parents=True, exist_ok=True)
                links = {f.name: f for f in libs.iterdir()} | {"libgfortran.so.5": gfortran[0]}
                for name, target in links.items():
                    link = shim / name
                    if link.is_symlink() and link.resolve() == target.resolve():
                        continue
                    link.unlink(missing_ok=True)
                    link.symlink_to(target)
            except OSError:
                return None
            return shim
    return None


def find_fast_blas() -> tuple[Path, Path | None] | None:
    """(library to preload, folder for LD_LIBRARY_PATH or None), or None."""
    forced = os.environ.get("KVCHAT_BLAS")
    if forced:
        return (Path(forced), None) if Path(forced).is_file() else None
    for lib in _system_openblas():
        if lib.is_file():
            return lib, None
    lib = _pip_openblas()
    if lib is None:
        return None
    if ctypes.util.find_library("gfortran"):
        return lib, None
    shim = _gfortran_shim()
    return (lib, shim) if shim is not None else None


def fast_blas_env() -> dict[str, str] | None:
    """The environment `kvchat` runs in once its fast BLAS is preloaded (None when there
    is nothing to do: not Linux, already preloaded, KVCHAT_NO_OPENBLAS=1, none found).
    Benchmarks give it to the processes they compare, so both run on the same BLAS.
    OpenBLAS's idle threads spin for 2^28 cycles (~0.1 s) after each threaded call before
    sleeping; on a shared core that spin steals the time slice of the single-threaded
    decode steps that follow a prefill, so it is bounded to 2^THREAD_TIMEOUT cycles unless
    OPENBLAS_THREAD_TIMEOUT is set."""
    preload = os.environ.get("LD_PRELOAD", "")
    if (
        sys.platform != "linux"
        or "blas" in preload
        or os.environ.get(_REEXEC_MARK)
        or os.environ.get("KVCHAT_NO_OPENBLAS") == "1"
    ):
        return None
    found = find_fast_blas()
    if found is None:
        return None
    lib, lib_dir = found
    env = {"OPENBLAS_THREAD_TIMEOUT": str(THREAD_TIMEOUT), **os.environ,
           "LD_PRELOAD": f"{lib} {preload}".strip(), _REEXEC_MARK: "1"}
    if lib_dir is not None:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (str(lib_dir), os.environ.get("LD_LIBRARY_PATH", "")) if p)
    return env


def reexec_with_fast_blas(module: str = "kvchat.app") -> None:
    """On Linux, re-exec `python -m module` once with a fast BLAS preloaded
    (KVCHAT_NO_OPENBLAS=1: never)."""
    env = fast_blas_env()
    if env is None:
        return
    try:
        os.execve(sys.executable, [sys.executable, "-m", module, *sys.argv[1:]], env)
    except OSError:
        pass  # run on the slower BLAS rather than not at all


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def _name_of(path: str) -> str:
    low = Path(path).name.lower()
    if "openblas" in low:
        return "OpenBLAS"
    if "mkl" in low:
        return "MKL"
    if "blis" in low:
        return "BLIS"
    return Path(path).name


@functools.cache
def active_blas() -> dict[str, Any]:
    """{"name", "path", "fast"}: the BLAS that serves `cblas_sgemm` in this process."""
    if sys.platform == "darwin":
        return {"name": "Accelerate", "path": None, "fast": True}
    if sys.platform != "linux":
        return {"name": "unknown", "path": None, "fast": False}
    try:
        proc = ctypes.CDLL(None)
        addr = ctypes.cast(proc.cblas_sgemm, ctypes.c_void_p)
        info = _DlInfo()
        if proc.dladdr(addr, ctypes.byref(info)) and info.dli_fname:
            path = info.dli_fname.decode(errors="replace")
            return {"name": _name_of(path), "path": path, "fast": True}
    except (AttributeError, OSError):
        pass  # not in the global scope: mlx resolves it from its own bundled library
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        maps = ""
    for line in maps.splitlines():
        if "mlx_cpu.libs/libblas" in line:
            return {"name": "reference BLAS", "path": line.split()[-1], "fast": False}
    return {"name": "unknown", "path": None, "fast": False}


def describe() -> str:
    """One line for diagnostics: the BLAS in use, with the hint when it is the slow one."""
    b = active_blas()
    where = f" ({b['path']})" if b["path"] else ""
    return f"{b['name']}{where}" + ("" if b["fast"] else f"; {HINT}")


def short_label() -> str:
    """For the side panel: the BLAS name, or the slow one with what to install."""
    b = active_blas()
    return b["name"] if b["fast"] else "reference (slow): pip install cmeel-openblas"


def version_text() -> str:
    """`kvchat --version`: kvchat, MLX, device, BLAS and the thread policy."""
    import mlx.core as mx

    from kvchat.app import __version__
    from kvchat.model import threads

    if not threads.bound():  # --version runs before main() configures the policy
        threads.configure(None, active_blas()["path"])  # a bad KVCHAT_THREADS: ThreadsError
    return (f"kvchat {__version__}\nmlx {mx.__version__} on {mx.default_device()}\n"
            f"BLAS: {describe()}\nthreads: {threads.describe()}")


class VersionAction(argparse.Action):
    """`--version`, computed only when asked (it imports MLX)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS,
                 default: str = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        from kvchat.model.threads import ThreadsError

        try:
            text = version_text()
        except ThreadsError as e:
            parser.error(str(e))  # a usage error: one line, exit 2
        print(text)
        parser.exit()
