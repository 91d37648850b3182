"""The `fast` backend: MLX's own fused kernels (`mx.fast`). It has no fused residual
norm and rotates Q and K in two launches; the default where Metal is absent."""

from __future__ import annotations

import mlx.core as mx


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    return mx.fast.rms_norm(x, weight, eps)


def add_rms_norm(
    x: mx.array, residual: mx.array, weight: mx.array, eps: float
) -> tuple[mx.array, mx.array]:
    h = x + residual
    return h, mx.fast.rms_norm(h, weight, eps)


def rope(x: mx.array, dims: int, traditional: bool, base: float | None, scale: float,
         offset: int | mx.array, freqs: mx.array | None) -> mx.array:
    return mx.fast.rope(
        x, dims, traditional=traditional, base=base, scale=scale, offset=offset, freqs=freqs
    )


def rope_qk(q: mx.array, k: mx.array, dims: int, traditional: bool, base: float | None,
            scale: float, offset: int | mx.array,
            freqs: mx.array | None) -> tuple[mx.array, mx.array]:
    args = (dims, traditional, base, scale, offset, freqs)
    return rope(q, *args), rope(k, *args)
