"""The OpenAI wire format: requests checked and turned into a prompt and GenParams, and
the response objects built from the engine's events. Pure functions, no I/O.

Every field is first checked against fields.py's tables (none is skipped in silence),
then read; every problem is an `ApiError` (errors.py) with a 4xx status naming the
field: the server never lets a request reach the engine half-checked. Anthropic's
Messages API (anthropic.py) reuses these checks for the fields the two APIs share.
"""

from __future__ import annotations

import math
import re
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvchat.app.serve import fields as known
from kvchat.app.serve.errors import ApiError, bad
from kvchat.model.errors import KVChatError
from kvchat.model.runtime.constrained import response_format_grammar
from kvchat.model.runtime.events import Done, GenParams, Started, stats_json
from kvchat.model.text.tool_calls import ToolCall, check_tools, chosen_tools

__all__ = ["ApiError", "Limits", "Request", "bad", "parse"]

MAX_SEED = 2**64 - 1  # the sampler's seed range (model/runtime/sampling.py)

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool"}
MAX_STOPS = 16
MAX_NAME_CHARS = 1024  # `user` and `prompt_cache_key`: names, not documents
# OpenAI's Responses API name: "disabled" (the default) refuses a prompt past the
# context, "auto" drops tokens from its middle to fit
TRUNCATION = ("disabled", "auto")
# the numeric fields and their ranges (OpenAI's where it has one): (low, high, low open)
RANGES: dict[str, tuple[float, float, bool]] = {
    "temperature": (0.0, 2.0, False),
    "top_p": (0.0, 1.0, True),
    "min_p": (0.0, 1.0, False),  # below 1: min_p 1 would keep only the top token's ties
    "repetition_penalty": (0.0, 100.0, True),
}
_SURROGATE = re.compile(r"[\ud800-\udfff]")
# the engine's finish reasons in OpenAI's words (cancelled/error never reach a client)
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context_full": "length",
          "tool_calls": "tool_calls"}


@dataclass
class Limits:
    """What the server allows: the model's name(s) and the cache bound every request uses."""

    model_ids: tuple[str, ...]  # the loaded model's id first, then aliases (its path)
    capacity: int  # tokens the cache holds: --max-kv-size, else the model's context
    max_kv_size: int | None = None
    keep: int = GenParams().keep
    # other models a request may name (--models-dir): id or path -> (path, context)
    local: Mapping[str, tuple[str, int]] = field(default_factory=dict)
    # GenParams every request starts from: the K/V quantization (--kv-bits) and the
    # speculative decoding default (--prompt-lookup / --draft-model, --draft-tokens)
    kv: Mapping[str, Any] = field(default_factory=dict)
    context: int = 0  # the loaded model's context length (0: unknown, use `capacity`)
    max_prompt_tokens: int | None = None  # --max-prompt-tokens (None: the context)


@dataclass
class Request:
    """A checked request: what to run, how, and how to answer."""

    kind: str  # "chat" | "text"
    prompt: Any  # messages for "chat", text or token ids for "text"
    params: GenParams
    stream: bool = False
    include_usage: bool = False
    model: str = ""
    model_path: str | None = None  # another local model to load first (None: the loaded one)
    prompt_limit: int = 0  # most prompt tokens the model may read (its context, the cap)
    context: int = 0  # the model's context length
    truncation: str = "disabled"  # "auto": cut a longer prompt to prompt_limit
    cache_name: str | None = None  # `prompt_cache_key`, else `user`: the client's own name
    api: str = "openai"  # whose wire format answers: "openai" or "anthropic" (anthropic.py)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))


# ---- checking requests ---------------------------------------------------------------
def _get(body: Mapping[str, Any], name: str, kinds: tuple[type, ...], what: str) -> Any:
    v = body.get(name)
    if v is None:
        return None
    # JSON true is not a number here, and 1.0 is not an integer count
    if isinstance(v, bool) and bool not in kinds or not isinstance(v, kinds):
        raise bad(f"'{name}' must be {what}, got {type(v).__name__}", name)
    if isinstance(v, float) and not math.isfinite(v):
        raise bad(f"'{name}' must be a finite number", name)
    return v


