"""A CPU emulator for `mx.fast.metal_kernel`: runs the exact Metal sources without a Mac.

`metal_kernel(...)` has the signature of `mx.fast.metal_kernel`; the callable it returns
takes the same keywords and returns a list of `mx.array`. The kernel text is wrapped in
the signature MLX would write (`signature.py`), compiled with g++ against a small MSL
compatibility header (`metal_compat.h`, `kvemu_runtime.h`), cached by hash, and run
threadgroup by threadgroup with cooperative threads (see kvemu_runtime.h).

Thread order is a module setting: `set_schedule("sequential" | "reversed" | "shuffled",
seed)`, `with schedule(...)`, or KVCHAT_EMULATOR_SCHEDULE=order[:seed] for a session.
Outputs and threadgroup memory start as NaN bytes, and guard bytes follow every buffer,
so unwritten, unsynchronised and out-of-bounds accesses show. With
ensure_row_contiguous=False inputs keep their own layout (as on a GPU), and contiguous
ones whose strides the kernel reads become gapped views. Differences from a GPU:
execution is eager (no lazy graph, no mx.compile tracing); fast-math accuracy is not
modelled.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import mlx.core as mx
import numpy as np

from .compiler import (
    BufferCast,
    EmulatorError,
    find_compiler,
    is_cooperative,
    load,
    translation_unit,
)
from .signature import (
    InputSpec,
    TemplateArg,
    attributes,
    kernel_name,
    shape_infos,
    type_string,
    write_signature,
    write_template,
)

__all__ = [
    "EmulatorError",
    "available",
    "unavailable_reason",
    "launches",
    "metal_kernel",
    "schedule",
    "set_schedule",
]

ORDERS = {"sequential": 0, "reversed": 1, "shuffled": 2}
# One scheduler per process: launches from several Python threads (ctypes drops the GIL)
# take turns.
_LAUNCH_LOCK = threading.Lock()


def _env_schedule() -> tuple[str, int]:
    """KVCHAT_EMULATOR_SCHEDULE=order[:seed] runs a whole test session in another order."""
    value = os.environ.get("KVCHAT_EMULATOR_SCHEDULE", "sequential")
    order, _, seed = value.partition(":")
    if order not in ORDERS or (seed and not seed.isdigit()):
        raise ValueError(
            f"KVCHAT_EMULATOR_SCHEDULE={value!r}; expected one of {list(ORDERS)}[:seed]"
        )
    return order, int(seed or 0)


_schedule: tuple[str, int] = _env_schedule()

# With ensure_row_contiguous=False, inputs arrive in their own layout, as MLX passes them
# (a transposed view stays transposed); row-contiguous ones whose strides the kernel reads
# are re-laid as gapped views (see `_strided`) unless this is False.
strided_views = True

# Launch count per kernel name, so tests can prove a call went through the emulator.
launches: Counter[str] = Counter()


def unavailable_reason() -> str | None:
    """Why the emulator cannot run here (for a test's skip reason), or None."""
    if not sys.platform.startswith("linux"):
        # ELF shared libraries, glibc ucontext and g++ flags: only built and tested on Linux
        return f"the Metal emulator runs on Linux only (this is {sys.platform})"
    if find_compiler() is None:
        return "the Metal emulator needs g++ (not found; set CXX to use another compiler)"
    return None


def available() -> bool:
    """Whether the emulator can build and run kernels here."""
    return unavailable_reason() is None


def set_schedule(order: str, seed: int = 0) -> None:
    """Thread order within each threadgroup for every later launch."""
    global _schedule
    if order not in ORDERS:
        raise ValueError(f"unknown schedule {order!r}; allowed: {', '.join(ORDERS)}")
    _schedule = (order, seed)


@contextmanager
def schedule(order: str, seed: int = 0) -> Iterator[None]:
    saved = _schedule
    set_schedule(order, seed)
    try:
        yield
    finally:
        set_schedule(*saved)


def _as_array(value: object) -> mx.array:
    if isinstance(value, mx.array):
        return value
    # What MLX's `to_array` makes of a Python scalar: bool, int32 or float32.
    if isinstance(value, bool):
        return mx.array(value, dtype=mx.bool_)
    if isinstance(value, int):
        return mx.array(value, dtype=mx.int32)
    if isinstance(value, float):
        return mx.array(value, dtype=mx.float32)
    raise TypeError(f"[metal_kernel] inputs must be arrays or scalars, got {type(value).__name__}")


def _raw(a: mx.array) -> np.ndarray:
    """Row-contiguous bytes of `a` as numpy (bfloat16 through its bits)."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.ascontiguousarray(np.array(a, copy=True))


def _row_strides(shape: Sequence[int]) -> list[int]:
    return [int(np.prod(shape[i + 1 :])) for i in range(len(shape))]


def _as_laid_out(a: mx.array) -> tuple[np.ndarray, int, list[int]]:
    """`a`'s own memory layout, as MLX passes it when it does not copy: (guarded bytes,
    byte offset of element 0 in them, strides in elements). Broadcast (0), transposed
    and negative strides come through as they are."""
    view = np.asarray(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)  # no copy
    item = view.itemsize
    if view.size == 0:
        return _guarded(np.zeros(0, np.uint8)), 0, [st // item for st in view.strides]
    lo = sum(min(0, (n - 1) * st) for n, st in zip(view.shape, view.strides, strict=True))
    hi = sum(max(0, (n - 1) * st) for n, st in zip(view.shape, view.strides, strict=True))
    mem = np.ctypeslib.as_array(
        (ctypes.c_uint8 * (hi - lo + item)).from_address(view.ctypes.data + lo)
    )
    return _guarded(mem.copy()), -lo, [st // item for st in view.strides]


def _strided(a: mx.array) -> tuple[np.ndarray, list[int]]:
    """`a` laid out as a view with gaps: last-axis stride 2 and padded rows, poison between.

    A kernel launched with ensure_row_contiguous=False must honour `<name>_strides`; MLX
    passes a view's real strides, and this layout makes a kernel that assumes contiguity
    read poison."""
    data = _raw(a)
    strides = [0] * a.ndim
    step = 2
    for i in reversed(range(a.ndim)):
        strides[i] = step
        step = step * a.shape[i] + 3
    size = 1 + sum((n - 1) * st for n, st in zip(a.shape, strides, strict=True)) if data.size else 1
    buf = np.full(size * data.itemsize, 0xFF, dtype=np.uint8).view(data.dtype)
    view = np.lib.stride_tricks.as_strided(buf, a.shape, [st * data.itemsize for st in strides])
    view[...] = data
    return buf, strides


# Bytes after every buffer: past an input they are poison (reads get NaN); past an output
# they are a pattern no NaN-propagating store reproduces, so any write past it is caught.
GUARD_BYTES = 4096
INPUT_GUARD, OUTPUT_GUARD = 0xFF, 0xA5


def _guarded(data: np.ndarray, fill: int = INPUT_GUARD) -> np.ndarray:
    buf = np.full(data.nbytes + GUARD_BYTES, fill, dtype=np.uint8)
    buf[: data.nbytes] = data.reshape(-1).view(np.uint8)
    return buf


def _from_raw(buf: np.ndarray, shape: Sequence[int], dtype: mx.Dtype) -> mx.array:
    if dtype == mx.bfloat16:
        return mx.array(buf.view(np.uint16)).view(mx.bfloat16).reshape(shape)
    np_dtype = np.dtype(np.bool_) if dtype == mx.bool_ else np.dtype(_NP_NAMES[dtype])
    return mx.array(buf.view(np_dtype)).reshape(shape)


_NP_NAMES = {
    mx.float32: "float32",
    mx.float16: "float16",
    mx.float64: "float64",
    mx.int8: "int8",
    mx.int16: "int16",
    mx.int32: "int32",
    mx.int64: "int64",
    mx.uint8: "uint8",
    mx.uint16: "uint16",
    mx.uint32: "uint32",
    mx.uint64: "uint64",
}


class EmulatedKernel:
    """The callable `metal_kernel` returns."""

    def __init__(
        self,
        name: str,
        input_names: Sequence[str],
        output_names: Sequence[str],
        source: str,
        header: str,
        ensure_row_contiguous: bool,
        atomic_outputs: bool,
    ) -> None:
        if not output_names:
            raise ValueError("[metal_kernel] Must specify at least one output.")
        self.name = name
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self.source = source
        self.header = header
        self.ensure_row_contiguous = ensure_row_contiguous
        self.atomic_outputs = atomic_outputs
        self.shape_infos = shape_infos(source, self.input_names)
        self.attributes = attributes(source)
        self.cooperative = is_cooperative(header + source)

    def generated_source(
        self,
        inputs: list[mx.array],
        output_dtypes: list[mx.Dtype],
        template: list[tuple[str, TemplateArg]],
    ) -> tuple[str, str]:
        """(kernel name, full source) exactly as MLX would compile it."""
        specs = [
            InputSpec(n, a.dtype, a.ndim, a.size)
            for n, a in zip(self.input_names, inputs, strict=True)
        ]
        kname = kernel_name(self.name, specs, output_dtypes, template)
        src = write_signature(
            kname,
            self.header,
            self.source,
            specs,
            self.output_names,
            output_dtypes,
            template,
            self.attributes,
            self.shape_infos,
            self.atomic_outputs,
        )
        return kname, src

    def __call__(
        self,
        *,
        inputs: Sequence[mx.array | bool | int | float],
        output_shapes: Sequence[Sequence[int]],
        output_dtypes: Sequence[mx.Dtype],
        grid: tuple[int, int, int],
        threadgroup: tuple[int, int, int],
        template: Sequence[tuple[str, TemplateArg]] | None = None,
        init_value: float | None = None,
        verbose: bool = False,
        stream: object = None,
    ) -> list[mx.array]:
        del stream  # the emulator always runs on the CPU, eagerly
        arrays = [_as_array(v) for v in inputs]
        for actual, expected, what in (
            (len(arrays), len(self.input_names), "inputs"),
            (len(output_shapes), len(self.output_names), "output_shapes"),
            (len(output_dtypes), len(self.output_names), "output_dtypes"),
        ):
            if actual != expected:
                raise ValueError(
                    f"[metal_kernel] Expected `{what}` to have size {expected} "
                    f"but got size {actual}."
                )
        tmpl = list(template or [])
        if any(not isinstance(v, bool | int | mx.Dtype) for _, v in tmpl):
            raise ValueError(
                "[metal_kernel] Invalid template argument. "
                "Must be `mlx.core.Dtype`, `int` or `bool`."
            )
        out_dtypes = list(output_dtypes)
        kname, src = self.generated_source(arrays, out_dtypes, tmpl)
        if verbose:
            print(f"Generated source code for `{self.name}`:\n```\n{src}\n```", file=sys.stdout)

        keep: list[tuple[np.ndarray, int]] = []  # (buffer, byte offset), MLX's buffer order
        casts: list[BufferCast] = []
        for a, (has_shape, has_strides, has_ndim) in zip(arrays, self.shape_infos, strict=True):
            strides = _row_strides(a.shape)
            if self.ensure_row_contiguous or a.ndim == 0:
                keep.append((_guarded(_raw(a)), 0))
            else:  # MLX passes the array's own buffer and strides
                buf, offset, strides = _as_laid_out(a)
                if strides == _row_strides(a.shape) and has_strides and strided_views:
                    gapped, strides = _strided(a)  # make a contiguity assumption visible
                    buf, offset = _guarded(gapped), 0
                keep.append((buf, offset))
            casts.append(BufferCast(f"const {type_string(a.dtype)}", by_ref=a.ndim == 0))
            if a.ndim > 0:
                if has_shape:
                    keep.append((np.array(a.shape, dtype=np.int32), 0))
                    casts.append(BufferCast("const int", False))
                if has_strides:
                    keep.append((np.array(strides, dtype=np.int64), 0))
                    casts.append(BufferCast("const int64_t", False))
                if has_ndim:
                    keep.append((np.array([a.ndim], dtype=np.int32), 0))
                    casts.append(BufferCast("const int", True))
        outs: list[tuple[np.ndarray, int]] = []
        for shape, dt in zip(output_shapes, out_dtypes, strict=True):
            nbytes = int(np.prod(shape)) * dt.size
            if init_value is None:
                # Metal leaves outputs uninitialised: poison them so unwritten elements show.
                buf = _guarded(np.full(nbytes, 0xFF, dtype=np.uint8), OUTPUT_GUARD)
            else:
                buf = _guarded(_raw(mx.full(tuple(shape), init_value, dtype=dt)), OUTPUT_GUARD)
            outs.append((buf, nbytes))
            keep.append((buf, 0))
            t = type_string(dt)
            casts.append(BufferCast(f"atomic<{t}>" if self.atomic_outputs else t, False))

        tu = translation_unit(
            src, kname, write_template(tmpl) if tmpl else "", casts, [a for a, _ in self.attributes]
        )
        lib = load(tu, kname)
        ptrs = (ctypes.c_void_p * max(1, len(keep)))(*[b.ctypes.data + o for b, o in keep])
        g = (ctypes.c_uint * 3)(*grid)
        t = (ctypes.c_uint * 3)(*threadgroup)
        err = ctypes.create_string_buffer(512)
        order, seed = _schedule
        with _LAUNCH_LOCK:
            rc = lib.kvemu_launch(ptrs, g, t, ORDERS[order], seed, int(self.cooperative), err, 512)
        if rc != 0:
            raise EmulatorError(f"[metal_kernel] {self.name}: {err.value.decode(errors='replace')}")
        for name, (buf, nbytes) in zip(self.output_names, outs, strict=True):
            if (buf[nbytes:] != OUTPUT_GUARD).any():
                raise EmulatorError(f"[metal_kernel] {self.name}: wrote past the end of `{name}`")
        launches[self.name] += 1
        return [
            _from_raw(buf[:nbytes], s, dt)
            for (buf, nbytes), s, dt in zip(outs, output_shapes, out_dtypes, strict=True)
        ]


def metal_kernel(
    name: str,
    input_names: Sequence[str],
    output_names: Sequence[str],
    source: str,
    header: str = "",
    ensure_row_contiguous: bool = True,
    atomic_outputs: bool = False,
    compile_options: dict | None = None,
) -> EmulatedKernel:
    """Drop-in for `mx.fast.metal_kernel` that runs the kernel on the CPU."""
    if compile_options is not None:
        if not isinstance(compile_options, dict):
            raise ValueError("[metal_kernel] Expected `compile_options` to be a dict.")
        for key, value in compile_options.items():
            if key != "math_mode":
                raise ValueError(f"[metal_kernel] Unknown compile option `{key}`.")
            if value not in ("safe", "relaxed", "fast"):
                raise ValueError(
                    "[metal_kernel] Expected math_mode to be 'safe', 'relaxed', or 'fast'."
                )
    return EmulatedKernel(
        name, input_names, output_names, source, header, ensure_row_contiguous, atomic_outputs
    )
