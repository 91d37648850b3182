"""Idle KV caches kept between turns, keyed by the token ids they hold (the server's cache
reuse across requests).

The chat keeps one cache: its conversation. A server sees many conversations interleaved,
each resent whole every turn; with one cache, every switch between clients would prefill
a conversation from its first token. The pool keeps the caches of recent turns, least
recently used first out within a byte budget, and hands a turn the one sharing the
longest prefix with its prompt, so turn N of any conversation prefills only its new
tokens. The engine owns the pool on its own thread (MLX arrays never cross threads).

Entries are looked up by key: the bound a cache was made with and, on a server, the
client it belongs to (GenParams.cache_partition), so one client's prompts never show in
another's `cached_tokens` (docs/serve.md, Who can reach the server).

The budget counts the bytes the entries' arrays really hold: a cache allocates its
buffers in steps of 256 tokens, so a short conversation holds several times what its
resident tokens (`nbytes`) take.

An entry whose every token the prompt repeats is moved out (the turn extends it; its
shorter self would only be a stale copy). A partial match (a branch, a regenerated
reply, a shared system prompt) gets a clone: new array objects over the entry's data
(MLX copies a buffer on the first write while another array still holds it), so the
entry stays intact. A hybrid model's entry cannot be cut back inside what its recurrent
states folded in: it travels with its checkpoints (checkpoints.py), and a partial match
restarts the clone from the latest checkpoint at or before the shared prefix.

A lookup also says why no more of the prompt was found (misses.py): nothing held for
this key, the best entry leaving the prompt at token N, or a cache the pool let go (for
the budget, or with its model) that shared more; the ids of those it remembers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from .checkpoints import Checkpoint, Checkpoints, reach
from .misses import (
    EVICTED,
    NEW_CONVERSATION,
    PREFIX_DIFFERS,
    DroppedCaches,
    Miss,
    common_prefix_len,
)

__all__ = ["CacheKey", "EntryInfo", "Lookup", "PrefixPool", "cache_nbytes", "clone_cache",
           "common_prefix_len"]

# the bound a cache was made with (max_kv_size, keep, K/V quantization), then the client
# partition where there is one (model/runtime/chat_cache.py's cache_key); compared whole
CacheKey = tuple[Any, ...]


def cache_nbytes(cache: list[Any], checkpoints: Checkpoints | None = None) -> int:
    """Bytes of every array the cache's layers and its checkpoints hold: their allocated
    buffers whole (slots not yet written included), each array once."""
    seen: set[int] = set()
    total = 0
    stack: list[Any] = [vars(c) for c in cache if hasattr(c, "__dict__")]
    if checkpoints is not None:
        stack.extend(cp.states for cp in checkpoints.items)
    while stack:
        x = stack.pop()
        if isinstance(x, mx.array):
            if id(x) not in seen:
                seen.add(id(x))
                total += int(x.nbytes)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (tuple, list)):
            stack.extend(x)
    return total


def clone_cache(cache: list[Any]) -> list[Any] | None:
    """New cache objects over the same data (None when a layer's cache cannot be rebuilt
    from its state, e.g. an empty one). The arrays must be new objects too: a cache
    writes in place (`keys[..., a:b, :] = k` rebinds that very array object), and a
    shared object would carry the clone's writes into the entry."""
    try:
        return [_clone(c) for c in cache]
    except (AttributeError, TypeError, ValueError):
        return None


def _clone(c: Any) -> Any:
    if hasattr(c, "members"):  # K/V beside a state (hybrid.py): each part cloned
        return type(c).from_members([_clone(m) for m in c.members])
    clone = type(c).from_state(tuple(_copy(a) for a in c.state))
    for name in getattr(c, "extras", ()):  # what the state has no place for
        setattr(clone, name, getattr(c, name))
    return clone


def _copy(x: Any) -> Any:
    """New array objects (a quantized buffer's parts each), scalars as they are."""
    if isinstance(x, mx.array):
        return mx.array(x)
    if isinstance(x, (tuple, list)):
        return tuple(_copy(p) for p in x)
    return x


@dataclass
class EntryInfo:
    """What the pool tells about a cache besides its ids: when it was first made, when a
    turn last used it and how many turns continued it (kept while a turn holds it)."""

    created: float
    used: float
    hits: int = 0


@dataclass
class _Entry:
    ids: list[int]
    cache: list[Any]
    key: CacheKey
    nbytes: int
    info: EntryInfo
    checkpoints: Checkpoints = field(default_factory=Checkpoints)


@dataclass
class Lookup:
    """A lookup's outcome: the cache and the ids it holds (None: nothing shared), its
    info, and why no more of the prompt was cached (misses.py)."""

    found: tuple[list[int], list[Any]] | None
    info: EntryInfo
    miss: Miss = field(default_factory=Miss)
    checkpoints: Checkpoints = field(default_factory=Checkpoints)  # those of `found`


