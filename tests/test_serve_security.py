"""`kvchat serve` facing the network (docs/serve.md, Who can reach the server): a real
server process driven with raw HTTP (a browser's headers, half-sent requests) and with the
official `openai` client.

- Host: only names of this server (DNS rebinding); Origin / Sec-Fetch-Site: no web page
  from another origin unless allowed; POST bodies: JSON only.
- The prefix pool is partitioned: one client's prompt never raises another's
  `cached_tokens` (the control: the same client's next request does reuse it).
- A prompt past the context is refused before it queues (the worker never counts it).
- Idle and slow connections are closed; a flood of half-open connections under a low
  descriptor limit leaves the server answering, with bounded logging.
- Numeric flags out of range are usage errors; bad fields are a 400 naming them.
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers import processes
from tests.helpers.paths import REPO_ROOT
from tests.helpers.server_process import ServerProcess

openai = pytest.importorskip("openai")
try:  # the HTTP client the openai package depends on (newer releases ship it as httpx2)
    import httpx
except ImportError:
    import httpx2 as httpx

MODEL = REPO_ROOT / "assets" / "kvchat-mini"
KEY_A, KEY_B = "key-a-123", "key-b-456"
IDLE_S = 1.0
ALLOWED_ORIGIN = "http://app.test"
# a client's secret system prompt another client might probe for
SECRET = "You guard the vault. The vault code is 4821. Never say the code. " * 3


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    s = ServerProcess(str(MODEL), "--api-key", KEY_A, "--api-key", KEY_B,
                      "--idle-timeout", str(IDLE_S), "--allow-origin", ALLOWED_ORIGIN,
                      "--allow-host", "kvchat.test", timeout_s=60)
    try:
        yield s
    finally:
        rc = s.stop()
        assert rc == 0, "\n".join(s.lines[-5:])
        assert all("Traceback" not in x for x in s.lines)


def _auth(key: str = KEY_A) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def stats(server: ServerProcess) -> dict[str, Any]:
    r = httpx.get(server.url + "/kvchat/stats", headers=_auth(), timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def chat_body(text: str = "hi", **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 4, **extra}


def post(server: ServerProcess, path: str, body: Any, headers: dict[str, str] | None = None,
         content_type: str | None = "application/json") -> Any:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    h = {**_auth(), **({"Content-Type": content_type} if content_type else {}),
         **(headers or {})}
    return httpx.post(server.url + path, content=content, headers=h, timeout=60)


def client(server: ServerProcess, key: str = KEY_A) -> Any:
    return openai.OpenAI(base_url=server.url, api_key=key, max_retries=0, timeout=60)


# ---- who may ask ------------------------------------------------------------------------
def test_the_host_header_must_name_this_server(server: ServerProcess) -> None:
    """DNS rebinding: a page whose name resolves to 127.0.0.1 sends its own name."""
    requests_before = stats(server)["totals"]["requests"]
    for host in ("attacker.example", f"attacker.example:{server.port}",
                 f"kvchat.test:{server.port + 1}", "127.0.0.1.nip.io", "[::2]"):
        for path in ("/models", "/kvchat/stats"):
            r = httpx.get(server.url + path, headers={**_auth(), "Host": host}, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host", host
        r = post(server, "/chat/completions", chat_body(), {"Host": host})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host"
        r = httpx.get(server.url.removesuffix("/v1") + "/health", headers={"Host": host})
        assert r.status_code == 400
    assert stats(server)["totals"]["requests"] == requests_before  # nothing ran
    for host in (f"localhost:{server.port}", f"127.0.0.1:{server.port}",
                 f"[::1]:{server.port}", f"KVCHAT.test:{server.port}"):
        r = httpx.get(server.url + "/models", headers={**_auth(), "Host": host}, timeout=30)
        assert r.status_code == 200, (host, r.text)


def test_pages_from_other_origins_can_neither_read_nor_trigger(server: ServerProcess) -> None:
    requests_before = stats(server)["totals"]["requests"]
    evil = {"Origin": "http://evil.test"}
    r = httpx.get(server.url + "/models", headers={**_auth(), **evil}, timeout=30)
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    assert "access-control-allow-origin" not in r.headers
    # a "simple" cross-origin POST (no preflight): text/plain, and JSON too
    for ctype in ("text/plain", "application/json"):
        r = post(server, "/chat/completions", chat_body(), evil, ctype)
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    # an <img> or a form sends no Origin on a GET, but says where it comes from
    r = httpx.get(server.url + "/models", headers={**_auth(), "Sec-Fetch-Site": "cross-site"})
    assert r.status_code == 403
    r = httpx.options(server.url + "/chat/completions", headers={
        **evil, "Access-Control-Request-Method": "POST"})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    assert stats(server)["totals"]["requests"] == requests_before  # nothing ran

    # the allowed origin (a browser front-end): CORS headers, and its requests run
    ok = {"Origin": ALLOWED_ORIGIN, "Sec-Fetch-Site": "cross-site"}
    r = httpx.options(server.url + "/chat/completions", headers={
        **ok, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    r = post(server, "/chat/completions", chat_body(), ok)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    # a user typing the address, or a non-browser client: no Origin, no cross-site
    r = httpx.get(server.url + "/models", headers={**_auth(), "Sec-Fetch-Site": "none"})
    assert r.status_code == 200


def test_post_bodies_must_be_json(server: ServerProcess) -> None:
    requests_before = stats(server)["totals"]["requests"]
    body = json.dumps(chat_body()).encode()
    for ctype in ("text/plain", "application/x-www-form-urlencoded",
                  "multipart/form-data; boundary=x", "application/jsonp", None):
        r = post(server, "/chat/completions", body, content_type=ctype)
        assert r.status_code == 415, (ctype, r.text)
        assert r.json()["error"]["code"] == "unsupported_media_type"
    assert stats(server)["totals"]["requests"] == requests_before
    r = post(server, "/chat/completions", body, content_type="Application/JSON; charset=utf-8")
    assert r.status_code == 200, r.text


# ---- one client's cache is not another's -------------------------------------------------
def _cached(c: Any, system: str, question: str, **kw: Any) -> int:
    r = c.chat.completions.create(model="kvchat-mini", max_tokens=4, temperature=0, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": question}], **kw)
    return r.usage.prompt_tokens_details.cached_tokens


def test_one_clients_cached_prompts_never_show_in_anothers(server: ServerProcess) -> None:
    """Client A's secret system prompt is pooled; client B (another key, or the same key
    with another `user`) sending a prompt that starts the same way reuses nothing of it,
    not even the BOS token, while A's own next request does reuse it."""
    a, b = client(server, KEY_A), client(server, KEY_B)
    mine = f"user-{uuid.uuid4().hex}"  # a partition no earlier test used
    _cached(a, SECRET, "What is the weather?", user=mine)  # A's turn, pooled
    assert _cached(b, SECRET, "What is the code?", user=mine) == 0  # another key
    assert _cached(a, SECRET, "What is the code?", user=mine + "-other") == 0  # another user
    assert _cached(a, SECRET, "What is the code?",
                   extra_body={"prompt_cache_key": mine + "-key"}) == 0
    # the control: the pool does hold A's prompt, for A
    reused = _cached(a, SECRET, "What is the code?", user=mine)
    assert reused > 30, reused
    # and B's own conversation is B's to continue
    assert _cached(b, SECRET, "And now?", user=mine) > 30


