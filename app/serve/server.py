"""The ASGI app: OpenAI's routes on Starlette, the engine behind an `EngineWorker`.

Routes: POST /v1/chat/completions, POST /v1/completions, POST /v1/messages (Anthropic's),
GET /v1/models(/{id}), GET /v1/kvchat/stats, GET /health. Every answer that is not a
completion is JSON; every failure is the route's error object (OpenAI's, or Anthropic's on
/v1/messages) with its status and one log line (never a traceback).
Every request passes guard.py (Host, Origin) first; bodies are JSON only, read within a
deadline, and a prompt is tokenized (prompts.py) and checked before it queues.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvchat.app.serve import anthropic, protocol
from kvchat.app.serve.connections import ConnectionLimits
from kvchat.app.serve.errors import ApiError
from kvchat.app.serve.guard import HostPolicy, OriginPolicy, RequestGuard
from kvchat.app.serve.log import RequestLog
from kvchat.app.serve.prompts import PromptEncoder
from kvchat.app.serve.protocol import Limits
from kvchat.app.serve.worker import RETRY_AFTER_S, EngineWorker, Job, NotReady, QueueFull
from kvchat.model.runtime.events import (
    Done,
    Started,
    TextDelta,
    ToolCallDelta,
    TurnStats,
    stats_json,
)
from kvchat.model.runtime.stops import stop_found

MAX_BODY_BYTES = 4 * 1024 * 1024
IDLE_TIMEOUT_S = 10.0  # a request's headers, its body, each piece of an answer; keep-alive
JSON_TYPE = "application/json"
MESSAGES_PATH = "/v1/messages"  # Anthropic's route: its error shape, its key header
# the answers' formats by Request.api
WIRES: dict[str, protocol.Wire] = {"openai": protocol.WIRE, "anthropic": anthropic.WIRE}


@dataclass
class ServeConfig:
    api_keys: list[str] = field(default_factory=list)  # --api-key: each one a client
    max_body_bytes: int = MAX_BODY_BYTES
    max_kv_size: int | None = None
    keep: int = 4
    kv: dict[str, Any] = field(default_factory=dict)  # --kv-bits etc., GenParams' names
    allow_origins: list[str] = field(default_factory=list)  # CORS (--allow-origin)
    # the Host names answered (--allow-host); None: any (a server not on a socket: tests)
    hosts: HostPolicy | None = None
    idle_timeout_s: float = IDLE_TIMEOUT_S
    max_prompt_tokens: int | None = None  # --max-prompt-tokens (None: the context)
    tokenizer: str = "auto"  # --tokenizer: the file the engine reads (prompts.py reads it too)
    connections: ConnectionLimits | None = None  # what the connections may (connections.py)
    # other local models /v1/models lists and a request may name (--models-dir):
    # [{"id", "path", "context", ...}]
    local_models: list[dict[str, Any]] = field(default_factory=list)


def _client(scope: Scope) -> str:
    c = scope.get("client")
    return f"{c[0]}:{c[1]}" if c else "-"


class _ErrorJSON(JSONResponse):
    """An error object that always encodes: text the request brought into a message
    (a name, a template's words) may hold what UTF-8 cannot."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=False, separators=(",", ":")).encode(
            "utf-8", "replace")


def error_response(e: ApiError, api: str = "openai") -> JSONResponse:
    """`e` as the error object of `api` ("openai" or "anthropic")."""
    return _ErrorJSON(WIRES[api].error_body(e), status_code=e.status, headers=e.headers)


def api_of(path: str | None) -> str:
    """Whose error shape a route answers with."""
    return "anthropic" if path == MESSAGES_PATH else "openai"


# the body is left unread: the connection closes rather than wait for the rest of it
_CLOSE = {"Connection": "close"}


async def read_json(request: HttpRequest, limit: int, timeout_s: float = IDLE_TIMEOUT_S
                    ) -> Any:
    """The body as JSON: `application/json` only (415: a web form or a `text/plain` post
    cannot send one without a CORS preflight), at most `limit` bytes (413), whole within
    `timeout_s` (408), valid JSON (400)."""
    media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media != JSON_TYPE:
        raise ApiError(415, f"the request body must be JSON (Content-Type: {JSON_TYPE})",
                       code="unsupported_media_type", headers=_CLOSE)
    too_large = ApiError(413, f"request body over {limit} bytes", code="body_too_large",
                         headers=_CLOSE)
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):  # a client sending its body slowly
            async for piece in request.stream():
                body += piece
                if len(body) > limit:
                    raise too_large
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s",
                       code="request_timeout", headers=_CLOSE) from None
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise protocol.bad(f"invalid JSON body: {e}") from None


