"""KV caches following mlx-lm's (>= 0.32) duck-typed protocol (update_and_fetch, offset,
make_mask, trim, is_trimmable, nbytes, `state` (the arrays and the scalars, in mlx-lm's
order for the classes it has), `from_state(state)`, empty, size) plus a read-only
`stats()` built from metadata only, so mlx-lm's `generate_step` can drive our model with
our caches, mlx-lm's save_prompt_cache / load_prompt_cache round-trip them, and the UI can
poll statistics every token for free.

Rotation semantics (docs/design.md): with capacity M and K sink tokens ("keep"), the query at
absolute position t attends to [0, K) ∪ [t − (M − K) + 1, t]. Storage is one buffer per
layer for K and one for V, shape (B, n_kv_heads, capacity, head_dim), grown in steps up to
M and written in place: position p lives in slot p while p < M; after that, ring positions
p ≥ K live in slot K + (p − K) mod (M − K) (the same layout as mlx-lm's RotatingKVCache
at decode time, so both give bit-identical logits token by token).

Trimming is exact within the last write: a multi-token write that wraps the ring keeps
copies of the slots it overwrote (`_Undo`), so dropping its last tokens (speculative
decoding's rejected drafts, docs/design.md "Speculative decoding") puts back the keys
they displaced. A trim reaching further back than the last write loses the evicted
keys: the window is then shorter until the ring refills, never stale.

Quantized caches (`QuantizedKVCache`, `QuantizedRotatingKVCache`) are the same classes
storing each buffer as the (packed, scales, biases) triple of `mx.quantize`
(model/decoder/kv_quant.py): every slot operation below maps over a buffer's parts, so writing in
place, growing, rotating and trimming are one code path for both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from kvchat.model.decoder.config import LayerSpec, ModelConfig
from kvchat.model.decoder.families import FFN_KINDS
from kvchat.model.decoder.kv_format import KVQuant
from kvchat.model.decoder.kv_quant import Packed
from kvchat.model.decoder.mask import causal_mask
from kvchat.model.errors import KVChatError

from .hybrid import HybridCache
from .kv_math import cached_widths, kv_bytes, kv_saving
from .layer_kinds import layer_kind
from .misses import NO_CHECKPOINT, WINDOW_ROTATED, Miss
from .state import PassCache, StateCache
from .stats import CacheStats

# a K or V buffer: floats, or the parts of a quantized one
Buf = mx.array | tuple[mx.array, ...]


class CacheError(KVChatError):
    """A cache bound that cannot work (e.g. keep ≥ max size)."""


# ---- slot operations on a buffer (floats or quantized parts) ---------------------------
def parts(buf: Buf) -> tuple[mx.array, ...]:
    return buf if isinstance(buf, tuple) else (buf,)


def map_parts(fn: Callable[..., mx.array], buf: Buf, *others: Buf) -> Buf:
    out = tuple(fn(*ps) for ps in zip(parts(buf), *map(parts, others), strict=True))
    return out if isinstance(buf, tuple) else out[0]


def slots(buf: Buf) -> int:
    return parts(buf)[0].shape[2]


def first_slots(buf: Buf, n: int) -> Buf:
    """The first `n` slots (the buffer itself when that is all of it)."""
    return buf if n == slots(buf) else map_parts(lambda p: p[..., :n, :], buf)


def _write(buf: Buf, slot: int, new: Buf, start: int = 0, run: int | None = None) -> None:
    """Slots [slot, slot + run) of `buf` = slots [start, start + run) of `new`, in place."""
    run = slots(new) - start if run is None else run
    for p, n in zip(parts(buf), parts(new), strict=True):
        p[..., slot : slot + run, :] = n[..., start : start + run, :]


def grow_buffer(buf: Buf | None, like: Buf, need: int, step: int, cap: int | None) -> Buf:
    """Return `buf` with at least `need` slots: grown in whole steps (capped at `cap`),
    old slots copied once per step rather than once per token."""
    have = 0 if buf is None else slots(buf)
    if have >= need:
        return buf  # type: ignore[return-value]
    size = ((need + step - 1) // step) * step
    if cap is not None:
        size = min(size, cap)

    def fresh(p: mx.array) -> mx.array:
        B, H, _, D = p.shape
        return mx.zeros((B, H, size - have, D), p.dtype)

    if buf is None:
        return map_parts(fresh, like)
    return map_parts(lambda p: mx.concatenate([p[..., :have, :], fresh(p)], axis=2), buf)


def buffer_bytes(buf: Buf | None, tokens: int, heads_factor: float = 1) -> int:
    """Bytes of `tokens` slots of one K or V buffer, from its parts' shapes and dtypes
    (kv_math's formula with one layer, halved: K or V); `heads_factor` scales the heads."""
    if buf is None:
        return 0
    total = 0
    for p in parts(buf):
        B, H, _, D = p.shape
        total += kv_bytes(tokens, 1, int(B * H * heads_factor), D, p.dtype.size) // 2
    return total


class _Buffers:
    """What every cache shares: K and V buffers of shape (B, n_kv_heads, slots, ·)
    whose first `_written()` slots hold tokens, and the hooks a quantized cache overrides
    (`_encode`, `quant`)."""

    keys: Buf | None
    values: Buf | None
    offset: int
    step = 256
    quant: KVQuant | None = None  # set on the quantized classes
    head_dim: int | None = None  # the model's head_dim (quantized storage may pad it)
    # attributes mlx-lm's state has no place for; kvchat's cache files keep them beside it
    extras: tuple[str, ...] = ()

    def _written(self) -> int:
        raise NotImplementedError

    def _encode(self, x: mx.array) -> Buf:
        return x

    def empty(self) -> bool:
        return self.keys is None

    def is_trimmable(self) -> bool:
        return True

    def _resident(self) -> tuple[Buf | None, Buf | None]:
        if self.keys is None or self.values is None:
            return None, None
        n = self._written()
        return first_slots(self.keys, n), first_slots(self.values, n)

    def _reserve(self, need: int, keys: Buf, values: Buf, cap: int | None) -> None:
        self.keys = grow_buffer(self.keys, keys, need, self.step, cap)
        self.values = grow_buffer(self.values, values, need, self.step, cap)

    def _bytes(self, tokens: int, heads_factor: float = 1) -> int:
        return buffer_bytes(self.keys, tokens, heads_factor) + buffer_bytes(
            self.values, tokens, heads_factor)

    def _float_bytes(self, tokens: int) -> int:
        """What the same tokens take unquantized (head_dim at the compute dtype)."""
        if self.keys is None:
            return 0
        if self.quant is None:
            return self._bytes(tokens)
        p = parts(self.keys)
        B, H = p[0].shape[:2]
        return kv_bytes(tokens, 1, B * H, self.head_dim or 0, p[1].dtype.size)

    def _quant_stats(self, tokens: int) -> dict[str, Any]:
        packed = self.packed() if self.quant is not None and self.head_dim else None
        return {
            # a float cache's bits are its element's
            "kv_bits": packed.bits if packed else parts(self.keys)[0].dtype.size * 8
            if self.keys is not None else None,
            "kv_group_size": packed.group_size if packed else None,
            "float_bytes": self._float_bytes(tokens),
        }

    def packed(self) -> Packed:
        assert self.quant is not None and self.head_dim is not None
        return Packed.of(self.quant, self.head_dim)

    def grow_to(self, size: int) -> None:
        """At least `size` slots allocated (whole steps, capped like the cache's writes);
        the compiled step calls it before writing slot size − 1."""
        assert self.keys is not None and self.values is not None
        self._reserve(size, self.keys, self.values, getattr(self, "max_size", None))

    def _advance(self, offset: int) -> None:
        self.offset = offset

    def layout_packed(self) -> Packed | None:
        """A quantized cache's layout (bits, group, head_dims) for the compiled step's
        trace key and its in-trace writes; None for floats."""
        return self.packed() if self.quant is not None else None

    def commit(self, keys: Buf, values: Buf, n: int = 1) -> None:
        """Take the buffers the compiled step wrote `n` tokens into (at `next_slot(n)`)."""
        self.keys, self.values = keys, values
        self._advance(self.offset + n)

    def quantized(self, q: KVQuant) -> _Buffers:
        """This cache, its buffers quantized (mlx-lm's `to_quantized`): the class of the
        same kind in `QUANTIZED`, every slot encoded once, offsets and bounds kept."""
        cls = QUANTIZED[type(self)]
        obj = cls.__new__(cls)
        obj.__dict__.update(self.__dict__)
        obj.__dict__.pop("pending_quant", None)
        obj.__dict__.pop("_undo", None)  # float copies: a quantized write starts afresh
        obj.quant = q
        if self.keys is not None and self.values is not None:
            obj.head_dim = parts(self.keys)[0].shape[-1]
            obj.keys, obj.values = obj._encode(self.keys), obj._encode(self.values)
        return obj


    def to_quantized(self, group_size: int = 64, bits: int = 4) -> _Buffers:
        """mlx-lm's name for `quantized` (its maybe_quantize_kv_cache calls it on any cache
        that is not its own QuantizedKVCache, ours already quantized included)."""
        return self if self.quant is not None else self.quantized(KVQuant(bits, group_size))


class _Quantized(_Buffers):
    """Mixin for the quantized classes: K/V encoded on write (the head_dim comes from the
    first chunk), `bits` / `group_size` as mlx-lm's QuantizedKVCache names them."""

    def _encode(self, x: mx.array | Buf) -> Buf:
        if isinstance(x, tuple):
            return x
        if self.head_dim is None:
            self.head_dim = x.shape[-1]
        return self.packed().encode(x)

    @property
    def bits(self) -> int:
        assert self.quant is not None
        return self.quant.bits

    @property
    def group_size(self) -> int:
        assert self.quant is not None
        return self.packed().group_size if self.head_dim else self.quant.group_for(0)

    def _set_quant(self, group_size: int, bits: int, head_dim: int | None) -> None:
        self.quant = KVQuant(int(bits), int(group_size))
        dim = parts(self.keys)[0].shape[-1] * 32 // int(bits) if self.keys is not None else None
        self.head_dim = int(head_dim) if head_dim is not None else dim


class KVCache(_Buffers):
    """Growing (unbounded) cache: K/V (B, n_kv_heads, capacity, head_dim) allocated in
    `step`s and written in place; `offset` tokens are resident. `state` is mlx-lm's
    KVCache state: (keys, values, offset)."""

    def __init__(self) -> None:
        self.keys: Buf | None = None
        self.values: Buf | None = None
        self.offset = 0

    def _written(self) -> int:
        return self.offset

    def slot_for(self, offset: int) -> int:
        return offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Buf, Buf]:
        keys, values = self._encode(keys), self._encode(values)
        prev, n = self.offset, slots(keys)
        if self.keys is not None and prev < slots(self.keys) < prev + n:
            # drop stale slots past `prev` (after a trim) before growing
            self.keys, self.values = first_slots(self.keys, prev), first_slots(self.values, prev)
        self._reserve(prev + n, keys, values, None)
        _write(self.keys, prev, keys)
        _write(self.values, prev, values)
        self.offset += n
        return first_slots(self.keys, self.offset), first_slots(self.values, self.offset)

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

    # ---- one token at a time, for the compiled step (model/runtime/generate.py) ---------------
    def slot_layout(self) -> tuple[Any, ...]:
        """What a trace needs to know about this cache's slots: position p lives in p."""
        return ("full", self.layout_packed())

    def next_slot(self, n: int = 1) -> tuple[int, int, int, int] | None:
        """Make room for `n` more tokens in consecutive slots; (offset, first slot,
        resident length after the write, lowest valid position)."""
        self.grow_to(self.offset + n)
        return self.slot_after(n)

    def slot_after(self, n: int = 1) -> tuple[int, int, int, int] | None:
        """`next_slot(n)`'s answer without making room (the caller's buffers hold it:
        model/runtime/slab.py)."""
        o = self.offset
        return o, self.slot_for(o), o + n, 0

    @property
    def state(self) -> tuple[Any, ...]:
        k, v = self._resident()
        return k, v, self.offset

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        keys, values, *rest = v
        self.keys, self.values = _as_buf(keys), _as_buf(values)
        # mlx-lm < 0.32 files held the arrays only: every slot holds a token
        self.offset = int(rest[0]) if rest else (slots(self.keys) if self.keys is not None else 0)

    @classmethod
    def from_state(cls, state: Any) -> KVCache:
        obj = cls.__new__(cls)
        obj.state = state
        return obj

    @property
    def nbytes(self) -> int:
        """Bytes of the resident K and V (the allocated buffer may be up to a step larger)."""
        return self._bytes(self.offset)

    def stats(self) -> dict[str, Any]:
        allocated = 0 if self.keys is None else slots(self.keys)
        return {
            "kind": "full",
            "cache_offset": self.offset,
            "cache_tokens": self.offset,
            "cache_capacity": None,  # unbounded: cache_stats reports the model's context
            "allocated_tokens": allocated,
            "cache_bytes": self._bytes(self.offset),
            "allocated_bytes": self._bytes(allocated),
            "evicted_tokens": 0,
            "keep": 0,
            "wrapped": False,
            **self._quant_stats(self.offset),
        }


