"""Checkpoints of a conversation's recurrent states, so that a prompt which leaves the
cached conversation (a re-rendered reply, a regenerated one, an edited last message)
restarts from the nearest earlier token instead of token 0 (docs/kv-cache.md, Checkpoints).

A recurrent layer's state folds every token into the same numbers and cannot go back
(state.py). A checkpoint is, for every such layer, a `snapshot` of its state at token `at`:
references to its arrays, which MLX never changes in place (the mixer hands back new
ones), so taking one copies nothing; it holds its arrays' memory once the conversation
moves on. Every other layer needs nothing kept: K/V caches and mixer-less layers trim back
to `at` (a rotating ring only while `at` is still in its window). A layer that attends and
keeps a state (hybrid.py) is both: its state snapshotted, its K/V trimmed. Restoring a
checkpoint is both: the snapshots back into the states, the rest trimmed.

When they are taken (the engine's turn, model/runtime/turn.py): at the end of the prompt
(where the next turn restarts when the template renders the reply differently), one token
before it (where a regenerated reply restarts: at least one prompt token always runs to
give the next logits), every `interval` tokens of a long prefill, and at the end of each
reply (where an edited next message restarts). At most `max_count` per conversation:
past that the older ones are thinned (the one closest to its older neighbour goes, the
oldest on a tie; the newest `KEEP_NEWEST` never), so they stay spread over the
conversation.

Used by the chat's cache (model/runtime/chat_cache.py) and the server's prefix pool
(prefix_pool.py), and saved with a chat's cache (file.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from .hybrid import HybridCache
from .kv import can_trim_to, untrimmable_miss
from .misses import NEAREST_CHECKPOINT, WINDOW_ROTATED, Miss
from .state import PassCache, StateCache

MAX_CHECKPOINTS = 8  # per conversation (llama.cpp's server keeps 8 by default too)
INTERVAL = 1024  # tokens between checkpoints inside a long prefill
KEEP_NEWEST = 3  # the last prompt's two and the last reply's, never thinned away

Snapshot = tuple[mx.array | None, mx.array | None, int]


def stateful(caches: Sequence[Any]) -> list[int]:
    """The layers whose cache holds a recurrent state (a StateCache, not a mixer-less
    PassCache, or a HybridCache's state part)."""
    return [i for i, c in enumerate(caches) if isinstance(c, HybridCache)
            or (isinstance(c, StateCache) and not isinstance(c, PassCache))]


def trimmed_parts(caches: Sequence[Any]) -> list[Any]:
    """What restoring a checkpoint trims: every layer without a state, and the K/V part
    of a layer that has both."""
    return [c.kv if isinstance(c, HybridCache) else c for c in caches
            if isinstance(c, HybridCache) or not (isinstance(c, StateCache)
                                                  and not isinstance(c, PassCache))]


def _snap_bytes(snaps: Sequence[tuple[int, Snapshot]]) -> int:
    return sum(a.nbytes for _, s in snaps for a in s[:2] if a is not None)


@dataclass(frozen=True)
class Checkpoint:
    """The recurrent layers' states after the first `at` tokens: (layer, snapshot) each."""

    at: int
    states: tuple[tuple[int, Snapshot], ...]

    @property
    def nbytes(self) -> int:
        return _snap_bytes(self.states)


class Checkpoints:
    """One conversation's checkpoints, oldest first (at most one per position)."""

    def __init__(self, max_count: int = MAX_CHECKPOINTS, interval: int = INTERVAL,
                 items: Sequence[Checkpoint] = ()) -> None:
        self.max_count, self.interval = max(1, max_count), max(1, interval)
        self.items: list[Checkpoint] = sorted(items, key=lambda c: c.at)

    def __len__(self) -> int:
        return len(self.items)

    @property
    def positions(self) -> list[int]:
        return [c.at for c in self.items]

    @property
    def nbytes(self) -> int:
        """Bytes the checkpoints hold, each array once (two checkpoints of an unchanged
        state share theirs; the live state's own arrays are counted too when shared)."""
        seen: set[int] = set()
        total = 0
        for c in self.items:
            for _, s in c.states:
                for a in s[:2]:
                    if a is not None and id(a) not in seen:
                        seen.add(id(a))
                        total += a.nbytes
        return total

    def plan(self, start: int, end: int) -> list[int]:
        """Where a prefill from token `start` to `end` should pause for a checkpoint: each
        multiple of `interval` in between, the token before the last one, and the end."""
        stops = set(range(-(-start // self.interval) * self.interval, end, self.interval))
        stops |= {end - 1, end}
        return sorted(p for p in stops if start <= p <= end)

    def take(self, caches: Sequence[Any]) -> Checkpoint | None:
        """A checkpoint of `caches` as they are now (None: no recurrent layer, or one
        that has seen no token)."""
        layers = stateful(caches)
        if not layers or any(caches[i].empty() for i in layers):
            return None
        at = caches[layers[0]].offset
        cp = Checkpoint(at, tuple((i, caches[i].snapshot()) for i in layers))
        self.items = [c for c in self.items if c.at != at] + [cp]
        self.items.sort(key=lambda c: c.at)
        while len(self.items) > self.max_count:
            self._thin()
        return cp

    def _thin(self) -> None:
        """Drop the older checkpoint closest to the one before it (the oldest on a tie)."""
        older = len(self.items) - KEEP_NEWEST
        if older <= 0:
            del self.items[0]
            return
        gaps = [c.at - (self.items[i - 1].at if i else 0) for i, c in
                enumerate(self.items[:older])]
        del self.items[gaps.index(min(gaps))]

    def latest(self, n: int, caches: Sequence[Any]) -> Checkpoint | None:
        """The latest checkpoint at or before token `n` that `caches` can go back to
        (their K/V trimmed there: a rotating ring only within its window)."""
        others = trimmed_parts(caches)
        for cp in reversed(self.items):
            if cp.at <= n and can_trim_to(others, cp.at):
                return cp
        return None

    def restore(self, caches: Sequence[Any], cp: Checkpoint) -> None:
        """Put `caches` back to token `cp.at`; the checkpoints after it are of another
        continuation and go."""
        snaps = dict(cp.states)
        for i, c in enumerate(caches):
            if i in snaps:
                c.restore(snaps[i])
            else:
                c.trim(c.offset - cp.at)
        self.drop_after(cp.at)

    def drop_after(self, n: int) -> None:
        """Forget the checkpoints past token `n` (the conversation was cut back to it)."""
        self.items = [c for c in self.items if c.at <= n]

    def upto(self, n: int) -> Checkpoints:
        """A copy holding those at or before token `n` (the snapshots are shared: they
        never change)."""
        return Checkpoints(self.max_count, self.interval, [c for c in self.items if c.at <= n])


def reach(caches: Sequence[Any], checkpoints: Checkpoints | None, keep: int
          ) -> tuple[int, Checkpoint | None, Miss | None]:
    """How far `caches` can serve a prompt that shares their first `keep` tokens (the
    most the engine keeps): all `keep` by trimming; else the latest checkpoint at or
    before it; else nothing. Returns (tokens reused, the checkpoint to restore or None,
    why fewer than `keep` were: None when all were)."""
    if can_trim_to(list(caches), keep):
        return keep, None, None
    cp = checkpoints.latest(keep, caches) if checkpoints is not None else None
    if cp is not None:
        return cp.at, cp, (Miss(NEAREST_CHECKPOINT, keep) if cp.at < keep else None)
    if checkpoints is not None and any(c.at <= keep for c in checkpoints.items):
        return 0, None, Miss(WINDOW_ROTATED)  # a checkpoint, but the ring moved past it
    return 0, None, untrimmable_miss(list(caches), keep)