class KVChatServer:
    """The routes, with the worker and the log they share."""

    def __init__(self, worker: EngineWorker, config: ServeConfig, log: RequestLog):
        self.worker = worker
        self.config = config
        self.log = log
        self.prompts = PromptEncoder(config.tokenizer)

    # ---- the app -----------------------------------------------------------------------
    def app(self) -> ASGIApp:
        g = self._guarded
        routes = [
            Route("/v1/chat/completions", g(self.chat), methods=["POST"]),
            Route("/v1/completions", g(self.text), methods=["POST"]),
            Route(MESSAGES_PATH, g(self.messages), methods=["POST"]),
            Route("/v1/models", g(self.models), methods=["GET"]),
            Route("/v1/models/{model_id:path}", g(self.model), methods=["GET"]),
            Route("/v1/kvchat/stats", g(self.stats), methods=["GET"]),
            Route("/health", g(self.health, auth=False), methods=["GET"]),
        ]

        async def http_error(request: HttpRequest, exc: Exception) -> Response:
            assert isinstance(exc, HTTPException)  # 404 / 405 from the router
            e = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                         code="not_found" if exc.status_code == 404 else None)
            self._log(request.scope, e.status, error=e.message)
            return error_response(e, api_of(request.url.path))

        middleware = []
        if self.config.allow_origins:  # browser front-ends on other origins (off by default)
            middleware.append(Middleware(
                CORSMiddleware, allow_origins=self.config.allow_origins,
                allow_methods=["GET", "POST"],
                allow_headers=["Authorization", "Content-Type", "X-Api-Key", "Anthropic-Version",
                               "Anthropic-Beta"]))
        app = Starlette(routes=routes, middleware=middleware,
                        exception_handlers={HTTPException: http_error})
        if self.config.hosts is None:
            return app
        return RequestGuard(app, self.config.hosts, OriginPolicy.build(self.config.allow_origins),
                            lambda scope, e: self._log(scope, e.status, error=e.message),
                            lambda scope, e: WIRES[api_of(scope.get("path"))].error_body(e))

    def _guarded(self, handler: Callable[[HttpRequest], Awaitable[Any]], auth: bool = True
                 ) -> Callable[[HttpRequest], Awaitable[Any]]:
        """Auth, then the handler; an ApiError becomes its error object, anything else
        a 500 with one log line (the server carries on)."""

        async def endpoint(request: HttpRequest) -> Any:
            t0 = time.monotonic()
            try:
                if auth:
                    request.state.api_key = self._check_key(request)
                return await handler(request)
            except ApiError as e:
                self._log(request.scope, e.status, error=e.message,
                          duration_s=time.monotonic() - t0)
                return error_response(e, api_of(request.url.path))
            except Exception as e:  # a bug: one line, an error object, the server lives
                msg = f"internal error: {type(e).__name__}: {e}"
                self._log(request.scope, 500, error=msg, duration_s=time.monotonic() - t0)
                return error_response(ApiError(500, msg, type="server_error"),
                                      api_of(request.url.path))

        return endpoint

    def _check_key(self, request: HttpRequest) -> str | None:
        """The API key the request gave (None when the server needs none), as OpenAI's
        clients send it (Authorization: Bearer KEY) or Anthropic's (x-api-key: KEY);
        401 else."""
        if not self.config.api_keys:
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        bearer = token.strip() if scheme.lower() == "bearer" else None
        sent = [x.encode("utf-8", "replace") for x in (bearer, request.headers.get("x-api-key"))
                if x is not None]
        # compare_digest, with every key: the time taken tells neither how much of a key
        # matched nor which one
        found = None
        for key in self.config.api_keys:
            for given in sent:
                if hmac.compare_digest(given, key.encode()):
                    found = key
        if found is None:
            raise ApiError(401, "invalid or missing API key (Authorization: Bearer KEY, or"
                           " x-api-key: KEY)", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        return found

    def _log(self, scope: Scope, status: int, **fields: Any) -> None:
        self.log.write(client=_client(scope), method=scope.get("method"),
                       path=scope.get("path"), status=status, **fields)

    # ---- routes ------------------------------------------------------------------------
    def _limits(self) -> Limits:
        info = self.worker.info
        ids = tuple(x for x in (info.get("name"), info.get("path")) if x)
        capacity = self.config.max_kv_size or int(info.get("context") or 0) or 2048
        local = {key: (m["path"], m["context"]) for m in self.config.local_models
                 if m["path"] != info.get("path") for key in (m["id"], m["path"])}
        return Limits(ids or ("kvchat",), capacity, self.config.max_kv_size, self.config.keep,
                      local, self.config.kv, int(info.get("context") or 0),
                      self.config.max_prompt_tokens)

    async def chat(self, request: HttpRequest) -> Any:
        return await self._complete(request, "chat")

    async def text(self, request: HttpRequest) -> Any:
        return await self._complete(request, "text")

    async def messages(self, request: HttpRequest) -> Any:
        return await self._complete(request, "messages")

    async def _complete(self, request: HttpRequest, kind: str) -> Any:
        """`kind`: "chat" or "text" (OpenAI's routes), "messages" (Anthropic's)."""
        body = await read_json(request, self.config.max_body_bytes, self.config.idle_timeout_s)
        if not self.worker.ready.is_set():
            raise ApiError(503, "the model is still loading; retry shortly",
                           type="server_error", code="model_loading",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        if self.worker.load_error is not None:
            raise ApiError(503, f"engine not available: {self.worker.load_error}",
                           type="server_error")
        if kind == "messages":
            req = anthropic.parse(body, self._limits())
        else:
            req = protocol.parse(kind, body, self._limits())
        # the prompt's length is known before it queues: too long, it is refused now
        path = req.model_path or str(self.worker.info.get("path") or "")
        ids = await self.prompts.ids(req, path)
        req.params.cache_partition = cache_partition(request.state.api_key, req.cache_name)
        try:
            job = self.worker.submit(ids, req.params, req.model_path)
        except QueueFull as e:
            raise ApiError(429, f"server busy: {e}; retry shortly", type="rate_limit_error",
                           code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)},
                           ) from None
        except NotReady as e:
            raise ApiError(503, f"engine not available: {e}", type="server_error") from None
        return JobResponse(self, job, req)

    def _model_object(self, model_id: str, extra: dict[str, Any]) -> dict[str, Any]:
        return {"id": model_id, "object": "model", "created": int(self.worker.t_start),
                "owned_by": "kvchat", "kvchat": extra}

    def _model_objects(self) -> list[dict[str, Any]]:
        w = self.worker
        status = "ready" if w.is_ready else ("failed" if w.load_error else "loading")
        loaded = self._model_object(self._limits().model_ids[0], {
            "loaded": True, "status": status, "ready": w.is_ready, "error": w.load_error,
            **w.info})
        others = [self._model_object(m["id"], {"loaded": False, **m})
                  for m in self.config.local_models if m.get("path") != w.info.get("path")]
        return [loaded, *others]

    async def models(self, request: HttpRequest) -> Any:
        self._log(request.scope, 200)
        return JSONResponse({"object": "list", "data": self._model_objects()})

    async def model(self, request: HttpRequest) -> Any:
        want = request.path_params["model_id"]
        for m in self._model_objects():
            if want in (m["id"], m["kvchat"].get("path")):
                self._log(request.scope, 200)
                return JSONResponse(m)
        raise ApiError(404, f"The model '{want}' does not exist", param="model",
                       code="model_not_found")

    async def stats(self, request: HttpRequest) -> Any:
        """Live numbers for a dashboard: the cache now (with the pool of idle caches: the
        caller's own conversations when the server has keys), the running turn, the last
        finished turn, the queue and the totals."""
        w = self.worker
        cache = None
        owner = partition_owner(request.state.api_key) if self.config.api_keys else None
        if w.engine is not None:
            cache = stats_json(w.engine.cache_stats())
            cache["prefix_pool"] = pool_view(cache.get("prefix_pool"), owner, time.time())
        running = running_view(w.started, owner, time.monotonic())
        context, cap = self._limits().context, self.config.max_prompt_tokens
        body = {
            "model": w.info.get("name"), "ready": w.is_ready,
            "uptime_s": round(time.time() - w.t_start, 3),
            "queue": w.queue_stats(),
            "totals": dict(w.counters),
            "cache": cache,
            "running": running[0] if running else None,
            "running_requests": running,
            "last": _turn_json(w.last),
            "connections": None if self.config.connections is None
            else self.config.connections.stats(),
            "limits": {"max_kv_size": self.config.max_kv_size, "keep": self.config.keep,
                       "max_body_bytes": self.config.max_body_bytes,
                       "max_prompt_tokens": min(context, cap) if cap else context,
                       "idle_timeout_s": self.config.idle_timeout_s},
        }
        self._log(request.scope, 200)
        return JSONResponse(body)

    async def health(self, request: HttpRequest) -> Any:
        code, body = health(self.worker)
        return JSONResponse(body, status_code=code)


