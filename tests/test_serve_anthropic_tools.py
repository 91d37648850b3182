"""Tool use on Anthropic's Messages API (docs/serve.md, Anthropic's Messages API; Tool
calls): the official `anthropic` client against a real `kvchat serve`, whose model is a
tiny random-weight Llama with Qwen 2.5's template (hermes calls): whatever it writes is
noise, so only constrained decoding makes a forced call valid.

References: the OpenAI route of the same server given the same conversation written in
OpenAI's shapes by hand (the same prompt tokens, the same greedy call or answer), the
tool's own input_schema (`jsonschema`), the non-streamed message for the streamed one,
and hand-written OpenAI requests for the mapping itself.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from kvchat.app.serve import anthropic as messages_api
from kvchat.app.serve import protocol
from tests.helpers.chat_models import NO_TOOLS_MODEL, TOOLS_MODEL, tool_models
from tests.helpers.server_process import ServerProcess

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODEL_ID = TOOLS_MODEL
WEATHER_SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
NOTE_SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 8}},
               "required": ["text"], "additionalProperties": False}
# the same two tools in each API's shape
TOOLS = [{"name": "get_weather", "description": "Weather in a city",
          "input_schema": WEATHER_SCHEMA},
         {"name": "take_note", "input_schema": NOTE_SCHEMA}]
FUNCTIONS = [{"type": "function", "function": {"name": "get_weather",
                                               "description": "Weather in a city",
                                               "parameters": WEATHER_SCHEMA}},
             {"type": "function", "function": {"name": "take_note",
                                               "parameters": NOTE_SCHEMA}}]
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "take_note": NOTE_SCHEMA}
ASK = [{"role": "user", "content": "Weather in Paris for two days?"}]
FORCED = {"type": "tool", "name": "get_weather"}
LIMITS = protocol.Limits(("m",), capacity=4096)


def _validate(name: str, doc: Any) -> None:
    schema = SCHEMAS[name]
    jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER).validate(doc)


# ---- the mapping, without a server --------------------------------------------------------
def test_a_tool_conversation_is_the_openai_request_written_by_hand() -> None:
    body = {"model": "m", "max_tokens": 10, "system": "Be brief.", "tools": TOOLS,
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "messages": [
                *ASK,
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                     "input": {"city": "Paris", "days": 2}},
                    {"type": "tool_use", "id": "toolu_2", "name": "take_note",
                     "input": {"text": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                     "content": [{"type": "text", "text": "disk "},
                                 {"type": "text", "text": "full"}]},
                    {"type": "text", "text": "And tomorrow?"}]}]}
    openai_body = {"model": "m", "max_tokens": 10, "tools": FUNCTIONS,
                   "tool_choice": "required", "parallel_tool_calls": False, "messages": [
                       {"role": "system", "content": "Be brief."}, *ASK,
                       {"role": "assistant", "content": "Let me look.", "tool_calls": [
                           {"id": "toolu_1", "type": "function", "function": {
                               "name": "get_weather",
                               "arguments": '{"city": "Paris", "days": 2}'}},
                           {"id": "toolu_2", "type": "function", "function": {
                               "name": "take_note", "arguments": '{"text": "Paris"}'}}]},
                       {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"},
                       {"role": "tool", "tool_call_id": "toolu_2",
                        "content": "Error: disk full"},
                       {"role": "user", "content": "And tomorrow?"}]}
    got, want = messages_api.parse(body, LIMITS), protocol.parse("chat", openai_body, LIMITS)
    assert got.prompt == want.prompt
    assert (got.params.tools, got.params.tool_choice, got.params.parallel_tool_calls) == (
        want.params.tools, want.params.tool_choice, False)
    named = messages_api.parse({**body, "tool_choice": FORCED}, LIMITS).params
    assert named.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert named.parallel_tool_calls
    for choice, openai_choice in (({"type": "auto"}, "auto"), ({"type": "none"}, "none")):
        assert messages_api.parse({**body, "tool_choice": choice},
                                  LIMITS).params.tool_choice == openai_choice


@pytest.mark.parametrize("change,named", [
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({"tools": [{"name": "f f", "input_schema": {"type": "object"}}]}, "tools[0].name"),
    ({"tools": [*TOOLS, TOOLS[0]]}, "tools[2].name"),
    ({"tools": [{**TOOLS[0], "strict": True}]}, "tools[0].strict"),
    ({"tools": [{**TOOLS[0], "input_examples": [{"city": "Oslo", "days": 1}]}]},
     "tools[0].input_examples"),
    ({"tools": [{**TOOLS[0], "defer_loading": True}]}, "tools[0].defer_loading"),
    ({"tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "any", "disable_parallel_tool_use": "yes"}},
     "tool_choice.disable_parallel_tool_use"),
    ({"tool_choice": {"type": "required"}}, "tool_choice.type"),
    ({"tools": [], "tool_choice": {"type": "any"}, "messages": ASK}, "tool_choice"),
    ({"tools": []}, "tools"),  # tool blocks need tools
    ({"messages": [*ASK, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9"}]}]},
     "messages[2].content[0].tool_use_id"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [*ASK, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "f", "input": "{}"}]},
        {"role": "user", "content": "ok"}]}, "messages[1].content[0].input"),
    ({"messages": [*ASK, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "image", "source": {}}]}]}]},
     "messages[2].content[0].content[0].type"),
])
def test_tool_fields_it_cannot_use_are_a_400_naming_them(change: dict[str, Any],
                                                          named: str) -> None:
    body = {"model": "m", "max_tokens": 10, "tools": TOOLS, "messages": [
        *ASK, {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"}]}],
        **change}
    with pytest.raises(protocol.ApiError) as e:
        messages_api.parse(body, LIMITS)
    assert e.value.status == 400 and e.value.param == named, e.value.message
    assert f"'{named}'" in e.value.message


@pytest.mark.parametrize("pieces", [
    ["Let me look. ", ("get_weather", {"city": "Oslo", "days": 2}), ("take_note", {"text": "x"}),
     "Done."],
    [("take_note", {"text": "ünï"})],
    ["Just text."],
    [],
])
def test_a_streamed_reply_accumulates_to_the_whole_message(pieces: list[Any]) -> None:
    """Text and calls in any order: the official client's own accumulator builds the
    message `whole` answers from the stream's events (blocks numbered as they open)."""
    from anthropic.lib.streaming._messages import accumulate_event

    from kvchat.model.runtime.events import Done, Started
    from kvchat.model.text.tool_calls import ToolCall, new_call_id

    req = messages_api.parse({"model": "m", "max_tokens": 10, "messages": ASK, "tools": TOOLS,
                              "stream": True}, LIMITS)
    wire = messages_api.WIRE.for_response()
    events = wire.start(req, Started(12, 0))
    text, calls, offsets = "", [], []
    for p in pieces:
        if isinstance(p, str):
            events += wire.text(req, p)
            text += p
        else:
            calls.append(ToolCall(p[0], json.dumps(p[1], ensure_ascii=False), new_call_id()))
            offsets.append(len(text))
            events += wire.tool_call(req, len(calls) - 1, calls[-1])
    done = Done("tool_calls" if calls else "eos", text, [5] * 3, list(range(12)),
                tool_calls=calls, tool_call_offsets=offsets)
    events += wire.end(req, done, None)
    snapshot, bufs = None, {}
    for name, data in events:
        assert name == data["type"]
        snapshot = accumulate_event(event=data, current_snapshot=snapshot, json_bufs=bufs)
    assert snapshot is not None
    whole = messages_api.WIRE.whole(req, done, None)
    assert [b.model_dump(exclude_none=True) for b in snapshot.content] == whole["content"]
    assert snapshot.stop_reason == whole["stop_reason"] == (
        "tool_use" if calls else "end_turn")
    starts = [d["index"] for n, d in events if n == "content_block_start"]
    stops = [d["index"] for n, d in events if n == "content_block_stop"]
    assert starts == stops == list(range(len(whole["content"])))


