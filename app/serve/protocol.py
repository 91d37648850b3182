"""The OpenAI wire format: requests checked and turned into a prompt and GenParams, and
the response objects built from the engine's events. Pure functions, no I/O.

Every problem with a request is an `ApiError` carrying the OpenAI error object and a 4xx
status; the server never lets a request reach the engine half-checked.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvchat.model.errors import KVChatError
from kvchat.model.runtime.events import Done, GenParams, stats_json

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MAX_STOPS = 16
# the engine's finish reasons in OpenAI's words (cancelled/error never reach a client)
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context_full": "length"}


class ApiError(Exception):
    """An OpenAI error object with its HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code = param, code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


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
    return None if v is None else float(v)


def _integer(body: Mapping[str, Any], name: str) -> int | None:
    return _get(body, name, (int,), "an integer")


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


def _model(body: Mapping[str, Any], limits: Limits) -> tuple[str, str | None, int]:
    """(the model's id, its path when it must be loaded first, its cache capacity)."""
    name = _get(body, "model", (str,), "a string")
    if name is None or name == "" or name in limits.model_ids:
        return limits.model_ids[0], None, limits.capacity
    if name in limits.local:
        path, context = limits.local[name]
        return name, path, limits.max_kv_size or context
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


def _params(body: Mapping[str, Any], limits: Limits, capacity: int) -> GenParams:
    if (n := _integer(body, "n")) is not None and n != 1:
        raise bad("only n=1 is supported", "n")
    if body.get("logprobs") not in (None, False, 0):
        raise bad("logprobs are not supported", "logprobs")
    d = GenParams()
    max_tokens = _integer(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens")
    fields: dict[str, Any] = {
        "max_tokens": d.max_tokens if max_tokens is None else max_tokens,
        "temp": _number(body, "temperature"),
        "top_p": _number(body, "top_p"),
        "seed": _integer(body, "seed"),
        # mlx-lm's extensions, under the same names
        "top_k": _integer(body, "top_k"),
        "min_p": _number(body, "min_p"),
        "repetition_penalty": _number(body, "repetition_penalty"),
        # llama-server's extension: generate max_tokens whatever the model says (benchmarks)
        "ignore_eos": _get(body, "ignore_eos", (bool,), "a boolean"),
    }
    asked = {k: v for k, v in fields.items() if v is not None} | _speculation(body, limits)
    params = GenParams(**{**limits.kv, **asked}, stop=_stops(body),
                       max_kv_size=limits.max_kv_size, keep=limits.keep)
    if params.max_tokens < 1:
        raise bad(f"'max_tokens' must be at least 1, got {params.max_tokens}", "max_tokens")
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


def _messages(body: Mapping[str, Any]) -> list[dict[str, str]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list):
        raise bad("'messages' must be a list of {role, content} objects", "messages")
    if not msgs:
        raise bad("'messages' must not be empty", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object", f"messages[{i}]")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"messages[{i}].role must be one of system, developer, user, assistant",
                      f"messages[{i}].role")
        out.append({"role": ROLES[role], "content": _content(m, i)})
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


def parse(kind: str, body: Any, limits: Limits) -> Request:
    """Check a decoded JSON body for `kind` ("chat" or "text"); ApiError on any problem."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    model, path, capacity = _model(body, limits)
    prompt = _messages(body) if kind == "chat" else _text_prompt(body)
    stream, include_usage = _stream(body)
    if kind == "text" and body.get("echo"):
        raise bad("echo is not supported", "echo")
    return Request(kind, prompt, _params(body, limits, capacity), stream, include_usage,
                   model, path)


# ---- building responses -----------------------------------------------------------------
def usage(done: Done) -> dict[str, Any]:
    cached = done.stats.cached_tokens or 0
    p, c = len(done.prompt_ids), len(done.ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": cached}}


def kvchat_stats(done: Done) -> dict[str, Any]:
    """kvchat's own numbers (DESIGN.md names) riding along in every final response, and
    the prompt tokens that ran through the model (not served from a cache)."""
    out = stats_json(done.stats)
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
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant",
                                                           "content": done.text},
                                  "logprobs": None, "finish_reason": finish}
        head = _head(req, "chat.completion")
    else:
        choice = {"index": 0, "text": done.text, "logprobs": None, "finish_reason": finish}
        head = _head(req, "text_completion")
    return {**head, "choices": [choice], "usage": usage(done),
            "kvchat": kvchat_stats(done)}


def chunk(req: Request, text: str | None = None, *, first: bool = False,
          done: Done | None = None) -> dict[str, Any]:
    """One streamed chunk: text, the role (first), or the finish (with usage and stats)."""
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
    if done is not None:
        out["usage"] = usage(done)
        out["kvchat"] = kvchat_stats(done)
    return out


def usage_chunk(req: Request, done: Done) -> dict[str, Any]:
    """stream_options.include_usage: the last chunk, no choices, the usage."""
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    return {**_head(req, obj), "choices": [], "usage": usage(done)}
