"""Rows of a batch, each over its own cache: one forward for many conversations.

A server decodes its requests together (docs/serve.md, "Many clients"): their new tokens
form one (B, 1) batch, so embeddings, norms, projections, MLPs and the head run once for
every row. The token mixer is the one part that reads a conversation's past, and each row
keeps its own cache, position and mask, exactly as alone. Attention
(layers.Attention._rows) projects and rotates all rows at once (each at its own
position), writes each row's K/V to that row's cache, then attends in one call where the
rows' K/V line up (`stacked`: float K/V reading the same number of slots, as the compiled
batch step arranges) and row by row otherwise (quantized K/V, an op-by-op step over rows
of different lengths). A recurrent mixer runs row by row (`mix`). So caches of any kind
and length (a rotating window, quantized K/V, a recurrent state) share a step.

The decoder never owns these caches: the caller hands `Rows` in, one per layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx


class Rows:
    """One layer's caches of a batch's rows, in row order."""

    def __init__(self, caches: Sequence[Any]):
        self.caches = list(caches)

    def __len__(self) -> int:
        return len(self.caches)

    @property
    def offsets(self) -> list[Any]:
        return [c.offset for c in self.caches]

    def make_mask(self, n: int, return_array: bool = False,
                  window_size: int | None = None) -> RowMasks:
        return RowMasks(c.make_mask(n, return_array=return_array, window_size=window_size)
                        if hasattr(c, "make_mask") else None for c in self.caches)

    def advance(self, tokens: int) -> None:
        """A layer without a token mixer: each row's cache counts the tokens."""
        for c in self.caches:
            c.advance(tokens)


class RowMasks(tuple[Any, ...]):
    """Each row's mask, from `Rows.make_mask`."""


def offset_array(cache: Rows) -> mx.array:
    """Each row's offset as one int32 array (B,): RoPE rotates every row at its own."""
    offsets = cache.offsets
    if all(isinstance(o, int) for o in offsets):
        return mx.array(offsets, dtype=mx.int32)
    return mx.stack([mx.array(o, dtype=mx.int32) if isinstance(o, int) else o.astype(mx.int32)
                     for o in offsets])


def row_masks(mask: Any, n: int) -> list[Any]:
    """Each of n rows' mask: `Rows.make_mask`'s, or one mask for all."""
    return list(mask) if isinstance(mask, RowMasks) else [mask] * n


def stacked(kvs: Sequence[tuple[Any, Any]], masks: Sequence[Any], T: int
            ) -> tuple[mx.array, mx.array, mx.array | str | None] | None:
    """The rows' K/V (each (1, kv_heads, S, D)) as one batch, with their masks as one
    (B, 1, T, S), where they line up: float K/V of one shape, and masks all None, all
    "causal" (rows prefilled together from one offset) or all arrays. Rows whose caches
    read the same number of slots (the compiled batch step
    gives every row the same view: model/runtime/rows_step.py) attend in one call; None
    otherwise (quantized K/V, different lengths: attention row by row)."""
    k0, v0 = kvs[0]
    if not all(isinstance(k, mx.array) and isinstance(v, mx.array) and k.shape == k0.shape
               and v.shape == v0.shape for k, v in kvs):
        return None
    keys = mx.concatenate([k for k, _ in kvs])
    values = mx.concatenate([v for _, v in kvs])
    if all(m is None for m in masks):
        return keys, values, None
    if all(isinstance(m, str) and m == "causal" for m in masks):
        return keys, values, "causal"  # the same slots read: the same causal mask
    if not all(isinstance(m, mx.array) for m in masks):
        return None
    S = k0.shape[2]
    return keys, values, mx.stack([mx.broadcast_to(m, (T, S)) for m in masks])[:, None]


def mix(mixer: Callable[..., mx.array], x: mx.array, mask: Any, cache: Any) -> mx.array:
    """`mixer(x, mask, cache)`, row by row when `cache` is `Rows`, unless the mixer takes
    `Rows` itself (attention: layers.Attention._rows)."""
    if not isinstance(cache, Rows) or getattr(mixer, "takes_rows", False):
        return mixer(x, mask, cache)
    masks = row_masks(mask, len(cache))
    return mx.concatenate([mixer(x[i : i + 1], m, c) for i, (m, c)
                           in enumerate(zip(masks, cache.caches, strict=True))], axis=0)


def part(cache: Any, name: str) -> Any:
    """A composite cache's part `name` (model/cache/hybrid.py: "kv", "mixer"), of every
    row when `cache` is `Rows`; None without a cache."""
    if cache is None:
        return None
    if isinstance(cache, Rows):
        return Rows([getattr(c, name) for c in cache.caches])
    return getattr(cache, name)
