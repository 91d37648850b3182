"""KV caches following mlx-lm's duck-typed protocol (update_and_fetch, offset, make_mask,
trim, is_trimmable, nbytes, state (arrays only), meta_state (integers as strings),
from_state(state, meta_state), empty, size) plus a read-only `stats()` built from
metadata only, so mlx-lm's `generate_step` can drive our model with our caches and the UI
can poll statistics every token for free.

Rotation semantics (DESIGN.md): with capacity M and K sink tokens ("keep"), the query at
absolute position t attends to [0, K) ∪ [t − (M − K) + 1, t]. Storage is one buffer per
layer for K and one for V, shape (B, n_kv_heads, capacity, head_dim), grown in steps up to
M and written in place: position p lives in slot p while p < M; after that, ring positions
p ≥ K live in slot K + (p − K) mod (M − K) (the same layout as mlx-lm's RotatingKVCache
at decode time, so both give bit-identical logits token by token).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .config import LayerSpec, ModelConfig
from .errors import KVChatError
from .events import TurnStats
from .kv_math import cached_widths, kv_bytes, kv_saving


class CacheError(KVChatError):
    """A cache bound that cannot work (e.g. keep ≥ max size)."""


def causal_mask(n: int, offset: int = 0, window: int | None = None) -> mx.array:
    """Boolean (n, offset + n) mask: query offset+i sees key j iff j <= offset+i
    (and offset+i - j < window when a sliding window is set)."""
    q = mx.arange(offset, offset + n)[:, None]
    k = mx.arange(offset + n)[None]
    mask = q >= k
    if window is not None:
        mask = mask & (q < k + window)
    return mask


def _grow(buf: mx.array | None, like: mx.array, need: int, step: int, cap: int | None) -> mx.array:
    """Return `buf` with at least `need` slots: grown in whole steps (capped at `cap`),
    old slots copied once per step rather than once per token."""
    have = 0 if buf is None else buf.shape[2]
    if have >= need:
        return buf  # type: ignore[return-value]
    size = ((need + step - 1) // step) * step
    if cap is not None:
        size = min(size, cap)
    B, H, _, D = like.shape
    fresh = mx.zeros((B, H, size - have, D), like.dtype)
    return fresh if buf is None else mx.concatenate([buf[..., :have, :], fresh], axis=2)


class _Buffers:
    """What both caches share: K and V buffers of shape (B, n_kv_heads, slots, head_dim)
    whose first `_written()` slots hold tokens; `state` is those slots (arrays only)."""

    keys: mx.array | None
    values: mx.array | None

    def _written(self) -> int:
        raise NotImplementedError

    def empty(self) -> bool:
        return self.keys is None

    def is_trimmable(self) -> bool:
        return True

    @property
    def state(self) -> tuple[mx.array, ...]:
        if self.keys is None or self.values is None:
            return ()
        n = self._written()
        if n == self.keys.shape[2]:
            return self.keys, self.values
        return self.keys[..., :n, :], self.values[..., :n, :]

    @state.setter
    def state(self, v: tuple[mx.array, ...]) -> None:
        self.keys, self.values = v


class KVCache(_Buffers):
    """Growing (unbounded) cache: K/V (B, n_kv_heads, capacity, head_dim) allocated in
    `step`s and written in place; `offset` tokens are resident."""

    step = 256

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    def _written(self) -> int:
        return self.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        prev, n = self.offset, keys.shape[2]
        if self.keys is not None and prev < self.keys.shape[2] < prev + n:
            # drop stale slots past `prev` (after a trim) before growing
            self.keys, self.values = self.keys[..., :prev, :], self.values[..., :prev, :]
        self.keys = _grow(self.keys, keys, prev + n, self.step, None)
        self.values = _grow(self.values, values, prev + n, self.step, None)
        self.offset += n
        self.keys[..., prev : self.offset, :] = keys
        self.values[..., prev : self.offset, :] = values
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    def make_mask(
        self, n: int, return_array: bool = False, window_size: int | None = None
    ) -> mx.array | str | None:
        if window_size is not None and self.offset + n > window_size:
            return causal_mask(n, self.offset, window_size)
        if return_array:
            return causal_mask(n, self.offset, None)
        return None if n == 1 else "causal"

    def size(self) -> int:
        return self.offset

    def slot_positions(self) -> tuple[mx.array, mx.array]:
        """Absolute position and residency of every written slot (slot p holds p)."""
        return mx.arange(self.offset), mx.ones((self.offset,), dtype=mx.bool_)

    def write_slot(self) -> int:
        """The slot the next token will be written to."""
        return self.offset

    def can_trim_to(self, n: int) -> bool:
        return 0 <= n <= self.offset

    def trim(self, n: int) -> int:
        n = max(0, min(self.offset, n))
        self.offset -= n
        return n

    # ---- one token at a time, for the compiled step (model/generate.py) ---------------
    def slot_layout(self) -> tuple[Any, ...]:
        """What a trace needs to know about this cache's slots: position p lives in p."""
        return ("full",)

    def next_slot(self) -> tuple[int, int, int, int]:
        """Make room for one more token; (offset, slot, resident length after the write,
        lowest valid position)."""
        o = self.offset
        assert self.keys is not None and self.values is not None
        self.keys = _grow(self.keys, self.keys, o + 1, self.step, None)
        self.values = _grow(self.values, self.values, o + 1, self.step, None)
        return o, o, o + 1, 0

    def commit_one(self, keys: mx.array, values: mx.array) -> None:
        """Take the buffers the step wrote the token into."""
        self.keys, self.values = keys, values
        self.offset += 1

    @property
    def meta_state(self) -> tuple[str, ...]:
        return (str(self.offset),)

    @meta_state.setter
    def meta_state(self, v: tuple[str, ...]) -> None:
        self.offset = int(v[0])

    @classmethod
    def from_state(cls, state: Any, meta_state: tuple[str, ...] | None = None) -> KVCache:
        obj = cls()
        obj.state = state
        # without meta_state (mlx-lm's old KVCache files) every slot holds a token
        obj.meta_state = meta_state or (str(obj.keys.shape[2]) if obj.keys is not None else "0",)
        return obj

    @property
    def nbytes(self) -> int:
        """Bytes of the resident K and V (the allocated buffer may be up to a step larger)."""
        return _layer_bytes(self.keys, self.offset, self.values)

    def stats(self) -> dict[str, Any]:
        allocated = 0 if self.keys is None else self.keys.shape[2]
        return {
            "kind": "full",
            "cache_offset": self.offset,
            "cache_tokens": self.offset,
            "cache_capacity": None,  # unbounded: cache_stats reports the model's context
            "allocated_tokens": allocated,
            "cache_bytes": _layer_bytes(self.keys, self.offset, self.values),
            "allocated_bytes": _layer_bytes(self.keys, allocated, self.values),
            "evicted_tokens": 0,
            "keep": 0,
            "wrapped": False,
        }