def test_the_running_requests_in_the_stats_are_the_callers_own(server: ServerProcess) -> None:
    """While A's request streams, A's /v1/kvchat/stats lists it (its own numbers: its
    prompt's tokens) and B's lists nothing: the running requests, like the pool's
    conversations, are shown to their own key only."""
    a = client(server, KEY_A)
    stream = a.chat.completions.create(
        model="kvchat-mini", messages=[{"role": "user", "content": SECRET}], max_tokens=2000,
        temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    try:
        seen = None
        for _ in stream:  # once its numbers are in (about ten times a second)
            mine = stats(server)["running_requests"]
            if mine and mine[0]["prompt_tokens"]:
                seen = mine
                break
        theirs = httpx.get(server.url + "/kvchat/stats", headers=_auth(KEY_B), timeout=30).json()
    finally:
        stream.close()
    assert seen is not None and len(seen) == 1, seen
    assert seen[0]["prompt_tokens"] > 30 and seen[0]["age_s"] >= 0
    assert theirs["queue"]["running_requests"] == 1  # the queue's count is no one's prompt
    assert theirs["running_requests"] == [] and theirs["running"] is None


# ---- bounded work -------------------------------------------------------------------------
def test_a_prompt_past_the_context_is_refused_before_it_queues(server: ServerProcess) -> None:
    c = client(server)
    context = c.models.list().data[0].model_extra["kvchat"]["context"]
    before = stats(server)["totals"]["requests"]
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="kvchat-mini", prompt=list(range(5, context + 100)),
                             max_tokens=4)
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="kvchat-mini", max_tokens=4, messages=[
            {"role": "user", "content": "story " * (2 * context)}])
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages"
    assert stats(server)["totals"]["requests"] == before  # the worker never saw them

    # asked for: the prompt is cut to leave max_tokens of the context for the reply
    r = c.completions.create(model="kvchat-mini", prompt=list(range(5, context + 100)),
                             max_tokens=8, extra_body={"truncation": "auto"})
    assert r.usage.prompt_tokens == context - 8
    r = post(server, "/completions", {"prompt": [5] * 10, "truncation": "sometimes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncation"


BAD = [
    # (what, body as JSON text, the field the error names)
    ("role a list", '{"messages": [{"role": ["user"], "content": "hi"}]}', "messages[0].role"),
    ("role a number", '{"messages": [{"role": 1, "content": "hi"}]}', "messages[0].role"),
    ("surrogate in model", '{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}',
     "model"),
    ("surrogate in content", '{"messages": [{"role": "user", "content": "hi \\udc00"}]}',
     "messages[0].content"),
    ("surrogate in a stop", '{"messages": [{"role": "user", "content": "hi"}],'
     ' "stop": ["\\ud83d"]}', "stop[0]"),
    ("temperature 5", '{"messages": [{"role": "user", "content": "hi"}], "temperature": 5}',
     "temperature"),
    ("top_p 0", '{"messages": [{"role": "user", "content": "hi"}], "top_p": 0}', "top_p"),
    ("top_p 1.5", '{"messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}', "top_p"),
    ("min_p 2", '{"messages": [{"role": "user", "content": "hi"}], "min_p": 2}', "min_p"),
    ("top_k -1", '{"messages": [{"role": "user", "content": "hi"}], "top_k": -1}', "top_k"),
    ("seed -1", '{"messages": [{"role": "user", "content": "hi"}], "seed": -1}', "seed"),
    ("seed 2**64", '{"messages": [{"role": "user", "content": "hi"}],'
     ' "seed": 18446744073709551616}', "seed"),
    ("max_tokens 0", '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}',
     "max_tokens"),
    ("repetition_penalty 0", '{"messages": [{"role": "user", "content": "hi"}],'
     ' "repetition_penalty": 0}', "repetition_penalty"),
    ("user a number", '{"messages": [{"role": "user", "content": "hi"}], "user": 5}', "user"),
    ("prompt_cache_key a list", '{"messages": [{"role": "user", "content": "hi"}],'
     ' "prompt_cache_key": ["a"]}', "prompt_cache_key"),
]


@pytest.mark.parametrize(("what", "body", "param"), BAD, ids=[b[0] for b in BAD])
def test_bad_fields_get_a_400_naming_them(server: ServerProcess, what: str, body: str,
                                          param: str) -> None:
    r = post(server, "/chat/completions", body.encode())
    assert r.status_code == 400, r.text
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert "pybind" not in err["message"] and "\n" not in err["message"]


# ---- fields kvchat does not honour are refused, never skipped (docs/serve.md, Fields) -----
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
REFUSED = [
    # (route, extra fields, the field the 400 names)
    ("/chat/completions", {"functions": [TOOL["function"]]}, "functions"),
    ("/chat/completions", {"logit_bias": {"5": 10}}, "logit_bias"),
    ("/chat/completions", {"frequency_penalty": 0.5}, "frequency_penalty"),
    ("/chat/completions", {"presence_penalty": -1}, "presence_penalty"),
    ("/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/chat/completions", {"logprobs": True}, "logprobs"),
    ("/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/chat/completions", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("/chat/completions", {"reasoning_effort": "high"}, "reasoning_effort"),
    ("/chat/completions", {"verbosity": "low"}, "verbosity"),
    ("/chat/completions", {"web_search_options": {}}, "web_search_options"),
    ("/chat/completions", {"temprature": 0.2}, "temprature"),  # a typo: not a default
    ("/chat/completions", {"stream": True, "stream_options": {"include_usage": True,
                                                              "chunk_size": 4}},
     "stream_options.chunk_size"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "hi", "name": "bob"}]},
     "messages[0].name"),
    ("/completions", {"prompt": "Once", "suffix": "end"}, "suffix"),
    ("/completions", {"prompt": "Once", "best_of": 3}, "best_of"),
    ("/completions", {"prompt": "Once", "echo": True}, "echo"),
]


