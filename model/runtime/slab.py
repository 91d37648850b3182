"""Shared K/V buffers for a batch whose rows' caches are alike (docs/design.md,
"Continuous batching").

The batched step over rows' own caches (rows_step.py) writes, views and masks each row's
K/V apart: on a small model those per-row operations cost more than the arithmetic.
Where every row's caches have one layout (float K/V, full or ring, the same bounds) and
every attention layer rotates rows at their own positions, the batch holds each layer's
K and V for all rows in one (B, kv_heads, slots, head_dim) buffer, as mlx-lm's
BatchKVCache does, and the step is the model run on batch-wide caches: one scatter
writes every row's new K (each at its own slot), one slice reads them, and one mask per
layout says which slots each row sees (its own offset, length and ring bound, exactly
as alone). Row i's positions, slots and masks are those of its own cache, so its ids
are the ones it gets alone.

While a row is in the slab its caches keep their offsets and bounds (advanced every
step) but not their K/V: each holds a broadcast stand-in of the same shape (no memory),
so statistics stay true. The slab gives every row its K/V back (`dissolve`) before
anything else runs on its caches: when the rows change (one joins or leaves), a row
steps alone, or the turn ends. Joining and leaving copy the rows' K/V once each.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from kvchat import metal_kernels
from kvchat.model.cache.kv import slots
from kvchat.model.decoder.layers import Attention

from .generate import CompiledStep, _slot_mask, view_slots

GROW = 256  # slots a full-kind slab grows by (the caches' own step)


def fits(model: Any, steps: Sequence[Any]) -> bool:
    """Whether rows with these compiled steps can share a slab: two or more, one layout
    of float full or ring K/V caches, one cache per attention layer, positions from RoPE
    alone (learned or sinusoidal ones are added per row: rows.py), and every attention
    layer rotating a batch at per-row positions with a mask of one row per row (Gemma 2's
    soft-capped scores broadcast a mask by head group)."""
    if len(steps) < 2 or not all(isinstance(s, CompiledStep) for s in steps):
        return False
    layout, counts = steps[0].layout, steps[0].counts
    if not all(s.layout == layout and s.counts == counts for s in steps):
        return False
    if any(k != 1 for k in counts) or not all(
            st[:2] == ("full", None) and len(st) == 2
            or st[:2] == ("ring", None) and len(st) == 4 for st in layout):
        return False
    return _attention_layers(model) == len(layout)


def _attention_layers(model: Any) -> int | None:
    """How many attention layers the model has, if every one of them can run on a slab
    (None if not); asked once per model."""
    if "_kvchat_slab_layers" not in model.__dict__:
        attention = [m for m in model.modules() if isinstance(m, Attention)]
        ok = getattr(getattr(model, "config", None), "positions", None) == "rope" and all(
            type(m).__call__ is Attention.__call__ and m._rotates_batched()
            and m.softcap is None for m in attention)
        model.__dict__["_kvchat_slab_layers"] = len(attention) if ok else None
    return model.__dict__["_kvchat_slab_layers"]


def pays(caches: Sequence[Sequence[Any]]) -> bool:
    """Whether rows' K/V (`caches[row][layer]`) may share buffers: every row gets as many
    slots as the longest, so a short row beside a long one holds slots it never uses.
    Shared while those unused slots cost at most what the rows use (plus one GROW step
    per row): a long conversation among short ones keeps buffers of its own. Asked when
    the rows come together: every step lengthens every row by one, so the unused share
    only shrinks while they stay."""
    for col in zip(*caches, strict=True):
        lengths = [_length(c) for c in col]
        if len(col) * max(lengths) > 2 * sum(lengths) + len(col) * GROW:
            return False
    return True


def _length(cache: Any) -> int:
    """Slots a cache uses after its next token (its slab row's need)."""
    slot = cache.slot_after(1)
    return slot[2] if slot is not None else slots(cache.keys)


class _SlabCache:
    """Inside the trace: one layer's caches of every row. `info` (B, 4): each row's
    (offset, slot, length after the write, lowest valid ring position)."""

    def __init__(self, static: tuple[Any, ...], info: mx.array, keys: mx.array,
                 values: mx.array, view: int, masks: dict[Any, mx.array]):
        self.static, self.info, self.view, self._masks = static, info, view, masks
        self.keys, self.values = keys, values
        self.offset = info[:, 0]  # RoPE rotates each row at its own position

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        rows, slot = mx.arange(keys.shape[0]), self.info[:, 1]
        self.keys[rows, :, slot] = keys[:, :, 0]
        self.values[rows, :, slot] = values[:, :, 0]
        return self.keys[:, :, : self.view], self.values[:, :, : self.view]

    def make_mask(self, n: int, return_array: bool = False,
                  window_size: int | None = None) -> mx.array:
        assert n == 1, "a slab steps one token per row"
        key = (self.static, id(self.info), self.view, window_size)
        if key not in self._masks:  # layers of one layout share it
            valid = _slot_mask(self.static, self.info.T[:, :, None], self.view, window_size)
            self._masks[key] = valid[0][:, None, None, :]  # (B, 1, 1, view)
        return self._masks[key]


class Slab:
    """The K/V of `rows` (their compiled steps' caches, in row order) in shared buffers;
    `step(ids) -> logits (B, V)`, then `dissolve()` hands every row its K/V back."""

    def __init__(self, model: Any, rows: Sequence[Any], steps: Sequence[CompiledStep]):
        self.model, self.rows = model, list(rows)
        self.caches = [s.caches for s in steps]  # [row][cache]
        self.layout = steps[0].layout
        self._fns: dict[tuple[Any, ...], Any] = model.__dict__.setdefault(
            "_kvchat_slab_traces", {})
        self.traced = False
        self.keys: list[mx.array] = []
        self.values: list[mx.array] = []
        for j in range(len(self.layout)):
            col = [row[j] for row in self.caches]
            size = max(slots(c.keys) for c in col)
            self.keys.append(mx.concatenate([_padded(c.keys, size) for c in col]))
            self.values.append(mx.concatenate([_padded(c.values, size) for c in col]))
            for c in col:
                _stand_in(c, size)

    def serves(self, rows: Sequence[Any]) -> bool:
        """Whether these are the slab's rows, in its order."""
        return len(rows) == len(self.rows) and all(
            a is b for a, b in zip(rows, self.rows, strict=True))

    def step(self, ids: mx.array) -> mx.array:
        """Logits (B, V) of `ids` (B,), row i's at its own cache's next slot."""
        infos: list[list[tuple[int, ...]]] = []
        index: dict[tuple[Any, ...], int] = {}
        groups, views = [], []
        # a row's caches of one layout and offset have the same slots: ask one of them
        asked: list[dict[tuple[Any, ...], tuple[int, ...]]] = [{} for _ in self.caches]
        for j, static in enumerate(self.layout):
            info = []
            for row, seen in zip(self.caches, asked, strict=True):
                k = (static, row[j].offset)
                if k not in seen:
                    seen[k] = row[j].slot_after(1)
                info.append(seen[k])
            length = max(i[2] for i in info)
            if length > slots(self.keys[j]):
                self._grow(j, length)
            views.append(view_slots(length, slots(self.keys[j])))
            g = index.setdefault((static, *info), len(infos))
            if g == len(infos):
                infos.append(info)
            groups.append(g)
        key = (self.layout, tuple(groups), tuple(views), len(self.rows),
               tuple(slots(k) for k in self.keys), metal_kernels.backend())
        fn = self._fns.get(key)
        self.traced = fn is None
        if fn is None:
            fn = self._fns[key] = self._build(tuple(groups), tuple(views), len(infos))
        buffers = [b for kv in zip(self.keys, self.values, strict=True) for b in kv]
        keys, values = self.keys, self.values
        self.keys = self.values = []  # the trace's inputs only: MLX writes them in place
        try:
            out = fn(ids[:, None], *(mx.array(i, dtype=mx.int32) for i in infos), *buffers)
        except BaseException:
            self.keys, self.values = keys, values  # nothing written: dissolve gives them back
            raise
        del buffers, keys, values
        self.keys, self.values = out[1::2], out[2::2]
        for row in self.caches:
            for c in row:
                c.commit(c.keys, c.values, 1)  # its stand-ins, its offset one on
        return out[0]

    def _build(self, groups: tuple[int, ...], views: tuple[int, ...], n_info: int) -> Any:
        model, layout = self.model, self.layout

        def step(ids: mx.array, *args: mx.array) -> list[mx.array]:
            infos, buffers = args[:n_info], args[n_info:]
            masks: dict[Any, mx.array] = {}
            caches = [_SlabCache(st, infos[groups[j]], buffers[2 * j], buffers[2 * j + 1],
                                 views[j], masks) for j, st in enumerate(layout)]
            out = [model(ids, cache=caches)[:, -1, :]]
            for c in caches:
                out += [c.keys, c.values]
            return out

        return mx.compile(step)

    def _grow(self, j: int, length: int) -> None:
        """Room for `length` slots in layer j's buffers (whole GROW steps; a ring to its
        size at most)."""
        static = self.layout[j]
        size = -(-length // GROW) * GROW
        if static[0] == "ring":
            size = min(size, static[2])
        self.keys[j] = _padded(self.keys[j], size)
        self.values[j] = _padded(self.values[j], size)
        for row in self.caches:
            _stand_in(row[j], size)

    def dissolve(self, keep: Sequence[Any] = ()) -> None:
        """Every row's caches take their K/V back: a copy of its slots for the rows going
        on alone or into the pool, a slice (no copy) for the rows in `keep`, which join
        the next slab at once. A slice holds the whole shared buffer: kept, it would hold
        every row's memory in one row's name."""
        for i, (r, row) in enumerate(zip(self.rows, self.caches, strict=True)):
            for c, k, v in zip(row, self.keys, self.values, strict=True):
                c.keys, c.values = k[i : i + 1], v[i : i + 1]
            if not any(r is k for k in keep):
                own(row)
        self.keys = self.values = []
        self.rows, self.caches = [], []


def own(caches: Sequence[Any]) -> None:
    """Each cache's K/V copied out of whatever buffer they are a slice of."""
    for c in caches:
        c.keys, c.values = mx.contiguous(c.keys), mx.contiguous(c.values)


def _padded(buf: mx.array, size: int) -> mx.array:
    """`buf` (B, H, S, D) with zero slots appended up to `size`."""
    B, H, S, D = buf.shape
    if S >= size:
        return buf
    return mx.concatenate([buf, mx.zeros((B, H, size - S, D), dtype=buf.dtype)], axis=2)


def _stand_in(cache: Any, size: int) -> None:
    """A cache in the slab: K/V of its shape and dtype, broadcast from one element."""
    for name in ("keys", "values"):
        buf = getattr(cache, name)
        _, H, _, D = buf.shape
        setattr(cache, name, mx.broadcast_to(mx.zeros((1, 1, 1, 1), dtype=buf.dtype),
                                             (1, H, size, D)))
