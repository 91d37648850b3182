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

Two corrections ride along, each measured on this project's 2-core Xeon (an Emerald
Rapids, newer than Debian's OpenBLAS 0.3.21):

- Kernels: OpenBLAS picks its kernels by CPU model at load time and falls back to Prescott
  (SSE3) for a model it does not know: 19-35 GFLOP/s instead of 90-183 with its SkylakeX
  kernels. A probe (cached per library and CPU) reads the choice; when it is that fallback
  and the CPU's flags allow better, OPENBLAS_CORETYPE names the better set. A library
  built for one CPU (cmeel's wheel: SKYLAKEX, AVX-512 only) is skipped on a CPU without
  the instructions it needs instead of dying with SIGILL.
- One-row products: `gemv_forward.c`, compiled once into the cache with the system's C
  compiler and preloaded ahead of the BLAS, sends MLX's `cblas_sgemm` calls with one row
  or one column to `cblas_sgemv` (decode of a 135M-class model: 12.8 -> 17.3 tok/s, README
  round 5). No compiler, or KVCHAT_GEMV=0: plain GEMM.

`active_blas()` answers from the running process (the library that resolves
`cblas_sgemv`, and whether the forwarding is in front of it), so the side panel, `bench`
and `kvchat --version` say what is really used.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import functools
import hashlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

HINT = ("reference BLAS in use (matmuls ~30x slower): pip install cmeel-openblas"
        " or apt-get install libopenblas0-pthread")
_REEXEC_MARK = "KVCHAT_BLAS_PRELOADED"
THREAD_TIMEOUT = 14  # OpenBLAS idle threads spin 2^14 cycles (a few µs), then sleep


GEMV_SOURCE = Path(__file__).with_name("gemv_forward.c")
# What a single-target OpenBLAS build's kernels need from the CPU (by its core name).
_AVX512 = frozenset({"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"})
_AVX2 = frozenset({"avx2", "fma"})
CORE_NEEDS = {"skylakex": _AVX512, "cooperlake": _AVX512, "sapphirerapids": _AVX512,
              "haswell": _AVX2, "zen": _AVX2, "sandybridge": frozenset({"avx"})}
BEST_FIRST = ("SkylakeX", "Haswell", "SandyBridge")  # OPENBLAS_CORETYPE names
FALLBACK_CORE = "prescott"  # what a DYNAMIC_ARCH OpenBLAS runs on a CPU it does not know
_PROBE = ("import ctypes, json, sys; lib = ctypes.CDLL(sys.argv[1]);"
          " lib.openblas_get_config.restype = lib.openblas_get_corename.restype ="
          " ctypes.c_char_p; print(json.dumps({'config': lib.openblas_get_config().decode(),"
          " 'core': lib.openblas_get_corename().decode()}))")


def _cache_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "kvchat" / "blas-shim"


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
            shim = _cache_dir() / libs.name
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
    """The best OpenBLAS kernel set (an OPENBLAS_CORETYPE name) a CPU with these flags runs."""
    return next((c for c in BEST_FIRST if CORE_NEEDS[c.lower()] <= flags), None)


def _is_probe(found: Any) -> bool:
    return isinstance(found, dict) and all(
        isinstance(found.get(k), str) for k in ("config", "core"))


def probe_openblas(lib: Path, lib_dir: Path | None = None) -> dict[str, str] | None:
    """{"config", "core"}: an OpenBLAS's build and the kernels it picks on this CPU, read
    in a child process (a build this CPU cannot run dies there, not here) and cached per
    library and CPU; None when it does not load."""
    try:
        st = lib.stat()
    except OSError:
        return None
    key = json.dumps([str(lib.resolve()), st.st_size, st.st_mtime_ns, sorted(cpu_flags())])
    cached = _cache_dir() / f"probe-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    try:
        found = json.loads(cached.read_text())
        if found == {} or _is_probe(found):
            return found or None  # {}: the library did not load here
    except (OSError, ValueError):
        pass  # missing or damaged: probe again
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "OPENBLAS_CORETYPE")}
    env["OPENBLAS_NUM_THREADS"] = "1"
    if lib_dir is not None:
        env["LD_LIBRARY_PATH"] = str(lib_dir)
    try:
        out = subprocess.run([sys.executable, "-I", "-S", "-c", _PROBE, str(lib)], env=env,
                             capture_output=True, text=True, timeout=60)
        found = json.loads(out.stdout) if out.returncode == 0 else {}
        if not _is_probe(found):
            found = {}
    except (OSError, ValueError, subprocess.SubprocessError):
        return None  # not cached: it may work next time
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(f"{cached.name}.{os.getpid()}")
        tmp.write_text(json.dumps(found))
        os.replace(tmp, cached)
    except OSError:
        pass
    return found or None


