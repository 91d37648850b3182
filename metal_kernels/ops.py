"""The `ops` backend: plain mlx ops written from the formulas — the readable reference
the other backends are tested against. Output dtypes follow `mx.fast` (the norm's output
is result_type(x, weight); rope keeps x's dtype)."""

from __future__ import annotations

import mlx.core as mx


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    out = mx.result_type(x, weight)
    xf = x.astype(mx.float32)
    y = xf * mx.rsqrt(mx.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return y.astype(out) * weight.astype(out)


def add_rms_norm(
    x: mx.array, residual: mx.array, weight: mx.array, eps: float
) -> tuple[mx.array, mx.array]:
    h = x + residual
    return h, rms_norm(h, weight, eps)


def _angles(T: int, dims: int, base: float | None, scale: float,
            offset: int | mx.array, freqs: mx.array | None) -> mx.array:
    """theta[b, t, i] = (offset[b] + t) * scale / period_i, shape (B or 1, T, dims/2)."""
    if freqs is None:
        assert base is not None
        inv = base ** (-mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    else:
        inv = 1.0 / freqs.astype(mx.float32)
    off = offset if isinstance(offset, mx.array) else mx.array(offset)
    off = off.astype(mx.float32).reshape(-1, 1)  # (B or 1, 1)
    pos = (mx.arange(T, dtype=mx.float32)[None, :] + off) * scale
    return pos[..., None] * inv


def rope(x: mx.array, dims: int, traditional: bool, base: float | None, scale: float,
         offset: int | mx.array, freqs: mx.array | None) -> mx.array:
    shape = x.shape
    x4 = x.reshape(shape[0], -1, shape[-2], shape[-1])  # (B, heads, T, D)
    theta = _angles(shape[-2], dims, base, scale, offset, freqs)[:, None]  # (B|1, 1, T, d/2)
    cos, sin = mx.cos(theta), mx.sin(theta)
    rot, rest = x4[..., :dims].astype(mx.float32), x4[..., dims:]
    if traditional:  # pairs (2i, 2i + 1)
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = mx.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(rot.shape)
    else:  # rotate-half: pairs (i, i + dims/2)
        a, b = rot[..., : dims // 2], rot[..., dims // 2 :]
        out = mx.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
    return mx.concatenate([out.astype(x.dtype), rest], axis=-1).reshape(shape)


def rope_qk(q: mx.array, k: mx.array, dims: int, traditional: bool, base: float | None,
            scale: float, offset: int | mx.array,
            freqs: mx.array | None) -> tuple[mx.array, mx.array]:
    args = (dims, traditional, base, scale, offset, freqs)
    return rope(q, *args), rope(k, *args)
