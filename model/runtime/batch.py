"""Continuous batching: the turns a server runs side by side decode in one forward per
step (docs/serve.md, "Many clients"; docs/design.md, "Continuous batching").

Each turn stays what it is alone (model/runtime/turn.py): its own cache, sampler, seed,
stops, grammar and statistics. Only its forward passes are shared: `row_decode` stands
in for `generate.decode`, and where `decode` would run the model for the id it just
sampled, it parks the id here and yields `WAIT`; `row_prefill` does the same for each
prompt chunk (`generate.prefill`). The engine, which drives every turn's generator on
its thread, runs `Batch.step` once every running turn is parked, and each parked turn
resumes with its row of the logits. Chunks parked together run as one forward, padded
to the longest (each row's padding after its last token, where no query of it looks,
and trimmed off its caches after), so turns that arrive together are prefilled
together instead of one after another.

The step is queued, not waited for (`mx.async_eval`), as `decode` queues its next step:
a row parks the id it sampled while that id is still being computed, and reads it only
once the step that takes it is queued, so the host's work on a round's tokens (reading,
detokenizing, stops, events) runs while the next step computes. A row with a grammar
reads its id first (the grammar must see it), as `decode` under a constraint does.

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
from .generate import CompiledStep, Constrain, Progress, chunk_spans, decode_step, run_chunk
from .rows_step import RowsStep
from .sampling import Argmax, Unseeded
from .slab import Slab, fits, own, pays


class Waiting:
    """Yielded by a turn parked for the next batched step (never an engine event)."""

    def __repr__(self) -> str:
        return "WAIT"


WAIT = Waiting()


class Drawn:
    """The ids one step drew at once for its rows sampled alike (`Argmax`, `Unseeded`),
    shape (B,): computed in the step's graph and read from it once for all of them."""

    def __init__(self, ids: mx.array):
        self.ids = ids
        self._host: list[int] | None = None

    def host(self) -> list[int]:
        if self._host is None:
            self._host = [int(i) for i in self.ids.tolist()]  # type: ignore[union-attr]
        return self._host


class Pick:
    """Row `i` of a `Drawn`: its row's next id. Fed back as it is, the next step
    takes the rows' ids straight from the `Drawn` (`_ids`), no operation per row."""

    __slots__ = ("drawn", "i")

    def __init__(self, drawn: Drawn, i: int):
        self.drawn, self.i = drawn, i

    def item(self) -> int:
        return self.drawn.host()[self.i]

    def array(self) -> mx.array:
        return self.drawn.ids[self.i : self.i + 1]


Token = int | mx.array | Pick  # an id to feed: known, or being computed


class BatchRow:
    """One turn's place in the batch: its caches, the id to run (an int, or the id a
    sampler returned, maybe not computed yet), then its logits and, where the row has a
    `sample` (no grammar to apply on the host first), its next id drawn in the step's own
    graph: by the row's sampler, or with the rows sampled alike at once (`_draw`)."""

    def __init__(self, caches: list[Any], compiled: bool,
                 sample: Callable[[mx.array], mx.array] | None = None):
        self.caches = caches
        self.compiled = compiled
        self.sample = sample
        self.token: Token = 0
        self.sampled: mx.array | Pick | None = None
        self.error: BaseException | None = None
        self._out: tuple[mx.array, int] | None = None  # the step's logits, this row's index
        self._step: Callable[[mx.array], mx.array] | None = None
        self.pending = pending_quantization(caches)

    @property
    def logits(self) -> mx.array | None:
        """This row's logits (1, V) from its last step (sliced when asked: a row drawn
        with others never needs them)."""
        return None if self._out is None else self._out[0][self._out[1] : self._out[1] + 1]

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


class PrefillRow:
    """One turn's prompt chunk parked for the next step: its caches and ids, then the
    logits (1, V) at the chunk's last token, or the error."""

    def __init__(self, caches: list[Any], chunk: Sequence[int]):
        self.caches, self.chunk = caches, list(chunk)
        self.logits: mx.array | None = None
        self.error: BaseException | None = None

    def pads(self, n: int) -> bool:
        """Whether its caches can take the chunk padded to `n` tokens and drop the padding
        exactly: K/V caches (row_prefill never runs a recurrent state's turn here) whose
        padded write displaces nothing (a ring not crossing its end)."""
        return all(c.offset + n <= getattr(c, "max_size", c.offset + n) for c in self.caches)


