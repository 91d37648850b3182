"""The cache of a layer that attends and runs a recurrent mixer side by side (Falcon-H1,
families.HYBRID): the attention's K/V cache (kv.py) and the mixer's state (state.py) in
one object, so that the cache list keeps one entry per layer.

It answers the per-layer protocol (offset, make_mask, stats, state, trim) from its two
members: positions and the mask from the K/V, and, since the state folds every token in,
no going back (`is_trimmable()` False, as a StateCache). The compiled step drives each
member as it drives a layer of that kind (`members`; model/runtime/generate.py).
"""

from __future__ import annotations

from typing import Any

from .state import StateCache


class HybridCache:
    """`kv`: the attention's K/V cache; `mixer`: the recurrent mixer's StateCache (what
    layers.ParallelMixerBlock hands each branch)."""

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

    # ---- no going back (the state's rule) ------------------------------------------------
    def is_trimmable(self) -> bool:
        return False

    def can_trim_to(self, n: int) -> bool:
        return n == self.offset

    def trim(self, n: int) -> int:
        return self.mixer.trim(n)

    # ---- quantized K/V (kv.maybe_quantize) --------------------------------------------------
    def quantized(self, q: Any) -> HybridCache:
        return HybridCache(self.kv.quantized(q), self.mixer)

    # ---- state (kv.py's protocol; prefix_pool.clone_cache) ------------------------------------
    @property
    def state(self) -> tuple[Any, ...]:
        """The K/V's class and state, then the mixer's (a ring's `_lo` needs no extra: this
        cache is never trimmed). Not written to files (file.savable: not a K/V class)."""
        return type(self.kv), self.kv.state, self.mixer.state

    @classmethod
    def from_state(cls, state: Any) -> HybridCache:
        kv_class, kv_state, mixer_state = state
        return cls(kv_class.from_state(tuple(kv_state)), StateCache.from_state(tuple(mixer_state)))

    @property
    def nbytes(self) -> int:
        return int(self.kv.nbytes) + self.mixer.nbytes

    def stats(self) -> dict[str, Any]:
        """The K/V's figures, with the state's bytes beside them (kind "hybrid")."""
        return {**self.kv.stats(), "kind": "hybrid", "state_bytes": self.mixer.nbytes}

