"""The `fast` backend: MLX's own fused kernels (`mx.fast`); the default where Metal is
absent. It has no fused residual norm.

On the CPU `mx.fast.rope` is no kernel: MLX builds it from about twenty ops (its
fallback), angles included, for every call, and a decode step calls it twice per layer.
There this backend rotates with `_rope_cpu` instead: the same angles, computed so that
every call of a step builds the identical subgraph (one cached constant per schedule),
which `mx.compile` merges into one computation per step, and rotate-half as a product
with a constant ±1 matrix, so a call is one matmul and one fused multiply-add. Measured
on kvchat-mini's compiled decode step, in one process, alternating: 465 tok/s with
`mx.fast.rope` against 641 with no rotation at all (docs/performance.md, "Kernels").
"""

from __future__ import annotations

import functools
import math
from typing import Any

import mlx.core as mx


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    return mx.fast.rms_norm(x, weight, eps)


def add_rms_norm(
    x: mx.array, residual: mx.array, weight: mx.array, eps: float
) -> tuple[mx.array, mx.array]:
    h = x + residual
    return h, mx.fast.rms_norm(h, weight, eps)


# Constants are built from Python numbers, never from MLX ops: the first call may come
# while `mx.compile` traces, and an op's result there would be a placeholder of the trace.
@functools.cache
def _inverse_periods(dims: int, base: float, traditional: bool) -> mx.array:
    """Each rotated feature's angle per position, base^(-2i/dims), in the feature order
    the rotation uses: [θ0..θh-1, θ0..θh-1] (rotate-half) or [θ0, θ0, θ1, θ1, …]."""
    half = dims // 2
    inv = [math.exp(-i * math.log(base) / half) for i in range(half)]
    return mx.array([v for v in inv for _ in (0, 1)] if traditional else inv + inv,
                    dtype=mx.float32)


def _spread(inv: mx.array, traditional: bool) -> mx.array:
    return mx.repeat(inv, 2) if traditional else mx.concatenate([inv, inv])


@functools.cache
def _partner(dims: int, traditional: bool, dtype: mx.Dtype) -> mx.array:
    """P with (x @ P)[j] = the feature j turns with, signed: -x[j + h] for j < h and
    x[j - h] above (rotate-half), or -x[2i + 1] / x[2i] (adjacent pairs)."""
    half = dims // 2
    p = [[0.0] * dims for _ in range(dims)]
    for j in range(dims):
        if traditional:
            i, sign = (j + 1, -1.0) if j % 2 == 0 else (j - 1, 1.0)
        else:
            i, sign = (j + half, -1.0) if j < half else (j - half, 1.0)
        p[i][j] = sign
    return mx.array(p, dtype=dtype)


@functools.lru_cache(maxsize=64)
def _steps(T: int) -> mx.array:
    """0, 1, …, T-1 as a constant (`mx.arange` is an op with no inputs, which the
    compiler never merges, and everything computed from it would stay per call)."""
    return mx.array(list(range(T)), dtype=mx.float32)


@functools.cache
def _eye(dims: int, dtype: mx.Dtype) -> mx.array:
    return mx.array([[float(i == j) for j in range(dims)] for i in range(dims)], dtype=dtype)


def _rope_cpu(x: mx.array, dims: int, traditional: bool, base: float | None, scale: float,
              offset: int | mx.array, freqs: mx.array | None) -> mx.array:
    """x rotated as `mx.fast.rope` rotates it: angle (offset + t) * scale / period."""
    inv = (_inverse_periods(dims, float(base), traditional) if freqs is None  # type: ignore[arg-type]
           else _spread(mx.reciprocal(freqs.astype(mx.float32)), traditional))
    off = offset if isinstance(offset, mx.array) else mx.array(offset, dtype=mx.int32)
    if off.size > 1:  # one offset per batch row: (B, 1, …, 1, 1)
        off = off.reshape((-1,) + (1,) * (x.ndim - 2))
    pos = (off.astype(mx.float32) + _steps(x.shape[-2])) * scale
    theta = mx.expand_dims(pos, -1) * inv
    cos, sin = mx.cos(theta).astype(x.dtype), mx.sin(theta).astype(x.dtype)
    rot = x if dims == x.shape[-1] else x[..., :dims]
    partner = _partner(dims, traditional, x.dtype)
    if theta.shape[:-1] == (1,):  # one position for the whole batch (a decode step):
        # the rotation as one matrix, eye * cos + P * sin, so the call is one matmul
        out = rot @ (_eye(dims, x.dtype) * cos + partner * sin)
    else:
        out = rot * cos + (rot @ partner) * sin
    return out if dims == x.shape[-1] else mx.concatenate([out, x[..., dims:]], axis=-1)


def _on_cpu() -> bool:
    return mx.default_device().type == mx.cpu


def mlx_rope(x: mx.array, dims: int, traditional: bool, base: float | None, scale: float,
             offset: int | mx.array, freqs: mx.array | None) -> mx.array:
    """`mx.fast.rope` itself: a kernel on a GPU."""
    return mx.fast.rope(
        x, dims, traditional=traditional, base=base, scale=scale, offset=offset, freqs=freqs
    )


def rope(x: mx.array, dims: int, traditional: bool, base: float | None, scale: float,
         offset: int | mx.array, freqs: mx.array | None) -> mx.array:
    return (_rope_cpu if _on_cpu() else mlx_rope)(x, dims, traditional, base, scale, offset,
                                                   freqs)


def rope_qk(q: mx.array, k: mx.array, dims: int, traditional: bool, base: float | None,
            scale: float, offset: int | mx.array,
            freqs: mx.array | None) -> tuple[mx.array, mx.array]:
    args = (dims, traditional, base, scale, offset, freqs)
    return rope(q, *args), rope(k, *args)


class WithMlxRope:
    """This backend with `mx.fast.rope` on every device, the CPU included (what it was
    before its own CPU rotation): the reference the tests and `bench_ab` compare with;
    register it with `metal_kernels.register_backend`."""

    rms_norm = staticmethod(rms_norm)
    add_rms_norm = staticmethod(add_rms_norm)
    rope = staticmethod(mlx_rope)

    def rope_qk(self, q: mx.array, k: mx.array, *args: Any) -> tuple[mx.array, mx.array]:
        return mlx_rope(q, *args), mlx_rope(k, *args)
