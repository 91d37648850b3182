"""Anthropic's Messages API on `kvchat serve` (docs/serve.md, Anthropic's Messages API): a
real server driven with the official `anthropic` client.

References: `kvchat generate` (same system and prompt, greedy) for a plain message, its
prompt_ids and ids for the usage; the engine itself (EngineClient, one conversation) for
a multi-turn one; the non-streamed answer for the streamed one; the unstopped text cut by
hand at the stop string for stop sequences.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers import processes
from tests.helpers.paths import REPO_ROOT
from tests.helpers.server_process import ServerProcess

anthropic = pytest.importorskip("anthropic")
try:  # the HTTP client the clients depend on (newer releases ship it as httpx2)
    import httpx
except ImportError:
    import httpx2 as httpx

MODEL = REPO_ROOT / "assets" / "kvchat-mini"
MODEL_ID = "kvchat-mini"
KEY = "anthropic-test-key"
SYSTEM = "Be brief."
STOP_REASONS = {"eos": "end_turn", "length": "max_tokens"}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    s = ServerProcess(str(MODEL), "--api-key", KEY, timeout_s=60)
    try:
        yield s
    finally:
        rc = s.stop()
        assert rc == 0, "\n".join(s.lines[-5:])
        assert all("Traceback" not in x for x in s.lines)


def client(server: ServerProcess, key: str = KEY) -> Any:
    return anthropic.Anthropic(base_url=server.url.removesuffix("/v1"), api_key=key,
                               max_retries=0, timeout=60)


def generate(prompt: str, max_tokens: int) -> dict[str, Any]:
    r = processes.run(
        [sys.executable, "-m", "kvchat.app", "generate", "--model", str(MODEL), "--system",
         SYSTEM, "--prompt", prompt, "--max-tokens", str(max_tokens), "--json"],
        capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_a_plain_message_equals_generate(server: ServerProcess) -> None:
    ref = generate("Tell me a story.", 24)
    m = client(server).messages.create(
        model=MODEL_ID, max_tokens=24, system=SYSTEM,
        messages=[{"role": "user", "content": "Tell me a story."}],
        extra_body={"temperature": 0})
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL_ID
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == ref["text"]
    assert m.stop_reason == STOP_REASONS[ref["finish_reason"]] and m.stop_sequence is None
    u = m.usage
    assert u.input_tokens + u.cache_read_input_tokens == len(ref["prompt_ids"])
    assert u.output_tokens == len(ref["ids"]) and u.cache_creation_input_tokens == 0
    assert m.model_extra["kvchat"]["cache"]["reused_tokens"] == u.cache_read_input_tokens


def test_a_multi_turn_conversation_equals_the_engine(server: ServerProcess) -> None:
    from kvchat.model.runtime.client import EngineClient
    from kvchat.model.runtime.events import GenParams

    turns = [{"role": "user", "content": "Tell me a story."},
             {"role": "assistant", "content": "Once upon a time there was a cat."},
             {"role": "user", "content": [{"type": "text", "text": "What did "},
                                          {"type": "text", "text": "the cat do?"}]}]
    m = client(server).messages.create(model=MODEL_ID, max_tokens=20, system=SYSTEM,
                                       messages=turns)
    engine = EngineClient(MODEL)
    try:
        ref = engine.run([{"role": "system", "content": SYSTEM}, turns[0], turns[1],
                          {"role": "user", "content": "What did the cat do?"}],
                         GenParams(max_tokens=20))
    finally:
        engine.close()
    assert m.content[0].text == ref.text
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(ref.prompt_ids)


def test_a_stream_is_anthropics_event_sequence_with_the_same_text(
        server: ServerProcess) -> None:
    c = client(server)
    args: dict[str, Any] = {"model": MODEL_ID, "max_tokens": 30, "system": SYSTEM,
                            "messages": [{"role": "user", "content": "Sing a song."}]}
    whole = c.messages.create(**args)
    events = list(c.messages.create(stream=True, **args))
    kinds = [e.type for e in events]
    n = kinds.count("content_block_delta")
    assert n >= 1 and kinds == ["message_start", "content_block_start",
                                *["content_block_delta"] * n, "content_block_stop",
                                "message_delta", "message_stop"]
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == whole.content[0].text
    start, delta = events[0].message, events[-2]
    assert start.content == [] and start.stop_reason is None
    assert start.usage.input_tokens + start.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert delta.delta.stop_reason == whole.stop_reason
    assert delta.usage.output_tokens == whole.usage.output_tokens
    assert delta.model_extra["kvchat"]["generated_tokens"] == whole.usage.output_tokens
    # the SDK's own accumulator agrees
    with c.messages.stream(**args) as s:
        final = s.get_final_message()
    assert final.content[0].text == whole.content[0].text


def test_stop_sequences_end_the_reply_and_are_named(server: ServerProcess) -> None:
    c = client(server)
    args: dict[str, Any] = {"model": MODEL_ID, "max_tokens": 40, "system": SYSTEM,
                            "messages": [{"role": "user", "content": "Tell me a story."}]}
    free = c.messages.create(**args).content[0].text
    words = free.split()
    assert len(words) >= 6, free
    late, early = words[5], words[2]  # `early` occurs first, though listed second
    assert free.index(early) < free.index(late)
    m = c.messages.create(stop_sequences=[late, early], **args)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == early
    assert m.content[0].text == free[: free.index(early)]
    chunks = list(c.messages.create(stop_sequences=[late, early], stream=True, **args))
    assert chunks[-2].delta.stop_reason == "stop_sequence"
    assert chunks[-2].delta.stop_sequence == early


def test_max_tokens_stops_with_max_tokens(server: ServerProcess) -> None:
    m = client(server).messages.create(model=MODEL_ID, max_tokens=3,
                                       messages=[{"role": "user", "content": "Tell me a story."}])
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3


def test_errors_are_anthropics_error_objects(server: ServerProcess) -> None:
    c = client(server)
    hello = [{"role": "user", "content": "Hello"}]
    with pytest.raises(anthropic.BadRequestError) as e:  # its template never reads tools
        c.messages.create(model=MODEL_ID, max_tokens=8, messages=hello, tools=[
            {"name": "get_weather", "input_schema": {"type": "object", "properties": {}}}])
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "kvchat-mini" in e.value.body["error"]["message"]
    assert "does not support tools" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError) as e:
        client(server, "wrong-key").messages.create(model=MODEL_ID, max_tokens=8,
                                                    messages=hello)
    assert e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as e:
        c.messages.create(model="claude-opus-9", max_tokens=8, messages=hello)
    assert e.value.body["error"]["type"] == "not_found_error"
    for body, named in (
            ({"model": MODEL_ID, "messages": hello}, "max_tokens"),  # required
            ({"model": MODEL_ID, "max_tokens": 8, "messages": hello, "temperature": 1.5},
             "temperature"),  # Anthropic's range is 0-1
            ({"model": MODEL_ID, "max_tokens": 8, "messages": [
                {"role": "user", "content": [{"type": "image", "source": {}}]}]},
             "messages[0].content[0].type"),
            ({"model": MODEL_ID, "max_tokens": 8, "messages": [
                *hello, {"role": "assistant", "content": "Hi"}]}, "messages"),  # a prefill
            ({"model": MODEL_ID, "max_tokens": 8, "messages": hello,
              "thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking")):
        r = httpx.post(server.url + "/messages", json=body, timeout=30,
                       headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"})
        assert r.status_code == 400, r.text
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        assert f"'{named}'" in err["error"]["message"], (named, err)
    # advisory fields pass; a Bearer token works as well as x-api-key
    r = httpx.post(server.url + "/messages", timeout=60, headers={
        "Authorization": f"Bearer {KEY}", "anthropic-version": "2023-06-01"}, json={
        "model": MODEL_ID, "max_tokens": 4, "messages": hello, "service_tier": "auto",
        "cache_control": {"type": "ephemeral"}, "metadata": {"user_id": "someone"}})
    assert r.status_code == 200, r.text
    assert any("POST /v1/messages 200" in x for x in server.lines)
