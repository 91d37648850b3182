"""One chat turn as a generator of the events it makes, in order: Started,
PrefillProgress after each prefill chunk, Overflow, TextDelta, ToolCallDelta (a turn with
tools), Stats (~10/s), AttentionView (while watched), and one Done last, whatever happens.

A turn may carry a grammar (GenParams.response_format, or a forced tool call): it is
built before the model runs, so a schema it cannot enforce fails the turn with one line
and the cache as it was (docs/serve.md, "Structured output" and "Tool calls").

The engine drives it on its thread and emits what it yields. `TurnContext.stop` is the
engine's cancel flag: checked while the template renders, between prefill chunks and
between decode steps, so a cancel ends the turn within one of them (docs/design.md, "Data
flow of one chat turn"); a stopped reply keeps its text and the cache keeps what ran.
A failure is the turn's Done("error") with one line; once the model has run, the cache
may hold a half-written step and is dropped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from kvchat.model.cache.checkpoints import stateful
from kvchat.model.errors import NEVER_CAUGHT, KVChatError, error_line
from kvchat.model.text.chat_template import TemplateCancelled
from kvchat.model.text.tokenizer import TokenizeCancelled, Tokenizer
from kvchat.model.text.tool_calls import (
    CallFormat,
    ToolCall,
    ToolCallError,
    ToolCallStream,
    call_format,
    check_tools,
    chosen_tools,
    marker_tokens,
    reads_tools,
    template_messages,
)

from .attention_watch import AttentionWatch
from .batch import Waiting, row_decode, row_prefill
from .chat_cache import ChatCache
from .events import (
    Done,
    Event,
    GenParams,
    PrefillProgress,
    Prompt,
    Started,
    Stats,
    TextDelta,
    ToolCallDelta,
    TurnStats,
)
from .generate import PREFILL_CHUNK, Progress, decode, prefill
from .sampling import Argmax, Sampler, Unseeded
from .speculative import DraftSource, PromptLookup, speculative_decode, why_not
from .stops import StopMatcher
from .turn_stats import STATS_INTERVAL_S, Evictions, TurnMeter

if TYPE_CHECKING:
    from .batch import Batch
    from .constrained import Constraint


@dataclass(frozen=True)
class TurnContext:
    """What a turn runs with, handed in by the engine (on its thread)."""

    model: Any
    tokenizer: Tokenizer
    chat: ChatCache
    stop: Callable[[], bool]  # the cancel flag
    clock: Callable[[], float]
    # a turn's numbers -> with the cache's and the runtime's as they are now
    stats: Callable[[TurnStats], TurnStats]
    watch: AttentionWatch
    prefill_chunk: int = PREFILL_CHUNK
    compiled: bool = True  # off: the plain step (same ids; for comparison)
    reuse_prefix: bool = True  # off: every turn prefills its whole prompt
    stats_interval_s: float = STATS_INTERVAL_S
    # a draft model folder -> its DraftModel, loaded once and checked against the
    # tokenizer (the engine's; None: no draft models here)
    draft: Callable[[str], Any] | None = None
    # a server's turns side by side: the decode step is parked here (WAIT is yielded)
    # and run in one forward with the other turns' (model/runtime/batch.py)
    batch: Batch | None = None


class PartialReply(Exception):
    """A turn that failed after its model work began: the reply shown so far and its ids."""

    def __init__(self, error: BaseException, text: str, ids: list[int]) -> None:
        super().__init__(str(error))
        self.error, self.text, self.ids = error, text, list(ids)


def is_blank(prompt: Prompt) -> bool:
    """Nothing to reply to: blank text, no ids, or a conversation whose last message is blank."""
    if isinstance(prompt, str):
        return not prompt.strip()
    if not prompt:
        return True
    last = prompt[-1]
    return isinstance(last, dict) and not str(last.get("content") or "").strip()


@dataclass(frozen=True)
class ToolUse:
    """A turn's tools: rendered by the chat template, calls parsed out in `fmt`."""

    tools: list[dict[str, Any]]
    fmt: CallFormat
    forced: list[dict[str, Any]] | None  # tool_choice required / named: a call must come


