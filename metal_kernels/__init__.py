"""Entry points for the two kernels the decoder calls on every layer: RMSNorm and RoPE.

`model/` calls only these four functions — `rms_norm`, `add_rms_norm`, `rope`,
`rope_qk` — so a backend can be swapped with no change in the model. Backends:

- `metal`: our `.metal` sources through `mx.fast.metal_kernel` (default where Metal exists);
- `fast`:  `mx.fast.rms_norm` / `mx.fast.rope` (default elsewhere);
- `ops`:   plain mlx ops written from the formulas — the readable reference.

`KVCHAT_KERNELS=metal|fast|ops` forces one; `set_backend()` switches at run time.
"""

from __future__ import annotations

import os

import mlx.core as mx

BACKENDS = ("metal", "fast", "ops")


class KernelError(ValueError):
    """A backend or a shape the kernels cannot serve (one line for the user)."""


def _default_backend() -> str:
    forced = os.environ.get("KVCHAT_KERNELS")
    if forced:
        return _check(forced)
    return "metal" if mx.metal.is_available() else "fast"


def _check(name: str) -> str:
    if name not in BACKENDS:
        raise KernelError(f"unknown kernels backend {name!r}; allowed: {', '.join(BACKENDS)}")
    if name == "metal" and not mx.metal.is_available():
        raise KernelError("kernels backend 'metal' needs Metal, which this machine lacks")
    return name


_BACKEND: str | None = None


def backend() -> str:
    """Name of the backend that serves the kernels now (shown in the UI and stats)."""
    global _BACKEND
    if _BACKEND is None:
        _BACKEND = _default_backend()
    return _BACKEND


def set_backend(name: str) -> str:
    """Switch backend at run time; raises KernelError (one line) for an unusable name."""
    global _BACKEND
    _BACKEND = _check(name)
    return _BACKEND


# ----------------------------------------------------------------------------- ops reference


def _ops_rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    xf = x.astype(mx.float32)
    y = xf * mx.rsqrt(mx.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y.astype(x.dtype) * weight).astype(x.dtype)


def _ops_rope(
    x: mx.array,
    dims: int,
    traditional: bool,
    base: float | None,
    scale: float,
    offset: int | mx.array,
    freqs: mx.array | None,
) -> mx.array:
    T = x.shape[-2]
    half = dims // 2
    if freqs is None:
        inv = base ** (-mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    else:
        inv = 1.0 / freqs.astype(mx.float32)
    pos = (mx.arange(T, dtype=mx.float32) + mx.array(offset, dtype=mx.float32)) * scale
    theta = pos[:, None] * inv[None, :]  # (T, dims/2)
    cos, sin = mx.cos(theta), mx.sin(theta)
    rot, rest = x[..., :dims].astype(mx.float32), x[..., dims:]
    if traditional:
        a, b = rot[..., 0::2], rot[..., 1::2]
        ra, rb = a * cos - b * sin, a * sin + b * cos
        out = mx.stack([ra, rb], axis=-1).reshape(rot.shape)
    else:
        a, b = rot[..., :half], rot[..., half:]
        out = mx.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
    return mx.concatenate([out.astype(x.dtype), rest], axis=-1)


# ----------------------------------------------------------------------------- entry points


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """y = x / sqrt(mean(x², last axis) + eps) * weight."""
    if backend() == "ops":
        return _ops_rms_norm(x, weight, eps)
    return mx.fast.rms_norm(x, weight, eps)


def add_rms_norm(
    x: mx.array, residual: mx.array, weight: mx.array, eps: float
) -> tuple[mx.array, mx.array]:
    """h = x + residual; returns (h, rms_norm(h, weight, eps)) — one pass on `metal`."""
    h = x + residual
    return h, rms_norm(h, weight, eps)


def rope(
    x: mx.array,
    dims: int,
    *,
    traditional: bool,
    base: float | None,
    scale: float,
    offset: int | mx.array,
    freqs: mx.array | None = None,
) -> mx.array:
    """Rotate the first `dims` features of x (B, H, T, D) by position `offset + t`.

    `traditional=False` is the Hugging Face "rotate_half" layout (pairs i, i + dims/2);
    `freqs` (periods, one per pair) overrides `base` for scaled RoPE variants; `scale`
    multiplies positions (linear scaling). Features past `dims` pass through.
    """
    if backend() == "ops":
        return _ops_rope(x, dims, traditional, base, scale, offset, freqs)
    return mx.fast.rope(
        x, dims, traditional=traditional, base=base, scale=scale, offset=offset, freqs=freqs
    )


def rope_qk(
    q: mx.array,
    k: mx.array,
    dims: int,
    *,
    traditional: bool,
    base: float | None,
    scale: float,
    offset: int | mx.array,
    freqs: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """RoPE on Q and K of one attention call (their head counts differ under GQA);
    one launch on `metal`."""
    kw = dict(traditional=traditional, base=base, scale=scale, offset=offset, freqs=freqs)
    return rope(q, dims, **kw), rope(k, dims, **kw)
