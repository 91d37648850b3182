"""Anthropic's Messages API (`POST /v1/messages`): requests checked and turned into the
same `Request` the OpenAI routes make (the conversation and tools: anthropic_messages.py),
and the answers in Anthropic's shapes: a message object, or its stream of events
(message_start, then per content block content_block_start, content_block_delta…,
content_block_stop, then message_delta, message_stop). Pure functions, no I/O
(docs/serve.md, Anthropic's Messages API).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvchat.app.serve import anthropic_messages as convert
from kvchat.app.serve import fields as known
from kvchat.app.serve import protocol
from kvchat.app.serve.errors import ApiError, bad
from kvchat.app.serve.protocol import Limits, Request, SseEvent
from kvchat.model.runtime.events import Done, Started
from kvchat.model.text.tool_calls import ToolCall

# the engine's finish reasons in Anthropic's words (cancelled/error never reach a client)
STOP_REASONS = {"eos": "end_turn", "stop": "stop_sequence", "length": "max_tokens",
                "context_full": "model_context_window_exceeded", "tool_calls": "tool_use"}


def _stops(body: Mapping[str, Any]) -> tuple[str, ...]:
    v = body.get("stop_sequences")
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad("'stop_sequences' must be a list of strings", "stop_sequences")
    if len(v) > protocol.MAX_STOPS:
        raise bad(f"'stop_sequences' may hold at most {protocol.MAX_STOPS} strings",
                  "stop_sequences")
    return tuple(s for s in v if s)


def _user(body: Mapping[str, Any]) -> str | None:
    meta = body.get("metadata")
    if meta is None:
        return None
    if not isinstance(meta, dict):
        raise bad("'metadata' must be an object", "metadata")
    known.check(meta, known.MESSAGES_METADATA, "metadata.")
    return protocol._name(meta, "user_id")


def parse(body: Any, limits: Limits) -> Request:
    """Check a decoded JSON body for /v1/messages; ApiError (a 4xx) on any problem."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    if (where := protocol._surrogate_at(body)) is not None:
        where = where if len(where) <= 200 else where[:199] + "…"
        raise bad(f"'{where}' holds a lone surrogate (U+D800..U+DFFF): not valid Unicode",
                  where)
    known.check(body, known.MESSAGES)
    model, path, capacity, context = protocol._model(body, limits)
    if body.get("max_tokens") is None:
        raise bad("'max_tokens' is required", "max_tokens")
    temp = protocol._get(body, "temperature", (int, float), "a number")
    if temp is not None and not 0 <= temp <= 1:
        raise bad(f"'temperature' must be in [0, 1], got {temp!r}", "temperature")
    prompt, tool_blocks = convert.conversation(body)
    functions = convert.tools(body.get("tools"))
    if tool_blocks and not functions:  # as Anthropic's API: the template needs them
        raise bad("a conversation with tool_use or tool_result blocks needs 'tools'",
                  "tools")
    choice, parallel = convert.tool_choice(body.get("tool_choice"), functions)
    sampling = {k: body.get(k) for k in ("max_tokens", "temperature", "top_p", "top_k")}
    params = protocol._params(sampling, limits, capacity, stop=_stops(body))
    params.tools, params.tool_choice = functions or None, choice
    params.parallel_tool_calls = parallel
    stream = bool(protocol._get(body, "stream", (bool,), "a boolean"))
    cap = limits.max_prompt_tokens
    return Request("chat", prompt, params, stream, False, model, path,
                   prompt_limit=min(context, cap) if cap else context, context=context,
                   cache_name=_user(body), api="anthropic")


