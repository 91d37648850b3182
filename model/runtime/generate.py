"""The one decode loop: chunked prefill, then a compiled single-token step, pipelined.

`prefill` then `decode` serve the engine's turn (model/runtime/turn.py), which reports
and stops between prefill chunks; `generate_step`, the two in a row, serves `kvchat bench`,
`inspect --live` and the training script's sampler. They yield token ids as ints; the
caller decides when to stop.

Why a compiled step: at small model sizes a decode step is ~100 tiny MLX operations and
their per-operation dispatch (Python and MLX) costs more than the arithmetic. `mx.compile`
traces the step once per buffer shape and replays it. A trace bakes in every Python
value it saw, so nothing that changes per token may be a Python int inside it: the
position, the slot to write and the mask's bounds enter as one int32 array, K/V are
written with `mx.slice_update` into buffers of fixed capacity (grown outside the trace,
a whole step at a time), and attention reads the slots in use under a mask: the first
`view_slots(length)` of them, a size that is part of the trace's key (so a trace serves
a range of lengths, and the work grows with the context, not with the allocation).

The caches stay the source of truth. Before each step each cache plans its own write
(`next_slot`: grow the buffers if needed, then the int32 row of offset, slot, length and
lowest valid position; `slot_layout` names its kind and bounds); inside the trace,
proxies with the caches' own duck-typed interface (`offset`, `update_and_fetch`,
`make_mask`) stand in for them, so the model code is unchanged; after
it, `commit` hands each cache its new buffers. The same trace, keyed by the token count
too, verifies speculative decoding's k + 1 tokens in one call (`CompiledStep.verify`:
model/runtime/speculative.py) wherever every cache can take them in consecutive slots.
A cache kind without these methods runs the plain (uncompiled) step. A quantized cache's
buffers travel as their parts (packed, scales, biases) and its layout (bits, group) is in
`slot_layout`: the trace quantizes the new tokens' rows and writes each part with
`slice_update`. A recurrent layer's state (model/cache/state.py, layout "state") travels
as its conv and recurrent arrays, which the mixer replaces whole; a verify pass of n > 1
tokens returns every position's states instead, stacked, so that the cache can go back
to the last accepted token (model/decoder/state_steps.py); a layer without a token mixer
("pass") as nothing. A layer whose cache has `members` (a K/V cache and a state side by
side: model/cache/hybrid.py) is driven as its members, and the model sees them
reassembled into one HybridCache of proxies.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx

from kvchat import metal_kernels
from kvchat.model.cache.hybrid import HybridCache
from kvchat.model.cache.kv import (
    Buf,
    first_slots,
    map_parts,
    maybe_quantize,
    parts,
    pending_quantization,
    slots,
)
from kvchat.model.decoder.kv_quant import Packed

from . import threads

PREFILL_CHUNK = 512
# The compiled step attends over the slots in use, not the whole allocation (softmax and
# the score matmuls scale with the slots read), rounded up so that a trace serves many
# tokens: to an eighth of the next power of two, at least VIEW_STEP (≤ 12.5 % extra
# slots, ~8 traces per doubling of the context, each traced once per model)
VIEW_STEP = 32


def view_slots(used: int, allocated: int) -> int:
    step = max(VIEW_STEP, (1 << max(used - 1, 0).bit_length()) // 8)
    return min(allocated, -(-used // step) * step)

Sample = Callable[[mx.array], mx.array]  # logits (1, V) -> ids (1,)


def greedy(logits: mx.array) -> mx.array:
    return mx.argmax(logits, axis=-1)


@dataclass
class Progress:
    """What `generate_step` has done so far (read by the caller between yields)."""

    prefilled: int = 0  # prompt tokens run through the model this call
    prefill_s: float = 0.0
    fed: int = 0  # generated tokens run through the model (their K/V are in the cache)
    compiled: bool = False  # whether the compiled step served this call
    # speculative decoding (model/runtime/speculative.py): tokens drafted and accepted,
    # target model calls while decoding, what drafted, or why speculation did not run
    drafted: int = 0
    accepted: int = 0
    forwards: int = 0
    speculation: str | None = None
    speculation_off: str | None = None


# ---- which caches the compiled step can drive -------------------------------------------
def _steppable(cache: Any) -> bool:
    """A cache that plans its own writes (slot_layout / next_slot / commit:
    model/cache/kv.py's KVCache and RotatingKVCache, state.py's caches) and holds
    concrete buffers (a state: after its first token)."""
    if isinstance(cache.offset, mx.array) or not all(
            hasattr(cache, m) for m in ("slot_layout", "next_slot", "commit")):
        return False
    if hasattr(cache, "keys"):  # K/V: its buffers exist once a token is in
        return cache.keys is not None
    static = cache.slot_layout()
    return static[0] == "pass" or static[1] > 0


def _arrays(cache: Any, static: tuple[Any, ...]) -> list[mx.array]:
    """What a cache hands the trace: K then V (each buffer's parts), or a state's arrays."""
    if static[0] == "pass":
        return []
    if static[0] == "state":
        return [a for a in (cache.conv, cache.recurrent) if a is not None]
    if getattr(cache, "keys", None) is None:
        return []
    return [*parts(cache.keys), *parts(cache.values)]


def _n_arrays(static: tuple[Any, ...]) -> int:
    if static[0] == "pass":
        return 0
    if static[0] == "state":
        return static[1]
    return 2 * _n_parts(static)


# ---- trace side -------------------------------------------------------------------------
def _slot_mask(static: tuple[Any, ...], row: mx.array, capacity: int,
               window: int | None, n: int = 1) -> mx.array:
    """Boolean (n, capacity) mask over buffer slots for the `n` queries at positions
    row[0] … row[0] + n − 1, written in consecutive slots (next_slot(n))."""
    o, length, lo = row[0], row[2], row[3]
    s = mx.arange(capacity)
    chunk = static[4] if static[0] != "full" and len(static) > 4 else None
    if static[0] == "full":
        pos = s
        valid = s < length
    else:
        M, K = static[2], static[3]
        R = M - K
        last = o + (n - 1)  # positions count back from the last one written
        ring_pos = last - mx.remainder(last - s, R)
        pos = mx.where(s < K, s, ring_pos)
        valid = (s < length) & mx.where(s < K, s < K, ring_pos >= lo)
    t = o if n == 1 else (o + mx.arange(n))[:, None]  # each query's position
    if n > 1:  # a later token's key is not visible to an earlier query
        valid = valid[None] & (pos[None] <= t)
    if chunk is not None:  # a chunked ring (Llama 4): the query's own chunk only
        valid = valid & (pos // chunk == t // chunk)
    if window is not None:
        valid = valid & (t - pos < window)
    return valid[None] if n == 1 else valid


class _TracedCache:
    """Stands in for one cache inside the trace: same interface, array offsets."""

    def __init__(self, static: tuple[Any, ...], row: mx.array, keys: Buf,
                 values: Buf, masks: dict[Any, mx.array], view: int, n: int = 1):
        self.static, self.row, self.n = static, row, n  # n: tokens this step writes
        self.keys, self.values = keys, values
        self.view = view  # slots attention reads: every slot in use, rounded up
        self.offset = row[0]
        self._packed: Packed | None = static[1]
        self._masks = masks  # shared by layers with the same layout and row

    def packed(self) -> Packed:
        assert self._packed is not None
        return self._packed

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Buf, Buf]:
        slot = self.row[1:2]
        if self._packed is not None:  # quantize the token, then write each part
            keys, values = self._packed.encode(keys), self._packed.encode(values)

        def put(buf: mx.array, new: mx.array) -> mx.array:
            return mx.slice_update(buf, new, slot, axes=(2,))

        self.keys = map_parts(put, self.keys, keys)
        self.values = map_parts(put, self.values, values)
        return first_slots(self.keys, self.view), first_slots(self.values, self.view)

    def make_mask(self, n: int, return_array: bool = False,
                  window_size: int | None = None) -> mx.array:
        assert n == self.n, "a trace writes the tokens it was built for"
        capacity = self.view
        key = (self.static, id(self.row), capacity, window_size)
        if key not in self._masks:
            self._masks[key] = _slot_mask(self.static, self.row, capacity, window_size, n)
        return self._masks[key]


class _TracedState:
    """Stands in for a recurrent layer's state inside the trace (state.py's protocol).
    A pass of n > 1 tokens (a verify pass) asks the mixer for every position's states
    (`rollback`), which the trace returns stacked and `commit` keeps."""

    def __init__(self, row: mx.array, arrays: Sequence[mx.array], n: int = 1):
        self.offset = row[0]
        self.conv = arrays[0]
        self.recurrent = arrays[1] if len(arrays) > 1 else None
        self.rollback = n - 1

    def update(self, tokens: int, conv: mx.array, recurrent: mx.array | None = None) -> None:
        self.conv, self.recurrent = conv, recurrent

    def update_steps(self, tokens: int, convs: mx.array, recurrents: mx.array | None) -> None:
        self.conv, self.recurrent = convs, recurrents

    def advance(self, tokens: int) -> None:
        """A layer without a token mixer (state.PassCache): nothing to carry."""

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.conv, self.recurrent) if a is not None]


def _n_parts(static: tuple[Any, ...]) -> int:
    """Arrays per K or V buffer of a cache with this layout: 1 float, 3 quantized."""
    return 1 if static[1] is None else 3


def _unflatten(n: int, arrays: Sequence[mx.array]) -> Buf:
    return arrays[0] if n == 1 else tuple(arrays)


class StepPlan:
    """One cache list's inputs to a trace, planned before the call (`plan_step`): each
    cache's write row (rows with the same layout and values shared as a group), the
    slots attention reads per cache (`views`) and the buffers to pass in."""

    def __init__(self, caches: Sequence[Any], layout: tuple[tuple[Any, ...], ...], n: int):
        self.caches, self.layout, self.n = caches, layout, n
        self.rows: list[list[int]] = []
        self.groups: list[int] = []
        self.lengths: list[int] = []  # each K/V cache's slots in use after the write
        self.buffers: list[mx.array] = []
        index: dict[tuple[Any, ...], int] = {}
        self.ok = True
        for c, static in zip(caches, layout, strict=True):
            slot = c.next_slot(n)
            if slot is None:
                self.ok = False
                return
            r = list(slot)
            self.lengths.append(r[2] if static[0] not in ("state", "pass") else 0)
            g = index.setdefault((*static, *r), len(self.rows))
            if g == len(self.rows):
                self.rows.append(r)
            self.groups.append(g)
            self.buffers += _arrays(c, static)
        self.views = self.view_for(None)

    def view_for(self, used: int | None) -> list[int]:
        """Slots each K/V cache's attention reads: its own slots in use, rounded up
        (`view_slots`), or those of `used` slots where a batch shares one view."""
        views = []
        for c, static, length in zip(self.caches, self.layout, self.lengths, strict=True):
            kv = static[0] not in ("state", "pass")
            views.append(view_slots(length if used is None else used, slots(c.keys))
                         if kv else 0)
        return views

    def key(self) -> tuple[Any, ...]:
        return (self.layout, tuple(self.groups), tuple(self.views))


def step_proxies(layout: tuple[tuple[Any, ...], ...], groups: Sequence[int],
                 views: Sequence[int], group_rows: Sequence[mx.array],
                 buffers: Sequence[mx.array], n: int) -> list[Any]:
    """Inside a trace: the stand-ins for one cache list (`group_rows[g]`: group g's row)."""
    masks: dict[Any, mx.array] = {}
    proxies: list[Any] = []
    at = 0
    for i, static in enumerate(layout):
        row = group_rows[groups[i]]
        if static[0] in ("state", "pass"):
            m = _n_arrays(static)
            proxies.append(_TracedState(row, buffers[at : at + m], n) if m else
                           _TracedState(row, [None]))
            at += m
            continue
        k = _n_parts(static)
        keys = _unflatten(k, buffers[at : at + k])
        values = _unflatten(k, buffers[at + k : at + 2 * k])
        at += 2 * k
        proxies.append(_TracedCache(static, row, keys, values, masks, views[i], n))
    return proxies


def layer_caches(proxies: Sequence[Any], counts: Sequence[int]) -> list[Any]:
    """Inside a trace: the model's cache list from the members' stand-ins (`counts`: each
    layer's members; a layer of two gets one HybridCache over their proxies)."""
    layers, at = [], 0
    for k in counts:
        layers.append(proxies[at] if k == 1 else HybridCache(*proxies[at : at + k]))
        at += k
    return layers


def proxy_outputs(proxies: Sequence[Any], layout: tuple[tuple[Any, ...], ...]
                  ) -> list[mx.array]:
    """Inside a trace: the buffers the step wrote, in `StepPlan.buffers`' order."""
    out: list[mx.array] = []
    for p, static in zip(proxies, layout, strict=True):
        if static[0] == "state":
            out += p.arrays()
        elif static[0] != "pass":
            out += [*parts(p.keys), *parts(p.values)]
    return out


def commit_step(caches: Sequence[Any], layout: tuple[tuple[Any, ...], ...],
                out: Sequence[mx.array], n: int, at: int = 0) -> int:
    """Hand each cache the buffers the trace wrote (`out[at:]`); the index after them."""
    for c, static in zip(caches, layout, strict=True):
        if static[0] in ("state", "pass"):
            m = _n_arrays(static)
            c.commit(*out[at : at + m], n=n)
            at += m
            continue
        k = _n_parts(static)
        c.commit(_unflatten(k, out[at : at + k]), _unflatten(k, out[at + k : at + 2 * k]), n)
        at += 2 * k
    return at


class CompiledStep:
    """`step(y (1,) ids) -> logits (1, V)` for one token, through `mx.compile`;
    `step.verify(ys (n,) ids) -> logits (n, V)` for n tokens in one call.

    One instance per cache list; `supported` is False when some cache cannot plan its
    writes (call the model directly then)."""

    def __init__(self, model: Any, caches: Sequence[Any]):
        self.model = model
        # each layer's caches: itself, or its members (a HybridCache's K/V and state)
        self.counts = tuple(len(getattr(c, "members", (c,))) for c in caches)
        self.caches = [m for c in caches for m in getattr(c, "members", (c,))]
        self.supported = all(_steppable(c) for c in self.caches)
        # each cache's kind and bounds: fixed for the cache, part of every trace's key
        self.layout = tuple(c.slot_layout() for c in self.caches) if self.supported else ()
        # traces live with the model (its weights are constants in them), so a new
        # cache list, e.g. every new chat, reuses them instead of tracing again
        self._fns: dict[tuple[Any, ...], Any] = model.__dict__.setdefault(
            "_kvchat_decode_traces", {})
        self.traced = False  # whether the last call built a new trace

    def _build(self, layout: tuple[tuple[Any, ...], ...], groups: tuple[int, ...],
               views: tuple[int, ...], n: int) -> Any:
        model, counts = self.model, self.counts

        def step(y: mx.array, rows: mx.array, *buffers: mx.array) -> list[mx.array]:
            group_rows = [rows[g] for g in range(rows.shape[0])]
            proxies = step_proxies(layout, groups, views, group_rows, buffers, n)
            logits = model(y[None], cache=layer_caches(proxies, counts))[0]
            return [logits, *proxy_outputs(proxies, layout)]

        return mx.compile(step)

    def __call__(self, y: mx.array) -> mx.array:
        out = self._run(y, 1)
        assert out is not None  # one token always has a slot
        return out

    def verify(self, ys: mx.array) -> mx.array | None:
        """Logits (n, V) of the n tokens `ys`, run and written to the caches in one call;
        None (nothing written) where some cache cannot take them in consecutive slots
        now (a ring whose end they would cross: run the model directly then)."""
        return self._run(ys, ys.shape[0])

    def _run(self, y: mx.array, n: int) -> mx.array | None:
        self.traced = False
        plan = StepPlan(self.caches, self.layout, n)
        if not plan.ok:
            return None
        # the kernel backend can be switched at run time: a trace keeps the one it saw
        layout, groups, views = plan.key()
        fkey = (layout, groups, views, metal_kernels.backend(), n, self.counts)
        fn = self._fns.get(fkey)
        self.traced = fn is None  # this call traces: its time is no step's (speculative.py)
        if fn is None:
            fn = self._fns[fkey] = self._build(layout, groups, views, n)
        out = fn(y, mx.array(plan.rows, dtype=mx.int32), *plan.buffers)
        # hand the new buffers to the caches before anything evaluates: the old ones
        # are then referenced by the graph alone, so MLX donates them and slice_update
        # writes in place (holding them would copy every buffer every token)
        del plan
        commit_step(self.caches, layout, out, n, at=1)
        return out[0]


def plain_step(model: Any, caches: Sequence[Any]) -> Callable[[mx.array], mx.array]:
    def step(y: mx.array) -> mx.array:
        return model(y[None], cache=caches)[:, -1, :]

    return step


def decode_step(model: Any, caches: Sequence[Any], compiled: bool = True
                ) -> Callable[[mx.array], mx.array]:
    """The single-token step for these caches: compiled where every cache supports it."""
    if compiled and caches:
        step = CompiledStep(model, caches)
        if step.supported:
            return step
    return plain_step(model, caches)


def chunk_spans(n: int, prefill_chunk: int, breaks: Sequence[int] = ()
                ) -> list[tuple[int, int]]:
    """(start, end) of each chunk of an n-token prompt: `prefill_chunk` tokens, also ending
    at each of `breaks`."""
    if n < 1:
        raise ValueError("prefill needs at least one prompt token")
    ends = sorted({*range(prefill_chunk, n, prefill_chunk), *(b for b in breaks if 0 < b < n), n})
    return list(zip([0, *ends], ends, strict=False))


def run_chunk(model: Any, chunk: Sequence[int], caches: Sequence[Any]) -> mx.array:
    """One prompt chunk through the model on `caches`: the logits (1, V) at its last token
    (not evaluated)."""
    if isinstance(caches, list):  # --quantized-kv-start reached: quantize from here
        maybe_quantize(caches)
    threads.apply(len(chunk), *threads.matmul_shape(model))  # OpenBLAS threads for its size
    return model(mx.array([chunk]), cache=caches, logits_to_keep=1)[:, -1, :]


def prefill(
    model: Any,
    prompt: Sequence[int],
    caches: Sequence[Any],
    *,
    prefill_chunk: int = PREFILL_CHUNK,
    progress: Progress,
    clock: Callable[[], float] = time.perf_counter,
    breaks: Sequence[int] = (),
) -> Iterator[mx.array]:
    """Run `prompt` through the model a chunk at a time; after each chunk yield the logits
    at its last position (evaluated for the final chunk only: those give the first token).
    A chunk also ends at each of `breaks` (prompt offsets: where the caller checkpoints a
    recurrent state, model/cache/checkpoints.py).

    A caller that stops between chunks (a cancel) leaves the caches holding the first
    `progress.prefilled` prompt tokens; `progress.prefill_s` is the time so far."""
    t0 = clock()
    for i, end in chunk_spans(len(prompt), prefill_chunk, breaks):
        logits = run_chunk(model, prompt[i:end], caches)
        last = end >= len(prompt)
        mx.eval(logits if last else [c.state for c in caches])
        progress.prefilled = end
        progress.prefill_s = clock() - t0
        yield logits


class _Upkeep:
    """Between decode steps: OpenBLAS's thread count rechecked now and then, and the
    caches quantized once --quantized-kv-start is reached (a new step for the new caches)."""

    def __init__(self, model: Any, caches: Sequence[Any], compiled: bool) -> None:
        self.model, self.caches, self.compiled = model, caches, compiled
        self.pending = pending_quantization(caches) if isinstance(caches, list) else None
        if self.pending is not None and maybe_quantize(caches):  # type: ignore[arg-type]
            self.pending = pending_quantization(caches)
        self.work = threads.step_work(model)
        threads.apply_decode(self.work)
        self.adapts = threads.policy().adapts(self.work)
        self.step = decode_step(model, caches, compiled)

    def before_step(self, n: int, last: mx.array) -> Callable[[mx.array], mx.array]:
        """The step to run after `n` tokens (`last`: the newest id, in flight)."""
        if self.adapts and n and n % threads.RECHECK_TOKENS == 0:
            mx.eval(last)  # MLX idle: OpenBLAS's count changes between calls only
            threads.apply_decode(self.work)  # another program may have started
        if self.pending is not None and maybe_quantize(self.caches):  # type: ignore[arg-type]
            # the caches changed class: a step for the new ones
            self.pending = pending_quantization(self.caches)
            self.step = decode_step(self.model, self.caches, self.compiled)
        return self.step


class Constrain(Protocol):
    """A grammar over the reply (model/runtime/constrained.py's Constraint)."""

    finished: bool

    def apply(self, logits: mx.array) -> mx.array: ...
    def advance(self, token: int) -> int: ...


def decode(
    model: Any,
    logits: mx.array,
    caches: Sequence[Any],
    *,
    sample: Sample = greedy,
    max_tokens: int = 256,
    compiled: bool = True,
    progress: Progress,
    constraint: Constrain | None = None,
) -> Iterator[int]:
    """Yield up to `max_tokens` sampled ids, the first from `logits` (prefill's last).

    The next step is queued (`mx.async_eval`) before the current id is read, so the host
    only waits for the id it needs. Closing the generator waits for the in-flight step, so
    the caches are consistent afterwards: they hold the prompt and the first
    `progress.fed` yielded ids. With a `constraint` see `_decode_constrained`.
    """
    if max_tokens < 1:
        return
    if constraint is not None:
        yield from _decode_constrained(model, logits, caches, sample, max_tokens, compiled,
                                       progress, constraint)
        return
    upkeep = _Upkeep(model, caches, compiled)
    progress.compiled = isinstance(upkeep.step, CompiledStep)
    y = sample(logits)
    mx.async_eval(y)
    next_y = None
    n = 0
    try:
        while True:
            next_y = None
            if n + 1 < max_tokens:
                step = upkeep.before_step(n, y)
                next_y = sample(step(y))
                mx.async_eval(next_y)
                progress.fed += 1
            token = int(y.item())
            n += 1
            yield token
            if next_y is None:
                return
            y = next_y
    finally:
        if next_y is not None:
            mx.eval(next_y)  # the in-flight step finishes before anyone touches the cache


def _decode_constrained(model: Any, logits: mx.array, caches: Sequence[Any], sample: Sample,
                        max_tokens: int, compiled: bool, progress: Progress,
                        constraint: Constrain) -> Iterator[int]:
    """`decode` under a grammar. The grammar must see each id before it can mask the next
    logits, so an id is read before the next step is queued; the step's logits are then
    masked on the host (`constraint.apply`) while the step runs, and the id the
    constraint keeps (`advance`) is the one the model is fed."""
    upkeep = _Upkeep(model, caches, compiled)
    progress.compiled = isinstance(upkeep.step, CompiledStep)
    in_flight = None
    n = 0
    try:
        while True:
            y = sample(constraint.apply(logits))
            token = constraint.advance(int(y.item()))
            n += 1
            in_flight = None
            if n < max_tokens and not constraint.finished:
                ids = mx.array([token], dtype=y.dtype)
                step = upkeep.before_step(n - 1, ids)
                logits = in_flight = step(ids)
                mx.async_eval(logits)
                progress.fed += 1
            yield token
            if in_flight is None:
                return
    finally:
        if in_flight is not None:
            mx.eval(in_flight)


def generate_step(
    model: Any,
    prompt: Sequence[int],
    caches: Sequence[Any],
    *,
    sample: Sample = greedy,
    max_tokens: int = 256,
    prefill_chunk: int = PREFILL_CHUNK,
    compiled: bool = True,
    progress: Progress | None = None,
    clock: Callable[[], float] = time.perf_counter,
    constraint: Constrain | None = None,
) -> Iterator[int]:
    """Prefill `prompt` (the ids not yet in `caches`) in chunks, then yield up to
    `max_tokens` sampled ids (`prefill` then `decode`; the engine's turn drives the two
    itself, to report and stop between prefill chunks). Closing the generator waits for
    the in-flight step: the caches then hold the prompt and the first `progress.fed` ids.
    """
    prog = progress if progress is not None else Progress()
    logits = None
    for chunk_logits in prefill(model, prompt, caches, prefill_chunk=prefill_chunk,
                                progress=prog, clock=clock):
        logits = chunk_logits  # the last chunk's give the first token
    assert logits is not None  # prefill raised on an empty prompt
    yield from decode(model, logits, caches, sample=sample, max_tokens=max_tokens,
                      compiled=compiled, progress=prog, constraint=constraint)