@pytest.mark.parametrize(("route", "extra", "param"), REFUSED,
                         ids=[f"{r[0]} {r[2]}" for r in REFUSED])
def test_fields_kvchat_does_not_honour_get_a_400_naming_them(
        server: ServerProcess, route: str, extra: dict[str, Any], param: str) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    if route == "/completions":
        body.pop("messages")
    r = post(server, route, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and f"'{param}'" in err["message"], err


def test_tools_on_a_template_without_them_are_refused_through_the_openai_client(
        server: ServerProcess) -> None:
    c = client(server)
    hi = [{"role": "user", "content": "What is the weather in Paris?"}]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="kvchat-mini", messages=hi, tools=[TOOL])
    assert e.value.param == "tools" and "does not support tools" in e.value.message


def test_defaults_of_refused_fields_and_advisory_fields_are_accepted(
        server: ServerProcess) -> None:
    """A refused field at a value that asks for nothing missing, and the fields the API
    makes advisory, answer as without them (greedy: the same text)."""
    c = client(server)
    hi = [{"role": "user", "content": "Tell me a story."}]
    plain = c.chat.completions.create(model="kvchat-mini", messages=hi, max_tokens=6,
                                      temperature=0)
    r = c.chat.completions.create(
        model="kvchat-mini", messages=hi, max_tokens=6, temperature=0, n=1, tools=[],
        tool_choice="none", response_format={"type": "text"}, frequency_penalty=0,
        presence_penalty=0, logit_bias={}, logprobs=False, modalities=["text"],
        store=True, metadata={"run": "test"}, service_tier="auto", safety_identifier="h1",
        parallel_tool_calls=False, prompt_cache_retention="24h")
    assert r.choices[0].message.content == plain.choices[0].message.content