def tool_use(tokenizer: Tokenizer, params: GenParams) -> ToolUse | None:
    """The turn's ToolUse (None without tools, or with tool_choice "none": the tools are
    then neither rendered nor parsed); KVChatError for a chat template that never reads
    `tools` (naming the model), or tools / a choice that cannot be used."""
    if not params.tools:
        if params.tool_choice not in (None, "none", "auto"):
            raise ToolCallError("tool_choice needs tools")
        return None
    tools = check_tools(params.tools)
    forced = chosen_tools(tools, params.tool_choice)
    if forced == []:
        return None
    template = tokenizer.tool_template or tokenizer.chat_template
    if not reads_tools(template):
        name = tokenizer.path.name if tokenizer.path is not None else "this model"
        kind = "chat template" if template is not None else "model (it has no chat template)"
        raise ToolCallError(f"{name}: the {kind} does not support tools (the template never"
                            " reads `tools`), so tool calls cannot be made with it")
    return ToolUse(tools, call_format(template), forced)


def prompt_ids(ctx: TurnContext, prompt: Prompt, tools: ToolUse | None = None) -> list[int]:
    """The ids of a prompt: raw text encoded, ids checked against the vocabulary, a
    conversation rendered by the chat template (a cancel stops a slow one at once), with
    the tools when there are any."""
    if isinstance(prompt, str) and tools is not None:
        raise ToolCallError("tools need a conversation (messages), not a raw prompt")
    # ids with tools: a conversation the caller already rendered with them (the server
    # tokenizes before queueing, app/serve/prompts.py); the calls are still parsed here
    if isinstance(prompt, str):
        return ctx.tokenizer.encode(prompt, should_stop=ctx.stop)
    if all(isinstance(x, int) for x in prompt):
        vocab = ctx.model.config.vocab_size
        bad = [x for x in prompt if not 0 <= x < vocab]  # type: ignore[operator]
        if bad:  # an embedding lookup out of range reads past the table (a crash)
            raise KVChatError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        return list(prompt)  # type: ignore[arg-type]
    messages = template_messages(prompt)  # type: ignore[arg-type]
    extra = {"tools": tools.tools} if tools is not None else {}
    return ctx.tokenizer.encode_chat(messages, should_stop=ctx.stop, **extra)


def make_constraint(ctx: TurnContext, params: GenParams, tools: ToolUse | None
                    ) -> Constraint | None:
    """The grammar the reply must follow: `response_format`'s, or a forced tool call's
    (docs/serve.md, "Structured output"); GrammarError for one it cannot enforce."""
    from .constrained import GrammarError, constraint_for, response_format_grammar

    grammar = response_format_grammar(params.response_format)
    what = "response_format"
    if tools is not None and tools.forced:
        if grammar is not None:
            raise GrammarError("response_format cannot be combined with a forced tool_choice")
        from .tool_grammar import tool_call_grammar

        many = params.tool_choice == "required" and params.parallel_tool_calls
        grammar = tool_call_grammar(tools.fmt, tools.forced, ctx.tokenizer, many)
        what = "tool call"
    if grammar is None:
        return None
    return constraint_for(ctx.tokenizer, grammar, params.max_tokens, what)


def fit_context(params: GenParams, n_prompt: int, capacity: int
                ) -> tuple[GenParams, int | None]:
    """--overflow refuse: a prompt past the context is an error, and the reply may not run
    past it. Returns the params to run with and the room the window leaves the reply when
    it, not max_tokens, ends it (None otherwise)."""
    if params.overflow != "refuse":
        return params, None
    room = capacity - n_prompt + 1
    if room < 1:
        raise KVChatError(f"prompt of {n_prompt} tokens exceeds the {capacity}-token context;"
                          " shorten it or allow rotation")
    context_room = room if room < params.max_tokens else None
    return dataclasses.replace(params, max_tokens=min(params.max_tokens, room)), context_room


