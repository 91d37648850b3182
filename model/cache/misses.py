"""Why a turn reused fewer cached tokens than it might have: one reason from a fixed list,
computed where the caches are looked up (model/runtime/chat_cache.py, prefix_pool.py),
and the record of caches let go that lets a later prompt name what it lost.

A turn reuses the longest prefix its prompt shares with a cached conversation; the
reason says why that was not the whole cached conversation or, with nothing reused, why
nothing was there. `cached_tokens: 0` with no reason is what users cannot act on
(docs/serve.md, Cache reuse across requests).
"""

from __future__ import annotations

import array
import collections
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

NEW_CONVERSATION = "new_conversation"
PREFIX_DIFFERS = "prefix_differs"
EVICTED = "evicted"
MODEL_CHANGED = "model_or_settings_changed"
WINDOW_ROTATED = "window_rotated"
REUSE_OFF = "reuse_off"
NO_CHECKPOINT = "no_checkpoint"
NEAREST_CHECKPOINT = "checkpoint_before"

# every reason a turn can give, with its line for people ({at}: the first differing token)
MISS_REASONS: dict[str, str] = {
    NEW_CONVERSATION: "nothing cached for this client shares the prompt's first token",
    PREFIX_DIFFERS: "the prompt differs from the cached conversation at token {at}",
    EVICTED: "the cached conversation was evicted to keep the pool within its byte budget",
    MODEL_CHANGED: "the model or the cache settings changed since the conversation was cached",
    WINDOW_ROTATED: "the rotating window moved past the shared prefix, so the cache could not"
                    " be cut back to it",
    REUSE_OFF: "prefix reuse is turned off",
    NO_CHECKPOINT: "the recurrent layers' state cannot go back: no checkpoint at or before"
                   " token {at}",
    NEAREST_CHECKPOINT: "the recurrent layers' state cannot go back to token {at}: it restarted"
                        " from its latest checkpoint before it",
}

MAX_DROPPED = 64  # caches let go that are remembered (their ids only)
MAX_DROPPED_TOKENS = 1 << 21  # and their ids at most: 8 MiB


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass
class CacheUse:
    """How one turn used the cache: the prompt tokens reused and prefilled, and why not
    more were reused (None: every cached token the prompt repeats was reused)."""

    reused_tokens: int
    prefilled_tokens: int
    miss_reason: str | None = None
    differs_at: int | None = None  # PREFIX_DIFFERS: the first prompt token that differs;
    # NO_CHECKPOINT, NEAREST_CHECKPOINT: the token the state would have to go back to

    def to_json(self) -> dict[str, Any]:
        line = None
        if self.miss_reason is not None:
            line = MISS_REASONS[self.miss_reason].format(at=self.differs_at)
        return {"reused_tokens": self.reused_tokens, "prefilled_tokens": self.prefilled_tokens,
                "miss_reason": self.miss_reason, "miss": line, "differs_at": self.differs_at}


@dataclass
class Miss:
    """A lookup's verdict before the cache is cut to fit: the reason (None: a full
    match) and, for PREFIX_DIFFERS, where the prompt leaves the cached ids."""

    reason: str | None = None
    differs_at: int | None = None


class DroppedCaches:
    """The token ids (only) of caches let go, with why and the key they were made under,
    newest last: a later prompt that shares more with one of them than with any cache
    still held lost it for that reason. Bounded in records and in tokens."""

    def __init__(self, max_records: int = MAX_DROPPED, max_tokens: int = MAX_DROPPED_TOKENS):
        self.max_records, self.max_tokens = max_records, max_tokens
        self._records: collections.deque[tuple[array.array[int], Hashable, str]] = (
            collections.deque())
        self._tokens = 0

    def add(self, ids: Sequence[int], key: Hashable, why: str) -> None:
        if not ids:
            return
        self.covered(ids, key)  # an older record it repeats says nothing more
        self._records.append((array.array("i", ids), key, why))
        self._tokens += len(ids)
        while self._records and (len(self._records) > self.max_records
                                 or self._tokens > self.max_tokens):
            self._tokens -= len(self._records.popleft()[0])

    def covered(self, ids: Sequence[int], key: Hashable) -> None:
        """A cache now held for `ids` under `key`: records it extends are moot."""
        keep = collections.deque()
        for rec in self._records:
            if rec[1] == key and len(rec[0]) <= len(ids) and \
                    common_prefix_len(rec[0], ids) == len(rec[0]):
                self._tokens -= len(rec[0])
            else:
                keep.append(rec)
        self._records = keep

    def best(self, ids: Sequence[int], key: Hashable) -> tuple[int, str | None]:
        """The most prompt tokens a dropped cache of `key` shared with `ids`, and why it
        went (the newest such record); (0, None) when none shares any."""
        best_n, why = 0, None
        for rec_ids, rec_key, rec_why in self._records:
            if rec_key == key and (n := common_prefix_len(rec_ids, ids)) >= best_n and n:
                best_n, why = n, rec_why
        return best_n, why

    def clear(self) -> None:
        self._records.clear()
        self._tokens = 0