def _number(body: Mapping[str, Any], name: str) -> float | None:
    v = _get(body, name, (int, float), "a number")
    if v is None:
        return None
    lo, hi, lo_open = RANGES[name]
    if not (lo < v if lo_open else lo <= v) or not v <= hi:
        what = f"({lo:g}, {hi:g}]" if lo_open else f"[{lo:g}, {hi:g}]"
        raise bad(f"'{name}' must be in {what}, got {v!r}", name)
    return float(v)


def _integer(body: Mapping[str, Any], name: str, low: int | None = None,
             high: int | None = None) -> int | None:
    v = _get(body, name, (int,), "an integer")
    if v is not None and (low is not None and v < low or high is not None and v > high):
        where = f"at least {low}" if high is None else f"in [{low}, {high}]"
        raise bad(f"'{name}' must be {where}, got {v}", name)
    return v


def _name(body: Mapping[str, Any], name: str) -> str | None:
    v = _get(body, name, (str,), "a string")
    if v is not None and len(v) > MAX_NAME_CHARS:
        raise bad(f"'{name}' is longer than {MAX_NAME_CHARS} characters", name)
    return v or None


def _surrogate_at(body: Any) -> str | None:
    """Where in `body` (a field path) a lone surrogate sits, in a key or a string: JSON's
    \\ud800 escapes decode to one, which is not Unicode (no tokenizer, log or reply can
    take it). A key holding one is named with U+FFFD in its place."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, x = stack.pop()
        if isinstance(x, str):
            if _SURROGATE.search(x):
                return path or "body"
        elif isinstance(x, dict):
            for k, v in x.items():
                key = str(k)
                if _SURROGATE.search(key):
                    return (path + "." if path else "") + _SURROGATE.sub("\ufffd", key)
                stack.append(((path + "." if path else "") + key, v))
        elif isinstance(x, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(x))
    return None


def _stops(body: Mapping[str, Any]) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad("'stop' must be a string or a list of strings", "stop")
    if len(v) > MAX_STOPS:
        raise bad(f"'stop' may hold at most {MAX_STOPS} strings", "stop")
    return tuple(s for s in v if s)


def _model(body: Mapping[str, Any], limits: Limits) -> tuple[str, str | None, int, int]:
    """(the model's id, its path when it must be loaded first, its cache capacity, its
    context length)."""
    name = _get(body, "model", (str,), "a string")
    if name is None or name == "" or name in limits.model_ids:
        return limits.model_ids[0], None, limits.capacity, limits.context or limits.capacity
    if name in limits.local:
        path, context = limits.local[name]
        return name, path, limits.max_kv_size or context, context
    raise ApiError(404, f"The model '{name}' does not exist; this server serves"
                   f" '{limits.model_ids[0]}' (GET /v1/models lists the others)",
                   param="model", code="model_not_found")


# a request's speculative decoding (kvchat's extension): "off", "lookup", or "draft" where
# the server has a draft model; never a folder (a request names no path)
SPECULATION = {"off": "off", "lookup": "lookup", "prompt_lookup": "lookup", "draft": "draft"}


def _speculation(body: Mapping[str, Any], limits: Limits) -> dict[str, Any]:
    out: dict[str, Any] = {}
    mode = _get(body, "speculation", (str,), "a string")
    if mode is not None:
        if mode not in SPECULATION:
            raise bad("'speculation' must be off, lookup or draft", "speculation")
        if SPECULATION[mode] == "draft" and not limits.kv.get("draft_model"):
            raise bad("this server has no draft model (start it with --draft-model DIR)",
                      "speculation")
        out["speculation"] = SPECULATION[mode]
    for name in ("draft_tokens", "lookup_ngram"):
        if (v := _integer(body, name)) is not None:
            out[name] = v
    return out


def _params(body: Mapping[str, Any], limits: Limits, capacity: int,
            stop: tuple[str, ...] | None = None) -> GenParams:
    """GenParams from the sampling fields (OpenAI's names; `stop`: given by the caller
    when its API names them otherwise)."""
    d = GenParams()
    max_tokens = _integer(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1)
    values: dict[str, Any] = {
        "max_tokens": d.max_tokens if max_tokens is None else max_tokens,
        "temp": _number(body, "temperature"),
        "top_p": _number(body, "top_p"),
        "seed": _integer(body, "seed", 0, MAX_SEED),
        # mlx-lm's extensions, under the same names
        "top_k": _integer(body, "top_k", 0),
        "min_p": _number(body, "min_p"),
        "repetition_penalty": _number(body, "repetition_penalty"),
        "repetition_context_size": _integer(body, "repetition_context_size", 1),
        # llama-server's extension: generate max_tokens whatever the model says (benchmarks)
        "ignore_eos": _get(body, "ignore_eos", (bool,), "a boolean"),
    }
    # a rotating window (--max-kv-size) was asked for; otherwise the reply stops when the
    # context is full rather than evict the prompt it answers
    overflow = "rotate" if limits.max_kv_size else "refuse"
    asked = {k: v for k, v in values.items() if v is not None} | _speculation(body, limits)
    params = GenParams(**{**limits.kv, **asked},
                       stop=_stops(body) if stop is None else stop,
                       max_kv_size=limits.max_kv_size, keep=limits.keep, overflow=overflow)
    # no reply outgrows the cache bound: a longer one would only evict its own prompt
    params.max_tokens = min(params.max_tokens, capacity)
    try:
        params.validate()
    except KVChatError as e:
        raise bad(str(e)) from None
    return params


def _stream(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = bool(_get(body, "stream", (bool,), "a boolean"))
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not isinstance(opts, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    known.check(opts, known.STREAM_OPTIONS, "stream_options.")
    if not stream:
        raise bad("'stream_options' is only allowed with 'stream': true", "stream_options")
    return stream, bool(_get(opts, "include_usage", (bool,), "a boolean"))


def _content(m: Mapping[str, Any], i: int) -> str:
    c = m.get("content")
    if c is None and m.get("role") == "assistant":
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):  # content parts: text only
        texts = []
        for part in c:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise bad(f"messages[{i}].content: only text parts are supported",
                          f"messages[{i}].content")
            texts.append(part["text"])
        return "".join(texts)
    raise bad(f"messages[{i}].content must be a string or a list of text parts",
              f"messages[{i}].content")


def _message(m: Mapping[str, Any], i: int) -> dict[str, Any]:
    """One message as the chat template reads it: an assistant's `tool_calls` and a tool
    result's `tool_call_id` pass through (the turn makes `arguments` objects itself)."""
    role = m.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise bad(f"messages[{i}].role must be one of system, developer, user, assistant,"
                  " tool", f"messages[{i}].role")
    out: dict[str, Any] = {"role": ROLES[role], "content": _content(m, i)}
    calls = m.get("tool_calls")
    if calls:
        if role != "assistant" or not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function"), dict)
                and isinstance(c["function"].get("name"), str) for c in calls):
            raise bad(f"messages[{i}].tool_calls must be an assistant's list of"
                      " {id, type, function: {name, arguments}}", f"messages[{i}].tool_calls")
        out["tool_calls"] = calls
    call_id = m.get("tool_call_id")
    if call_id is not None:
        if role != "tool" or not isinstance(call_id, str):
            raise bad(f"messages[{i}].tool_call_id must be a tool message's string",
                      f"messages[{i}].tool_call_id")
        out["tool_call_id"] = call_id
    return out


