"""Entry points for the two kernels the decoder calls on every layer: RMSNorm and RoPE.

`model/` calls only these functions, so a backend can be swapped (custom Metal kernels
on Apple silicon, `mx.fast` elsewhere) with no change in the model. This round every
call dispatches to `mx.fast`; the custom Metal kernels land in their own issue and plug
in here by setting the backend.
"""

from __future__ import annotations

import mlx.core as mx

_BACKEND = "mx.fast"


def backend() -> str:
    """Name of the backend that serves rms_norm and rope now (shown in the UI and stats)."""
    return _BACKEND


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """y = x / sqrt(mean(x², last axis) + eps) * weight."""
    return mx.fast.rms_norm(x, weight, eps)


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
    `freqs` (periods, one per pair) overrides `base` for scaled RoPE variants.
    """
    return mx.fast.rope(
        x, dims, traditional=traditional, base=base, scale=scale, offset=offset, freqs=freqs
    )
