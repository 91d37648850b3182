"""The cache of a layer that attends and keeps a recurrent state (families.HYBRID:
Falcon-H1's attention and Mamba-2 side by side, Zamba2's shared block feeding its
Mamba-2): the attention's K/V cache (kv.py) and the mixer's StateCache (state.py) in one
object, so that the cache list keeps one entry per layer.

It answers the per-layer protocol from its two members (`members`): positions and the
mask from the K/V, the bytes of each apart (`stats`: K/V in cache_bytes, the state in
state_bytes). Going back is the state's rule, applied to both: the layer can go back as
far as its state can (the tokens a speculative verify pass kept, `rollback`) and its K/V
can; a checkpoint (checkpoints.py) snapshots the state part and, restored, trims the K/V
part to the same token. Every mechanism that walks caches treats a cache with `members`
as those members where it drives arrays: the compiled step (model/runtime/generate.py),
a saved chat (file.py), a clone (prefix_pool.py), the integrity check (integrity.py).
"""

from __future__ import annotations

from typing import Any

from .state import StateCache


class HybridCache:
    """`kv`: the attention's K/V cache; `mixer`: the recurrent mixer's StateCache (what
    layers.ParallelMixerBlock and layers.SharedBlock hand each part)."""

    extras: tuple[str, ...] = ()

    def __init__(self, kv: Any, mixer: Any) -> None:
        self.kv, self.mixer = kv, mixer

    @property
    def members(self) -> tuple[Any, Any]:
        return self.kv, self.mixer

    @property
    def offset(self) -> Any:
        return self.kv.offset

    def make_mask(self, *args: Any, **kwargs: Any) -> Any:
        return self.kv.make_mask(*args, **kwargs)

    def empty(self) -> bool:
        return self.kv.empty()

    def size(self) -> int:
        return int(self.kv.size())

    # ---- going back: as far as the state and the K/V both can ------------------------------
    def is_trimmable(self) -> bool:
        return False

    def can_trim_to(self, n: int) -> bool:
        return bool(self.mixer.can_trim_to(n) and self.kv.can_trim_to(n))

    def trim(self, n: int) -> int:
        """Take back the last `n` tokens: the state first (StateError, nothing changed,
        when it did not keep them), then the K/V."""
        dropped = self.mixer.trim(n)
        if dropped:
            self.kv.trim(dropped)
        return dropped

    @property
    def rollback(self) -> int:
        return self.mixer.rollback

    # ---- checkpoints (checkpoints.py): the state's snapshot; the K/V trimmed back ---------
    def snapshot(self) -> tuple[Any, Any, int]:
        return self.mixer.snapshot()

    def restore(self, snap: tuple[Any, Any, int]) -> None:
        self.mixer.restore(snap)
        self.kv.trim(self.kv.offset - int(snap[2]))

    # ---- quantized K/V (kv.maybe_quantize) --------------------------------------------------
    @property
    def pending_quant(self) -> Any:
        return getattr(self.kv, "pending_quant", None)

    @pending_quant.setter
    def pending_quant(self, q: Any) -> None:
        self.kv.pending_quant = q

    def quantized(self, q: Any) -> HybridCache:
        return HybridCache(self.kv.quantized(q), self.mixer)

    # ---- state (kv.py's protocol) --------------------------------------------------------
    @property
    def state(self) -> tuple[Any, ...]:
        """The members' states (what `mx.eval` needs); a file or a clone rebuilds each
        member from its own (`from_members`)."""
        return self.kv.state, self.mixer.state

    @classmethod
    def from_members(cls, members: list[Any]) -> HybridCache:
        kv, mixer = members
        if not isinstance(mixer, StateCache):
            raise ValueError(f"a hybrid layer's second part is a {type(mixer).__name__},"
                             " not a state")
        return cls(kv, mixer)

    @property
    def nbytes(self) -> int:
        return int(self.kv.nbytes) + self.mixer.nbytes

    def stats(self) -> dict[str, Any]:
        """The K/V's figures, with the state's bytes beside them (kind "hybrid")."""
        return {**self.kv.stats(), "kind": "hybrid", "state_bytes": self.mixer.nbytes}