def run_turn(ctx: TurnContext, prompt: Prompt, params: GenParams, t_submit: float
             ) -> Iterator[Event | Waiting]:
    """The events of one turn, ending with its Done (`t_submit`: when it was queued, on
    `ctx.clock`)."""
    ids: list[int] = []
    try:
        params.validate()
        if is_blank(prompt):
            raise KVChatError("empty prompt: type a message first")
        tools = tool_use(ctx.tokenizer, params)
        ids = prompt_ids(ctx, prompt, tools)
        if not ids:
            raise KVChatError("empty prompt")
        capacity = params.max_kv_size or ctx.model.config.max_position_embeddings
        params, context_room = fit_context(params, len(ids), capacity)
        constraint = make_constraint(ctx, params, tools)
        # a draft model that fails to load: before prefill; none for a constrained reply
        source = None if _unspeculated(constraint, tools) else _draft_source(ctx, params)
        yield from _generate(ctx, ids, params, t_submit, context_room, tools, constraint,
                             source)
    except (TemplateCancelled, TokenizeCancelled):
        yield Done("cancelled", "", [], ids)
    except PartialReply as p:
        _debug(p.error)
        ctx.chat.drop()  # it may hold a half-written step
        # the reply so far is kept (the client marks it), with its ids for --json
        yield Done("error", p.text, p.ids, ids, error=error_line(p.error))
    except KVChatError as e:  # before the model ran: the cache is as it was
        yield Done("error", "", [], ids, error=str(e))
    except NEVER_CAUGHT:
        raise
    except BaseException as e:  # a Rust tokenizer's panic is a BaseException, too
        _debug(e)
        ctx.chat.drop()
        yield Done("error", "", [], ids, error=error_line(e))


def _debug(e: BaseException) -> None:
    if os.environ.get("KVCHAT_DEBUG") == "1":
        traceback.print_exception(e)


class _Every:
    """True at most once per `interval` seconds of the turn's clock."""

    def __init__(self, interval: float, now: float) -> None:
        self.interval, self.last = interval, now

    def due(self, now: float) -> bool:
        if now - self.last < self.interval:
            return False
        self.last = now
        return True


def _draft_source(ctx: TurnContext, params: GenParams) -> DraftSource | None:
    """Where this turn's drafts come from (None: plain decoding)."""
    if params.speculation == "lookup":
        return PromptLookup(params.lookup_ngram)
    if params.speculation == "draft":
        if ctx.draft is None:
            raise KVChatError("this engine cannot load a draft model")
        assert params.draft_model is not None  # validate() checked
        source = ctx.draft(params.draft_model)
        # the draft draws with its own key: the acceptance test's draws must not repeat them
        s = params.sampling()
        draws = Sampler(dataclasses.replace(s, seed=None if s.seed is None else
                                            (s.seed + 1) % 2**64))
        source.start(None if draws.greedy else draws, _n_ids(ctx), params.max_kv_size,
                     params.keep)
        return source  # type: ignore[no-any-return]
    return None


def _n_ids(ctx: TurnContext) -> int:
    """Ids that may be sampled: embedding tables are often padded past the tokenizer's
    vocabulary, and an id the tokenizer cannot decode must never be sampled."""
    return min(ctx.model.config.vocab_size, ctx.tokenizer.vocab_size)


def _sampler(sampler: Sampler, n_ids: int, params: GenParams, prompt: list[int],
             batched: bool = False) -> Callable[[mx.array], mx.array]:
    """logits -> the next id, with the repetition penalty's window of recent ids. Greedy
    with no penalty: `Argmax`; in a batch, unseeded with no penalty: `Unseeded` (the
    batch draws all rows sampled alike at once)."""
    window = params.repetition_context_size
    use_history = params.repetition_penalty != 1.0
    if not use_history and sampler.greedy:
        return Argmax(n_ids)
    if not use_history and batched and params.seed is None:
        return Unseeded.of(sampler.params, n_ids)
    history = mx.array(prompt[-window:], dtype=mx.int32)

    def sample(logits: mx.array) -> mx.array:
        nonlocal history
        y = sampler(logits[..., :n_ids], history if use_history else [])
        if use_history:
            history = mx.concatenate([history, y.astype(mx.int32)])[-window:]
        return y

    return sample


