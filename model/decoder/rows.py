"""Rows of a batch, each over its own cache: one forward for many conversations.

A server decodes its requests together (docs/serve.md, "Many clients"): their new tokens
form one (B, 1) batch, so embeddings, norms, projections, MLPs and the head run once for
every row. The token mixer is the one part that reads a conversation's past: each row's
runs on its own cache, at its own position, under its own mask, exactly as the row would
alone, and the rows' outputs are stacked again. So caches of any kind and length (a
rotating window, quantized K/V, a recurrent state) share a step, with no padding to
mask.

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


def mix(mixer: Callable[..., mx.array], x: mx.array, mask: Any, cache: Any) -> mx.array:
    """`mixer(x, mask, cache)`, row by row when `cache` is `Rows`."""
    if not isinstance(cache, Rows):
        return mixer(x, mask, cache)
    masks = mask if isinstance(mask, RowMasks) else [mask] * len(cache)
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
