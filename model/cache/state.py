"""The cache of a recurrent layer (Mamba, Mamba-2, the gated delta rule, LFM2's short
convolution): a fixed-size state in place of K/V, whatever the number of tokens.

Per layer a conv state (the last K − 1 inputs of the mixer's causal convolution) and, for
the mixers that have one, a recurrent state (Mamba: features × N; Mamba-2: heads ×
head_dim × N; gated delta: value heads × k_dim × v_dim). The mixer reads both and hands
back the next ones with `update` (model/decoder/conv.py, ssm.py, delta.py).

The protocol is the K/V caches' (kv.py) where it means something: `offset` (tokens seen),
`state` / `from_state`, `nbytes`, `stats()`, `empty()`, `size()`. A state cannot go back
to an earlier token (it folds every token into the same numbers), so `is_trimmable()` is
False and `trim` refuses anything but 0: an engine whose next prompt does not extend the
cached one prefills it again (kv.why_not_trimmable says why).

The one exception is speculative decoding's: with `rollback` = n > 0 (`set_rollback`) the
cache keeps the states it passed through over its last n tokens (references to the
immutable arrays: a multi-token pass hands back every position's, model/decoder/
state_steps.py; a one-token step the one it replaces), and a trim of at most those tokens
puts the state back exactly (docs/design.md, "Speculative decoding").
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kvchat.model.errors import KVChatError


class StateError(KVChatError):
    """A recurrent layer's state was asked to forget tokens."""