class _Reply:
    """The reply's visible text on its way out: tool calls taken out of it when the turn
    has tools (model/text/tool_calls.py), the rest as TextDelta. `one_call`
    (parallel_tool_calls False): the reply ends with its first call, nothing after it."""

    def __init__(self, tools: ToolUse | None, one_call: bool = False) -> None:
        self.calls = ToolCallStream(tools.fmt) if tools is not None else None
        self.parts: list[str] = []
        self.made: list[ToolCall] = []  # the calls handed on
        self.offsets: list[int] = []  # where in the text each was made
        self._chars = 0
        self.one_call = one_call

    @property
    def ended(self) -> bool:
        """The one call allowed is made: the turn stops decoding."""
        return self.one_call and bool(self.made)

    def events(self, text: str, token: int, final: bool = False) -> Iterator[Event]:
        if self.calls is None:
            pieces: list[str | Any] = [text] if text else []
        else:
            pieces = self.calls.feed(text) if text else []
            if final:
                pieces += self.calls.finish()
        for p in pieces:
            if self.ended:
                return
            if isinstance(p, str):
                self.parts.append(p)
                self._chars += len(p)
                yield TextDelta(p, token)
            else:
                self.made.append(p)
                self.offsets.append(self._chars)
                yield ToolCallDelta(len(self.made) - 1, p)

    @property
    def text(self) -> str:
        return "".join(self.parts)


def _unspeculated(constraint: Constraint | None, tools: ToolUse | None) -> bool:
    """A reply that decodes without speculation whatever was asked: a grammar masks each
    step's logits as its state advances, which a verify pass of k + 1 drafted tokens does
    not; a turn with tools may force a call through such a grammar (docs/design.md,
    Speculative decoding)."""
    return constraint is not None or tools is not None


def _decode(ctx: TurnContext, params: GenParams, ids: list[int], logits: mx.array,
            caches: list[Any], source: DraftSource | None, progress: Progress,
            constraint: Constraint | None = None, tools: ToolUse | None = None
            ) -> Iterator[int | Waiting]:
    """The decode loop for this turn: speculative from `source` where the caches can take
    rejected drafts back exactly and the reply is unconstrained, else plain
    (`progress.speculation_off` says why)."""
    model, n_ids = ctx.model, _n_ids(ctx)
    sampler = Sampler(params.sampling())
    if params.speculation != "off" and _unspeculated(constraint, tools):
        progress.speculation_off = ("speculation off: a constrained reply (response_format"
                                    " or tools) decodes one token at a time")
    elif source is not None:
        why = why_not(model, caches)
        if why is None:
            return speculative_decode(
                model, logits, caches, source=source, sampler=sampler, n_ids=n_ids,
                history=ids, max_tokens=params.max_tokens, draft_tokens=params.draft_tokens,
                compiled=ctx.compiled, progress=progress)
        progress.speculation_off = why
    sample = _sampler(sampler, n_ids, params, ids, batched=ctx.batch is not None)
    if ctx.batch is not None:
        return row_decode(ctx.batch, logits, caches, sample=sample,
                          max_tokens=params.max_tokens, compiled=ctx.compiled,
                          progress=progress, constraint=constraint)
    return decode(model, logits, caches, sample=sample, max_tokens=params.max_tokens,
                  compiled=ctx.compiled, progress=progress, constraint=constraint)