# ---- connections --------------------------------------------------------------------------
def _closed(sock: socket.socket) -> bytes:
    """What the server sends before it closes `sock` (a server that keeps it open fails
    the test with socket.timeout, long after the idle timeout)."""
    sock.settimeout(30 + 10 * IDLE_S)
    got = b""
    while piece := sock.recv(65536):
        got += piece
    return got


def test_idle_and_slow_connections_are_closed(server: ServerProcess) -> None:
    timed_out = stats(server)["connections"]["timed_out"]
    addr = (server.host, server.port)
    with socket.create_connection(addr) as idle:  # connects, sends nothing
        assert _closed(idle) == b""
    with socket.create_connection(addr) as slow_head:  # half a request head
        slow_head.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        assert _closed(slow_head) == b""
    with socket.create_connection(addr) as slow_body:  # the head, then 1 byte of 100
        slow_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s:%d\r\nAuthorization:"
                          b" Bearer %s\r\nContent-Type: application/json\r\nContent-Length:"
                          b" 100\r\n\r\n{" % (server.host.encode(), server.port, KEY_A.encode()))
        answer = _closed(slow_body)
        assert answer.startswith(b"HTTP/1.1 408 ") and b'"request_timeout"' in answer
    with socket.create_connection(addr) as kept:  # keep-alive after an answer
        kept.sendall(b"GET /health HTTP/1.1\r\nHost: %s:%d\r\n\r\n" % (
            server.host.encode(), server.port))
        assert _closed(kept).startswith(b"HTTP/1.1 200 ")
    assert stats(server)["connections"]["timed_out"] >= timed_out + 2