# ---- a real server ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """`kvchat serve` of the tool model, with the one whose template reads no tools."""
    root = tool_models(tmp_path_factory.mktemp("anthropic-tools"))
    s = ServerProcess(str(root / MODEL_ID), "--models-dir", str(root))
    try:
        yield s
    finally:
        assert s.stop() == 0, "\n".join(s.lines[-5:])
        assert all("Traceback" not in x for x in s.lines)


@pytest.fixture(scope="module")
def clients(server: ServerProcess) -> tuple[Any, Any]:
    """(Anthropic's client, OpenAI's) on the same server."""
    return (anthropic.Anthropic(base_url=server.url.removesuffix("/v1"), api_key="none",
                                max_retries=0, timeout=300),
            openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=300))


def _forced(client: Any, **kw: Any) -> Any:
    """A forced call, greedy (the server's default temperature is 0)."""
    args: dict[str, Any] = {"model": MODEL_ID, "max_tokens": 200, "messages": ASK,
                            "tools": TOOLS, "tool_choice": FORCED}
    return client.messages.create(**{**args, **kw})


def _prompt_tokens(message: Any) -> int:
    return message.usage.input_tokens + message.usage.cache_read_input_tokens


def _calls(message: Any) -> list[tuple[str, Any]]:
    return [(b.name, b.input) for b in message.content if b.type == "tool_use"]