def _as_buf(x: Any) -> Buf | None:
    """A loaded K or V: an array, the parts of a quantized one (lists after a load), or
    None (an empty cache)."""
    if x is None or isinstance(x, mx.array):
        return x
    return tuple(x)


class QuantizedKVCache(_Quantized, KVCache):
    """A full cache in `bits` bits. `state` is mlx-lm's QuantizedKVCache state,
    ((k parts), (v parts), offset, group_size, bits), so its loader reads ours; the
    head_dim a padded buffer cannot tell is kept apart (`extras`)."""

    def __init__(self, quant: KVQuant) -> None:
        super().__init__()
        self.quant = quant

    @property
    def state(self) -> tuple[Any, ...]:
        k, v = self._resident()
        return k, v, self.offset, self.group_size, self.bits

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        keys, values, offset, group_size, bits, *head_dim = v
        KVCache.state.fset(self, (keys, values, offset))  # type: ignore[attr-defined]
        self._set_quant(group_size, bits, head_dim[0] if head_dim else None)

    extras = ("head_dim",)


class _Undo:
    """What one multi-token ring write displaced: for each run of slots it wrote, the
    first position written there and copies of the slots' previous K and V. Valid until
    the next write; `end` is the offset the write (or a trim since) left."""

    def __init__(self, start: int, lo: int, end: int) -> None:
        self.start, self.lo, self.end = start, lo, end  # lo: the lowest ring position before
        self.runs: list[tuple[int, int, int, Buf, Buf]] = []  # (position, slot, run, k, v)

    def save(self, p: int, slot: int, run: int, keys: Buf, values: Buf) -> None:
        # a gather copies: a slice would keep the whole old buffer alive
        idx = mx.arange(slot, slot + run)
        take = lambda x: mx.take(x, idx, axis=2)  # noqa: E731
        self.runs.append((p, slot, run, map_parts(take, keys), map_parts(take, values)))

    def restore(self, keys: Buf, values: Buf, new: int) -> None:
        """Put back what the positions [new, end) overwrote."""
        for p, slot, run, k, v in self.runs:
            a, b = max(p, new), min(p + run, self.end)
            if a < b:
                _write(keys, slot + a - p, k, a - p, b - a)
                _write(values, slot + a - p, v, a - p, b - a)
        self.end = new