def test_a_flood_of_half_open_connections_leaves_the_server_answering() -> None:
    """60 connections that never finish their request head, under a 64-descriptor limit
    (and a timeout too long to help): the oldest make room for the newest, the server
    answers, and its log stays a few lines."""
    s = ServerProcess(str(MODEL), "--idle-timeout", "600", max_open_files=64, timeout_s=60)
    socks: list[socket.socket] = []
    try:
        for _ in range(60):
            sock = socket.create_connection((s.host, s.port))
            sock.sendall(b"GET /v1/models HTTP/1.1\r\n")
            socks.append(sock)
        r = client(s).chat.completions.create(
            model="kvchat-mini", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert r.choices[0].finish_reason in ("stop", "length")
        conns = httpx.get(s.url + "/kvchat/stats", timeout=30).json()["connections"]
        assert conns["evicted"] > 0 and conns["open"] <= conns["max"] + 1
        assert len(s.lines) < 10, s.lines
    finally:
        for sock in socks:
            sock.close()
        assert s.stop() == 0
    assert all("Traceback" not in x for x in s.lines)


# ---- flags ------------------------------------------------------------------------------
BAD_FLAGS = [
    (["--max-body-mb", "nan"], "--max-body-mb"),
    (["--max-body-mb", "0"], "--max-body-mb"),
    (["--cache-pool-mb", "inf"], "--cache-pool-mb"),
    (["--cache-pool-mb", "-1"], "--cache-pool-mb"),
    (["--max-kv-size", str(2**63)], "--max-kv-size"),
    (["--max-kv-size", "0"], "--max-kv-size"),
    (["--max-prompt-tokens", "0"], "--max-prompt-tokens"),
    (["--idle-timeout", "0"], "--idle-timeout"),
    (["--idle-timeout", "nan"], "--idle-timeout"),
    (["--max-queue", "-1"], "--max-queue"),
    (["--port", "70000"], "--port"),
    (["--max-kv-size", "64", "--keep", "-1"], "--keep"),
    (["--allow-host", "evil example"], "--allow-host"),
    (["--api-key", ""], "--api-key"),
]


@pytest.mark.parametrize(("flags", "named"), BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_numeric_flags_out_of_range_are_usage_errors(flags: list[str], named: str) -> None:
    from kvchat.app.core.errors import UsageError
    from kvchat.app.serve import command

    p = argparse.ArgumentParser()
    command.add_arguments(p)
    with pytest.raises(UsageError, match=named):
        command._check(p.parse_args(flags))


def test_a_window_past_the_context_and_nan_are_one_line_exit_2() -> None:
    from kvchat.app.core.errors import UsageError
    from kvchat.app.serve import command

    p = argparse.ArgumentParser()
    command.add_arguments(p)
    with pytest.raises(UsageError, match="--max-kv-size must be at most the model's context"):
        command._check_context(p.parse_args(["--max-kv-size", "4096"]), str(MODEL))
    r = processes.run([sys.executable, "-m", "kvchat.app", "serve", "--max-body-mb", "nan"],
                      capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--max-body-mb" in r.stderr


# ---- the parts, without a server ------------------------------------------------------------
def test_prompts_are_cut_or_refused_by_the_limit() -> None:
    from kvchat.app.serve.prompts import fit
    from kvchat.app.serve.protocol import ApiError, Limits, parse

    limits = Limits(("m",), 100, None, 4, {}, {}, context=100, max_prompt_tokens=50)
    req = parse("text", {"prompt": [7], "max_tokens": 10}, limits)
    assert req.prompt_limit == 50  # the cap, below the context
    assert fit(list(range(50)), req) == list(range(50))
    with pytest.raises(ApiError) as e:
        fit(list(range(51)), req)
    assert e.value.code == "context_length_exceeded" and e.value.status == 400
    req = parse("text", {"prompt": [7], "max_tokens": 10, "truncation": "auto"}, limits)
    cut = fit(list(range(1000)), req)
    assert cut == [0, 1, 2, 3, *range(1000 - 46, 1000)]  # keep 4, then the newest


def test_partitions_from_keys_and_names() -> None:
    from kvchat.app.serve.server import cache_partition

    assert cache_partition(None, None) is None  # a single user's server: one partition
    parts = {cache_partition(k, n) for k in (None, "k1", "k2") for n in (None, "u1", "u2")}
    assert len(parts) == 9
    assert cache_partition("k1", "u1") == cache_partition("k1", "u1")
    assert "k1" not in str(cache_partition("k1", None))  # no key travels to the engine


def test_repeated_warnings_are_rate_limited() -> None:
    from kvchat.app.serve.log import RateLimit

    now = [0.0]
    f = RateLimit(10.0, clock=lambda: now[0])

    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, msg, None, None)

    passed = []
    for i in range(1000):  # 1000 failed accepts in 20 s
        now[0] = i * 0.02
        rec = record("socket.accept() out of system resource")
        if f.filter(rec):
            passed.append(getattr(rec, "held_back", 0))
    assert passed == [0, 499]  # one line, then one with the count held back
    assert f.filter(record("Invalid HTTP request received."))  # another kind: its own line


def test_a_client_that_stops_reading_is_let_go() -> None:
    """The answer's sends have the idle deadline too: a client whose socket never drains
    frees its connection, and its turn is cancelled, one log line saying why."""
    import asyncio
    from types import SimpleNamespace

    from kvchat.app.serve import protocol
    from kvchat.app.serve.server import JobResponse, ServeConfig
    from kvchat.app.serve.worker import Job
    from kvchat.model.runtime.events import Started

    cancelled: list[Any] = []
    logged: list[tuple[int, dict[str, Any]]] = []
    server = SimpleNamespace(config=ServeConfig(idle_timeout_s=0.2),
                             worker=SimpleNamespace(cancel=cancelled.append),
                             _log=lambda scope, status, **f: logged.append((status, f)))

    async def run() -> None:
        req = protocol.parse("text", {"prompt": [1, 2], "stream": True},
                             protocol.Limits(("m",), 100))
        job = Job([1, 2], req.params)
        job.events.put_nowait(Started(2, 0))
        stuck = asyncio.Event()  # never set: nothing drains, no disconnect comes

        async def receive() -> dict[str, Any]:
            await stuck.wait()
            return {"type": "http.disconnect"}

        async def send(message: Any) -> None:
            await stuck.wait()

        await asyncio.wait_for(JobResponse(server, job, req)({}, receive, send), 30)  # type: ignore[arg-type]

    asyncio.run(run())
    assert cancelled and len(logged) == 1
    assert "took no part of the answer" in logged[0][1]["error"]
