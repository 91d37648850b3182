"""Turn a generated Metal kernel source into a loaded CPU library (g++, cached by hash)."""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
HEADERS = ("metal_compat.h", "kvemu_abi.h", "kvemu_runtime.h", "kvemu_runtime.cpp")
CXX_FLAGS = (
    "-std=c++20",
    "-O1",
    "-shared",
    "-fPIC",
    "-fvisibility=hidden",
    "-ffp-contract=off",
    "-fno-strict-aliasing",
    "-fsingle-precision-constant",  # MSL has no double: 0.5 is a float literal
    "-Wno-attributes",
    "-w",
)

# `threadgroup T name[N];` / `threadgroup T name;` declare memory shared by the
# threadgroup: those become references into the runtime's arena (kvemu_runtime.h). Other
# uses of the word (pointer types such as `threadgroup float* p`) are address spaces.
_TG_DECL = re.compile(
    r"\bthreadgroup\s+(?P<type>[A-Za-z_][\w:]*(?:\s*<[^;<>]*>)?)\s+(?P<name>[A-Za-z_]\w*)"
    r"\s*(?P<dims>(?:\[[^\]]+\]\s*)*);"
)
_TG_POINTER = re.compile(r"\bthreadgroup\s+(?:const\s+)?[A-Za-z_][\w:]*(?:\s*<[^;<>]*>)?\s*[*&]")
_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
# Anything that can suspend a thread; kernels without them run as plain calls.
_COOPERATIVE = ("threadgroup_barrier", "simdgroup_barrier", "simd_", "quad_")


class EmulatorError(RuntimeError):
    """The emulator could not compile or run a kernel (message names the kernel)."""


def find_compiler() -> str | None:
    """The C++ compiler the emulator uses, or None if there is none."""
    return shutil.which(os.environ.get("CXX") or "g++")


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(os.environ.get("KVCHAT_EMULATOR_CACHE", Path(root) / "kvchat" / "metal_emulator"))


def rewrite_threadgroup_decls(text: str) -> str:
    def decl(m: re.Match[str]) -> str:
        dims = re.sub(r"\s+", "", m["dims"])
        return f"auto& {m['name']} = KVEMU_TG({m['type']}{dims});"

    out = _TG_DECL.sub(decl, text)
    code = _COMMENT.sub(lambda m: re.sub(r"[^\n]", " ", m[0]), out)  # same offsets, no comments
    for m in re.finditer(r"\bthreadgroup\b", code):
        if not _TG_POINTER.match(code, m.start()):
            line = code[: m.start()].count("\n") + 1
            raise EmulatorError(
                f"[metal_emulator] unsupported threadgroup declaration, line {line}"
            )
    return out


# MSL half literals (1.5h, 2e-3h) -> half(1.5f)
_HALF_LITERAL = re.compile(
    r"(?<![\w.])(\d+\.\d*(?:[eE][+-]?\d+)?|\d*\.\d+(?:[eE][+-]?\d+)?|\d+[eE][+-]?\d+)h\b"
)


def rewrite_half_literals(text: str) -> str:
    return _HALF_LITERAL.sub(r"half(\1f)", text)


def is_cooperative(text: str) -> bool:
    return any(tok in text for tok in _COOPERATIVE)


@dataclass(frozen=True)
class BufferCast:
    """How the launcher passes buffer `index` to the kernel parameter."""

    ctype: str  # element type as the signature spells it
    by_ref: bool  # `const constant T& x`: pass *(T*)buf