def _tools(body: Mapping[str, Any]) -> dict[str, Any]:
    """`tools`, `tool_choice` and `response_format` checked before the request queues
    (a 400 naming the field or schema keyword); the engine enforces them."""
    out: dict[str, Any] = {}
    tools, choice, fmt = body.get("tools"), body.get("tool_choice"), body.get("response_format")
    try:
        response_format_grammar(fmt)
    except KVChatError as e:
        raise bad(str(e), "response_format") from None
    if fmt is not None and fmt != {"type": "text"}:
        out["response_format"] = fmt
    if tools:
        try:
            checked = check_tools(tools)
        except KVChatError as e:
            raise bad(str(e), "tools") from None
        out["tools"] = checked
    if choice is not None:
        try:
            if tools:
                chosen_tools(out["tools"], choice)
            elif choice not in ("none", "auto"):
                raise KVChatError("tool_choice needs tools")
        except KVChatError as e:
            raise bad(str(e), "tool_choice") from None
        out["tool_choice"] = choice
    parallel = _get(body, "parallel_tool_calls", (bool,), "a boolean")
    if parallel is not None:
        out["parallel_tool_calls"] = parallel
    return out


def _messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list):
        raise bad("'messages' must be a list of {role, content} objects", "messages")
    if not msgs:
        raise bad("'messages' must not be empty", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object", f"messages[{i}]")
        known.check(m, known.MESSAGE, f"messages[{i}].")
        out.append(_message(m, i))
    if not out[-1]["content"].strip():
        raise bad("the last message is empty: nothing to reply to", "messages")
    return out


def _text_prompt(body: Mapping[str, Any]) -> str | list[int]:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        p = p[0]  # one prompt in a batch of one
    if isinstance(p, str):
        if not p.strip():
            raise bad("'prompt' is empty", "prompt")
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                         and t >= 0 for t in p):
        return list(p)  # token ids
    raise bad("'prompt' must be a non-empty string or a list of token ids (one prompt)",
              "prompt")