class Batch:
    """The rows parked for the next step (the engine's thread only)."""

    def __init__(self, model: Any, shared: bool = True):
        self.model = model
        self.shared = shared  # rows with alike caches share K/V buffers (False: never)
        self.parked: list[BatchRow] = []
        self.prefilling: list[PrefillRow] = []  # prompt chunks parked for the next step
        self.steps = 0
        self._work = threads.step_work(model)
        self._compiled = RowsStep(model)
        self._slab: Slab | None = None  # the rows' K/V in shared buffers, while it fits
        # rows whose K/V are still slices of a dissolved slab's buffers (until they step)
        self._sliced: list[BatchRow] = []
        self.traced = False  # whether the last step built a new trace

    def park(self, row: BatchRow, token: Token) -> None:
        row.token, row._out, row.sampled, row.error = token, None, None, None
        self.parked.append(row)

    def unpark(self, row: BatchRow | PrefillRow) -> None:
        if row in self.parked:
            self.parked.remove(row)  # type: ignore[arg-type]
        if row in self.prefilling:
            self.prefilling.remove(row)  # type: ignore[arg-type]

    def park_prefill(self, row: PrefillRow) -> None:
        self.prefilling.append(row)

    def leave(self, row: BatchRow) -> None:
        """`row` is done with the batch: its caches hold their own K/V again, in memory
        of their own (they may go to the prefix pool)."""
        self.unpark(row)
        if self._slab is not None and any(r is row for r in self._slab.rows):
            self._dissolve([r for r in self._slab.rows if r is not row])
        if any(r is row for r in self._sliced):
            self._sliced = [r for r in self._sliced if r is not row]
            own(row.caches)

    def _dissolve(self, keep: Sequence[BatchRow] = ()) -> None:
        """The rows' K/V back in their caches (slab.py): slices for the rows in `keep`,
        about to step on (a step writes them into buffers of their own), copies for the
        rest."""
        if self._slab is not None:
            rows = self._slab.rows
            self._slab.dissolve(keep)
            self._sliced = [r for r in rows if any(r is k for k in keep)]
            self._slab = None

    def step(self) -> None:
        """The parked prompt chunks (`_prefill`), then one forward for every parked row,
        queued: each gets its logits (1, V) and, with a sampler, its next id (both computed
        in the background), or the error."""
        if self.prefilling:
            self._prefill()
        rows, self.parked = self.parked, []
        if not rows:
            return
        if self.steps % threads.RECHECK_TOKENS == 0:
            threads.apply_decode(self._work)  # OpenBLAS's threads, for the cores free now
        self.steps += 1
        try:
            if self._slab is not None and not self._slab.serves(rows):
                self._dissolve(rows)  # the rows changed: each takes its K/V back first
            for r in rows:
                r.upkeep(self.model)
            ids = _ids([r.token for r in rows])
            logits = rows[0].alone(self.model, ids) if len(rows) == 1 else self._forward(rows, ids)
            for i, r in enumerate(rows):
                r._out = (logits, i)
            # each row's next id in the step's graph: one queue for the batch instead of a
            # wait per row (docs/design.md)
            drawn = _draw(rows, logits)
            mx.async_eval(logits, drawn)
            # their K/V are now in buffers the step wrote (a slab's, or their own)
            self._sliced = [r for r in self._sliced if not any(r is x for x in rows)]
        except Exception as e:  # every row of the step fails with it (turn.py reports it)
            self._dissolve()
            for r in rows:
                r.error, r._out, r.sampled = e, None, None

    def _prefill(self) -> None:
        """The parked prompt chunks, together where they can be: right-padded to the
        longest, one forward for all (each row over its own caches, model/decoder/rows.py;
        a query never sees the padding after it), each row's logits taken at its last
        token and its padding trimmed off its caches. Chunks whose caches cannot take
        padding, or so uneven that padding would cost more than the tokens, run alone."""
        rows, self.prefilling = self.prefilling, []
        n = max(len(r.chunk) for r in rows)
        # those that take padding to the longest (and so to any shorter), shortest first;
        # the longest go alone until the padding costs at most the tokens
        together = sorted((r for r in rows if r.pads(n)), key=lambda r: len(r.chunk))
        while len(together) > 1 and len(together) * len(together[-1].chunk) > 2 * sum(
                len(r.chunk) for r in together):
            together.pop()
        if len(together) < 2:
            together = []
        groups = [together] if together else []
        groups += [[r] for r in rows if not any(r is t for t in together)]
        for group in groups:
            try:
                self._prefill_group(group)
            except Exception as e:  # each row of the group fails with it (turn.py reports)
                for r in group:
                    r.error, r.logits = e, None
        # computed in the background; a turn reads its first id from them next round
        mx.async_eval([r.logits for r in rows if r.logits is not None],
                      [c.state for r in rows if r.logits is not None for c in r.caches])
        threads.apply_decode(self._work)

    def _prefill_group(self, group: list[PrefillRow]) -> None:
        if len(group) == 1:
            group[0].logits = run_chunk(self.model, group[0].chunk, group[0].caches)
            return
        for r in group:
            maybe_quantize(r.caches)  # --quantized-kv-start reached: quantize from here
        n = max(len(r.chunk) for r in group)
        threads.apply(n * len(group), *threads.matmul_shape(self.model))
        ids = mx.array([r.chunk + [0] * (n - len(r.chunk)) for r in group])
        layers = [Rows(c) for c in zip(*(r.caches for r in group), strict=True)]
        at = mx.array([len(r.chunk) - 1 for r in group])
        logits = self.model(ids, cache=layers, at=at)[:, -1]
        for i, r in enumerate(group):
            for c in r.caches:
                assert c.trim(n - len(r.chunk)) == n - len(r.chunk)  # pads() said it would
            r.logits = logits[i : i + 1]

    def _may_share(self, rows: list[BatchRow], steps: list[Any]) -> bool:
        """Whether these rows' K/V go into shared buffers (slab.py): alike caches, none
        about to be quantized, and few slots left unused."""
        return (self.shared and all(r.pending is None for r in rows) and fits(self.model, steps)
                and pays([s.caches for s in steps]))

    def _forward(self, rows: list[BatchRow], ids: mx.array) -> mx.array:
        """Logits (B, V) of `ids` (B,): on shared K/V buffers where the rows' caches are
        alike (slab.py), else compiled when every row's own step is (rows_step.py), else
        the model run op by op on each layer's `Rows`."""
        steps = [r.step_for(self.model) for r in rows]
        if self._slab is None and self._may_share(rows, steps):
            self._slab = Slab(self.model, rows, steps)  # type: ignore[arg-type]
        if self._slab is not None:
            logits = self._slab.step(ids)
            self.traced = self._slab.traced
            return logits
        if all(isinstance(s, CompiledStep) for s in steps):
            logits = self._compiled(
                [(s.caches, s.layout, s.counts) for s in steps],  # type: ignore[union-attr]
                ids)
            self.traced = self._compiled.traced
            return logits
        layers = [Rows(c) for c in zip(*(r.caches for r in rows), strict=True)]
        return self.model(ids[:, None], cache=layers)[:, -1, :]


