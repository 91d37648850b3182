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
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kvchat.model.errors import KVChatError


class StateError(KVChatError):
    """A recurrent layer's state was asked to forget tokens."""


class StateCache:
    """One recurrent layer's conv and recurrent state (None until the first token)."""

    def __init__(self) -> None:
        self.conv: mx.array | None = None
        self.recurrent: mx.array | None = None
        self.offset = 0

    def update(self, tokens: int, conv: mx.array, recurrent: mx.array | None = None) -> None:
        """The states after `tokens` more tokens (the mixer computed them)."""
        self.conv, self.recurrent = conv, recurrent
        self.offset += tokens

    def empty(self) -> bool:
        return self.conv is None

    def size(self) -> int:
        """Tokens the state stands for: all it has seen (none is ever evicted)."""
        return self.offset

    # ---- no going back ------------------------------------------------------------------
    def is_trimmable(self) -> bool:
        return False

    def can_trim_to(self, n: int) -> bool:
        return n == self.offset

    def trim(self, n: int) -> int:
        if n == 0:
            return 0
        raise StateError(
            f"a recurrent layer's state cannot drop its last {n} tokens; prefill again"
        )

    # ---- one token at a time, for the compiled step (model/runtime/generate.py) ------------
    def slot_layout(self) -> tuple[Any, ...]:
        """The trace's key: a state, and how many arrays it carries (conv, recurrent)."""
        return ("state", sum(a is not None for a in (self.conv, self.recurrent)))

    def next_slot(self, n: int = 1) -> tuple[int, int, int, int] | None:
        """The trace's row: only the offset means something here. None for n > 1 (a
        speculative verify pass): a state cannot take back the drafts it rejects."""
        return (self.offset, 0, 0, 0) if n == 1 else None

    def commit(self, conv: mx.array, recurrent: mx.array | None = None, n: int = 1) -> None:
        """Take the states the compiled step computed for `n` more tokens (kv.py's
        `commit`, with a state's arrays in place of K/V buffers)."""
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