class StateCache:
    """One recurrent layer's conv and recurrent state (None until the first token)."""

    # tokens a trim may take back (0: none); `_back[-i]` is the (conv, recurrent) state of
    # i tokens ago, the one a trim of i puts back
    rollback = 0
    _back: tuple[tuple[mx.array | None, mx.array | None], ...] = ()

    def __init__(self) -> None:
        self.conv: mx.array | None = None
        self.recurrent: mx.array | None = None
        self.offset = 0

    def update(self, tokens: int, conv: mx.array, recurrent: mx.array | None = None) -> None:
        """The states after `tokens` more tokens (the mixer computed them)."""
        if self.rollback and tokens == 1:
            self._remember([(self.conv, self.recurrent)])
        else:
            self._back = ()
        self.conv, self.recurrent = conv, recurrent
        self.offset += tokens

    def update_steps(self, tokens: int, convs: mx.array, recurrents: mx.array | None) -> None:
        """The states after each of `tokens` more tokens, stacked on axis 0 (a pass that
        may be taken back: model/decoder/state_steps.py); every one is kept, so a trim
        of up to `tokens` is exact whatever `rollback` says."""
        before = [(self.conv, self.recurrent)]
        before += [(convs[t], None if recurrents is None else recurrents[t])
                   for t in range(tokens - 1)]
        self._remember(before, max(self.rollback, tokens))
        self.conv, self.recurrent = convs[-1], None if recurrents is None else recurrents[-1]
        self.offset += tokens

    def _remember(self, states: list[tuple[mx.array | None, mx.array | None]],
                  most: int | None = None) -> None:
        most = self.rollback if most is None else most
        kept = (*self._back, *states)
        self._back = kept[max(0, len(kept) - most):] if most else ()

    def empty(self) -> bool:
        return self.conv is None

    def size(self) -> int:
        """Tokens the state stands for: all it has seen (none is ever evicted)."""
        return self.offset

    # ---- no going back, but over the states kept (`rollback`) --------------------------
    def is_trimmable(self) -> bool:
        return False

    def can_trim_to(self, n: int) -> bool:
        return self.offset - len(self._back) <= n <= self.offset

    def trim(self, n: int) -> int:
        if n == 0:
            return 0
        if not 0 < n <= len(self._back):
            raise StateError(
                f"a recurrent layer's state cannot drop its last {n} tokens; prefill again"
            )
        self.conv, self.recurrent = self._back[-n]
        self._back = self._back[:-n]
        self.offset -= n
        return n

    # ---- one token at a time, for the compiled step (model/runtime/generate.py) ------------
    def slot_layout(self) -> tuple[Any, ...]:
        """The trace's key: a state, and how many arrays it carries (conv, recurrent)."""
        return ("state", sum(a is not None for a in (self.conv, self.recurrent)))

    def next_slot(self, n: int = 1) -> tuple[int, int, int, int]:
        """The trace's row: only the offset means something here. Any n: a verify pass
        of n > 1 tokens hands back every position's states (model/decoder/state_steps.py)."""
        return self.offset, 0, 0, 0

    def commit(self, conv: mx.array, recurrent: mx.array | None = None, n: int = 1) -> None:
        """Take the states the compiled step computed for `n` more tokens (kv.py's
        `commit`, with a state's arrays in place of K/V buffers; each position's,
        stacked, when n > 1)."""
        if n > 1:
            self.update_steps(n, conv, recurrent)
        else:
            self.update(n, conv, recurrent)

    # ---- checkpoints (model/cache/checkpoints.py) -----------------------------------------
    def snapshot(self) -> tuple[mx.array | None, mx.array | None, int]:
        """The state as it is now: references to its arrays (MLX arrays are immutable and
        `update` replaces them, so this copies nothing) and the tokens it stands for."""
        return self.conv, self.recurrent, self.offset

    def restore(self, snap: tuple[mx.array | None, mx.array | None, int]) -> None:
        """Go back to a `snapshot` of this layer taken earlier in the same conversation."""
        self.conv, self.recurrent, self.offset = snap[0], snap[1], int(snap[2])

    # ---- state (kv.py's protocol) ---------------------------------------------------------
    @property
    def state(self) -> tuple[Any, ...]:
        return self.conv, self.recurrent, self.offset

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        self.conv, self.recurrent, offset = v
        self.offset = int(offset)

    @classmethod
    def from_state(cls, state: Any) -> StateCache:
        obj = cls.__new__(cls)
        obj.state = state
        return obj

    @property
    def nbytes(self) -> int:
        """Bytes of the states: fixed by the model, the same at every token."""
        return sum(a.nbytes for a in (self.conv, self.recurrent) if a is not None)

    def stats(self) -> dict[str, Any]:
        """kv.py's per-layer figures: no K/V (cache_bytes 0), the state apart."""
        return {
            "kind": "state",
            "cache_offset": self.offset,
            "cache_tokens": self.offset,
            "cache_capacity": None,
            "allocated_tokens": 0,
            "cache_bytes": 0,
            "allocated_bytes": 0,
            "evicted_tokens": 0,
            "keep": 0,
            "wrapped": False,
            "kv_bits": None,
            "kv_group_size": None,
            "float_bytes": 0,
            "state_bytes": self.nbytes,
        }


class PassCache(StateCache):
    """A layer without a token mixer (Nemotron-H's MLP and expert layers): nothing to
    keep, so any trim is exact; it only counts the tokens (the block calls `advance`)."""

    def advance(self, tokens: int) -> None:
        self.offset += tokens

    def slot_layout(self) -> tuple[Any, ...]:
        return ("pass",)

    def next_slot(self, n: int = 1) -> tuple[int, int, int, int]:
        """Any number of tokens: there is nothing to write, and a trim is exact."""
        return self.offset, 0, 0, 0

    def commit(self, *arrays: mx.array, n: int = 1) -> None:
        self.advance(n)

    def is_trimmable(self) -> bool:
        return True

    def can_trim_to(self, n: int) -> bool:
        return 0 <= n <= self.offset

    def trim(self, n: int) -> int:
        n = max(0, min(self.offset, n))
        self.offset -= n
        return n

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "kind": "none"}


def set_rollback(caches: Any, tokens: int) -> None:
    """Let the recurrent layers among `caches` take back up to `tokens` tokens exactly
    (speculative decoding's rejected drafts); 0 forgets the states kept for it. A layer
    with `members` (hybrid.py: K/V beside a state) sets its state's."""
    for c in (m for layer in caches for m in getattr(layer, "members", (layer,))):
        if isinstance(c, StateCache) and not isinstance(c, PassCache):
            c.rollback = tokens
            if not tokens:
                c._back = ()