def health(w: EngineWorker) -> tuple[int, dict[str, Any]]:
    """/health: 200 only while the model is loaded and the engine lives; what it is doing
    (a job running for how long, how many wait), so a monitor sees a turn that never ends."""
    alive = w.engine is not None and getattr(w.engine, "alive", True)
    if not (w.is_ready and alive):
        state = "failed" if w.load_error else ("stopped" if w.ready.is_set() else "loading")
        return 503, {"status": state}
    job = w.current
    running_s = None if job is None or job.t_start is None else time.monotonic() - job.t_start
    return 200, {"status": "ok", "engine": "busy" if job is not None else "idle",
                 "running_s": None if running_s is None else round(running_s, 1),
                 "waiting": len(w.waiting)}


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value).encode("utf-8", "replace")).hexdigest()


def partition_owner(api_key: str | None) -> str:
    """The first part of the partitions of `api_key`'s requests (a digest)."""
    return _digest(["owner", api_key])[:16]


def cache_partition(api_key: str | None, name: str | None) -> str | None:
    """Whose cached prompts a request may continue (GenParams.cache_partition): its API
    key's, narrowed by the `prompt_cache_key` or `user` it names; None (one partition
    for all) when it has neither. Digests, "OWNER.NAME": no key travels to the engine,
    and the stats show a key's client its own conversations (`pool_view`)."""
    if api_key is None and name is None:
        return None
    return f"{partition_owner(api_key)}.{_digest([api_key, name])[:32]}"