def runs_here(probe: dict[str, str]) -> bool:
    """Whether this CPU has the instructions the kernels the library picked need."""
    return CORE_NEEDS.get(probe["core"].lower(), frozenset()) <= cpu_flags()


def core_override(probe: dict[str, str]) -> str | None:
    """OPENBLAS_CORETYPE for a library that fell back to its generic kernels on a CPU it
    does not know although the CPU runs better ones; None when its own choice stands."""
    if "DYNAMIC_ARCH" not in probe["config"] or probe["core"].lower() != FALLBACK_CORE:
        return None
    return best_core(cpu_flags())


def _find() -> tuple[Path, Path | None, dict[str, str] | None] | None:
    forced = os.environ.get("KVCHAT_BLAS")
    if forced:  # the user's choice, as it is
        return (Path(forced), None, None) if Path(forced).is_file() else None
    candidates: list[tuple[Path, Path | None]] = [
        (lib, None) for lib in _system_openblas() if lib.is_file()]
    lib = _pip_openblas()
    if lib is not None:
        if ctypes.util.find_library("gfortran"):
            candidates.append((lib, None))
        elif (shim := _gfortran_shim()) is not None:
            candidates.append((lib, shim))
    for lib, lib_dir in candidates:
        probe = probe_openblas(lib, lib_dir)
        if probe is None or runs_here(probe):  # an unprobed library is tried, not dropped
            return lib, lib_dir, probe
    return None


def find_fast_blas() -> tuple[Path, Path | None] | None:
    """(library to preload, folder for LD_LIBRARY_PATH or None), or None."""
    found = _find()
    return None if found is None else found[:2]


def gemv_forward_lib() -> Path | None:
    """`gemv_forward.c` compiled into the cache (once per source), or None when
    KVCHAT_GEMV=0 or it cannot be built (no C compiler: plain GEMM then)."""
    if os.environ.get("KVCHAT_GEMV") == "0":
        return None
    try:
        source = GEMV_SOURCE.read_bytes()
    except OSError:
        return None
    tag = hashlib.sha256(source + platform.machine().encode()).hexdigest()[:12]
    out = _cache_dir() / f"libkvchat-gemv-{tag}.so"
    if out.is_file():
        try:
            ctypes.CDLL(str(out))  # loads (local scope: it replaces nothing in this process)
            return out
        except OSError:
            out.unlink(missing_ok=True)  # damaged: build it again
    cc = shlex.split(os.environ.get("CC", ""))
    if not cc:
        found = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
        if found is None:
            return None
        cc = [found]
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        built = subprocess.run([*cc, "-O2", "-shared", "-fPIC", "-o", str(tmp),
                                str(GEMV_SOURCE), "-ldl"], capture_output=True, timeout=120)
        if built.returncode != 0:
            return None
        os.replace(tmp, out)  # atomic: a second window never loads a half-written file
    except (OSError, subprocess.SubprocessError):
        return None
    finally:
        tmp.unlink(missing_ok=True)
    return out


def fast_blas_env() -> dict[str, str] | None:
    """The environment `kvchat` runs in once its fast BLAS is preloaded (None when there
    is nothing to do: not Linux, already preloaded, KVCHAT_NO_OPENBLAS=1, none found).
    Benchmarks give it to the processes they compare, so both run on the same BLAS.
    OpenBLAS's idle threads spin for 2^28 cycles (~0.1 s) after each threaded call before
    sleeping; on a shared core that spin steals the time slice of the single-threaded
    decode steps that follow a prefill, so it is bounded to 2^THREAD_TIMEOUT cycles unless
    OPENBLAS_THREAD_TIMEOUT is set. OPENBLAS_CORETYPE, where the library's own choice is
    its generic fallback (`core_override`), is likewise the user's to override."""
    preload = os.environ.get("LD_PRELOAD", "")
    if (
        sys.platform != "linux"
        or "blas" in preload
        or os.environ.get(_REEXEC_MARK)
        or os.environ.get("KVCHAT_NO_OPENBLAS") == "1"
    ):
        return None
    found = _find()
    if found is None:
        return None
    lib, lib_dir, probe = found
    defaults = {"OPENBLAS_THREAD_TIMEOUT": str(THREAD_TIMEOUT)}
    if probe is not None and (core := core_override(probe)) is not None:
        defaults["OPENBLAS_CORETYPE"] = core
    # the forwarding goes first: its cblas_sgemm is found before the BLAS's own
    libs = [str(p) for p in (gemv_forward_lib(), lib) if p is not None]
    env = {**defaults, **os.environ, _REEXEC_MARK: "1",
           "LD_PRELOAD": " ".join([*libs, preload]).strip()}
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