class RotatingKVCache(_Buffers):
    """Bounded cache: `keep` sink tokens plus a ring of the `max_size − keep` most recent.

    Writes are in place. A single token (decode) or a chunk that fits before the buffer
    end is written first and the buffer returned. A multi-token chunk that would
    overwrite keys that earlier queries of the same chunk still need is answered with
    [resident keys in slot order] + [the chunk's keys] and an explicit mask; then only the
    chunk's surviving tokens are written. Masks are exact for every query (see
    `make_mask`); the common cases return None / "causal" as mlx-lm does.
    """

    extras: tuple[str, ...] = ("_lo",)  # kvchat's files keep it beside mlx-lm's state

    def __init__(self, max_size: int, keep: int = 0) -> None:
        if max_size < 1:
            raise CacheError(f"KV cache size must be >= 1, got {max_size}")
        if keep < 0 or keep >= max_size:
            raise CacheError(f"keep must be in [0, max size {max_size}), got {keep}")
        self.max_size = max_size
        self.keep = keep
        self.keys: Buf | None = None
        self.values: Buf | None = None
        self.offset = 0
        # lowest ring position still valid, as lowered by a trim past evicted tokens;
        # the effective bound is max(_lo, offset − ring, keep) (see _ring_lo)
        self._lo = keep
        self._undo: _Undo | None = None  # what the last write displaced (exact trims)

    # ---- layout ---------------------------------------------------------------------
    @property
    def _ring(self) -> int:
        return self.max_size - self.keep

    def _ring_lo(self, offset: int) -> int:
        """Lowest resident ring position once `offset` tokens have been written."""
        return max(self._lo, offset - self._ring, self.keep)

    def slot_for(self, p: int) -> int:
        """The slot position p is written to."""
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
        return self.slot_for(self.offset)

    # ---- writes ---------------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Buf, Buf]:
        keys, values = self._encode(keys), self._encode(values)
        o, n = self.offset, slots(keys)
        K, R, M = self.keep, self._ring, self.max_size
        if self._inplace(n):
            self._reserve(min(o + n, M), keys, values, M)
            s = self.slot_for(o)
            _write(self.keys, s, keys)
            _write(self.values, s, values)
            self._advance(o + n)
            length = min(o + n, M)
            return first_slots(self.keys, length), first_slots(self.values, length)

        # Chunk crossing the buffer end: queries of this chunk still need keys its own
        # later tokens would overwrite, so attend over old + new and write afterwards.
        have = min(o, M)
        if have:
            cat = lambda old, new: mx.concatenate([old[..., :have, :], new], axis=2)  # noqa: E731
            out_k, out_v = map_parts(cat, self.keys, keys), map_parts(cat, self.values, values)
        else:
            out_k, out_v = keys, values
        self._reserve(M, keys, values, M)
        # a chunk no longer than the ring can be taken back exactly (see trim)
        undo = _Undo(o, self._ring_lo(o), o + n) if n <= R else None
        if o < K:  # sink positions land in their own slots
            e = min(K, o + n)
            if undo is not None:
                undo.save(o, o, e - o, self.keys, self.values)
            _write(self.keys, o, keys, 0, e - o)
            _write(self.values, o, values, 0, e - o)
        p = max(K, o, o + n - R)  # first chunk position that survives in the ring
        while p < o + n:  # at most two contiguous runs (before and after the ring end)
            s = self.slot_for(p)
            run = min(o + n - p, M - s)
            if undo is not None:
                undo.save(p, s, run, self.keys, self.values)
            _write(self.keys, s, keys, p - o, run)
            _write(self.values, s, values, p - o, run)
            p += run
        self._advance(o + n)
        self._undo = undo
        return out_k, out_v

    def _advance(self, offset: int) -> None:
        self._lo = self._ring_lo(offset)
        self.offset = offset
        self._undo = None  # a new write: the previous one can no longer be taken back

    # ---- one token at a time, for the compiled step (model/runtime/generate.py) ---------------
    def slot_layout(self) -> tuple[Any, ...]:
        """What a trace needs to know about this cache's slots: `keep` sinks, then a ring."""
        return ("ring", self.layout_packed(), self.max_size, self.keep)

    def next_slot(self, n: int = 1) -> tuple[int, int, int, int] | None:
        """Make room for `n` more tokens; (offset, first slot, resident length after the
        write, lowest valid ring position after it). None when n > 1 tokens would not
        fit before the buffer end: written in place they would displace keys that the
        earlier of them still see (update_and_fetch's chunk path handles that)."""
        slot = self.slot_after(n)
        if slot is not None:
            self.grow_to(slot[2])
        return slot

    def slot_after(self, n: int = 1) -> tuple[int, int, int, int] | None:
        """`next_slot(n)`'s answer without making room (the caller's buffers hold it:
        model/runtime/slab.py)."""
        o = self.offset
        if n > 1 and o + n > self.max_size:
            return None
        return o, self.slot_for(o), min(o + n, self.max_size), self._ring_lo(o + n)

    # ---- protocol -------------------------------------------------------------------
    def size(self) -> int:
        """Resident tokens."""
        o = self.offset
        return min(o, self.keep) + max(0, o - self._ring_lo(o))

    def _written(self) -> int:
        assert self.keys is not None
        return min(self.offset, self.max_size, slots(self.keys))

    def _last_write(self) -> _Undo | None:
        u = getattr(self, "_undo", None)  # absent on a cache made by from_state
        return u if u is not None and u.end == self.offset else None

    def can_trim_to(self, n: int) -> bool:
        """True when, after trimming to `n` tokens, the query at position n would find
        every key its window needs (False once rotation evicted some of them; always
        True within the last write, whose displaced keys come back)."""
        if not 0 <= n <= self.offset:
            return False
        u = self._last_write()
        if u is not None and n >= u.start:
            return True
        # from the state before the last write, when that can be taken back
        ring_lo = u.lo if u is not None else self._ring_lo(self.offset)
        lo = min(ring_lo, max(self.keep, n))
        return lo <= max(self.keep, n - self._ring + 1)

    def trim(self, n: int) -> int:
        """Drop the last `n` tokens. Within the last write the keys it displaced come
        back (exact); past evicted tokens (see can_trim_to) the next queries see a
        shorter window until the ring refills; never stale keys."""
        n = max(0, min(self.offset, n))
        new = self.offset - n
        u = self._last_write()
        if u is not None and self.keys is not None and self.values is not None:
            u.restore(self.keys, self.values, max(new, u.start))
            self._lo, self.offset = u.lo, u.end
            if new >= u.start:
                return n
            self._undo = None
        self._lo = min(self._ring_lo(self.offset), max(self.keep, new))
        self.offset = new
        return n

    @property
    def state(self) -> tuple[Any, ...]:
        """mlx-lm's RotatingKVCache state: keys, values, offset, keep, max_size and the
        next write slot (its `_idx`, so its class continues from our buffers)."""
        k, v = self._resident()
        o = self.offset
        return k, v, o, self.keep, self.max_size, self.slot_for(o) if o else 0

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        keys, values, offset, keep, max_size, _idx = v[:6]
        self.keys, self.values = _as_buf(keys), _as_buf(values)
        self.offset, self.keep, self.max_size = int(offset), int(keep), int(max_size)
        self._lo = self.keep
        self._lo = self._ring_lo(self.offset)  # untrimmed; `extras` restores a trimmed one
        self._undo = None

    @classmethod
    def from_state(cls, state: Any) -> RotatingKVCache:
        obj = cls.__new__(cls)
        obj.state = state
        return obj

    @property
    def nbytes(self) -> int:
        """Bytes of the resident K and V (not the allocated buffer)."""
        return self._bytes(self.size())

    def stats(self) -> dict[str, Any]:
        tokens = self.size()
        allocated = 0 if self.keys is None else slots(self.keys)
        return {
            "kind": "rotating",
            "cache_offset": self.offset,
            "cache_tokens": tokens,
            "cache_capacity": self.max_size,
            "allocated_tokens": allocated,
            "cache_bytes": self._bytes(tokens),
            "allocated_bytes": self._bytes(allocated),
            "evicted_tokens": self.offset - tokens,
            "keep": self.keep,
            "wrapped": self.offset > tokens,
            **self._quant_stats(tokens),
        }


