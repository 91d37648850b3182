"""Tool calls and structured output through `kvchat serve` (docs/serve.md, Fields, Tool
calls, Structured output), driven with the official `openai` client against a real
server. The model is a tiny random-weight Llama whose byte-level tokenizer can spell any
JSON and whose chat template is Qwen 2.5's (it reads `tools`): whatever it writes is
noise, so only constrained decoding can make the answers valid. References: the
request's own JSON schema (`jsonschema`), and the non-streamed call for the streamed one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests.helpers.chat_models import NO_TOOLS_MODEL, TOOLS_MODEL, tool_models
from tests.helpers.server_process import ServerProcess, side_by_side

openai = pytest.importorskip("openai")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODEL_ID = TOOLS_MODEL
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}
NOTE = {"type": "function", "function": {"name": "take_note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string", "maxLength": 8}},
    "required": ["text"], "additionalProperties": False}}}
TOOLS = [WEATHER, NOTE]
FORCED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "Weather in Paris for two days?"}]
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tool_models(tmp_path_factory.mktemp("serve-tools"))


@pytest.fixture(scope="module")
def client(models: Path) -> Iterator[Any]:
    server = ServerProcess(str(models / MODEL_ID), "--models-dir", str(models))
    try:
        yield openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=300)
    finally:
        server.stop()


def _validate(schema: dict[str, Any], doc: Any) -> None:
    jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER).validate(doc)


def _forced_call(client: Any, **kw: Any) -> Any:
    return client.chat.completions.create(model=MODEL_ID, messages=ASK, tools=TOOLS,
                                          tool_choice=FORCED, max_tokens=200, seed=3,
                                          temperature=1.0, **kw)


def test_response_format_json_schema_validates(client: Any) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for seed in (1, 2):
        r = client.chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": "A person, please."}],
            response_format=fmt, max_tokens=120, temperature=1.0, seed=seed)
        choice = r.choices[0]
        # a random model pads with whitespace: the grammar closes the document within
        # max_tokens, so it parses even when the budget ended it
        assert choice.finish_reason in ("stop", "length"), choice
        _validate(PERSON, json.loads(choice.message.content))


def test_a_named_tool_choice_makes_a_call_that_validates(client: Any) -> None:
    r = _forced_call(client)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls and all(c.function.name == "get_weather" and c.type == "function"
                         for c in calls)
    for c in calls:
        assert c.id
        _validate(WEATHER["function"]["parameters"], json.loads(c.function.arguments))
    assert choice.message.content in (None, "")


def test_a_tool_round_trip_ends_with_an_answer(client: Any) -> None:
    first = _forced_call(client).choices[0].message
    call = first.tool_calls[0]
    messages = [*ASK,
                {"role": "assistant", "content": first.content, "tool_calls": [
                    {"id": call.id, "type": "function",
                     "function": {"name": call.function.name,
                                  "arguments": call.function.arguments}}]},
                {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]

    def answer(result: str) -> Any:
        said = [*messages[:-1], {**messages[-1], "content": result}]
        return client.chat.completions.create(model=MODEL_ID, messages=said, tools=TOOLS,
                                              max_tokens=8, temperature=0)

    r = answer("18 degrees and sunny")
    choice = r.choices[0]
    # tools still offered (tool_choice auto): greedy, this model answers in text
    assert choice.finish_reason in ("stop", "length"), choice
    assert choice.message.tool_calls is None and isinstance(choice.message.content, str)
    # the tool's result is rendered into the prompt: a longer one makes a longer prompt
    longer = answer("18 degrees and sunny, light wind from the west")
    assert longer.usage.prompt_tokens > r.usage.prompt_tokens


def test_a_streamed_forced_call_reassembles_to_the_same_call(client: Any) -> None:
    whole = _forced_call(client).choices[0]
    parts: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in _forced_call(client, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for d in delta.tool_calls or []:
            got = parts.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            got["id"] += d.id or ""
            got["name"] += d.function.name or "" if d.function else ""
            got["arguments"] += d.function.arguments or "" if d.function else ""
            assert d.type in (None, "function")
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert sorted(parts) == list(range(len(parts)))
    streamed = [(parts[i]["name"], json.loads(parts[i]["arguments"])) for i in sorted(parts)]
    # seeded: the same call as the whole answer (ids are fresh per call)
    assert streamed == [(c.function.name, json.loads(c.function.arguments))
                        for c in whole.message.tool_calls]


def test_a_template_without_tools_is_a_400_naming_it(client: Any) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NO_TOOLS_MODEL, messages=ASK, tools=TOOLS,
                                       max_tokens=8)
    assert e.value.param == "tools"
    assert NO_TOOLS_MODEL in e.value.message and "does not support tools" in e.value.message


def test_an_unsupported_schema_keyword_is_a_400_naming_it(client: Any) -> None:
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL_ID, messages=ASK, max_tokens=8,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "xs", "schema": schema}})
    assert e.value.param == "response_format" and "uniqueItems" in e.value.message
    odd = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"xs": schema}}}}
    with pytest.raises(openai.BadRequestError) as e:  # a forced call's parameters, too
        client.chat.completions.create(model=MODEL_ID, messages=ASK, tools=[odd],
                                       tool_choice="required", max_tokens=50)
    assert "uniqueItems" in e.value.message


def test_constrained_requests_side_by_side_answer_as_they_do_alone(client: Any) -> None:
    """Several grammar-constrained requests at once (continuous batching: each row's
    logits masked by its own grammar, sampled by its own seeded sampler) answer exactly
    as each does alone, and every answer still validates."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}

    def person(seed: int) -> str:
        r = client.chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": "A person, please."}],
            response_format=fmt, max_tokens=80, temperature=1.0, seed=seed)
        return r.choices[0].message.content

    def call(seed: int) -> str:
        r = client.chat.completions.create(
            model=MODEL_ID, messages=ASK, tools=TOOLS, tool_choice=FORCED, max_tokens=120,
            seed=seed, temperature=1.0)
        return json.dumps([c.function.arguments for c in r.choices[0].message.tool_calls])

    jobs = [(person, 11), (person, 12), (call, 13), (call, 14)]
    alone = [fn(seed) for fn, seed in jobs]
    together, most = side_by_side(str(client.base_url).rstrip("/"),
                                  [lambda fn=fn, seed=seed: fn(seed) for fn, seed in jobs])
    assert most >= 2  # batched, not queued
    assert together == alone
    for (fn, _), text in zip(jobs, alone, strict=True):
        if fn is person:
            _validate(PERSON, json.loads(text))
        else:
            for args in json.loads(text):
                _validate(WEATHER["function"]["parameters"], json.loads(args))
