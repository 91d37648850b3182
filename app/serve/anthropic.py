"""Anthropic's Messages API (`POST /v1/messages`): requests checked and turned into the
same `Request` the OpenAI routes make, and the answers in Anthropic's shapes: a message
object, or its stream of events (message_start, content_block_start,
content_block_delta…, content_block_stop, message_delta, message_stop). Pure functions,
no I/O (docs/serve.md, Anthropic's Messages API).

Tool use is refused until tool calls are wired (fields.py): a 400 naming `tools`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvchat.app.serve import fields as known
from kvchat.app.serve import protocol
from kvchat.app.serve.errors import ApiError, bad
from kvchat.app.serve.protocol import Limits, Request, SseEvent
from kvchat.model.runtime.events import Done, Started
from kvchat.model.text.tool_calls import ToolCall

# the engine's finish reasons in Anthropic's words (cancelled/error never reach a client)
STOP_REASONS = {"eos": "end_turn", "stop": "stop_sequence", "length": "max_tokens",
                "context_full": "model_context_window_exceeded"}
ROLES = ("user", "assistant")


def _text_blocks(value: Any, param: str) -> str:
    """A string, or a list of text blocks joined; any other block refused by name."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad(f"'{param}' must be a string or a list of content blocks", param)
    texts = []
    for j, block in enumerate(value):
        where = f"{param}[{j}]"
        if not isinstance(block, dict):
            raise bad(f"'{where}' must be a content block object", where)
        kind = block.get("type")
        if kind != "text":
            raise known.refused(f"only text blocks are supported (got {kind!r})",
                                f"{where}.type")
        known.check(block, known.TEXT_BLOCK, f"{where}.")
        if not isinstance(block.get("text"), str):
            raise bad(f"'{where}.text' must be a string", f"{where}.text")
        texts.append(block["text"])
    return "".join(texts)


def _messages(body: Mapping[str, Any]) -> list[dict[str, str]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list of {role, content} objects", "messages")
    out: list[dict[str, str]] = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": _text_blocks(system, "system")})
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object", f"messages[{i}]")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"messages[{i}].role must be 'user' or 'assistant'", f"messages[{i}].role")
        extra = sorted(set(m) - {"role", "content"})
        if extra:
            raise bad(f"unknown field 'messages[{i}].{extra[0]}'", f"messages[{i}].{extra[0]}")
        text = _text_blocks(m.get("content"), f"messages[{i}].content")
        if len(out) > (system is not None) and out[-1]["role"] == role:
            out[-1]["content"] += "\n\n" + text  # consecutive turns of a role are one turn
        else:
            out.append({"role": role, "content": text})
    if out[-1]["role"] != "user":
        raise known.refused("a last assistant message (a prefill to continue)", "messages")
    if not out[-1]["content"].strip():
        raise bad("the last message is empty: nothing to reply to", "messages")
    return out


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
    prompt = _messages(body)
    sampling = {k: body.get(k) for k in ("max_tokens", "temperature", "top_p", "top_k")}
    params = protocol._params(sampling, limits, capacity, stop=_stops(body))
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


class AnthropicWire:
    """The answers of /v1/messages (server.py's JobResponse sends them)."""

    done_marker: bytes | None = None  # the stream ends with message_stop

    def whole(self, req: Request, done: Done, stop: str | None) -> dict[str, Any]:
        return {**_message(req, [{"type": "text", "text": done.text}], _done_usage(done),
                           STOP_REASONS.get(done.finish_reason, "end_turn"), stop),
                "kvchat": protocol.kvchat_stats(done)}

    def start(self, req: Request, started: Started) -> list[SseEvent]:
        usage = _usage(started.prompt_tokens, started.cached_tokens, 0)
        return [("message_start", {"type": "message_start",
                                   "message": _message(req, [], usage)}),
                ("content_block_start", {"type": "content_block_start", "index": 0,
                                         "content_block": {"type": "text", "text": ""}})]

    def tool_call(self, req: Request, index: int, call: ToolCall) -> list[SseEvent]:
        return []  # never made: `tools` are refused on this route (fields.py)

    def text(self, req: Request, text: str) -> list[SseEvent]:
        return [("content_block_delta", {"type": "content_block_delta", "index": 0,
                                         "delta": {"type": "text_delta", "text": text}})]

    def end(self, req: Request, done: Done, stop: str | None) -> list[SseEvent]:
        reason = STOP_REASONS.get(done.finish_reason, "end_turn")
        return [("content_block_stop", {"type": "content_block_stop", "index": 0}),
                ("message_delta", {"type": "message_delta",
                                   "delta": {"stop_reason": reason, "stop_sequence": stop},
                                   "usage": _done_usage(done),
                                   "kvchat": protocol.kvchat_stats(done)}),
                ("message_stop", {"type": "message_stop"})]

    def error(self, err: ApiError) -> list[SseEvent]:
        return [("error", err.anthropic_body())]

    def error_body(self, err: ApiError) -> dict[str, Any]:
        return err.anthropic_body()


WIRE = AnthropicWire()