class QuantizedRotatingKVCache(_Quantized, RotatingKVCache):
    """A rotating (or sliding-ring) cache in `bits` bits: mlx-lm has no such class (its
    RotatingKVCache raises "Quantization NYI"), so `state` is kvchat's own: the rotating
    state, then group_size, bits, head_dim and the lowest valid ring position."""

    extras = ()

    def __init__(self, max_size: int, keep: int, quant: KVQuant) -> None:
        super().__init__(max_size, keep)
        self.quant = quant

    @property
    def state(self) -> tuple[Any, ...]:
        return (*RotatingKVCache.state.fget(self), self.group_size, self.bits,  # type: ignore[attr-defined]
                self.head_dim or 0, self._lo)

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        RotatingKVCache.state.fset(self, v[:6])  # type: ignore[attr-defined]
        group_size, bits, head_dim, lo = v[6:10]
        self._set_quant(group_size, bits, int(head_dim) or None)
        self._lo = int(lo)


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
        return ("ring", self.layout_packed(), self.max_size, self.keep, self.chunk)

    @property
    def state(self) -> tuple[Any, ...]:
        return RotatingKVCache.state.fget(self)  # type: ignore[attr-defined]

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        RotatingKVCache.state.fset(self, v)  # type: ignore[attr-defined]
        self.chunk = self.max_size  # the ring is exactly one chunk