# ---- answers -----------------------------------------------------------------------
def _usage(prompt_tokens: int, cached: int, output: int) -> dict[str, Any]:
    """Anthropic counts a prompt in parts: read from the cache, and the rest."""
    return {"input_tokens": prompt_tokens - cached, "output_tokens": output,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _done_usage(done: Done) -> dict[str, Any]:
    return _usage(len(done.prompt_ids), done.stats.cached_tokens or 0, len(done.ids))


def _message(req: Request, content: list[dict[str, Any]], usage: dict[str, Any],
             stop_reason: str | None = None, stop: str | None = None) -> dict[str, Any]:
    return {"id": "msg_" + req.id, "type": "message", "role": "assistant", "model": req.model,
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop,
            "usage": usage}


def _content(done: Done) -> list[dict[str, Any]]:
    """The reply's blocks in the order it wrote them (as a stream numbers them): its
    text between the calls, each call; one text block, empty or not, when no call."""
    if not done.tool_calls:
        return [{"type": "text", "text": done.text}]
    out: list[dict[str, Any]] = []
    start = 0
    for call, at in zip(done.tool_calls, done.tool_call_offsets, strict=True):
        if done.text[start:at]:
            out.append({"type": "text", "text": done.text[start:at]})
        out.append(convert.tool_use_block(call))
        start = at
    if done.text[start:]:
        out.append({"type": "text", "text": done.text[start:]})
    return out


class AnthropicWire:
    """The answers of /v1/messages (server.py's JobResponse sends them). A stream's
    content blocks are numbered as they open: text opens a text block (closed by a call
    or the end), each call is one tool_use block, whole: its input in one
    `input_json_delta`. So one wire answers one request (`for_response`)."""

    done_marker: bytes | None = None  # the stream ends with message_stop

    def __init__(self) -> None:
        self._next = 0  # the next block's index
        self._text_open = False

    def for_response(self) -> AnthropicWire:
        return AnthropicWire()

    def whole(self, req: Request, done: Done, stop: str | None) -> dict[str, Any]:
        return {**_message(req, _content(done), _done_usage(done),
                           STOP_REASONS.get(done.finish_reason, "end_turn"), stop),
                "kvchat": protocol.kvchat_stats(done)}

    def start(self, req: Request, started: Started) -> list[SseEvent]:
        usage = _usage(started.prompt_tokens, started.cached_tokens, 0)
        return [("message_start", {"type": "message_start",
                                   "message": _message(req, [], usage)})]

    def _open(self, block: dict[str, Any]) -> list[SseEvent]:
        self._next += 1
        return [("content_block_start", {"type": "content_block_start",
                                         "index": self._next - 1, "content_block": block})]

    def _close(self) -> list[SseEvent]:
        self._text_open = False
        return [("content_block_stop", {"type": "content_block_stop",
                                        "index": self._next - 1})]

    def _delta(self, delta: dict[str, Any]) -> list[SseEvent]:
        return [("content_block_delta", {"type": "content_block_delta",
                                         "index": self._next - 1, "delta": delta})]

    def text(self, req: Request, text: str) -> list[SseEvent]:
        out: list[SseEvent] = []
        if not self._text_open:
            out = self._open({"type": "text", "text": ""})
            self._text_open = True
        return out + self._delta({"type": "text_delta", "text": text})

    def tool_call(self, req: Request, index: int, call: ToolCall) -> list[SseEvent]:
        block = convert.tool_use_block(call)
        out = self._close() if self._text_open else []
        return (out + self._open({**block, "input": {}})
                + self._delta({"type": "input_json_delta", "partial_json": call.arguments})
                + self._close())

    def end(self, req: Request, done: Done, stop: str | None) -> list[SseEvent]:
        reason = STOP_REASONS.get(done.finish_reason, "end_turn")
        out: list[SseEvent] = []
        if not self._next:  # no text and no call: one empty text block, as `whole`'s
            out = self._open({"type": "text", "text": ""})
            self._text_open = True
        if self._text_open:
            out += self._close()
        return out + [("message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": reason,
                                                   "stop_sequence": stop},
                                         "usage": _done_usage(done),
                                         "kvchat": protocol.kvchat_stats(done)}),
                      ("message_stop", {"type": "message_stop"})]

    def error(self, err: ApiError) -> list[SseEvent]:
        return [("error", err.anthropic_body())]

    def error_body(self, err: ApiError) -> dict[str, Any]:
        return err.anthropic_body()


WIRE = AnthropicWire()