class RotatingKVCache(_Buffers):
    """Bounded cache: `keep` sink tokens plus a ring of the `max_size − keep` most recent.

    Writes are in place. A single token (decode) or a chunk that fits before the buffer
    end is written first and the buffer returned. A multi-token chunk that would
    overwrite keys that earlier queries of the same chunk still need is answered with
    [resident keys in slot order] + [the chunk's keys] and an explicit mask; then only the
    chunk's surviving tokens are written. Masks are exact for every query (see
    `make_mask`); the common cases return None / "causal" as mlx-lm does.
    """

    step = 256

    def __init__(self, max_size: int, keep: int = 0) -> None:
        if max_size < 1:
            raise CacheError(f"KV cache size must be >= 1, got {max_size}")
        if keep < 0 or keep >= max_size:
            raise CacheError(f"keep must be in [0, max size {max_size}), got {keep}")
        self.max_size = max_size
        self.keep = keep
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0
        # lowest ring position still valid, as lowered by a trim past evicted tokens;
        # the effective bound is max(_lo, offset − ring, keep) (see _ring_lo)
        self._lo = keep

    # ---- layout ---------------------------------------------------------------------
    @property
    def _ring(self) -> int:
        return self.max_size - self.keep

    def _ring_lo(self, offset: int) -> int:
        """Lowest resident ring position once `offset` tokens have been written."""
        return max(self._lo, offset - self._ring, self.keep)

    def _slot(self, p: int) -> int:
        return p if p < self.max_size else self.keep + (p - self.keep) % self._ring

    def _inplace(self, n: int) -> bool:
        # one token only ever overwrites position t − ring, which query t does not see;
        # a chunk ending before the buffer end overwrites nothing valid
        return n == 1 or self.offset + n <= self.max_size

    def _key_positions(self, n: int) -> tuple[mx.array, mx.array]:
        """Absolute position and validity of every key `update_and_fetch(n)` will return
        (computed from offsets only, never from the arrays)."""
        o, K, R, M = self.offset, self.keep, self._ring, self.max_size
        if self._inplace(n):
            end, extra = o + n, 0  # buffer state after the write
            length = min(end, M)
        else:
            end, extra = o, n  # buffer state before the write, then the chunk
            length = min(o, M)
        s = mx.arange(length)
        u = end - 1
        ring_pos = u - mx.remainder(u - s, R)
        pos = mx.where(s < K, s, ring_pos)
        valid = mx.where(s < K, s < min(K, end), ring_pos >= self._ring_lo(end))
        if extra:
            pos = mx.concatenate([pos, mx.arange(o, o + n)])
            valid = mx.concatenate([valid, mx.ones((n,), dtype=mx.bool_)])
        return pos, valid

    def make_mask(
        self, n: int, return_array: bool = False, window_size: int | None = None
    ) -> mx.array | str | None:
        """Mask for the next `n` queries over the keys `update_and_fetch` will return:
        key p visible to query t iff p ≤ t, p is resident, (p < keep or t − p < M − keep),
        and (no window or t − p < window_size)."""
        o, K, R, M, W = self.offset, self.keep, self._ring, self.max_size, window_size
        if not return_array:
            # nothing evicted and every key in reach: plain causal
            if o + n <= M and self._lo == K and (W is None or o + n <= W):
                return None if n == 1 else "causal"
            # decode on a full ring: every resident key is visible
            if (
                n == 1
                and o >= M
                and self._lo <= o + 1 - R
                and (W is None or (R <= W and (K == 0 or o < W)))
            ):
                return None
        pos, valid = self._key_positions(n)
        t = mx.arange(o, o + n)[:, None]
        p = pos[None]
        mask = valid[None] & (p <= t) & ((p < K) | (t - p < R))
        if W is not None:
            mask = mask & (t - p < W)
        return mask

    def slot_positions(self) -> tuple[mx.array, mx.array]:
        """Absolute position and residency of every written slot, as they stand now."""
        return self._key_positions(0)

    def write_slot(self) -> int:
        """The slot the next token will be written to (past the end: the oldest ring entry)."""
        return self._slot(self.offset)

    # ---- writes ---------------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        o, n = self.offset, keys.shape[2]
        K, R, M = self.keep, self._ring, self.max_size
        if self._inplace(n):
            self._reserve(min(o + n, M), keys, values)
            s = self._slot(o)
            self.keys[..., s : s + n, :] = keys
            self.values[..., s : s + n, :] = values
            self._advance(o + n)
            length = min(o + n, M)
            if length == self.keys.shape[2]:
                return self.keys, self.values
            return self.keys[..., :length, :], self.values[..., :length, :]

        # Chunk crossing the buffer end: queries of this chunk still need keys its own
        # later tokens would overwrite, so attend over old + new and write afterwards.
        have = min(o, M)
        if have:
            out_k = mx.concatenate([self.keys[..., :have, :], keys], axis=2)
            out_v = mx.concatenate([self.values[..., :have, :], values], axis=2)
        else:
            out_k, out_v = keys, values
        self._reserve(M, keys, values)
        if o < K:  # sink positions land in their own slots
            e = min(K, o + n)
            self.keys[..., o:e, :] = keys[..., : e - o, :]
            self.values[..., o:e, :] = values[..., : e - o, :]
        p = max(K, o, o + n - R)  # first chunk position that survives in the ring
        while p < o + n:  # at most two contiguous runs (before and after the ring end)
            s = self._slot(p)
            run = min(o + n - p, M - s)
            self.keys[..., s : s + run, :] = keys[..., p - o : p - o + run, :]
            self.values[..., s : s + run, :] = values[..., p - o : p - o + run, :]
            p += run
        self._advance(o + n)
        return out_k, out_v

    def _reserve(self, need: int, keys: mx.array, values: mx.array) -> None:
        self.keys = _grow(self.keys, keys, need, self.step, self.max_size)
        self.values = _grow(self.values, values, need, self.step, self.max_size)

    def _advance(self, offset: int) -> None:
        self._lo = self._ring_lo(offset)
        self.offset = offset

    # ---- one token at a time, for the compiled step (model/generate.py) ---------------
    def slot_layout(self) -> tuple[Any, ...]:
        """What a trace needs to know about this cache's slots: `keep` sinks, then a ring."""
        return ("ring", self.max_size, self.keep)

    def next_slot(self) -> tuple[int, int, int, int]:
        """Make room for one more token; (offset, slot, resident length after the write,
        lowest valid ring position after it)."""
        o = self.offset
        length = min(o + 1, self.max_size)
        assert self.keys is not None and self.values is not None
        self._reserve(length, self.keys, self.values)
        return o, self._slot(o), length, self._ring_lo(o + 1)

    def commit_one(self, keys: mx.array, values: mx.array) -> None:
        """Take the buffers the step wrote the token into."""
        self.keys, self.values = keys, values
        self._advance(self.offset + 1)

    # ---- protocol -------------------------------------------------------------------
    def size(self) -> int:
        """Resident tokens."""
        o = self.offset
        return min(o, self.keep) + max(0, o - self._ring_lo(o))

    def _written(self) -> int:
        assert self.keys is not None
        return min(self.offset, self.max_size, self.keys.shape[2])

    def can_trim_to(self, n: int) -> bool:
        """True when, after trimming to `n` tokens, the query at position n would find
        every key its window needs (False once rotation evicted some of them)."""
        if not 0 <= n <= self.offset:
            return False
        lo = min(self._ring_lo(self.offset), max(self.keep, n))
        return lo <= max(self.keep, n - self._ring + 1)

    def trim(self, n: int) -> int:
        """Drop the last `n` tokens. Past evicted tokens (see can_trim_to) the next
        queries see a shorter window until the ring refills; never stale keys."""
        n = max(0, min(self.offset, n))
        new = self.offset - n
        self._lo = min(self._ring_lo(self.offset), max(self.keep, new))
        self.offset = new
        return n

    @property
    def meta_state(self) -> tuple[str, ...]:
        """offset, keep, max_size, the next write slot (mlx-lm's `_idx`, so its
        RotatingKVCache can continue from our buffers), and our lowest valid position."""
        o = self.offset
        return tuple(map(str, (o, self.keep, self.max_size, self._slot(o), self._lo)))

    @meta_state.setter
    def meta_state(self, v: tuple[str, ...]) -> None:
        offset, keep, max_size, _idx, lo = map(int, v)
        self.offset, self.keep, self.max_size, self._lo = offset, keep, max_size, lo

    @classmethod
    def from_state(cls, state: Any, meta_state: tuple[str, ...]) -> RotatingKVCache:
        obj = cls(max_size=int(meta_state[2]), keep=int(meta_state[1]))
        obj.state = state
        obj.meta_state = meta_state
        return obj

    @property
    def nbytes(self) -> int:
        """Bytes of the resident K and V (not the allocated buffer)."""
        return _layer_bytes(self.keys, self.size(), self.values)

    def stats(self) -> dict[str, Any]:
        tokens = self.size()
        allocated = 0 if self.keys is None else self.keys.shape[2]
        return {
            "kind": "rotating",
            "cache_offset": self.offset,
            "cache_tokens": tokens,
            "cache_capacity": self.max_size,
            "allocated_tokens": allocated,
            "cache_bytes": _layer_bytes(self.keys, tokens, self.values),
            "allocated_bytes": _layer_bytes(self.keys, allocated, self.values),
            "evicted_tokens": self.offset - tokens,
            "keep": self.keep,
            "wrapped": self.offset > tokens,
        }