# the quantized class of each float one (`_Buffers.quantized`)
QUANTIZED: dict[type, type] = {
    KVCache: QuantizedKVCache, RotatingKVCache: QuantizedRotatingKVCache,
}



def make_cache(cfg: ModelConfig, max_kv_size: int | None = None, keep: int = 4,
               kv: KVQuant | None = None) -> list[Any]:
    """One cache per layer, of the kind the layer needs (`cfg.layers`).

    - a global layer: the model's full context (max_position_embeddings) grown in steps,
      then rotation keeping `keep` sinks; with max_kv_size=N, RotatingKVCache(N, keep);
    - a sliding layer: a ring of exactly its window with keep 0 (key j visible iff
      t − j < window, the model's own mask), unless max_kv_size asks for less, in which
      case the mask is the intersection of both;
    - a recurrent layer (Mamba, gated delta, short conv): a StateCache, the same size at
      every token (max_kv_size and kv do not apply to it);
    - a layer that attends and keeps a state (Falcon-H1): a HybridCache of both.

    With `kv`, K/V are stored in kv.bits bits: from the first token when kv.start is 0,
    else the float caches carry `pending_quant` and `maybe_quantize` converts them once
    they hold kv.start tokens.
    """
    if max_kv_size is not None and max_kv_size < 1:
        raise CacheError(f"--max-kv-size must be >= 1, got {max_kv_size}")
    if kv is not None and cfg.mla is not None:  # its absorbed attention reads float latents
        raise CacheError("--kv-bits is not supported for latent attention (MLA) models")
    caches: list[Any] = []
    for spec in cfg.layers:
        if spec.kind in FFN_KINDS:  # no token mixer (Nemotron-H's MLP layers): nothing kept
            caches.append(PassCache())
            continue
        if not spec.attends:  # a recurrent layer: a fixed-size state (state.py), never K/V
            caches.append(StateCache())
            continue
        caches.append(_kv_cache(cfg, spec, max_kv_size, keep, kv))
        if spec.mixer is not None:  # attention and a recurrent mixer side by side
            caches[-1] = HybridCache(caches[-1], StateCache())
    plan_quantization(caches, kv)
    return caches