def translation_unit(
    kernel_source: str,
    func_name: str,
    template_def: str,
    casts: list[BufferCast],
    attrs: list[str],
) -> str:
    """Kernel source plus an `extern "C"` launcher that calls it for one thread."""
    args = []
    for i, c in enumerate(casts):
        args.append(f"*({c.ctype}*)b[{i}]" if c.by_ref else f"({c.ctype}*)b[{i}]")
    args += [f"id.{a}" for a in attrs]
    call = f"{func_name}{template_def}({', '.join(args)})"
    return (
        '#include "kvemu_runtime.h"\n'
        f'#line 1 "{func_name}.metal"\n'
        f"{rewrite_half_literals(rewrite_threadgroup_decls(kernel_source))}\n"
        '#line 100000 "kvemu_launcher"\n'
        "static void kvemu_run(void* ctx, const kvemu::Ids& id) {\n"
        "  void** b = (void**)ctx;\n"
        f"  {call};\n"
        "}\n"
        'extern "C" __attribute__((visibility("default"))) int kvemu_launch(\n'
        "    void** b, const unsigned* grid, const unsigned* tg, int order,\n"
        "    unsigned long long seed, int cooperative, char* err, int errlen) {\n"
        "  return kvemu::kvemu_run_grid(kvemu::Kernel{kvemu_run, b}, grid, tg, order, seed,\n"
        "      cooperative, err, errlen);\n"
        "}\n"
    )


_LOADED: dict[str, ctypes.CDLL] = {}


def _header_digest() -> str:
    h = hashlib.sha256()
    for name in HEADERS:
        h.update((HERE / name).read_bytes())
    h.update(" ".join(CXX_FLAGS).encode())
    return h.hexdigest()


def _compile(cxx: str, source: str, out: Path, label: str, extra: tuple[str, ...] = ()) -> None:
    """Build `source` into the shared library `out` unless it is cached already."""
    if out.exists():
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / "unit.cpp"
        src.write_text(source)
        lib = Path(tmp) / out.name
        res = subprocess.run(
            [cxx, *CXX_FLAGS, *extra, "-I", str(HERE), str(src), "-o", str(lib)],
            capture_output=True,
            text=True,
        )
        if res.returncode != 0:
            raise EmulatorError(f"[metal_emulator] compiling {label} failed:\n{res.stderr[-4000:]}")
        os.replace(lib, out)  # atomic: parallel test workers never see half a library


_RUNTIME: ctypes.CDLL | None = None


def _runtime(cxx: str) -> ctypes.CDLL:
    """The scheduler library, loaded globally so kernel libraries link against it."""
    global _RUNTIME
    if _RUNTIME is None:
        out = cache_dir() / f"kvemu_runtime_{_header_digest()[:16]}.so"
        _compile(
            cxx, (HERE / "kvemu_runtime.cpp").read_text(), out, "the emulator runtime", ("-O2",)
        )
        _RUNTIME = ctypes.CDLL(str(out), mode=ctypes.RTLD_GLOBAL)
    return _RUNTIME


def _pch_dir(cxx: str) -> Path | None:
    """A folder holding kvemu_runtime.h precompiled (5x faster kernel builds), or None."""
    folder = cache_dir() / f"pch_{_header_digest()[:16]}"
    gch = folder / "kvemu_runtime.h.gch"
    if not gch.exists():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f"kvemu_runtime.h.gch.{os.getpid()}"
        res = subprocess.run(
            [
                cxx,
                *CXX_FLAGS,
                "-x",
                "c++-header",
                "-I",
                str(HERE),
                str(HERE / "kvemu_runtime.h"),
                "-o",
                str(tmp),
            ],
            capture_output=True,
            text=True,
        )
        if res.returncode != 0:
            tmp.unlink(missing_ok=True)
            return None
        os.replace(tmp, gch)
    return folder


def load(tu: str, label: str) -> ctypes.CDLL:
    """Compile `tu` (or reuse the cached build with the same hash) and load it."""
    key = hashlib.sha256((_header_digest() + tu).encode()).hexdigest()[:32]
    if key in _LOADED:
        return _LOADED[key]
    cxx = find_compiler()
    if cxx is None:
        raise EmulatorError("the Metal emulator needs a C++ compiler (g++), and none was found")
    _runtime(cxx)
    out = cache_dir() / f"{key}.so"
    if not out.exists():
        pch = _pch_dir(cxx)
        _compile(cxx, tu, out, label, ("-I", str(pch)) if pch else ())
    dll = ctypes.CDLL(str(out))
    dll.kvemu_launch.restype = ctypes.c_int
    dll.kvemu_launch.argtypes = [
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.POINTER(ctypes.c_uint),
        ctypes.POINTER(ctypes.c_uint),
        ctypes.c_int,
        ctypes.c_ulonglong,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
    ]
    _LOADED[key] = dll
    return dll
