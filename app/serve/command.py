"""`kvchat serve`: the engine behind an OpenAI-compatible HTTP API (Starlette on uvicorn).

Safe by default: it listens on 127.0.0.1; another address needs --api-key (a Bearer
token) or an explicit --insecure. It answers requests naming it in their Host header,
refuses web pages from other origins, bounds every request's work and every connection's
time (docs/serve.md, Who can reach the server). The socket is bound before the model
loads (a port in use is one line, exit 1; --port 0 takes a free one and says which), the
model loads in the engine's own process, and /v1/models and /health say when it is ready.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import math
import os
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvchat.app.core import memory
from kvchat.app.core.discovery import DEFAULT_MODEL
from kvchat.app.core.engine_service import EngineOptions, EngineService
from kvchat.app.core.errors import UsageError
from kvchat.app.core.kv_args import add_kv_arguments, kv_quant_from_args
from kvchat.app.core.speculation_args import add_speculation_arguments, speculation_fields
from kvchat.model.errors import KVChatError
from kvchat.model.runtime.events import MAX_KV_SIZE, GenParams

DEFAULT_PORT = 8080
# idle caches kept for other conversations (model/cache/prefix_pool.py): by default this
# share of the machine's memory, at least MIN_POOL_MB (FALLBACK_POOL_MB where unknown)
POOL_SHARE = 8
MIN_POOL_MB = 64
FALLBACK_POOL_MB = 256
DEFAULT_MAX_QUEUE = 16
DEFAULT_MAX_BATCH = 8  # requests decoded side by side (docs/serve.md, "Many clients")
DEFAULT_IDLE_TIMEOUT_S = 10.0
# the numeric flags' ranges: (low, high, low open); a value outside is a usage error
RANGES: dict[str, tuple[float, float, bool]] = {
    "port": (0, 65535, False),
    "max_queue": (0, 100_000, False),
    "max_batch": (1, 256, False),
    "cache_pool_mb": (0, 2**20, False),  # 1 TiB
    "max_body_mb": (0, 1024, True),
    "idle_timeout": (0, 3600, True),
    "max_prompt_tokens": (1, MAX_KV_SIZE, False),
    "max_kv_size": (1, MAX_KV_SIZE, False),
    "keep": (0, MAX_KV_SIZE - 1, False),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="DIR", help="model folder, GGUF file or ollama:NAME[:TAG]"
                   f" (default: {DEFAULT_MODEL})")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default %(default)s; another needs --api-key"
                   " or --insecure)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help="port (default %(default)s; 0 = any free port, printed at start)")
    p.add_argument("--api-key", dest="api_keys", action="append", metavar="KEY",
                   help="require 'Authorization: Bearer KEY' (repeatable: one per client,"
                   " each with its own cached prompts; default: $KVCHAT_API_KEY)")
    p.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback --host without --api-key")
    p.add_argument("--max-kv-size", type=int, default=None, metavar="N",
                   help="bound every request's KV cache to N tokens (rotating)")
    add_kv_arguments(p)
    memory.add_argument(p)
    add_speculation_arguments(p)  # the default of every request; one may ask otherwise
    p.add_argument("--keep", type=int, default=None, metavar="K",
                   help=f"sink tokens kept when the cache rotates (needs --max-kv-size;"
                   f" default {GenParams().keep})")
    p.add_argument("--allow-origin", dest="allow_origins", action="append", default=[],
                   metavar="ORIGIN", help="let web pages from ORIGIN call the API (CORS;"
                   " repeatable, * = any; other pages are refused)")
    p.add_argument("--allow-host", dest="allow_hosts", action="append", default=[],
                   metavar="NAME", help="answer requests whose Host header is NAME (at this"
                   " port) or NAME:PORT too, besides localhost and the bound address"
                   " (repeatable, * = any)")
    p.add_argument("--hosts", dest="serve_hostfile", metavar="HOSTFILE",
                   help="split the model across the hosts of an mlx.launch hostfile")
    p.add_argument("--models-dir", dest="models_dirs", action="append", default=[],
                   metavar="DIR", help="serve the models found in DIR too: listed in"
                   " /v1/models, loaded when a request names one (repeatable)")
    p.add_argument("--cache-pool-mb", type=float, default=None, metavar="MB",
                   help="memory for idle caches of other conversations, reused by prefix"
                   f" (default: 1/{POOL_SHARE} of the machine's memory, shown at start;"
                   " 0 = one cache)")
    p.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH, metavar="N",
                   help="requests decoded side by side in one batched step"
                   " (default %(default)s; 1: one at a time)")
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE, metavar="N",
                   help="requests that may wait; past it: 429 (default %(default)s)")
    p.add_argument("--max-body-mb", type=float, default=4.0, metavar="MB",
                   help="largest request body accepted (default %(default)s)")
    p.add_argument("--max-prompt-tokens", type=int, default=None, metavar="N",
                   help="longest prompt a request may send, in tokens (default and at most:"
                   " the model's context); past it: 400, or cut with \"truncation\": \"auto\"")
    p.add_argument("--idle-timeout", type=float, default=DEFAULT_IDLE_TIMEOUT_S, metavar="S",
                   help="seconds a connection gets to send a request's headers, then its body,"
                   " to take each piece of an answer, and to stay idle between requests"
                   " (default %(default)s)")
    p.add_argument("--json-logs", action="store_true", help="log one JSON object per line")
    p.add_argument("--tokenizer", choices=["auto", "sentencepiece", "hf"], default="auto",
                   help="tokenizer file to use: auto prefers tokenizer.json")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def api_keys(args: argparse.Namespace) -> list[str]:
    """The --api-key values, else $KVCHAT_API_KEY; none: no key needed."""
    keys = args.api_keys or [os.environ.get("KVCHAT_API_KEY") or ""]
    if any(not k.strip() for k in args.api_keys or ()):
        raise UsageError("--api-key must not be empty")
    return [k for k in keys if k]


def _check_ranges(args: argparse.Namespace) -> None:
    """Every numeric flag inside its range (NaN and infinities never are)."""
    for name, (lo, hi, lo_open) in RANGES.items():
        v = getattr(args, name)
        if v is None:
            continue
        ok = math.isfinite(v) and (lo < v if lo_open else lo <= v) and v <= hi
        if not ok:
            what = f"({lo:g}, {hi:g}]" if lo_open else f"{lo:g}..{hi:g}"
            raise UsageError(f"--{name.replace('_', '-')} must be in {what}, got {v:g}")


def _check(args: argparse.Namespace) -> GenParams:
    _check_ranges(args)
    keys = api_keys(args)
    if not is_loopback(args.host) and not keys and not args.insecure:
        raise UsageError(f"--host {args.host} exposes the model to the network: give"
                         " --api-key KEY (or --insecure to serve without one)")
    if args.keep is not None and args.max_kv_size is None:
        raise UsageError("--keep applies to a bounded cache; give --max-kv-size too")
    try:
        host_policy(args, args.host, args.port)
    except ValueError as e:
        raise UsageError(str(e)) from None
    kv_quant_from_args(args)  # the K/V flags' errors in the flags' own words
    bound = GenParams(max_kv_size=args.max_kv_size,
                      keep=GenParams().keep if args.keep is None else args.keep,
                      **request_defaults(args))
    try:
        bound.validate()
    except KVChatError as e:
        raise UsageError(str(e)) from None
    return bound


def kv_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The K/V quantization every request's cache uses (GenParams' field names)."""
    return {"kv_bits": args.kv_bits, "kv_group_size": args.kv_group_size,
            "quantized_kv_start": args.quantized_kv_start}