def _kv_cache(cfg: ModelConfig, spec: LayerSpec, max_kv_size: int | None, keep: int,
              kv: KVQuant | None) -> Any:
    """The K/V cache of one attention layer (make_cache's rules)."""
    if spec.chunk is not None:  # never more than one chunk resident
        return ChunkedKVCache(spec.chunk)
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
    if kv is not None and kv.start == 0:
        return QuantizedRotatingKVCache(size, k, kv)
    return RotatingKVCache(size, k)


def make_prompt_cache(model: Any, max_kv_size: int | None = None, keep: int = 4,
                      kv: KVQuant | None = None) -> list[Any]:
    """The caches for `model` (mlx-lm's name): its own `make_cache` where it has one (a
    model split across hosts), else `make_cache` of its config. The decoder builds no
    caches itself."""
    own = getattr(model, "make_cache", None)
    if own is not None:
        return own(max_kv_size=max_kv_size, keep=keep, **({} if kv is None else {"kv": kv}))
    return make_cache(model.config, max_kv_size=max_kv_size, keep=keep, kv=kv)


def plan_quantization(caches: list[Any], kv: KVQuant | None) -> None:
    """Mark the float caches to be quantized once they hold kv.start tokens (a cache read
    back from a file has no such mark: the engine marks it again)."""
    if kv is None:
        return
    for c in caches:
        if type(c) in QUANTIZED or (isinstance(c, HybridCache) and type(c.kv) in QUANTIZED):
            c.pending_quant = kv