def pool_view(pool: dict[str, Any] | None, owner: str | None, now: float
              ) -> dict[str, Any] | None:
    """The prefix pool as /v1/kvchat/stats shows it: its counters, and its conversations
    (tokens, bytes, age, idle time, hits), those of `owner`'s partitions only (None:
    all, a server without keys). Partitions themselves are not shown."""
    if pool is None:
        return None
    shown = []
    for c in pool.get("conversations", []):
        if owner is not None and not str(c.get("partition") or "").startswith(owner + "."):
            continue
        shown.append({"tokens": c["tokens"], "bytes": c["bytes"],
                      "age_s": round(max(0.0, now - c["created"]), 3),
                      "idle_s": round(max(0.0, now - c["used"]), 3),
                      "hits": c["hits"], "current": c["current"]})
    counters = {k: v for k, v in pool.items() if k not in ("conversations", "tokens")}
    return {**counters, "conversations": shown}


def running_view(jobs: list[Any], owner: str | None, now: float) -> list[dict[str, Any]]:
    """The running requests as /v1/kvchat/stats shows them, the longest-running first:
    each one's own latest numbers and `age_s` (since it started), those of `owner`'s
    partitions only (None: all, a server without keys)."""
    return [{"age_s": round(max(0.0, now - (j.t_start or now)), 3),
             **_turn_json(j.live or TurnStats())} for j in jobs
            if owner is None or str(j.params.cache_partition or "").startswith(owner + ".")]


def _turn_json(stats: Any) -> dict[str, Any]:
    """A turn's numbers without the pool (every client's: the stats route shows it once)."""
    out = stats_json(stats)
    out.pop("prefix_pool", None)
    return out