def _generate(ctx: TurnContext, ids: list[int], params: GenParams, t_submit: float,
              context_room: int | None, tools: ToolUse | None = None,
              constraint: Constraint | None = None, source: DraftSource | None = None
              ) -> Iterator[Event | Waiting]:
    model, chat = ctx.model, ctx.chat
    mx.reset_peak_memory()
    cached, again, reason = chat.prepare(model, ids, params, ctx.reuse_prefix)
    caches = chat.caches
    assert caches is not None
    # a recurrent state's checkpoints: where the prefill pauses to take them
    plan = chat.checkpoints.plan(cached, len(ids)) if stateful(caches) else []
    if plan and plan[0] == cached:
        chat.checkpoints.take(caches)
    yield Started(len(ids), cached, reason, again)
    use = chat.use.to_json() if chat.use is not None else None
    meter = TurnMeter(TurnStats(prompt_tokens=len(ids), cached_tokens=cached, cache=use),
                      t_submit)
    evictions = Evictions(model, caches)
    todo = ids[cached:]
    progress = Progress()
    # control tokens are never text, except a tool-call marker the parser must see
    markers = marker_tokens(tools.fmt) if tools is not None else ()
    keep = {i for m in markers if (i := ctx.tokenizer.token_to_id(m)) is not None}
    detok = ctx.tokenizer.detokenizer(skip_special_tokens=True, keep=keep)
    stops = StopMatcher(params.stop)
    reply = _Reply(tools, one_call=not params.parallel_tool_calls)
    eos = set(ctx.tokenizer.end_ids)  # EOS, and BOS: a base model starting a new document
    generated: list[int] = []
    finish = "length"
    now = ctx.clock()  # the first stats and attention view come an interval after this
    stats_tick, view_tick = _Every(ctx.stats_interval_s, now), _Every(ctx.watch.interval_s, now)
    try:
        logits = None
        if ctx.batch is not None and not stateful(caches):  # chunks beside other turns'
            chunks = row_prefill(ctx.batch, todo, caches, prefill_chunk=ctx.prefill_chunk,
                                 progress=progress, clock=ctx.clock)
        else:
            chunks = prefill(model, todo, caches, prefill_chunk=ctx.prefill_chunk,
                             progress=progress, clock=ctx.clock,
                             breaks=[p - cached for p in plan])
        try:
            while progress.prefilled < len(todo) and not ctx.stop():
                logits = next(chunks)
                if isinstance(logits, Waiting):  # parked for the batched step
                    yield logits
                    continue
                if cached + progress.prefilled in plan:
                    chat.checkpoints.take(caches)
                yield PrefillProgress(progress.prefilled, len(todo), progress.prefill_s)
        finally:
            chunks.close()  # a chunk parked in the batch leaves it with the turn
        chat.ids.extend(todo[: progress.prefilled])
        if progress.prefilled < len(todo):  # cancelled during prefill
            yield Done("cancelled", "", [], ids, ctx.stats(meter.stats))
            return
        assert logits is not None
        if (overflow := evictions.overflow("prompt")) is not None:  # before decoding
            yield overflow

        steps = _decode(ctx, params, ids, logits, caches, source, progress, constraint, tools)
        try:
            for token in steps:
                if isinstance(token, Waiting):  # parked for the batched step
                    yield token
                    continue
                now = ctx.clock()
                meter.token(now, progress, len(todo))
                generated.append(token)
                if token in eos and not params.ignore_eos:
                    finish = "eos"
                    break
                text, hit = stops.feed(detok.add_token(token))
                yield from reply.events(text, token)
                if reply.ended:
                    finish = "tool_calls"
                    break
                if hit:
                    finish = "stop"
                    break
                if ctx.stop():
                    finish = "cancelled"
                    break
                if stats_tick.due(now):
                    yield Stats(ctx.stats(meter.decoded(len(generated))))
                if ctx.watch.target is not None and view_tick.due(now):
                    # the newest token in the cache: the last one fed
                    newest = generated[progress.fed - 1] if progress.fed else todo[-1]
                    if (view := ctx.watch.view(model, caches, newest)) is not None:
                        yield view
        except BaseException:
            with contextlib.suppress(Exception):
                steps.close()  # the first failure is the one to report
            raise
        steps.close()  # waits for the in-flight step before the cache is touched
    except NEVER_CAUGHT:
        raise
    except BaseException as e:  # a pipeline rank died, MLX failed: keep what was shown
        raise PartialReply(e, stops.shown, generated) from e

    tail = ""
    if finish != "stop":  # flush text held for UTF-8 completion or stop matching
        tail, _ = stops.feed(detok.finalize())
        tail += stops.flush()
    if generated:
        yield from reply.events(tail, generated[-1], final=True)
    chat.ids.extend(generated[: progress.fed])
    if plan:  # the reply's end: where the next turn continues
        chat.checkpoints.take(caches)
    if (overflow := evictions.overflow("reply")) is not None:
        yield overflow
    if finish == "length" and context_room is not None and len(generated) >= context_room:
        finish = "context_full"
    final = ctx.stats(meter.decoded(len(generated)))
    yield Stats(final)
    calls = reply.made
    if calls and finish != "cancelled":
        finish = "tool_calls"
    text = reply.text if reply.calls is not None else stops.text
    yield Done(finish, text, generated, ids, final, tool_calls=list(calls),
               tool_call_offsets=list(reply.offsets))