def maybe_quantize(caches: list[Any]) -> bool:
    """Replace, in the list, every float cache whose `pending_quant` start has been
    reached by its quantized twin (mlx-lm's maybe_quantize_kv_cache); True if any was."""
    changed = False
    for i, c in enumerate(caches):
        q = getattr(c, "pending_quant", None)
        if q is not None and not c.empty() and c.offset >= q.start:
            caches[i] = c.quantized(q)
            changed = True
    return changed


def pending_quantization(caches: list[Any]) -> int | None:
    """The lowest offset at which `maybe_quantize` will convert a layer (None: never)."""
    starts = [c.pending_quant.start for c in caches if getattr(c, "pending_quant", None)]
    return min(starts) if starts else None


# ---- statistics (metadata only) ---------------------------------------------------------
def _attention_name(cfg: ModelConfig, spec: LayerSpec) -> str:
    if spec.mixer is not None and not spec.attends:  # a recurrent layer: its mixer ("mamba2",
        return spec.mixer  # "gated_delta", …)
    if spec.kind in FFN_KINDS:  # no token mixer: "mlp" or "moe"
        return spec.kind
    kind = ("sliding" if spec.window is not None else "chunked" if spec.chunk is not None
            else "latent" if cfg.mla else "global")
    return kind + (
        "" if spec.rope is not None else " NoPE"
    ) + ("" if spec.mixer is None else f" + {spec.mixer}")  # Falcon-H1: both side by side


def _layer_bytes(c: Any, tokens: int, heads_factor: float = 1) -> int:
    """K + V bytes of `tokens` positions of one layer, from its buffers' parts' shapes and
    dtypes; `heads_factor` scales the KV heads (MHA bytes)."""
    c = c.kv if isinstance(c, HybridCache) else c
    keys = getattr(c, "keys", None)
    return buffer_bytes(keys, tokens, heads_factor) + buffer_bytes(
        getattr(c, "values", keys), tokens, heads_factor)


def _mha_bytes(cfg: ModelConfig, c: Any, tokens: int) -> int:
    """What `tokens` positions of one layer would take with one K/V head per query head
    (in the same storage: a quantized cache's packed rows, scales and biases)."""
    c = c.kv if isinstance(c, HybridCache) else c
    keys = getattr(c, "keys", None)
    if keys is None:
        return 0
    if getattr(c, "quant", None) is not None:
        return _layer_bytes(c, tokens, cfg.num_attention_heads / parts(keys)[0].shape[1])
    w = cached_widths(cfg, cfg.num_attention_heads)
    return keys.shape[0] * tokens * w.bytes_per_token(1, keys.dtype.size)


