"""The compiled step for a batch's rows: one `mx.compile` trace runs B conversations' next
tokens (docs/design.md, "Continuous batching").

A batched step run op by op costs a Python dispatch for every operation of every row's
token mixer (model/decoder/rows.py runs them row by row), which on a small model costs
more than the arithmetic: 8 rows ran slower than 8 single compiled steps. So the batch
gets what one row gets (model/runtime/generate.py, `CompiledStep`): each row's caches
plan their writes (`StepPlan`), proxies stand in for them inside the trace, and the trace
replays. Every row's K/V caches read the same number of slots (a view for the longest
row's length, masked per row as alone), so a trace's key changes only when the batch
changes (its rows' cache layouts, their count) or the longest row crosses a view step,
not whenever any row does. Traces live with the model, beside the single-row ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from kvchat import metal_kernels
from kvchat.model.decoder.rows import Rows

from .generate import StepPlan, commit_step, layer_caches, proxy_outputs, step_proxies

Layout = tuple[tuple[Any, ...], ...]
# a row's trace inputs (layout, groups, views) and its layers' member counts
RowKey = tuple[Layout, tuple[int, ...], tuple[int, ...], tuple[int, ...]]


class RowsStep:
    """`step(rows, ids) -> logits (B, V)`: one compiled forward of `ids[i]` (int32 (B,))
    on row i's caches (`rows[i]`: its caches (a HybridCache's members apart), their
    `slot_layout()`s and each layer's member count: `CompiledStep`'s), each committed."""

    def __init__(self, model: Any):
        self.model = model
        self._fns: dict[tuple[Any, ...], Any] = model.__dict__.setdefault(
            "_kvchat_batch_traces", {})
        self.traced = False  # whether the last call built a new trace

    def _build(self, keys: tuple[RowKey, ...], counts: list[tuple[int, int]]) -> Any:
        """`counts`: each row's (groups, buffers), which its key determines."""
        model = self.model

        def step(ids: mx.array, rows: mx.array, *buffers: mx.array) -> list[mx.array]:
            group_rows = [rows[g] for g in range(rows.shape[0])]
            proxies: list[list[Any]] = []
            at_g = at_b = 0
            for (layout, groups, views, _), (ng, nb) in zip(keys, counts, strict=True):
                proxies.append(step_proxies(layout, groups, views,
                                            group_rows[at_g : at_g + ng],
                                            buffers[at_b : at_b + nb], 1))
                at_g, at_b = at_g + ng, at_b + nb
            per_row = [layer_caches(p, key[3]) for p, key in zip(proxies, keys, strict=True)]
            layers = [Rows(col) for col in zip(*per_row, strict=True)]
            out = [model(ids, cache=layers)[:, -1, :]]
            for p, (layout, _, _, _) in zip(proxies, keys, strict=True):
                out += proxy_outputs(p, layout)
            return out

        return mx.compile(step)

    def __call__(self, rows: Sequence[tuple[Sequence[Any], Layout, tuple[int, ...]]],
                 ids: mx.array) -> mx.array:
        plans = [StepPlan(caches, layout, 1) for caches, layout, _ in rows]
        assert all(p.ok for p in plans)  # one token always has a slot
        used = max((n for p in plans for n in p.lengths), default=0)
        for p in plans:
            p.views = p.view_for(used)
        keys = tuple((*p.key(), r[2]) for p, r in zip(plans, rows, strict=True))
        fkey = (keys, metal_kernels.backend())
        fn = self._fns.get(fkey)
        self.traced = fn is None
        if fn is None:
            fn = self._fns[fkey] = self._build(keys, [(len(p.rows), len(p.buffers))
                                                       for p in plans])
        group_rows = mx.array([r for p in plans for r in p.rows], dtype=mx.int32)
        out = fn(ids[:, None], group_rows,
                 *(b for p in plans for b in p.buffers))
        # the caches take the new buffers before anything evaluates, so MLX can donate
        # the old ones (generate.py, CompiledStep._run)
        for p in plans:
            p.buffers = []
        at = 1
        for p in plans:
            at = commit_step(p.caches, p.layout, out, 1, at)
        return out[0]