class PrefixPool:
    """Caches keyed by their token prefix, LRU within `budget_bytes` (an entry larger than
    the budget is not kept). Not thread-safe: the engine thread alone uses it."""

    def __init__(self, budget_bytes: int, clock: Callable[[], float] = time.time):
        self.budget_bytes = int(budget_bytes)
        self.clock = clock  # wall-clock: a server shows ages from another process
        self._entries: list[_Entry] = []  # least recently used first
        # the ids of caches let go, so a later prompt can say what it lost (misses.py)
        self.dropped = DroppedCaches()
        self.hits = 0  # turns that continued a pooled cache
        self.misses = 0  # turns that found no shared prefix
        self.evictions = 0  # entries dropped for the budget
        self.reused_tokens = 0  # prompt tokens served from pooled caches, all turns

    def new_info(self) -> EntryInfo:
        now = self.clock()
        return EntryInfo(now, now)

    def put(self, ids: list[int], cache: list[Any], key: CacheKey,
            info: EntryInfo | None = None, checkpoints: Checkpoints | None = None) -> None:
        """Keep `cache` (holding `ids`, with its `checkpoints`) as the most recently used
        entry."""
        if not ids:
            return
        checkpoints = checkpoints if checkpoints is not None else Checkpoints()
        nbytes = cache_nbytes(cache, checkpoints)
        # an entry this one extends is redundant when this one can go back to it
        self._entries = [
            e for e in self._entries
            if not (e.key == key and len(e.ids) <= len(ids) and ids[: len(e.ids)] == e.ids
                    and reach(cache, checkpoints, len(e.ids))[0] == len(e.ids))
        ]
        self.dropped.covered(ids, key)
        if nbytes > self.budget_bytes:
            self.evictions += 1
            self.dropped.add(ids, key, EVICTED)
            return
        self._entries.append(_Entry(list(ids), cache, key, nbytes, info or self.new_info(),
                                    checkpoints))
        while self.total_bytes > self.budget_bytes:
            gone = self._entries.pop(0)
            self.evictions += 1
            self.dropped.add(gone.ids, gone.key, EVICTED)

    def take(self, ids: list[int], key: CacheKey) -> tuple[list[int], list[Any]] | None:
        """The cache (and the ids it holds) sharing the longest prefix with `ids`, or
        None. A full-prefix entry leaves the pool; a partial match leaves a clone."""
        return self.find(ids, key).found

    def find(self, ids: list[int], key: CacheKey) -> Lookup:
        """`take`, with the entry's info and why no more of `ids` was found: nothing of
        this key held (NEW_CONVERSATION), the best entry leaves the prompt at token N
        (PREFIX_DIFFERS), a recurrent state that went back only to an earlier checkpoint
        or to none, or a cache let go shared more (its reason)."""
        best, best_n, best_got = None, 0, 0
        best_cp: Checkpoint | None = None
        best_short: Miss | None = None
        stuck_keep, stuck_miss = 0, Miss()  # the longest match that cannot go back to it
        mine = [e for e in self._entries if e.key == key]
        for e in mine:
            n = common_prefix_len(e.ids, ids)
            # the engine keeps at most len(ids) − 1 of them; a cache that cannot go back
            # there (a recurrent layer's state, an evicted ring) restarts from its latest
            # checkpoint before it, or is prefilled again
            keep = min(n, len(ids) - 1)
            got, cp, short = reach(e.cache, e.checkpoints, keep)
            if (cp is not None or short is None) and (got, n) > (best_got, best_n):
                best, best_n, best_got, best_cp, best_short = e, n, got, cp, short
            if short is not None and keep > stuck_keep:
                stuck_keep, stuck_miss = keep, short
        found, info, checkpoints = None, self.new_info(), Checkpoints()
        if best is not None:
            self._entries.remove(best)
            best.info.hits += 1
            best.info.used = info.used
            if best_cp is None and best_n == len(best.ids):
                found, info, checkpoints = (best.ids, best.cache), best.info, best.checkpoints
            else:
                self._entries.append(best)  # still there, now the most recently used
                clone = clone_cache(best.cache)
                checkpoints = best.checkpoints.upto(len(best.ids))
                if clone is not None and best_cp is not None:
                    checkpoints.restore(clone, best_cp)
                held = best.ids if best_cp is None else best.ids[: best_cp.at]
                found = None if clone is None else (list(held), clone)
        if found is None:
            self.misses += 1
        else:
            self.hits += 1
            self.reused_tokens += best_got
        miss = self._miss(ids, key, best, best_n, bool(mine))
        if best_short is not None and miss.reason in (None, PREFIX_DIFFERS):
            miss = best_short
        if stuck_keep > best_got and miss.reason is not None:
            miss = stuck_miss
        return Lookup(found, info, miss, checkpoints)

    def _miss(self, ids: list[int], key: CacheKey, best: _Entry | None, best_n: int,
              any_held: bool) -> Miss:
        lost_n, why = self.dropped.best(ids, key)
        if why is not None and lost_n > best_n:
            return Miss(why)
        if best_n >= len(ids) or best is not None and best_n == len(best.ids):
            return Miss()  # all of the prompt, or all of the entry
        if best is None and not any_held:
            return Miss(NEW_CONVERSATION)
        return Miss(PREFIX_DIFFERS, best_n)

    def clear(self, why: str | None = None) -> None:
        """Let every entry go; `why` (a misses.py reason) is remembered for them."""
        if why is not None:
            for e in self._entries:
                self.dropped.add(e.ids, e.key, why)
        self._entries = []

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self._entries)

    def entries(self) -> list[tuple[int, int, CacheKey, EntryInfo]]:
        """(tokens, bytes, key, info) of each entry, most recently used first."""
        return [(len(e.ids), e.nbytes, e.key, e.info) for e in reversed(list(self._entries))]

    def stats(self) -> dict[str, Any]:
        """For the statistics (JSON-ready): the counters, and the entries' tokens, most
        recent first."""
        return {
            "entries": len(self._entries),
            "bytes": self.total_bytes,
            "budget_bytes": self.budget_bytes,
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "reused_tokens": self.reused_tokens,
            "tokens": [len(e.ids) for e in reversed(list(self._entries))],
        }
