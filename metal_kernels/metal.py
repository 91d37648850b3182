"""The `metal` backend: our `.metal` sources launched through a kernel factory.

The factory has exactly `mx.fast.metal_kernel`'s signature (the default), so the same
launch code runs the sources on a GPU and, in tests, on the CPU emulator
(`MetalBackend(factory=tests.metal_emulator.metal_kernel, name="emulated")`). Here we
compute what the kernels need: template parameters (dtype and shape class), the grid (in
threads, as MLX's dispatchThreads takes it) and the threadgroup size.

The CUDA seam: `mx.fast.cuda_kernel` takes nearly the same arguments (name, input/output
names, source, header, ensure_row_contiguous; `shared_memory` instead of
`atomic_outputs`), and its kernel the same call (grid, threadgroup, template, output
shapes and dtypes). A `cuda` backend is a subclass that overrides `_kernel` to read `.cu` twins
of the two sources (warp shuffles for `simd_sum`, `__shared__` for threadgroup memory,
`__syncthreads()` for the barriers) and keeps this class's launch geometry; it is then
registered with `metal_kernels.register_backend("cuda", ...)` where
`mx.cuda.is_available()`. Not written yet: no CUDA GPU was lent to run its tests.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

import mlx.core as mx

from .errors import KernelError

KernelFactory = Callable[..., Callable[..., list[mx.array]]]

SOURCE_DIR = Path(__file__).parent
BODY_MARKER = "//// body"  # above: header= (helpers); below: source= (the kernel body)
SIMD_WIDTH = 32
MAX_THREADS = 1024  # threads per threadgroup (Apple GPUs' limit)
N_READS = 4  # elements per thread per step in the norm kernels
MAX_CHUNKS = 8  # steps per thread kept in registers: hidden sizes up to 32768
ROPE_THREADS = 256


def read_source(kind: str) -> str:
    """The shipped text of `metal_kernels/<kind>.metal` (kinds: rms_norm, rope)."""
    return (SOURCE_DIR / f"{kind}.metal").read_text(encoding="utf-8")


def split_source(text: str) -> tuple[str, str]:
    """(header, body) of a .metal file, split at the line that is exactly `//// body`."""
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.strip() == BODY_MARKER:
            return "".join(lines[:i]), "".join(lines[i + 1 :])
    raise KernelError(f"kernel source lacks the {BODY_MARKER!r} line")


def norm_launch(hidden: int, rows: int) -> tuple[int, int]:
    """(threads per threadgroup, N_CHUNKS) for one row per threadgroup: enough whole
    simdgroups to cover the row in N_READS steps, more steps once 1024 threads are not
    enough."""
    n_vec = math.ceil(hidden / N_READS)
    threads = min(MAX_THREADS, SIMD_WIDTH * math.ceil(n_vec / SIMD_WIDTH))
    chunks = math.ceil(n_vec / threads)
    if chunks > MAX_CHUNKS:
        limit = MAX_THREADS * N_READS * MAX_CHUNKS
        raise KernelError(
            f"rms_norm: hidden size {hidden} exceeds the metal kernels' {limit}; "
            "use KVCHAT_KERNELS=fast"
        )
    return threads, chunks


@lru_cache(maxsize=64)
def _scalar(value: float) -> mx.array:
    return mx.array(value, dtype=mx.float32)


@lru_cache(maxsize=64)
def _small(values: tuple[float | int, ...], dtype: mx.Dtype) -> mx.array:
    return mx.array(values, dtype=dtype)


class MetalBackend:
    """rms_norm / add_rms_norm / rope / rope_qk from the .metal sources.

    `sources` maps a kind (`rms_norm`, `rope`) to the full text of its file, replacing the
    shipped one (the emulator tests run deliberately broken variants this way).
    """

    def __init__(
        self,
        factory: KernelFactory | None = None,
        name: str = "metal",
        sources: dict[str, str] | None = None,
    ):
        self.name = name
        self._factory = factory if factory is not None else mx.fast.metal_kernel
        self._sources = {k: (sources or {}).get(k) or read_source(k) for k in ("rms_norm", "rope")}
        self._kernels: dict[str, Callable[..., list[mx.array]]] = {}

    def _kernel(self, kind: str) -> Callable[..., list[mx.array]]:
        """Build each kernel object once; MLX (or the emulator) then compiles one variant
        per template instantiation (dtype and shape class) and caches it."""
        if kind not in self._kernels:
            if kind == "rope":
                header, body = split_source(self._sources["rope"])
                spec: dict[str, Any] = dict(
                    input_names=["q", "k", "offset", "freqs", "params", "meta"],
                    output_names=["q_out", "k_out"],
                    ensure_row_contiguous=False,  # q, k read through their strides
                )
            else:
                add = kind == "add_rms_norm"
                header, body = split_source(self._sources["rms_norm"])
                header = f"#define ADD_RESIDUAL {int(add)}\n{header}"
                spec = dict(
                    input_names=["x", "residual", "w", "eps"] if add else ["x", "w", "eps"],
                    output_names=["h", "y"] if add else ["y"],
                    ensure_row_contiguous=True,
                )
            self._kernels[kind] = self._factory(
                name=f"kvchat_{kind}", source=body, header=header, atomic_outputs=False, **spec
            )
        return self._kernels[kind]

    # --------------------------------------------------------------------------- norms

    def _norm(
        self, x: mx.array, residual: mx.array | None, weight: mx.array, eps: float
    ) -> list[mx.array]:
        t = x.dtype if residual is None else mx.result_type(x, residual)
        w = mx.result_type(t, weight.dtype)
        hidden = x.shape[-1]
        rows = x.size // hidden
        out_dtypes = [w] if residual is None else [t, w]
        if rows == 0:
            return [mx.zeros(x.shape, d) for d in out_dtypes]
        threads, chunks = norm_launch(hidden, rows)
        inputs = [x.astype(t)]
        if residual is not None:
            inputs.append(residual.astype(t))
        inputs += [weight.astype(w), _scalar(float(eps))]
        return self._kernel("rms_norm" if residual is None else "add_rms_norm")(
            inputs=inputs,
            template=[("T", t), ("W", w), ("N_READS", N_READS), ("N_CHUNKS", chunks)],
            grid=(threads * rows, 1, 1),
            threadgroup=(threads, 1, 1),
            output_shapes=[x.shape] * len(out_dtypes),
            output_dtypes=out_dtypes,
            init_value=None,
            verbose=False,
        )

    def rms_norm(self, x: mx.array, weight: mx.array, eps: float) -> mx.array:
        return self._norm(x, None, weight, eps)[0]

    def add_rms_norm(
        self, x: mx.array, residual: mx.array, weight: mx.array, eps: float
    ) -> tuple[mx.array, mx.array]:
        h, y = self._norm(x, residual, weight, eps)
        return h, y

    # --------------------------------------------------------------------------- rope

    def _rope(
        self,
        q: mx.array,
        k: mx.array | None,
        dims: int,
        traditional: bool,
        base: float | None,
        scale: float,
        offset: int | mx.array,
        freqs: mx.array | None,
    ) -> list[mx.array]:
        def as4(a: mx.array) -> mx.array:  # (B, heads, T, D), as mx.fast.rope reads it
            return a if a.ndim == 4 else a.reshape(a.shape[0], -1, *a.shape[-2:])

        q4 = as4(q)
        k4 = as4(k) if k is not None else None
        B, Hq, T, D = q4.shape
        Hk = k4.shape[1] if k4 is not None else 0
        if q4.size == 0 and (k4 is None or k4.size == 0):
            return [q, k] if k is not None else [q]
        off = offset if isinstance(offset, mx.array) else mx.array(offset)
        off = mx.broadcast_to(off.astype(mx.int32).reshape(-1), (B,))
        periods = freqs.astype(mx.float32) if freqs is not None else _small((1.0,), mx.float32)
        inputs = [
            q4,
            k4 if k4 is not None else q4,  # unread when Hk = 0
            mx.contiguous(off),
            mx.contiguous(periods),
            _small((math.log2(base) if base is not None else 0.0, float(scale)), mx.float32),
            _small((dims, int(traditional), int(freqs is not None), Hk), mx.int32),
        ]
        gx = D - dims // 2
        tx = min(gx, ROPE_THREADS)
        outs = self._kernel("rope")(
            inputs=inputs,
            template=[("T", q.dtype)],
            grid=(gx, T, B * (Hq + Hk)),
            threadgroup=(tx, max(1, min(T, ROPE_THREADS // tx)), 1),
            output_shapes=[q4.shape, k4.shape if k4 is not None else (1,)],
            output_dtypes=[q.dtype, q.dtype],
            init_value=None,
            verbose=False,
        )
        res = [outs[0].reshape(q.shape)]
        if k is not None:
            res.append(outs[1].reshape(k.shape))
        return res

    def rope(self, x: mx.array, dims: int, traditional: bool, base: float | None,
             scale: float, offset: int | mx.array, freqs: mx.array | None) -> mx.array:
        return self._rope(x, None, dims, traditional, base, scale, offset, freqs)[0]

    def rope_qk(self, q: mx.array, k: mx.array, dims: int, traditional: bool,
                base: float | None, scale: float, offset: int | mx.array,
                freqs: mx.array | None) -> tuple[mx.array, mx.array]:
        qo, ko = self._rope(q, k, dims, traditional, base, scale, offset, freqs)
        return qo, ko
