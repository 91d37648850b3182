"""Attention masks: causal, optionally within a sliding window."""

from __future__ import annotations

import mlx.core as mx


def causal_mask(n: int, offset: int = 0, window: int | None = None) -> mx.array:
    """Boolean (n, offset + n) mask: query offset+i sees key j iff j <= offset+i
    (and offset+i - j < window when a sliding window is set)."""
    q = mx.arange(offset, offset + n)[:, None]
    k = mx.arange(offset + n)[None]
    mask = q >= k
    if window is not None:
        mask = mask & (q < k + window)
    return mask