def _draw(rows: Sequence[BatchRow], logits: mx.array) -> list[mx.array]:
    """Each row's next id (`row.sampled`), drawn in the step's graph: rows sampled alike
    (`Argmax`: greedy; `Unseeded`: the same settings, no seed) with one draw over their
    logits, each other row (a seed of its own, a repetition penalty) with its own sampler
    on its own row. The arrays to queue."""
    out: list[mx.array] = []
    alike: dict[Argmax | Unseeded, list[int]] = {}  # a draw -> the rows it serves
    for i, r in enumerate(rows):
        if isinstance(r.sample, (Argmax, Unseeded)):
            alike.setdefault(r.sample, []).append(i)
        elif r.sample is not None:
            r.sampled = r.sample(r.logits)
            out.append(r.sampled)
    for draw, idx in alike.items():
        part = logits if len(idx) == len(rows) else logits[mx.array(idx)]
        drawn = Drawn(draw(part))
        for j, i in enumerate(idx):
            rows[i].sampled = Pick(drawn, j)
        out.append(drawn.ids)
    return out


def _ids(tokens: Sequence[Token]) -> mx.array:
    """The rows' ids as one int32 array (B,): ints, samplers' (1,) arrays, or Picks
    (the very ids a step drew, in their order, are fed as they are)."""
    if all(isinstance(t, int) for t in tokens):
        return mx.array(tokens, dtype=mx.int32)
    first = tokens[0]
    if isinstance(first, Pick) and all(
            isinstance(t, Pick) and t.drawn is first.drawn for t in tokens):
        picked = [t.i for t in tokens]  # type: ignore[union-attr]
        if picked == list(range(first.drawn.ids.shape[0])):
            return first.drawn.ids
        return first.drawn.ids[mx.array(picked)]
    return mx.concatenate([_array(t) for t in tokens]).astype(mx.int32)