class JobResponse:
    """An ASGI response that runs a job: the whole reply as JSON, or server-sent events
    (OpenAI's chunks ending with `data: [DONE]`, or Anthropic's events), as `req.api`
    says. Headers wait for the turn to start, so a prompt the engine refuses (a template
    that fails, say) still gets a 400. A client that goes away cancels the job (dropped
    from the queue, or stopped within one decode step)."""

    def __init__(self, server: KVChatServer, job: Job, req: protocol.Request):
        self.server, self.job, self.req = server, job, req
        self.wire = WIRES[req.api].for_response()
        self._held: Any = None  # an event read ahead while merging text deltas

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = asyncio.create_task(self._watch(receive))
        t0 = time.monotonic()
        status, done, error = 500, None, None
        timeout_s = self.server.config.idle_timeout_s

        async def send_in_time(message: Message) -> None:
            async with asyncio.timeout(timeout_s):  # a client that stopped reading
                await send(message)

        try:
            reply = self._stream if self.req.stream else self._whole
            status, done = await reply(scope, send_in_time)
        except TimeoutError:
            error = f"the client took no part of the answer for {timeout_s:g} s"
        except Exception as e:  # the connection broke mid-answer, say: one line, no trace
            error = f"{type(e).__name__}: {e}"
        finally:
            watcher.cancel()
            self.server.worker.cancel(self.job)  # no-op once done
            self._log(scope, status, done, time.monotonic() - t0, error)

    async def _watch(self, receive: Receive) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                self.server.worker.cancel(self.job)
                return

    def _log(self, scope: Scope, status: int, done: Done | None, secs: float,
             error: str | None = None) -> None:
        fields: dict[str, Any] = {"duration_s": secs, "error": error, "model": self.req.model}
        if done is not None:
            s = done.stats
            use = s.cache or {}
            fields.update(prompt_tokens=len(done.prompt_ids), reused_tokens=s.cached_tokens or 0,
                          generated_tokens=len(done.ids), prefill_tps=s.prefill_tps or 0.0,
                          decode_tps=s.decode_tps or 0.0, finish_reason=done.finish_reason,
                          miss_reason=use.get("miss_reason"), differs_at=use.get("differs_at"))
            if done.finish_reason == "error":
                fields["error"] = done.error
            elif done.finish_reason == "cancelled":
                fields["error"] = error or "client disconnected"
        self.server._log(scope, status, **fields)

    async def _next(self) -> Any:
        if self._held is not None:
            ev, self._held = self._held, None
            return ev
        return await self.job.events.get()

    def _more_text(self) -> str:
        """Text deltas already queued behind the one just read (sent as one chunk)."""
        text = ""
        while self._held is None and not self.job.events.empty():
            ev = self.job.events.get_nowait()
            if isinstance(ev, TextDelta):
                text += ev.text
            else:
                self._held = ev
        return text

    def _failure(self, done: Done) -> ApiError:
        """Before the turn started, an error is the request's (template, empty prompt,
        too long to fit): 400; after, the server's: 500."""
        msg = done.error or "generation failed"
        if self.job.started is None:
            return ApiError(400, msg, code="invalid_prompt")
        return ApiError(500, msg, type="server_error")

    async def _refuse(self, done: Done, scope: Scope, send: Send) -> int:
        """Answer a failed or cancelled job with an error object; its status."""
        err = self._failure(done) if done.finish_reason == "error" else \
            ApiError(499, "client disconnected", code="cancelled")
        await error_response(err, self.req.api)(scope, _nothing, send)
        return err.status

    async def _stop(self, done: Done) -> str | None:
        """The stop string that ended the reply (Anthropic's `stop_sequence`; OpenAI's
        answers do not say): the reply's ids decoded whole, read where the text was cut."""
        stops = self.req.params.stop
        if self.req.api != "anthropic" or done.finish_reason != "stop" or not stops:
            return None
        path = self.req.model_path or str(self.server.worker.info.get("path") or "")
        text = await self.server.prompts.decode(done.ids, path)
        return stop_found(text, len(done.text), stops)

    async def _whole(self, scope: Scope, send: Send) -> tuple[int, Done]:
        while not isinstance(done := await self._next(), Done):
            pass
        if done.finish_reason in ("error", "cancelled"):
            return await self._refuse(done, scope, send), done
        answer = self.wire.whole(self.req, done, await self._stop(done))
        await JSONResponse(answer)(scope, _nothing, send)
        return 200, done

    async def _stream(self, scope: Scope, send: Send) -> tuple[int, Done | None]:
        ev = await self._next()
        while not isinstance(ev, (Started, Done)):
            ev = await self._next()
        if isinstance(ev, Done):  # refused before it started: a plain error answer
            return await self._refuse(ev, scope, send), ev
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})
        await self._events(send, self.wire.start(self.req, ev))
        while True:
            ev = await self._next()
            if isinstance(ev, TextDelta):
                text = ev.text + self._more_text()
                await self._events(send, self.wire.text(self.req, text))
            elif isinstance(ev, ToolCallDelta):
                await self._events(send, self.wire.tool_call(self.req, ev.index, ev.call))
            elif isinstance(ev, Done):
                break
        if ev.finish_reason == "error":  # mid-stream: the error object as an event
            await self._events(send, self.wire.error(self._failure(ev)))
        elif ev.finish_reason != "cancelled":
            await self._events(send, self.wire.end(self.req, ev, await self._stop(ev)))
        await send({"type": "http.response.body", "body": self.wire.done_marker or b"",
                    "more_body": False})
        return 200, ev

    @staticmethod
    async def _events(send: Send, events: list[tuple[str | None, dict[str, Any]]]) -> None:
        """Server-sent events: `data: JSON`, after `event: NAME` where the API names them."""
        data = b""
        for name, obj in events:
            if name is not None:
                data += b"event: " + name.encode() + b"\n"
            data += b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"
        await send({"type": "http.response.body", "body": data, "more_body": True})


async def _nothing() -> dict[str, Any]:  # a Receive for responses that never read
    return {"type": "http.disconnect"}