def layer_stats(caches: list[Any], cfg: ModelConfig) -> list[dict[str, Any]]:
    """Per-layer view for the UI: the cache's own stats() plus the layer index, its
    attention kind (sliding / global, NoPE), the name of its kind (layer_kinds.py) and
    window, its bytes per token, the MHA-equivalent bytes (same storage, every head) and,
    quantized or not, the bits, group size and float bytes. `cache_stats` sums these rows."""
    out = []
    for i, c in enumerate(caches):
        s = dict(c.stats())
        if s["cache_capacity"] is None:
            s["cache_capacity"] = cfg.max_position_embeddings
        s["layer"] = i
        if i < len(cfg.layers):
            s["attention"] = _attention_name(cfg, cfg.layers[i])
            s["layer_kind"] = layer_kind(cfg, i, c)  # the name the UI shows
            s["window"] = cfg.layers[i].window
        s["bytes_per_token"] = _layer_bytes(c, 1)
        s["mha_bytes"] = _mha_bytes(cfg, c, s["cache_tokens"])
        s.setdefault("kv_bits", None)
        s.setdefault("kv_group_size", None)
        s.setdefault("float_bytes", s["cache_bytes"])
        s.setdefault("state_bytes", 0)
        out.append(s)
    return out


def _reference_layer(cfg: ModelConfig, n: int) -> int:
    """The layer whose cache speaks for the model's position and capacity: the first
    global attention layer (a sliding layer's ring says nothing about the conversation's
    length, a recurrent layer's state holds no tokens), else the first layer."""
    for i, spec in enumerate(cfg.layers[:n]):
        if spec.window is None and spec.attends:
            return i
    return 0


def cache_stats(caches: list[Any], cfg: ModelConfig) -> CacheStats:
    """The cache's figures, summed over `layer_stats` by docs/design.md's
    definitions; never reads array values.

    Besides the GQA saving, `window_saving` says how much smaller the cache is than if
    the sliding layers held every token the global ones do (1.0 without sliding layers),
    and `kv_saving` how much smaller it is than unquantized (1.0 for a float cache).
    """
    saving = kv_saving(cfg)
    if not caches:
        return CacheStats(
            cache_offset=0, cache_tokens=0, cache_capacity=0, cache_bytes=0, mha_bytes=0,
            gqa_saving=saving, evicted_tokens=0, keep=0, wrapped=False, sliding_layers=0,
            sliding_bytes=0, window_saving=1.0, float_bytes=0, kv_saving=1.0, state_bytes=0,
            state_layers=0,
        )
    rows = layer_stats(caches, cfg)
    ref = rows[_reference_layer(cfg, len(rows))]
    sliding = [r for r in rows if r.get("window") is not None]
    cache_bytes = sum(r["cache_bytes"] for r in rows)
    float_bytes = sum(r["float_bytes"] for r in rows)
    # what the sliding layers would hold if they kept every token the global ones do
    no_window_bytes = sum(r["bytes_per_token"] * max(r["cache_tokens"], ref["cache_tokens"])
                          for r in rows)
    return CacheStats(
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
        kv_bits=ref["kv_bits"],
        kv_group_size=ref["kv_group_size"],
        float_bytes=float_bytes,
        kv_saving=float_bytes / cache_bytes if cache_bytes else 1.0,
        state_bytes=sum(r["state_bytes"] for r in rows),
        state_layers=sum(r["kind"] in ("state", "hybrid") for r in rows),
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


def untrimmable_miss(caches: list[Any], n_tokens_to_keep: int) -> Miss:
    """Why caches that cannot go back to `n_tokens_to_keep` give no more of a prompt
    (model/cache/misses.py): a recurrent layer's state, else the window moved past it."""
    if any(isinstance(c, (StateCache, HybridCache)) and not c.can_trim_to(n_tokens_to_keep)
           for c in caches):
        return Miss(NO_CHECKPOINT, n_tokens_to_keep)
    return Miss(WINDOW_ROTATED)


def why_not_trimmable(caches: list[Any], cfg: ModelConfig, n_tokens_to_keep: int) -> str:
    """Why `can_trim_to` said no, for the `Started` reason: a recurrent layer (its state
    cannot go back), a sliding-window layer that moved past the shared prefix, or rotation
    of a bounded cache."""
    if any(isinstance(c, (StateCache, HybridCache)) and not c.can_trim_to(n_tokens_to_keep)
           for c in caches):
        return "the recurrent layers' state cannot go back to the shared prefix"
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
