"""Idle KV caches kept between turns, keyed by the token ids they hold (the server's cache
reuse across requests).

The chat keeps one cache: its conversation. A server sees many conversations interleaved,
each resent whole every turn; with one cache, every switch between clients would prefill
a conversation from its first token. The pool keeps the caches of recent turns, least
recently used first out within a byte budget, and hands a turn the one sharing the
longest prefix with its prompt, so turn N of any conversation prefills only its new
tokens. The engine owns the pool on its own thread (MLX arrays never cross threads).

An entry whose every token the prompt repeats is moved out (the turn extends it; its
shorter self would only be a stale copy). A partial match (a branch, a regenerated
reply, a shared system prompt) gets a clone: new array objects over the entry's data
(MLX copies a buffer on the first write while another array still holds it), so the
entry stays intact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from .kv import can_trim_to

CacheKey = tuple[int | None, int]  # (max_kv_size, keep): the bound a cache was made with


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def cache_nbytes(cache: list[Any]) -> int:
    return sum(int(c.nbytes) for c in cache)


def clone_cache(cache: list[Any]) -> list[Any] | None:
    """New cache objects over the same data (None when a layer's cache cannot be rebuilt
    from its state, e.g. an empty one). The arrays must be new objects too: a cache
    writes in place (`keys[..., a:b, :] = k` rebinds that very array object), and a
    shared object would carry the clone's writes into the entry."""
    try:
        out = []
        for c in cache:
            clone = type(c).from_state(tuple(_copy(a) for a in c.state))
            for name in getattr(c, "extras", ()):  # what the state has no place for
                setattr(clone, name, getattr(c, name))
            out.append(clone)
        return out
    except (AttributeError, TypeError, ValueError):
        return None


def _copy(x: Any) -> Any:
    """New array objects (a quantized buffer's parts each), scalars as they are."""
    if isinstance(x, mx.array):
        return mx.array(x)
    if isinstance(x, (tuple, list)):
        return tuple(_copy(p) for p in x)
    return x


@dataclass
class _Entry:
    ids: list[int]
    cache: list[Any]
    key: CacheKey
    nbytes: int


class PrefixPool:
    """Caches keyed by their token prefix, LRU within `budget_bytes` (an entry larger than
    the budget is not kept). Not thread-safe: the engine thread alone uses it."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = int(budget_bytes)
        self._entries: list[_Entry] = []  # least recently used first
        self.hits = 0  # turns that continued a pooled cache
        self.misses = 0  # turns that found no shared prefix
        self.evictions = 0  # entries dropped for the budget
        self.reused_tokens = 0  # prompt tokens served from pooled caches, all turns

    def put(self, ids: list[int], cache: list[Any], key: CacheKey) -> None:
        """Keep `cache` (holding `ids`) as the most recently used entry."""
        if not ids:
            return
        nbytes = cache_nbytes(cache)
        # an entry this one extends is redundant when this one can be trimmed back to it
        self._entries = [
            e for e in self._entries
            if not (e.key == key and len(e.ids) <= len(ids) and ids[: len(e.ids)] == e.ids
                    and can_trim_to(cache, len(e.ids)))
        ]
        if nbytes > self.budget_bytes:
            self.evictions += 1
            return
        self._entries.append(_Entry(list(ids), cache, key, nbytes))
        while self.total_bytes > self.budget_bytes:
            self._entries.pop(0)
            self.evictions += 1

    def take(self, ids: list[int], key: CacheKey) -> tuple[list[int], list[Any]] | None:
        """The cache (and the ids it holds) sharing the longest prefix with `ids`, or
        None. A full-prefix entry leaves the pool; a partial match leaves a clone."""
        best, best_n = None, 0
        for e in self._entries:
            n = common_prefix_len(e.ids, ids) if e.key == key else 0
            # the engine keeps at most len(ids) − 1 of them; a cache that cannot go back
            # there (a recurrent layer's state, an evicted ring) would be prefilled again
            if n > best_n and can_trim_to(e.cache, min(n, len(ids) - 1)):
                best, best_n = e, n
        found = None
        if best is not None:
            self._entries.remove(best)
            if best_n == len(best.ids):
                found = best.ids, best.cache
            else:
                self._entries.append(best)  # still there, now the most recently used
                clone = clone_cache(best.cache)
                found = None if clone is None else (list(best.ids), clone)
        if found is None:
            self.misses += 1
        else:
            self.hits += 1
            self.reused_tokens += min(best_n, len(ids) - 1)
        return found

    def clear(self) -> None:
        self._entries = []

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self._entries)

    def stats(self) -> dict[str, Any]:
        """For the statistics (JSON-ready): the entries, most recent first, and counters."""
        return {
            "entries": len(self._entries),
            "bytes": self.total_bytes,
            "budget_bytes": self.budget_bytes,
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "reused_tokens": self.reused_tokens,
            "tokens": [len(e.ids) for e in reversed(self._entries)],
        }
