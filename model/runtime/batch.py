"""Continuous batching: the turns a server runs side by side decode in one forward per
step (docs/serve.md, "Many clients"; docs/design.md, "Continuous batching").

Each turn stays what it is alone (model/runtime/turn.py): its own cache, sampler, seed,
stops, grammar and statistics. Only its decode step is shared: `row_decode` stands in
for `generate.decode`, and where `decode` would run the model for the id it just
sampled, it parks the id here and yields `WAIT`. The engine, which drives every turn's
generator on its thread, runs `Batch.step` once every running turn is parked (or
prefilling a chunk), and each parked turn resumes with its row of the logits.

Rows share a step whatever their cache (a float, rotating or quantized K/V cache, a
recurrent state) and length: the decoder runs each row's token mixer on that row's cache
(model/decoder/rows.py), so a row's ids are the ones it gets alone. A lone row runs the
compiled step (model/runtime/generate.py), as a turn alone does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import mlx.core as mx

from kvchat.model.cache.kv import maybe_quantize, pending_quantization
from kvchat.model.decoder.rows import Rows

from . import threads
from .generate import CompiledStep, Constrain, Progress, decode_step
from .rows_step import RowsStep


class Waiting:
    """Yielded by a turn parked for the next batched step (never an engine event)."""

    def __repr__(self) -> str:
        return "WAIT"


WAIT = Waiting()


class BatchRow:
    """One turn's place in the batch: its caches, the id to run, then its logits and,
    where the row has a `sample` (no grammar to apply on the host first), its next id
    drawn by that sampler in the step's own evaluation."""

    def __init__(self, caches: list[Any], compiled: bool,
                 sample: Callable[[mx.array], mx.array] | None = None):
        self.caches = caches
        self.compiled = compiled
        self.sample = sample
        self.token = 0
        self.logits: mx.array | None = None
        self.sampled: mx.array | None = None
        self.error: BaseException | None = None
        self._step: Callable[[mx.array], mx.array] | None = None
        self.pending = pending_quantization(caches)

    def upkeep(self, model: Any) -> None:
        """--quantized-kv-start reached: the caches change class (and need a new step)."""
        if self.pending is not None and maybe_quantize(self.caches):
            self.pending = pending_quantization(self.caches)
            self._step = None

    def step_for(self, model: Any) -> Callable[[mx.array], mx.array]:
        """This row's own step: the compiled one where its caches allow (and `compiled`)."""
        if self._step is None:
            self._step = decode_step(model, self.caches, self.compiled)
        return self._step

    def alone(self, model: Any, y: mx.array) -> mx.array:
        """The logits (1, V) of `y` run for this row only: the compiled step."""
        return self.step_for(model)(y)


class Batch:
    """The rows parked for the next step (the engine's thread only)."""

    def __init__(self, model: Any):
        self.model = model
        self.parked: list[BatchRow] = []
        self.steps = 0
        self._work = threads.step_work(model)
        self._compiled = RowsStep(model)
        self.widths: list[int] = []  # rows per step, for the statistics

    def park(self, row: BatchRow, token: int) -> None:
        row.token, row.logits, row.sampled, row.error = token, None, None, None
        self.parked.append(row)

    def unpark(self, row: BatchRow) -> None:
        if row in self.parked:
            self.parked.remove(row)

    def step(self) -> None:
        """One forward for every parked row; each gets its logits (1, V) and, with a
        sampler, its next id, or the error."""
        rows, self.parked = self.parked, []
        if not rows:
            return
        if self.steps % threads.RECHECK_TOKENS == 0:
            threads.apply_decode(self._work)  # OpenBLAS's threads, for the cores free now
        self.steps += 1
        try:
            for r in rows:
                r.upkeep(self.model)
            if len(rows) == 1:
                logits = rows[0].alone(self.model, mx.array([rows[0].token], dtype=mx.int32))
            else:
                logits = self._forward(rows)
            for i, r in enumerate(rows):
                r.logits = logits[i : i + 1]
                # each row's own sampler on its own row, evaluated with the step: one
                # wait for the batch instead of one per row (docs/design.md)
                r.sampled = r.sample(r.logits) if r.sample is not None else None
            mx.eval(logits, [r.sampled for r in rows if r.sampled is not None])
        except Exception as e:  # every row of the step fails with it (turn.py reports it)
            for r in rows:
                r.error, r.logits, r.sampled = e, None, None

    def _forward(self, rows: list[BatchRow]) -> mx.array:
        """Logits (B, V): compiled when every row's own step is (rows_step.py), else the
        model run op by op on each layer's `Rows`."""
        steps = [r.step_for(self.model) for r in rows]
        if all(isinstance(s, CompiledStep) for s in steps):
            return self._compiled(
                [(s.caches, s.layout, s.counts) for s in steps],  # type: ignore[union-attr]
                [r.token for r in rows])
        ids = mx.array([[r.token] for r in rows], dtype=mx.int32)
        layers = [Rows(c) for c in zip(*(r.caches for r in rows), strict=True)]
        return self.model(ids, cache=layers)[:, -1, :]


def row_decode(batch: Batch, logits: mx.array, caches: Sequence[Any], *,
               sample: Callable[[mx.array], mx.array], max_tokens: int, compiled: bool,
               progress: Progress, constraint: Constrain | None = None
               ) -> Iterator[int | Waiting]:
    """`generate.decode` for a turn in a batch: yields its ids, and WAIT while its next
    step is parked in `batch`. Sampling (and a grammar's mask) stays the row's own, on
    its row of the logits. The caches hold the prompt and the first `progress.fed` ids."""
    if max_tokens < 1:
        return
    row = BatchRow(list(caches) if not isinstance(caches, list) else caches, compiled,
                   sample if constraint is None else None)
    progress.compiled = compiled
    n = 0
    parked = False
    sampled: mx.array | None = None
    try:
        while True:
            if constraint is not None:
                token = constraint.advance(int(sample(constraint.apply(logits)).item()))
            else:
                token = int((sample(logits) if sampled is None else sampled).item())
            n += 1
            yield token
            if n >= max_tokens or (constraint is not None and constraint.finished):
                return
            batch.park(row, token)
            parked = True
            yield WAIT
            parked = False
            if row.error is not None:
                raise row.error
            assert row.logits is not None, "resumed before the batch stepped"
            progress.fed += 1
            logits, sampled = row.logits, row.sampled
    finally:
        if parked and row in batch.parked:  # closed while parked, before the step
            batch.unpark(row)
        elif parked and row.error is None:  # the step ran: its id is in the cache
            progress.fed += 1
