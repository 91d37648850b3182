"""`kvchat serve` end to end: a real server process on a free 127.0.0.1 port, driven with
the official `openai` client (and raw HTTP where a client would hide the status).

References: `kvchat generate` (same messages, greedy) for the text, its prompt_ids and
ids for the usage, and the chat's own engine path (one Engine, one conversation) for
how many tokens a 10-turn conversation prefills. The model is the shipped kvchat-mini
(always there; slow enough on a CPU that a long reply is still running when the test
disconnects from it or fills the queue behind it).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import processes
from tests.helpers.paths import REPO_ROOT
from tests.helpers.server_process import ServerProcess, free_port

openai = pytest.importorskip("openai")
try:  # the HTTP client the openai package depends on (newer releases ship it as httpx2)
    import httpx
except ImportError:
    import httpx2 as httpx

MODEL = REPO_ROOT / "assets" / "kvchat-mini"
MODEL_ID = "kvchat-mini"
KEY = "test-key-123"
START_TIMEOUT_S = 60
SYSTEM = "Be brief."
# the plain fallback template, refusing one message: a template that fails
REFUSE = ("{%- for m in messages -%}{%- if m['content'] == 'boom' -%}"
          "{{- raise_exception('this template refuses boom') -}}{%- endif -%}{%- endfor -%}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped model with a chat template that renders as the plain fallback, except
    that it refuses a message 'boom'."""
    from kvchat.model.text.chat_template import PLAIN_FALLBACK

    d = tmp_path_factory.mktemp("serve") / "kvchat-mini"
    shutil.copytree(MODEL, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = REFUSE + PLAIN_FALLBACK
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


class Server(ServerProcess):
    """`kvchat serve` in its own process group (ended as a whole, on failure too)."""

    def client(self, **kw: Any) -> Any:
        return openai.OpenAI(base_url=self.url, api_key=KEY, max_retries=0, timeout=60, **kw)

    def stats(self) -> dict[str, Any]:
        r = httpx.get(self.url + "/kvchat/stats", headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200
        return r.json()


@pytest.fixture(scope="module")
def other_models(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A --models-dir holding one more model: a copy of model_dir, named other-mini."""
    d = tmp_path_factory.mktemp("serve-models")
    shutil.copytree(model_dir, d / "other-mini")
    return d


@pytest.fixture(scope="module")
def server(model_dir: Path, other_models: Path) -> Iterator[Server]:
    # one request runs at a time (--max-batch 1), so the queue's bound shows with two
    # requests; side by side decoding: tests/test_serve_batching.py
    s = Server(str(model_dir), "--api-key", KEY, "--max-batch", "1", "--max-queue", "1",
               "--max-body-mb", "0.05",
               "--allow-origin", "http://app.test", "--models-dir", str(other_models),
               timeout_s=START_TIMEOUT_S)
    try:
        yield s
    finally:
        rc = s.stop()
        assert rc == 0, "\n".join(s.lines[-5:])


def generate(model: Path, prompt: str, max_tokens: int, *, raw: bool = False) -> dict:
    args = ["--raw"] if raw else ["--system", SYSTEM]
    r = processes.run(
        [sys.executable, "-m", "kvchat.app", "generate", "--model", str(model), *args,
         "--prompt", prompt, "--max-tokens", str(max_tokens), "--json"],
        capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def chat_messages(prompt: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]


def test_models_and_health_say_ready(server: Server) -> None:
    models = server.client().models.list().data
    assert models[0].id == MODEL_ID
    assert models[0].model_extra["kvchat"]["status"] == "ready"
    assert httpx.get(server.url.removesuffix("/v1") + "/health").json() == {
        "status": "ok", "engine": "idle", "running_s": None, "waiting": 0}


def test_the_models_figures_are_the_design_names_and_agree(server: Server,
                                                          model_dir: Path) -> None:
    """/v1/models: the GQA saving by docs/design.md's name, heads / kv heads from the
    model's config.json; no second figure for the same thing beside it."""
    info = server.client().models.list().data[0].model_extra["kvchat"]
    cfg = json.loads((model_dir / "config.json").read_text())
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    assert (info["n_heads"], info["n_kv_heads"]) == (heads, kv)
    assert info["attention"] == "GQA" and info["gqa_saving"] == heads / kv > 1
    assert info["as_gqa_factor"] is None  # latent attention's only
    assert "kv_saving" not in info and "gqa_factor" not in info  # a cache's, and the old name


def test_chat_greedy_equals_generate_with_usage(server: Server, model_dir: Path) -> None:
    ref = generate(model_dir, "Tell me a story.", 24)
    c = server.client()
    r = c.chat.completions.create(model=MODEL_ID, messages=chat_messages(
        "Tell me a story."), max_tokens=24, temperature=0)
    assert r.choices[0].message.content == ref["text"]
    assert r.choices[0].finish_reason == {"eos": "stop", "length": "length"}[
        ref["finish_reason"]]
    assert r.usage.prompt_tokens == len(ref["prompt_ids"])
    assert r.usage.completion_tokens == len(ref["ids"])
    assert r.usage.total_tokens == len(ref["prompt_ids"]) + len(ref["ids"])
    k = r.model_extra["kvchat"]
    assert k["prompt_tokens"] == len(ref["prompt_ids"]) and k["generated_tokens"] == len(ref["ids"])
    # docs/design.md by hand: 2 x layers x kv_heads x tokens x head_dim x dtype bytes; MHA: heads
    info = c.models.list().data[0].model_extra["kvchat"]
    per = 2 * info["n_layers"] * info["head_dim"] * {"float32": 4, "float16": 2,
                                                     "bfloat16": 2}[info["dtype"]]
    assert k["cache_tokens"] == len(ref["prompt_ids"]) + len(ref["ids"]) - 1
    assert k["cache_bytes"] == per * info["n_kv_heads"] * k["cache_tokens"]
    assert k["mha_bytes"] == per * info["n_heads"] * k["cache_tokens"]

    # streamed: the same text in pieces, the finish chunk, then the usage chunk
    chunks = list(c.chat.completions.create(model=MODEL_ID,
        messages=chat_messages("Tell me a story."), max_tokens=24,
        temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == \
        ref["text"]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == \
        r.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == r.usage.total_tokens
    # the same prompt again: all but its last token came from the cache
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == len(ref["prompt_ids"]) - 1
    # the kvchat object rides on that usage chunk; the chunks before it have no usage
    assert all(ch.usage is None and "kvchat" not in (ch.model_extra or {})
               for ch in chunks[:-1])
    k = chunks[-1].model_extra["kvchat"]
    assert k["generated_tokens"] == len(ref["ids"])
    assert k["cache"]["reused_tokens"] == len(ref["prompt_ids"]) - 1
    assert k["cache"]["miss_reason"] is None  # the whole prompt was cached
    # without include_usage, the finish chunk carries both
    plain = list(c.chat.completions.create(model=MODEL_ID,
        messages=chat_messages("Tell me a story."), max_tokens=24, temperature=0, stream=True))
    assert plain[-1].choices[0].finish_reason and plain[-1].usage.total_tokens == \
        r.usage.total_tokens and "cache" in plain[-1].model_extra["kvchat"]


def test_raw_completion_equals_generate_raw(server: Server, model_dir: Path) -> None:
    ref = generate(model_dir, "Once upon a time", 16, raw=True)
    r = server.client().completions.create(model=MODEL_ID, prompt="Once upon a time",
                                           max_tokens=16, temperature=0)
    assert r.choices[0].text == ref["text"]
    assert r.usage.prompt_tokens == len(ref["prompt_ids"])
    assert r.usage.completion_tokens == len(ref["ids"])


@pytest.mark.slow  # two ten-turn conversations
def test_ten_turn_conversations_prefill_like_the_chat(server: Server, model_dir: Path) -> None:
    """Two conversations interleaved through the server prefill (prompt minus cached
    tokens) about what the chat's single-conversation engine prefills for each alone."""
    from kvchat.model.runtime.client import EngineClient
    from kvchat.model.runtime.events import GenParams

    c = server.client()
    convs = {"a": [{"role": "system", "content": SYSTEM}], "b": []}
    served = {"a": 0, "b": 0}
    whole = {"a": 0, "b": 0}  # every prompt prefilled from its first token
    for turn in range(10):
        for name, msgs in convs.items():
            msgs.append({"role": "user", "content": f"{name} question {turn}: what next?"})
            r = c.chat.completions.create(model=MODEL_ID, messages=msgs, max_tokens=8,
                                          temperature=0)
            served[name] += r.usage.prompt_tokens - r.usage.prompt_tokens_details.cached_tokens
            whole[name] += r.usage.prompt_tokens
            msgs.append({"role": "assistant", "content": r.choices[0].message.content})
    pool = server.stats()["cache"]["prefix_pool"]
    assert pool["hits"] >= 18 and pool["entries"] >= 1

    # the chat: one engine, one conversation, the same turns (the same greedy replies)
    engine = EngineClient(model_dir)
    for name, msgs in convs.items():
        chat = 0
        engine.reset()  # a new chat
        for i in range(len(msgs)):
            if msgs[i]["role"] != "user":
                continue
            done = engine.run(msgs[: i + 1], GenParams(max_tokens=8))
            assert done.text == msgs[i + 1]["content"]
            chat += (done.stats.prompt_tokens or 0) - (done.stats.cached_tokens or 0)
        assert sum(1 for m in msgs if m["role"] == "user") == 10
        assert abs(served[name] - chat) <= 10, (name, served[name], chat)
        assert served[name] < whole[name] / 3, (name, served[name], whole[name])
    engine.close()


def _stream_text(c: Any, prompt: str, max_tokens: int, out: dict, key: str) -> None:
    chunks = c.chat.completions.create(model=MODEL_ID, messages=chat_messages(prompt),
                                       max_tokens=max_tokens, temperature=0, stream=True)
    text, finish = "", None
    for ch in chunks:
        text += ch.choices[0].delta.content or ""
        finish = ch.choices[0].finish_reason or finish
    out[key] = (text, finish)


def test_two_concurrent_streams_both_complete(server: Server, model_dir: Path) -> None:
    c = server.client()
    out: dict[str, Any] = {}
    threads = [threading.Thread(target=_stream_text, args=(c, p, 30, out, p))
               for p in ("Tell me a story.", "Sing a song.")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for p in ("Tell me a story.", "Sing a song."):
        alone = c.chat.completions.create(model=MODEL_ID, messages=chat_messages(p),
                                          max_tokens=30, temperature=0)
        assert out[p] == (alone.choices[0].message.content, alone.choices[0].finish_reason)


LONG = 900  # tokens a long reply would generate: many seconds on this model


def _long_stream(server: Server) -> Any:
    """A streamed request for a LONG-token reply; the response starts when it runs."""
    body = {"messages": chat_messages("Tell me a long story."), "max_tokens": LONG,
            "ignore_eos": True, "stream": True}
    return httpx.stream("POST", server.url + "/chat/completions", json=body, timeout=60,
                        headers={"Authorization": f"Bearer {KEY}"})


def _wait_for(cond: Any, server: Server, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = server.stats()
        if cond(s):
            return s
        assert time.monotonic() < deadline, f"timed out; stats: {s}"
        time.sleep(0.02)


def test_disconnect_cancels_and_full_queue_answers_429(server: Server) -> None:
    before = server.stats()["totals"]
    second: dict[str, Any] = {}

    def wait_in_line() -> None:  # a second client, queued behind the first
        with _long_stream(server) as r:
            second["status"] = r.status_code
            lines = r.iter_lines()  # (a dropped iterator would close the response)
            second["first"] = next(lines)
        # and it leaves after its first chunk too

    with _long_stream(server) as first:
        assert first.status_code == 200
        lines = first.iter_lines()  # kept: a dropped iterator would close the response
        assert next(lines).startswith("data: ")  # the turn runs
        t = threading.Thread(target=wait_in_line)
        t.start()
        _wait_for(lambda s: s["queue"]["waiting"] == 1, server)
        # --max-queue 1: one running, one waiting, the next is turned away
        r = httpx.post(server.url + "/chat/completions", timeout=30,
                       headers={"Authorization": f"Bearer {KEY}"},
                       json={"messages": chat_messages("hi"), "max_tokens": 4})
        assert r.status_code == 429 and r.headers["retry-after"].isdigit()
        assert r.json()["error"]["code"] == "queue_full"
    # the first client left: its turn stops, the waiting one runs, then leaves too
    t.join(60)
    assert second["status"] == 200 and second["first"].startswith("data: ")
    s = _wait_for(lambda s: s["totals"]["cancelled"] == before["cancelled"] + 2
                  and not s["queue"]["running"], server)
    # both stopped long before their LONG tokens
    assert s["totals"]["generated_tokens"] - before["generated_tokens"] < LONG // 2
    r = server.client().chat.completions.create(model=MODEL_ID, messages=chat_messages("hi"),
                                                max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length")


BAD = [
    # (what, route, body or raw bytes, status, error code or param)
    ("invalid JSON", "/chat/completions", b"{not json", 400, None),
    ("not an object", "/chat/completions", [1, 2], 400, None),
    ("messages missing", "/chat/completions", {"temperature": 0}, 400, "messages"),
    ("empty messages", "/chat/completions", {"messages": []}, 400, "messages"),
    ("bad role", "/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages[0].role"),
    ("content wrong type", "/chat/completions", {"messages": [{"role": "user", "content": 5}]},
     400, "messages[0].content"),
    ("max_tokens a string", "/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "10"}, 400, "max_tokens"),
    ("max_tokens a bool", "/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": True}, 400, "max_tokens"),
    ("negative temperature", "/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400, None),
    ("stop of numbers", "/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "stop": [1]}, 400, "stop"),
    ("unknown model", "/chat/completions",
     {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    ("template fails", "/chat/completions",
     {"messages": [{"role": "user", "content": "boom"}]}, 400, None),
    ("unknown role", "/chat/completions", {"messages": [{"role": "function", "content": "x"}]},
     400, "messages[0].role"),
    ("tool calls from a user", "/chat/completions", {"messages": [
        {"role": "user", "content": "x", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     400, "messages[0].tool_calls"),
    ("tool_choice without tools", "/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, 400,
     "tool_choice"),
    ("unknown response_format", "/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}},
     400, "response_format"),
    ("a malformed tool", "/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "x"}]}, 400,
     "tools"),
    ("n of 2", "/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n"),
    ("NaN temperature", "/chat/completions",
     b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400,
     "temperature"),
    ("nested too deep", "/chat/completions", b"[" * 40_000, 400, None),
    ("empty prompt", "/completions", {"prompt": "  "}, 400, "prompt"),
    ("token id past the vocabulary", "/completions", {"prompt": [1, 2, 10**9]}, 400, None),
    ("body too large", "/completions", {"prompt": "x" * 60_000}, 413, None),
]


@pytest.mark.parametrize(("what", "route", "body", "status", "param"), BAD,
                         ids=[b[0] for b in BAD])
def test_bad_requests_get_the_openai_error_object(server: Server, what: str, route: str,
                                                  body: Any, status: int, param: Any) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + route, content=content, timeout=30,
                   headers={"Authorization": f"Bearer {KEY}",
                            "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param
    if what == "template fails":
        assert "refuses boom" in err["message"]
    # the server lives on
    assert httpx.get(server.url.removesuffix("/v1") + "/health").status_code == 200


def test_api_key_and_log_lines(server: Server) -> None:
    bad = openai.OpenAI(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = httpx.get(server.url + "/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    # text from a request is data in the log: the escape is shown, never sent
    httpx.post(server.url + "/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
               json={"model": "\x1b[31mred\nnext", "messages": [{"role": "user",
                                                                  "content": "hi"}]})
    time.sleep(0.2)
    line = next(x for x in server.lines if "red" in x)
    assert "\x1b" not in line and "␛[31mred␤next" in line
    assert all("Traceback" not in x for x in server.lines)
    done = [x for x in server.lines if "POST /v1/chat/completions 200" in x]
    assert done and "prompt=" in done[0] and "finish=" in done[0]


@pytest.mark.slow  # two ranks
def test_a_model_split_across_two_local_ranks_serves_the_same_text(
        server: Server, model_dir: Path, tmp_path: Path) -> None:
    """--hosts: rank 1 runs the second half of the layers; the reply is the same."""
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps({"hosts": [{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * 2}))
    ring = free_port()  # the ring takes this port and the next
    split = Server(str(model_dir), "--hosts", str(hosts), "--api-key", KEY,
                   timeout_s=START_TIMEOUT_S, env={"KVCHAT_RING_PORT": str(ring)})
    try:
        args = {"model": MODEL_ID, "prompt": "Once upon a time", "max_tokens": 12,
                "temperature": 0}
        r = split.client().completions.create(**args)
        ref = server.client().completions.create(**args)
        assert r.choices[0].text == ref.choices[0].text
        pipe = r.model_extra["kvchat"]["pipeline"]
        assert [x["rank"] for x in pipe["ranks"]] == [0, 1]
    finally:
        assert split.stop() == 0, "\n".join(split.lines[-5:])


def test_a_request_naming_another_local_model_loads_it(server: Server) -> None:
    c = server.client()
    assert [m.id for m in c.models.list().data] == [MODEL_ID, "other-mini"]
    args = {"messages": chat_messages("Tell me a story."), "max_tokens": 12, "temperature": 0}
    here = c.chat.completions.create(model=MODEL_ID, **args)
    other = c.chat.completions.create(model="other-mini", **args)
    assert other.model == "other-mini"
    assert other.choices[0].message.content == here.choices[0].message.content  # same weights
    assert other.usage.prompt_tokens_details.cached_tokens == 0  # caches go with the model
    assert [(m.id, m.model_extra["kvchat"]["loaded"]) for m in c.models.list().data] == \
        [("other-mini", True), (MODEL_ID, False)]
    assert server.stats()["model"] == "other-mini"
    back = c.chat.completions.create(model=MODEL_ID, **args)  # and back
    assert back.model == MODEL_ID and server.stats()["model"] == MODEL_ID
    assert any("loaded other-mini for a request" in line for line in server.lines)


def test_cors_only_for_the_allowed_origin(server: Server) -> None:
    def preflight(origin: str) -> Any:
        return httpx.options(server.url + "/chat/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})

    ok = preflight("http://app.test")
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == "http://app.test"
    assert "access-control-allow-origin" not in preflight("http://evil.test").headers


def test_non_loopback_host_needs_a_key() -> None:  # checked before any model loads
    r = processes.run([sys.executable, "-m", "kvchat.app", "serve", "--host", "0.0.0.0"],
                      capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "--api-key" in r.stderr


def test_a_crashed_engine_is_started_again(server: Server) -> None:
    """The engine process dies (a crash in native code, say): the server answers 503
    while it loads again, then serves as before."""
    engine = next(int(p) for p in os.listdir("/proc") if p.isdigit()
                  and _parent(int(p)) == server.proc.pid)
    os.kill(engine, signal.SIGKILL)
    s = _wait_for(lambda s: s["totals"]["engine_restarts"] == 1 and s["ready"], server)
    assert s["ready"]
    r = server.client().chat.completions.create(model=MODEL_ID, messages=chat_messages("hi"),
                                                max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert any("starting it again" in line for line in server.lines)


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None