def _truncation(body: Mapping[str, Any]) -> str:
    v = _get(body, "truncation", (str,), "a string")
    if v is None:
        return "disabled"
    if v not in TRUNCATION:
        raise bad(f"'truncation' must be 'auto' or 'disabled', got {v!r}", "truncation")
    return v


def parse(kind: str, body: Any, limits: Limits) -> Request:
    """Check a decoded JSON body for `kind` ("chat" or "text"); ApiError on any problem."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    if (where := _surrogate_at(body)) is not None:
        where = where if len(where) <= 200 else where[:199] + "…"
        raise bad(f"'{where}' holds a lone surrogate (U+D800..U+DFFF): not valid Unicode",
                  where)
    known.check(body, known.CHAT if kind == "chat" else known.TEXT)
    model, path, capacity, context = _model(body, limits)
    prompt = _messages(body) if kind == "chat" else _text_prompt(body)
    stream, include_usage = _stream(body)
    cap = limits.max_prompt_tokens
    cache_key, user = _name(body, "prompt_cache_key"), _name(body, "user")
    params = _params(body, limits, capacity)
    if kind == "chat":
        for name, value in _tools(body).items():
            setattr(params, name, value)
    return Request(kind, prompt, params, stream, include_usage,
                   model, path, prompt_limit=min(context, cap) if cap else context,
                   context=context, truncation=_truncation(body),
                   cache_name=cache_key or user)


# ---- building responses -----------------------------------------------------------------
def usage(done: Done) -> dict[str, Any]:
    cached = done.stats.cached_tokens or 0
    p, c = len(done.prompt_ids), len(done.ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": cached}}


def kvchat_stats(done: Done) -> dict[str, Any]:
    """kvchat's own numbers (docs/design.md names) riding along in every final response,
    and the prompt tokens that ran through the model (not served from a cache). Not the
    prefix pool's: it holds every client's caches (GET /v1/kvchat/stats shows it)."""
    out = stats_json(done.stats)
    out.pop("prefix_pool", None)
    out["prefilled_tokens"] = len(done.prompt_ids) - (done.stats.cached_tokens or 0)
    return out


def _head(req: Request, obj: str) -> dict[str, Any]:
    prefix = "chatcmpl-" if req.kind == "chat" else "cmpl-"
    return {"id": prefix + req.id, "object": obj, "created": req.created, "model": req.model,
            "system_fingerprint": "kvchat"}


def completion(req: Request, done: Done) -> dict[str, Any]:
    """The non-streaming response."""
    finish = FINISH.get(done.finish_reason, "stop")
    if req.kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": done.text}
        if done.tool_calls:
            message["content"] = done.text or None
            message["tool_calls"] = [c.openai() for c in done.tool_calls]
        choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None,
                                  "finish_reason": finish}
        head = _head(req, "chat.completion")
    else:
        choice = {"index": 0, "text": done.text, "logprobs": None, "finish_reason": finish}
        head = _head(req, "text_completion")
    return {**head, "choices": [choice], "usage": usage(done),
            "kvchat": kvchat_stats(done)}


def chunk(req: Request, text: str | None = None, *, first: bool = False,
          done: Done | None = None) -> dict[str, Any]:
    """One streamed chunk: text, the role (first), or the finish. The finish carries the
    usage and the `kvchat` object unless a usage chunk follows (`include_usage`)."""
    finish = None if done is None else FINISH.get(done.finish_reason, "stop")
    if req.kind == "chat":
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                  "finish_reason": finish}
        head = _head(req, "chat.completion.chunk")
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        head = _head(req, "text_completion")
    out = {**head, "choices": [choice]}
    if done is not None and not req.include_usage:
        out["usage"] = usage(done)
        out["kvchat"] = kvchat_stats(done)
    return out


def tool_call_chunk(req: Request, index: int, call: ToolCall) -> dict[str, Any]:
    """A streamed tool call: the whole call, in one chunk, once the reply completed it."""
    delta = {"tool_calls": [{"index": index, **call.openai()}]}
    return {**_head(req, "chat.completion.chunk"),
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]}


def usage_chunk(req: Request, done: Done) -> dict[str, Any]:
    """stream_options.include_usage: the last chunk, no choices, the usage and the
    `kvchat` object."""
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    return {**_head(req, obj), "choices": [], "usage": usage(done),
            "kvchat": kvchat_stats(done)}


SseEvent = tuple[str | None, dict[str, Any]]  # (the SSE event name, if any; its data)


class Wire(Protocol):
    """An API's answers to a job (server.py's JobResponse sends them): the whole reply,
    or a stream's events at its start, for each piece of text or call and at its end."""

    done_marker: bytes | None  # what ends a stream after its last event, if anything

    def for_response(self) -> Wire:
        """The wire for one response (a stream's state, where the API numbers its parts)."""
        ...

    def whole(self, req: Request, done: Done, stop: str | None) -> dict[str, Any]: ...
    def start(self, req: Request, started: Started) -> list[SseEvent]: ...
    def text(self, req: Request, text: str) -> list[SseEvent]: ...
    def tool_call(self, req: Request, index: int, call: ToolCall) -> list[SseEvent]: ...
    def end(self, req: Request, done: Done, stop: str | None) -> list[SseEvent]: ...
    def error(self, err: ApiError) -> list[SseEvent]: ...
    def error_body(self, err: ApiError) -> dict[str, Any]: ...


class OpenAIWire:
    """The answers of the OpenAI routes (server.py's JobResponse sends them)."""

    done_marker: bytes | None = b"data: [DONE]\n\n"

    def for_response(self) -> OpenAIWire:
        return self  # stateless: every chunk names its own index

    def whole(self, req: Request, done: Done, stop: str | None) -> dict[str, Any]:
        return completion(req, done)

    def start(self, req: Request, started: Started) -> list[SseEvent]:
        return [(None, chunk(req, "", first=True))]

    def text(self, req: Request, text: str) -> list[SseEvent]:
        return [(None, chunk(req, text))]

    def tool_call(self, req: Request, index: int, call: ToolCall) -> list[SseEvent]:
        return [(None, tool_call_chunk(req, index, call))]

    def end(self, req: Request, done: Done, stop: str | None) -> list[SseEvent]:
        out = [(None, chunk(req, done=done))]
        if req.include_usage:
            out.append((None, usage_chunk(req, done)))
        return out

    def error(self, err: ApiError) -> list[SseEvent]:
        return [(None, err.body())]

    def error_body(self, err: ApiError) -> dict[str, Any]:
        return err.body()


WIRE = OpenAIWire()