def _array(t: Token) -> mx.array:
    """One id as a (1,) array."""
    if isinstance(t, Pick):
        return t.array()
    if isinstance(t, mx.array):
        return t if t.ndim == 1 else t.reshape(1)
    return mx.array([t], dtype=mx.int32)


def row_prefill(batch: Batch, prompt: Sequence[int], caches: list[Any], *,
                prefill_chunk: int, progress: Progress,
                clock: Callable[[], float]) -> Iterator[mx.array | Waiting]:
    """`generate.prefill` for a turn in a batch: each chunk is parked (WAIT) and run in the
    next step beside the other turns' chunks (`Batch._prefill`); after each, the logits at
    its last position. A caller that stops between chunks leaves the caches holding the
    first `progress.prefilled` prompt tokens."""
    t0 = clock()
    for i, end in chunk_spans(len(prompt), prefill_chunk):
        row = PrefillRow(caches, prompt[i:end])
        batch.park_prefill(row)
        try:
            yield WAIT
        finally:
            if row in batch.prefilling:  # closed before the step: nothing written
                batch.unpark(row)
            elif row.error is None:  # the step wrote the chunk: count it
                progress.prefilled = end
        if row.error is not None:
            raise row.error
        assert row.logits is not None, "resumed before the batch stepped"
        progress.prefill_s = clock() - t0
        yield row.logits


def row_decode(batch: Batch, logits: mx.array, caches: Sequence[Any], *,
               sample: Callable[[mx.array], mx.array], max_tokens: int, compiled: bool,
               progress: Progress, constraint: Constrain | None = None
               ) -> Iterator[int | Waiting]:
    """`generate.decode` for a turn in a batch: yields its ids, and WAIT while its next
    step is parked in `batch`. Sampling (and a grammar's mask) stays the row's own, on
    its row of the logits. The first id (from prefill's computed logits) is read at
    once; after it, as in `decode`, an id is parked before it is read, so the step that
    takes it is queued first. The caches hold the prompt and the first `progress.fed`
    ids, and closing waits for the step in flight."""
    if max_tokens < 1:
        return
    row = BatchRow(list(caches) if not isinstance(caches, list) else caches, compiled,
                   sample if constraint is None else None)
    progress.compiled = compiled
    if constraint is not None:
        yield from _row_decode_constrained(batch, row, logits, sample, max_tokens,
                                           progress, constraint)
        return
    y: mx.array | Pick = sample(logits)
    next_y: mx.array | Pick | None = None
    try:
        # the first id: prefill's logits are computed, so it is read and shown at once
        n, read = 1, True
        yield int(y.item())
        while True:
            # `y`: the id to feed (`read`: already yielded); the step feeding it is queued
            # before a not yet read `y` is read, so reading waits on the step before
            next_y = None
            if n + (not read) < max_tokens:
                yield from _stepped(batch, row, y, progress)
                next_y = row.sampled
            if not read:
                n += 1
                yield int(y.item())
            if next_y is None:
                return
            y, read = next_y, False
    finally:
        if next_y is not None:  # the step in flight finishes before anyone touches the cache
            mx.eval(next_y.drawn.ids if isinstance(next_y, Pick) else next_y)
        batch.leave(row)


def _row_decode_constrained(batch: Batch, row: BatchRow, logits: mx.array,
                            sample: Callable[[mx.array], mx.array], max_tokens: int,
                            progress: Progress, constraint: Constrain
                            ) -> Iterator[int | Waiting]:
    """`row_decode` under a grammar: each id is read (and the grammar advanced) before it
    is parked, as `generate._decode_constrained` does."""
    n = 0
    try:
        while True:
            token = constraint.advance(int(sample(constraint.apply(logits)).item()))
            n += 1
            yield token
            if n >= max_tokens or constraint.finished:
                return
            yield from _stepped(batch, row, token, progress)
            assert row.logits is not None, "resumed before the batch stepped"
            logits = row.logits
    finally:
        batch.leave(row)


def _stepped(batch: Batch, row: BatchRow, token: Token,
             progress: Progress) -> Iterator[Waiting]:
    """Park `token` for the next step and wait for it (WAIT); it is then in the cache. A
    row closed while parked leaves the batch before its step, or (the step ran) counts
    its id and waits for that step before anyone touches the cache."""
    batch.park(row, token)
    try:
        yield WAIT
    except GeneratorExit:
        if row in batch.parked:
            batch.unpark(row)
        elif row.error is None:
            progress.fed += 1
            mx.eval(row.logits)
        raise
    if row.error is not None:
        raise row.error
    progress.fed += 1
