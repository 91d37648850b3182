"""KV caches following mlx-lm's duck-typed protocol (update_and_fetch, offset, make_mask,
trim, nbytes, state) plus a read-only `stats()` built from metadata only."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .config import ModelConfig


def _causal(n: int, offset: int, window: int | None) -> mx.array:
    q = mx.arange(offset, offset + n)[:, None]
    k = mx.arange(offset + n)[None]
    mask = q >= k
    if window is not None:
        mask = mask & (q < k + window)
    return mask


class KVCache:
    """Growing cache: K/V (B, n_kv_heads, capacity, head_dim) allocated in `step`s and
    written in place; `offset` tokens are resident."""

    step = 256

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        prev, n = self.offset, keys.shape[2]
        if self.keys is None or prev + n > self.keys.shape[2]:
            B, H, _, Dk = keys.shape
            grow = ((n + self.step - 1) // self.step) * self.step
            new_k = mx.zeros((B, H, grow, Dk), keys.dtype)
            new_v = mx.zeros((B, H, grow, values.shape[3]), values.dtype)
            if self.keys is None:
                self.keys, self.values = new_k, new_v
            else:
                self.keys = mx.concatenate([self.keys[..., :prev, :], new_k], axis=2)
                self.values = mx.concatenate([self.values[..., :prev, :], new_v], axis=2)
        self.offset += n
        self.keys[..., prev : self.offset, :] = keys
        self.values[..., prev : self.offset, :] = values
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        if window_size is not None:
            return _causal(n, self.offset, window_size)
        if n == 1:
            return None
        return _causal(n, self.offset, None) if return_array else "causal"

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n

    def empty(self) -> bool:
        return self.keys is None

    @property
    def state(self) -> tuple[mx.array, mx.array]:
        if self.keys is None:
            return ()  # type: ignore[return-value]
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    @state.setter
    def state(self, v: tuple[mx.array, mx.array]) -> None:
        self.keys, self.values = v
        self.offset = self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes of the resident K and V (the allocated buffer may be up to a step larger)."""
        if self.keys is None:
            return 0
        per_token = (self.keys.nbytes + self.values.nbytes) // self.keys.shape[2]
        return per_token * self.offset

    def stats(self) -> dict[str, Any]:
        tokens = self.offset
        return {
            "cache_offset": self.offset,
            "cache_tokens": tokens,
            "cache_bytes": self.nbytes,
            "evicted_tokens": 0,
            "keep": 0,
            "wrapped": False,
        }


def make_cache(cfg: ModelConfig, max_kv_size: int | None = None, keep: int = 4) -> list[Any]:
    """One cache per layer."""
    return [KVCache() for _ in range(cfg.num_hidden_layers)]