def request_defaults(args: argparse.Namespace) -> dict[str, Any]:
    """The GenParams every request starts from (ServeConfig.kv, the protocol's
    Limits.kv): the K/V quantization and the speculative decoding default."""
    return {**kv_fields(args), **speculation_fields(args)}


def host_policy(args: argparse.Namespace, bound: str, port: int) -> Any:
    """The Host names this server answers (app/serve/guard.py)."""
    from kvchat.app.serve.guard import HostPolicy

    return HostPolicy.build(bound, port, args.host, args.allow_hosts)


def _check_context(args: argparse.Namespace, model: str) -> None:
    """Flags that must fit the model's context, once the model folder is known."""
    from kvchat.model.decoder.config import load_config

    context = load_config(model).max_position_embeddings
    if args.max_kv_size is not None and args.max_kv_size > context:
        raise UsageError(f"--max-kv-size must be at most the model's context ({context}"
                         f" tokens), got {args.max_kv_size}")


def physical_memory() -> int | None:
    """The machine's memory in bytes (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def pool_budget(cache_pool_mb: float | None, total: int | None) -> tuple[int, str]:
    """The prefix pool's byte budget, and where it comes from (the start-up line says):
    --cache-pool-mb, else 1/POOL_SHARE of the machine's memory `total`."""
    from kvchat.model.cache.kv_math import human_bytes

    if cache_pool_mb is not None:
        return int(cache_pool_mb * 2**20), "--cache-pool-mb"
    if not total:
        return FALLBACK_POOL_MB * 2**20, "the machine's memory is unknown; --cache-pool-mb MB"
    budget = max(MIN_POOL_MB * 2**20, total // POOL_SHARE)
    return budget, f"1/{POOL_SHARE} of the machine's {human_bytes(total)}; --cache-pool-mb MB"


def pool_line(cache_pool_mb: float | None) -> str:
    """The start-up line about the pool of idle caches."""
    from kvchat.model.cache.kv_math import human_bytes

    budget, source = pool_budget(cache_pool_mb, physical_memory())
    if budget <= 0:
        return "prefix pool off: one cache, the last conversation's (--cache-pool-mb 0)"
    return f"prefix pool: up to {human_bytes(budget)} of idle caches ({source})"


def engine_options(args: argparse.Namespace) -> EngineOptions:
    """The engine's settings from the flags (the place where new engine options reach
    the server)."""
    budget, _ = pool_budget(args.cache_pool_mb, physical_memory())
    # a model split across hosts runs one turn at a time (its ranks step one sequence)
    batch = 1 if args.serve_hostfile else args.max_batch
    return EngineOptions(tokenizer=args.tokenizer, prefix_pool_bytes=budget, max_batch=batch)


def _listen(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError as e:
        raise KVChatError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(False)
    return sock


def _local_models(model: str, dirs: list[str]) -> list[dict[str, Any]]:
    """The models a request may name: the start-up one (to switch back to) and the
    loadable ones found in `dirs`."""
    if not dirs:
        return []
    from kvchat.app.core.discovery import model_rows
    from kvchat.model.decoder.config import load_config
    from kvchat.model.files import model_name

    found = [{"id": r.entry.name, **r.to_dict()}
             for r in model_rows(dirs, include_defaults=False) if r.loadable]
    if all(m["path"] != model for m in found):
        found.insert(0, {"id": model_name(model), "path": model})
    return [{**m, "context": load_config(m["path"]).max_position_embeddings} for m in found]


def run(args: argparse.Namespace) -> int:
    bound = _check(args)
    from kvchat.model.explain.facts import check_model_folder

    model = str(Path(args.model or DEFAULT_MODEL).expanduser().resolve())
    check_model_folder(model)  # a folder we cannot load: one line before anything starts
    _check_context(args, model)
    if not args.serve_hostfile:  # weights, every request's cache bound and the pool
        memory.require_fit(model, bound.max_kv_size, kv_quant_from_args(args),
                           extra_bytes=pool_budget(args.cache_pool_mb, physical_memory())[0],
                           ignore=args.ignore_memory_check)
    # Ctrl+C stops the server, which then closes the engine (app/core/engine_service.py)
    service = EngineService("process", engine_options(args))
    try:
        if args.serve_hostfile:
            from kvchat.app.core.hosts import read_hostfile

            read_hostfile(args.serve_hostfile)
            service.split_across(args.serve_hostfile, model)
        sock = _listen(args.host, args.port)
        stopped = _Stopped()
        load_error = asyncio.run(_serve(args, model, bound, sock, stopped, service))
        if load_error is not None:
            raise KVChatError(load_error)
        return 130 if stopped.signal == signal.SIGINT else 0  # Ctrl+C: the CLI's 130
    finally:
        service.close(5.0)


class _Stopped:
    signal: int | None = None


def _uvicorn_server(config: Any, stopped: _Stopped) -> Any:
    """uvicorn's Server ending on SIGINT/SIGTERM by returning rather than raising the
    signal again afterwards (which would end this process before the engine closes)."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            handled = (signal.SIGINT, signal.SIGTERM)
            original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig: int, frame: Any) -> None:
            stopped.signal = stopped.signal or sig
            super().handle_exit(sig, frame)

    return Server(config)


async def _serve(args: argparse.Namespace, model: str, bound: GenParams,
                 sock: socket.socket, stopped: _Stopped, service: EngineService) -> str | None:
    """Serve until SIGINT/SIGTERM; the load error when the model could not load."""
    import uvicorn

    from kvchat.app.serve.connections import (
        ConnectionLimits,
        default_max_connections,
        uvicorn_options,
    )
    from kvchat.app.serve.log import RequestLog, route_uvicorn_logs
    from kvchat.app.serve.server import KVChatServer, ServeConfig
    from kvchat.app.serve.worker import EngineWorker

    host, port = sock.getsockname()[:2]
    connections = ConnectionLimits(args.idle_timeout, default_max_connections())
    config = ServeConfig(api_keys=api_keys(args),
                         max_body_bytes=int(args.max_body_mb * 2**20),
                         max_kv_size=bound.max_kv_size, keep=bound.keep,
                         kv=request_defaults(args),
                         allow_origins=args.allow_origins,
                         hosts=host_policy(args, host, port), idle_timeout_s=args.idle_timeout,
                         max_prompt_tokens=args.max_prompt_tokens, tokenizer=args.tokenizer,
                         connections=connections,
                         local_models=_local_models(model, args.models_dirs))
    log = RequestLog(args.json_logs)
    worker = EngineWorker(lambda on_event: service.build(on_event, model), args.max_queue,
                          log.notice)
    server = KVChatServer(worker, config, log)
    shown = f"[{host}]" if ":" in host else host
    uv = _uvicorn_server(uvicorn.Config(
        server.app(), log_config=None, access_log=False, lifespan="off",
        timeout_graceful_shutdown=3, **uvicorn_options(connections)), stopped)
    route_uvicorn_logs(log)
    await worker.start()
    base = f"http://{shown}:{port}"
    server.log.notice(f"loading {model}; listening on {base}/v1")
    server.log.notice(pool_line(args.cache_pool_mb))

    async def announce() -> None:
        await worker.ready.wait()
        if not worker.load_error:
            server.log.notice(f"ready: {worker.info.get('name')} at {base}/v1 (OPENAI_BASE_URL;"
                              f" Anthropic's /v1/messages at ANTHROPIC_BASE_URL={base});"
                              f" live stats: {base}/v1/kvchat/stats")
        await worker.failed.wait()  # no model, or the engine died: nothing left to serve
        uv.should_exit = True

    watch = asyncio.create_task(announce())
    try:
        await uv.serve(sockets=[sock])
    finally:
        watch.cancel()
        worker.close()
        server.prompts.close()
        sys.stderr.flush()
    # stopped by a signal: an engine that died of the same signal is no error
    return None if stopped.signal else worker.load_error