class ChunkedKVCache(RotatingKVCache):
    """Chunked local attention (Llama 4): query t sees only the keys of its own chunk,
    positions ⌊t / chunk⌋·chunk … t. A ring of exactly `chunk` slots always holds them;
    the mask drops the ring's older keys from the previous chunk."""

    def __init__(self, chunk: int) -> None:
        super().__init__(chunk, 0)
        self.chunk = chunk

    def make_mask(
        self, n: int, return_array: bool = False, window_size: int | None = None
    ) -> mx.array:
        pos, valid = self._key_positions(n)
        t = mx.arange(self.offset, self.offset + n)[:, None]
        p = pos[None]
        return valid[None] & (p <= t) & (p // self.chunk == t // self.chunk)

    def slot_layout(self) -> tuple[Any, ...]:
        return ("ring", self.max_size, self.keep, self.chunk)

    @classmethod
    def from_state(cls, state: Any, meta_state: tuple[str, ...]) -> ChunkedKVCache:
        obj = cls(int(meta_state[2]))
        obj.state = state
        obj.meta_state = meta_state
        return obj


def _layer_bytes(keys: mx.array | None, tokens: int, values: mx.array | None = None) -> int:
    """K + V bytes of `tokens` positions of one layer, from the buffers' shapes and dtype
    (kv_math's formula with one layer; V may be narrower than K, as latent attention's)."""
    if keys is None:
        return 0
    B, H, _, D = keys.shape
    dv = D if values is None else values.shape[-1]
    return kv_bytes(tokens, 1, B * H, D, keys.dtype.size, dv)


def _mha_bytes(cfg: ModelConfig, keys: mx.array | None, tokens: int) -> int:
    """What `tokens` positions of one layer would take with one K/V head per query head."""
    if keys is None:
        return 0
    w = cached_widths(cfg, cfg.num_attention_heads)
    return keys.shape[0] * tokens * w.bytes_per_token(1, keys.dtype.size)


def make_cache(cfg: ModelConfig, max_kv_size: int | None = None, keep: int = 4) -> list[Any]:
    """One cache per layer, of the kind the layer needs (`cfg.layers`).

    - a global layer: the model's full context (max_position_embeddings) grown in steps,
      then rotation keeping `keep` sinks; with max_kv_size=N, RotatingKVCache(N, keep);
    - a sliding layer: a ring of exactly its window with keep 0 (key j visible iff
      t − j < window, the model's own mask), unless max_kv_size asks for less, in which
      case the mask is the intersection of both.
    """
    if max_kv_size is not None and max_kv_size < 1:
        raise CacheError(f"--max-kv-size must be >= 1, got {max_kv_size}")
    caches: list[Any] = []
    for spec in cfg.layers:
        if spec.chunk is not None:  # never more than one chunk resident
            caches.append(ChunkedKVCache(spec.chunk))
            continue
        window = spec.window
        if window is not None and (max_kv_size is None or max_kv_size >= window):
            size, k = window, 0
        elif max_kv_size is not None:
            size, k = max_kv_size, keep
        else:
            size, k = cfg.max_position_embeddings, keep
        if keep < 0 or k >= size:
            raise CacheError(
                f"--keep must be in [0, {size}) for a KV cache of {size}, got {keep}"
            )
        caches.append(RotatingKVCache(size, k))
    return caches


# ---- statistics (metadata only) ---------------------------------------------------------
def _attention_name(cfg: ModelConfig, spec: LayerSpec) -> str:
    kind = ("sliding" if spec.window is not None else "chunked" if spec.chunk is not None
            else "latent" if cfg.mla else "global")
    return kind + (
        "" if spec.rope is not None else " NoPE"
    )


def layer_stats(caches: list[Any], cfg: ModelConfig) -> list[dict[str, Any]]:
    """Per-layer view for the UI: the cache's own stats() plus the layer index, its
    attention kind (sliding / global, NoPE) and window, its bytes per token and the
    MHA-equivalent bytes. `cache_stats` sums these rows."""
    out = []
    for i, c in enumerate(caches):
        s = dict(c.stats())
        if s["cache_capacity"] is None:
            s["cache_capacity"] = cfg.max_position_embeddings
        s["layer"] = i
        if i < len(cfg.layers):
            s["attention"] = _attention_name(cfg, cfg.layers[i])
            s["window"] = cfg.layers[i].window
        keys = getattr(c, "keys", None)
        s["bytes_per_token"] = _layer_bytes(keys, 1, getattr(c, "values", None))
        s["mha_bytes"] = _mha_bytes(cfg, keys, s["cache_tokens"])
        out.append(s)
    return out


def _reference_layer(cfg: ModelConfig, n: int) -> int:
    """The layer whose cache speaks for the model's position and capacity: the first
    global one (a sliding layer's ring says nothing about the conversation's length)."""
    for i, spec in enumerate(cfg.layers[:n]):
        if spec.window is None:
            return i
    return 0


def cache_stats(caches: list[Any], cfg: ModelConfig) -> TurnStats:
    """The cache fields of TurnStats, summed over layers by DESIGN.md's definitions;
    never reads array values.

    Besides the GQA saving, `window_saving` says how much smaller the cache is than if
    the sliding layers held every token the global ones do (1.0 without sliding layers).
    """
    saving = kv_saving(cfg)
    if not caches:
        return TurnStats(
            cache_offset=0, cache_tokens=0, cache_capacity=0, cache_bytes=0, mha_bytes=0,
            gqa_saving=saving, evicted_tokens=0, keep=0, wrapped=False, sliding_layers=0,
            sliding_bytes=0, window_saving=1.0,
        )
    rows = layer_stats(caches, cfg)
    ref = rows[_reference_layer(cfg, len(rows))]
    sliding = [r for r in rows if r.get("window") is not None]
    cache_bytes = sum(r["cache_bytes"] for r in rows)
    # what the sliding layers would hold if they kept every token the global ones do
    no_window_bytes = sum(r["bytes_per_token"] * max(r["cache_tokens"], ref["cache_tokens"])
                          for r in rows)
    return TurnStats(
        cache_offset=ref["cache_offset"],
        cache_tokens=ref["cache_tokens"],
        cache_capacity=ref["cache_capacity"],
        cache_bytes=cache_bytes,
        mha_bytes=sum(r["mha_bytes"] for r in rows),
        gqa_saving=saving,
        evicted_tokens=ref["evicted_tokens"],
        keep=ref["keep"],
        wrapped=ref["wrapped"],
        sliding_layers=len(sliding),
        sliding_bytes=sum(r["cache_bytes"] for r in sliding),
        window_saving=no_window_bytes / cache_bytes if cache_bytes else 1.0,
    )


def can_trim_to(caches: list[Any], n_tokens_to_keep: int) -> bool:
    """Whether every layer can go back to its first `n_tokens_to_keep` tokens exactly
    (False once rotation evicted tokens the next query would need)."""
    for c in caches:
        if hasattr(c, "can_trim_to"):
            if not c.can_trim_to(n_tokens_to_keep):
                return False
        elif not (c.is_trimmable() and 0 <= n_tokens_to_keep <= c.offset):
            return False
    return True


def why_not_trimmable(caches: list[Any], cfg: ModelConfig, n_tokens_to_keep: int) -> str:
    """Why `can_trim_to` said no, for the `Started` reason: a sliding-window layer that
    moved past the shared prefix, or rotation of a bounded cache."""
    for c, spec in zip(caches, cfg.layers, strict=False):
        if spec.window is not None and not can_trim_to([c], n_tokens_to_keep):
            return (
                f"the sliding-window layers (window {spec.window}) no longer hold the"
                " keys the shared prefix needs"
            )
    return "the shared prefix was evicted by rotation"


def trim_to(caches: list[Any], n_tokens_to_keep: int) -> int:
    """Trim every layer back to `n_tokens_to_keep` tokens; returns tokens dropped.
    Check `can_trim_to` first when exactness matters."""
    dropped = 0
    for c in caches:
        dropped = c.trim(c.offset - n_tokens_to_keep)
    return dropped