def test_a_forced_tool_validates_and_is_the_openai_routes_call(clients: tuple[Any, Any]
                                                               ) -> None:
    claude, oai = clients
    m = _forced(claude)
    assert m.stop_reason == "tool_use" and m.content
    assert all(b.type == "tool_use" and b.name == "get_weather" for b in m.content)
    for block in m.content:
        assert block.id.startswith("toolu_") and len(block.id) > len("toolu_")
        _validate(block.name, block.input)
    r = oai.chat.completions.create(
        model=MODEL_ID, messages=ASK, tools=FUNCTIONS, max_tokens=200, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert r.choices[0].finish_reason == "tool_calls"
    assert _calls(m) == [(c.function.name, json.loads(c.function.arguments))
                         for c in r.choices[0].message.tool_calls]
    assert _prompt_tokens(m) == r.usage.prompt_tokens


def test_any_without_parallel_calls_makes_exactly_one(clients: tuple[Any, Any]) -> None:
    claude, oai = clients
    several = _forced(claude, tool_choice={"type": "any"})
    # greedy, this model writes several calls when it may (the test would show nothing
    # otherwise), each valid
    assert several.stop_reason == "tool_use" and len(several.content) > 1
    for block in several.content:
        _validate(block.name, block.input)
    m = _forced(claude, tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert m.stop_reason == "tool_use" and len(m.content) == 1
    assert m.content[0].type == "tool_use"
    assert _calls(m) == _calls(several)[:1]
    r = oai.chat.completions.create(model=MODEL_ID, messages=ASK, tools=FUNCTIONS,
                                    max_tokens=200, temperature=0, tool_choice="required",
                                    parallel_tool_calls=False)
    assert _calls(m) == [(c.function.name, json.loads(c.function.arguments))
                         for c in r.choices[0].message.tool_calls]


def test_a_tool_round_trip_ends_with_the_openai_routes_answer(clients: tuple[Any, Any]
                                                               ) -> None:
    claude, oai = clients
    first = _forced(claude)
    use = first.content[0]

    def both(result: str, is_error: bool = False) -> tuple[Any, Any]:
        block: dict[str, Any] = {"type": "tool_result", "tool_use_id": use.id,
                                 "content": result}
        if is_error:
            block["is_error"] = True
        m = claude.messages.create(
            model=MODEL_ID, max_tokens=8, tools=TOOLS, messages=[
                *ASK, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                {"role": "user", "content": [block]}])
        r = oai.chat.completions.create(
            model=MODEL_ID, max_tokens=8, temperature=0, tools=FUNCTIONS, messages=[
                *ASK, {"role": "assistant", "content": None, "tool_calls": [
                    {"id": b.id, "type": "function",
                     "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                    for b in first.content]},
                {"role": "tool", "tool_call_id": use.id,
                 "content": ("Error: " if is_error else "") + result}])
        return m, r

    m, r = both("18 degrees and sunny")
    # tools still offered (auto): greedy, this model answers in text
    assert m.stop_reason in ("end_turn", "max_tokens"), m
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text == r.choices[0].message.content
    assert _prompt_tokens(m) == r.usage.prompt_tokens
    # the result is rendered into the prompt: a longer one makes a longer prompt
    longer, _ = both("18 degrees and sunny, light wind from the west")
    assert _prompt_tokens(longer) > _prompt_tokens(m)
    failed, failed_ref = both("timed out", is_error=True)
    assert _prompt_tokens(failed) == failed_ref.usage.prompt_tokens
    assert failed.content[0].text == failed_ref.choices[0].message.content


def test_a_streamed_tool_use_is_assembled_by_the_client(clients: tuple[Any, Any]) -> None:
    claude, _ = clients
    whole = _forced(claude)
    events = list(_forced(claude, stream=True))
    kinds = [e.type for e in events]
    n = len(whole.content)
    assert kinds == ["message_start",
                     *["content_block_start", "content_block_delta", "content_block_stop"] * n,
                     "message_delta", "message_stop"]
    starts = [e for e in events if e.type == "content_block_start"]
    assert [e.index for e in starts] == list(range(n))
    assert all(e.content_block.type == "tool_use" and e.content_block.id.startswith("toolu_")
               for e in starts)
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert all(d.type == "input_json_delta" for d in deltas)
    assert events[-2].delta.stop_reason == "tool_use"
    with claude.messages.stream(model=MODEL_ID, max_tokens=200, messages=ASK, tools=TOOLS,
                                tool_choice=FORCED) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use"
    assert _calls(final) == _calls(whole)
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_tool_use_it_cannot_serve_is_anthropics_400(clients: tuple[Any, Any]) -> None:
    claude, _ = clients
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=NO_TOOLS_MODEL, max_tokens=8, messages=ASK, tools=TOOLS)
    body = e.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert NO_TOOLS_MODEL in body["error"]["message"]
    assert "does not support tools" in body["error"]["message"]
    odd = {"name": "f", "input_schema": {"type": "object", "properties": {
        "xs": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}}
    with pytest.raises(anthropic.BadRequestError) as e:  # a forced call's schema keyword
        claude.messages.create(model=MODEL_ID, max_tokens=50, messages=ASK, tools=[odd],
                               tool_choice={"type": "any"})
    assert e.value.body["type"] == "error" and "uniqueItems" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL_ID, max_tokens=8, messages=ASK, tools=TOOLS,
                               tool_choice={"type": "tool", "name": "nope"})
    assert "'tool_choice.name'" in e.value.body["error"]["message"]