def _openblas_core(proc: ctypes.CDLL) -> str | None:
    try:
        get = proc.openblas_get_corename
    except AttributeError:
        return None
    get.restype = ctypes.c_char_p
    core = get()
    return core.decode(errors="replace") if core else None


@functools.cache
def active_blas() -> dict[str, Any]:
    """{"name", "path", "fast", "core", "gemv_forward"}: the BLAS that serves MLX's
    matmuls in this process (the library of `cblas_sgemv`: `cblas_sgemm` may be the
    forwarding in front of it), OpenBLAS's kernel set, and whether one-row products go
    to GEMV."""
    none = {"core": None, "gemv_forward": False}
    if sys.platform == "darwin":
        return {"name": "Accelerate", "path": None, "fast": True, **none}
    if sys.platform != "linux":
        return {"name": "unknown", "path": None, "fast": False, **none}
    try:
        proc = ctypes.CDLL(None)
        addr = ctypes.cast(proc.cblas_sgemv, ctypes.c_void_p)
        info = _DlInfo()
        if proc.dladdr(addr, ctypes.byref(info)) and info.dli_fname:
            path = info.dli_fname.decode(errors="replace")
            return {"name": _name_of(path), "path": path, "fast": True,
                    "core": _openblas_core(proc),
                    "gemv_forward": hasattr(proc, "kvchat_gemv_forward")}
    except (AttributeError, OSError):
        pass  # not in the global scope: mlx resolves it from its own bundled library
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        maps = ""
    for line in maps.splitlines():
        if "mlx_cpu.libs/libblas" in line:
            return {"name": "reference BLAS", "path": line.split()[-1], "fast": False, **none}
    return {"name": "unknown", "path": None, "fast": False, **none}


def set_gemv_forward(on: bool) -> bool:
    """Switch the one-row forwarding on or off in this process, for A/B timing; False
    when it is not loaded."""
    try:
        flag = ctypes.c_int.in_dll(ctypes.CDLL(None), "kvchat_gemv_forward")
    except (ValueError, OSError):
        return False
    flag.value = int(on)
    return True


def label(b: dict[str, Any], where: str = "") -> str:
    """`active_blas()`'s answer in words: name, (where,) kernels, forwarding."""
    extras = ([f"{b['core']} kernels"] if b.get("core") else []) + (
        ["one-row products as GEMV"] if b.get("gemv_forward") else [])
    return b["name"] + where + "".join(f", {e}" for e in extras)


def describe() -> str:
    """One line for diagnostics: the BLAS in use, its kernels, and the hint when it is
    the slow one."""
    b = active_blas()
    where = f" ({b['path']})" if b["path"] else ""
    return label(b, where) + ("" if b["fast"] else f"; {HINT}")


def short_label() -> str:
    """For the side panel: the BLAS name (+ gemv where one-row products go to GEMV), or
    the slow one with what to install."""
    b = active_blas()
    if not b["fast"]:
        return "reference (slow): pip install cmeel-openblas"
    return b["name"] + (" + gemv" if b.get("gemv_forward") else "")


def version_text() -> str:
    """`kvchat --version`: kvchat, MLX, device, BLAS and the thread policy."""
    import mlx.core as mx

    from kvchat.app import __version__
    from kvchat.model.runtime import threads

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
        from kvchat.model.runtime.threads import ThreadsError

        try:
            text = version_text()
        except ThreadsError as e:
            parser.error(str(e))  # a usage error: one line, exit 2
        print(text)
        parser.exit()
