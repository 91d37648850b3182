"""Tool calls, model side (model/text/tool_calls.py, model/runtime/tool_grammar.py):
each family's call format parsed whole and streamed in random splits; tools and tool
messages rendered through real-style templates exactly as transformers renders them; a
template that never reads `tools` refused by name; a forced call from a random-weight
model that parses and whose arguments validate (jsonschema); a whole round trip."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from kvchat.model.runtime.client import EngineClient
from kvchat.model.runtime.events import GenParams, TextDelta, ToolCallDelta
from kvchat.model.text.tokenizer import load_tokenizer
from kvchat.model.text.tool_calls import (
    HERMES,
    LLAMA3,
    MISTRAL,
    CallFormat,
    ToolCall,
    ToolCallError,
    ToolCallStream,
    call_format,
    check_tools,
    chosen_tools,
    parse_tool_calls,
    reads_tools,
    template_messages,
)
from tests.helpers.chat_models import random_chat_model
from tests.helpers.paths import STORIES260K
from tests.helpers.tiny_tokenizers import GEMMA, QWEN25, byte_level_bpe, write_folder
from tests.helpers.tiny_tokenizers import LLAMA3 as LLAMA3_NO_TOOLS

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# ---- templates written after the real ones ------------------------------------------------

LLAMA31 = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools_in_user_message and not tools is none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {{- ")" }}
        {%- else %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""  # noqa: E501

MISTRAL_TOOLS = """{{- bos_token }}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- if loop.last and tools %}
            {{- '[AVAILABLE_TOOLS]' + tools | tojson + '[/AVAILABLE_TOOLS]' }}
        {%- endif %}
        {{- '[INST]' + message.content + '[/INST]' }}
    {%- elif message.role == 'assistant' and message.tool_calls %}
        {{- '[TOOL_CALLS][' }}
        {%- for tc in message.tool_calls %}
            {{- '{"name": "' + tc.function.name + '", "arguments": ' + tc.function.arguments | tojson + '}' }}
            {%- if not loop.last %}{{- ', ' }}{%- endif %}
        {%- endfor %}
        {{- ']' + eos_token }}
    {%- elif message.role == 'assistant' %}
        {{- message.content + eos_token }}
    {%- elif message.role == 'tool' %}
        {{- '[TOOL_RESULTS]{"content": ' + message.content | tojson + '}[/TOOL_RESULTS]' }}
    {%- endif %}
{%- endfor %}
"""  # noqa: E501

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time now", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
        "required": ["zone"]}}}
NOTE = {"type": "function", "function": {"name": "take_note"}}  # no parameters at all
TOOLS = [WEATHER, TIME, NOTE]

ROUND_TRIP = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
]


# ---- parsing ------------------------------------------------------------------------------

def _args(call: ToolCall) -> Any:
    return (call.name, json.loads(call.arguments))


CASES: list[tuple[CallFormat, str, str, list[tuple[str, Any]]]] = [
    (HERMES, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
             '{"city": "Paris", "days": 2}}\n</tool_call>\n<tool_call>\n{"name": "get_time",'
             ' "arguments": {"zone": "CET"}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": "Paris", "days": 2}),
                       ("get_time", {"zone": "CET"})]),
    (HERMES, "No tools needed: 2 < 3 and <b>bold</b> <tool_ stays.\n",
     "No tools needed: 2 < 3 and <b>bold</b> <tool_ stays.\n", []),
    (HERMES, "<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after",
     []),
    (HERMES, 'Cut off: <tool_call>{"name": "get_weather", "argu',
     'Cut off: <tool_call>{"name": "get_weather", "argu', []),
    (HERMES, '<tool_call>{"name": "take_note", "arguments": "{\\"a\\": 1}"}</tool_call>', "",
     [("take_note", {"a": 1})]),
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 3}}', "",
     [("get_weather", {"city": "Oslo", "days": 3})]),
    (LLAMA3, '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}; '
             '{"name": "take_note", "arguments": {}}', "",
     [("get_time", {"zone": "UTC"}), ("take_note", {})]),
    (LLAMA3, '{"answer": 42, "name": "x"}', '{"answer": 42, "name": "x"}', []),
    (LLAMA3, "  The answer is {1, 2}.", "  The answer is {1, 2}.", []),
    (MISTRAL, 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome", '
              '"days": 1}}, {"name": "take_note", "arguments": {}}]',
     "Sure.", [("get_weather", {"city": "Rome", "days": 1}), ("take_note", {})]),
    (MISTRAL, '[TOOL_CALLS]get_time[ARGS]{"zone": "JST"}', "", [("get_time", {"zone": "JST"})]),
    (MISTRAL, "[TOOL_CALLS] oops, no list", "[TOOL_CALLS] oops, no list", []),
]


@pytest.mark.parametrize("fmt,reply,content,calls", CASES)
def test_parse_whole_reply(fmt: CallFormat, reply: str, content: str, calls: list) -> None:
    text, got = parse_tool_calls(reply, fmt)
    assert text == content
    assert [_args(c) for c in got] == calls
    assert all(c.id.startswith("call_") for c in got) and len({c.id for c in got}) == len(got)


@pytest.mark.parametrize("fmt,reply,content,calls", CASES)
def test_parse_streamed_in_random_splits(fmt: CallFormat, reply: str, content: str,
                                         calls: list) -> None:
    rnd = random.Random(hash(reply) & 0xFFFF)
    for _ in range(40):
        cuts = sorted(rnd.sample(range(1, len(reply)), min(len(reply) - 1, rnd.randint(1, 12))))
        pieces = [reply[a:b] for a, b in zip([0, *cuts], [*cuts, len(reply)], strict=True)]
        stream = ToolCallStream(fmt)
        out = [p for piece in pieces for p in stream.feed(piece)] + stream.finish()
        assert "".join(p for p in out if isinstance(p, str)) == content
        assert [_args(c) for c in out if isinstance(c, ToolCall)] == calls


def test_a_call_is_emitted_as_soon_as_it_closes() -> None:
    stream = ToolCallStream(HERMES)
    assert stream.feed("Checking <tool") == ["Checking"]
    assert stream.feed('_call>{"name": "take_note", "arguments": {}}') == []
    out = stream.feed("</tool_call>\n")
    assert len(out) == 1 and isinstance(out[0], ToolCall)
    assert stream.feed("more ") == ["more"]  # its trailing space waits for what follows
    assert stream.finish() == []


def test_one_call_at_most_ends_the_reply_with_its_first_call() -> None:
    """parallel_tool_calls false (the turn's `_Reply`): the first call ends the reply, the
    text after it and any other call never shown; true, the reply as parsed whole."""
    from kvchat.model.runtime.turn import ToolUse, _Reply

    text = ('Sure. <tool_call>\n{"name": "take_note", "arguments": {"text": "a"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {}}\n'
            "</tool_call> and more")
    whole_text, whole_calls = parse_tool_calls(text, HERMES)
    for one in (False, True):
        reply = _Reply(ToolUse(TOOLS, HERMES, None), one_call=one)
        events: list[Any] = []
        for ch in text:  # a character a token
            events += reply.events(ch, 0)
            if reply.ended:
                break
        else:
            events += reply.events("", 0, final=True)
        calls = [(e.index, e.call.name) for e in events if isinstance(e, ToolCallDelta)]
        shown = "".join(e.text for e in events if isinstance(e, TextDelta))
        assert reply.ended == one and shown == reply.text
        assert reply.offsets == [len("Sure.")] * len(calls)  # both where the text stood
        if one:
            assert calls == [(0, "take_note")] and shown == "Sure."
        else:
            assert calls == [(i, c.name) for i, c in enumerate(whole_calls)]
            assert len(calls) == 2 and shown == whole_text


# ---- requests ---------------------------------------------------------------------------

def test_tools_and_choice_are_checked_by_field() -> None:
    assert check_tools(TOOLS) == TOOLS
    for bad, field in [([], "tools"), ([{"type": "code"}], "tools[0].type"),
                       ([{"type": "function", "function": {}}], "tools[0].function.name"),
                       ([WEATHER, WEATHER], "tools[1].function.name"),
                       ([{"type": "function", "function": {"name": "f", "parameters": 3}}],
                        "tools[0].function.parameters")]:
        with pytest.raises(ToolCallError, match=field.replace("[", r"\[").replace(".", r"\.")):
            check_tools(bad)
    assert chosen_tools(TOOLS, "auto") is None and chosen_tools(TOOLS, None) is None
    assert chosen_tools(TOOLS, "none") == [] and chosen_tools(TOOLS, "required") == TOOLS
    named = {"type": "function", "function": {"name": "get_time"}}
    assert chosen_tools(TOOLS, named) == [TIME]
    with pytest.raises(ToolCallError, match="'nope'"):
        chosen_tools(TOOLS, {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(ToolCallError, match="tool_choice"):
        chosen_tools(TOOLS, "always")


def test_formats_and_tool_support_are_read_from_the_template() -> None:
    # a template that reads tools but teaches no call syntax gets Llama 3's JSON calls
    plain = "{% for t in tools %}{{ t | tojson }}{% endfor %}{{ messages[0]['content'] }}"
    assert call_format(QWEN25) is HERMES and call_format(plain) is LLAMA3
    assert call_format(LLAMA31) is LLAMA3 and call_format(MISTRAL_TOOLS) is MISTRAL
    for template in (QWEN25, LLAMA31, MISTRAL_TOOLS, plain):
        assert reads_tools(template)
    for template in (LLAMA3_NO_TOOLS, GEMMA, None, "{{ tools_x }}{% set tools = 1 %}{{ tools }}"):
        assert not reads_tools(template)


# ---- rendering through the model's template, as transformers renders it -----------------------

def _dict_args(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as transformers documents it: arguments as objects, no None."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        if "tool_calls" in m:
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(
                c["function"]["arguments"])}} for c in m["tool_calls"]]
        out.append(m)
    return out


@pytest.mark.parametrize("template", [QWEN25, LLAMA31, MISTRAL_TOOLS])
def test_tools_render_as_transformers_renders_them(tmp_path: Path, template: str) -> None:
    transformers = pytest.importorskip("transformers")
    folder = write_folder(tmp_path / "m", byte_level_bpe(), tokenizer_config={
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "chat_template": template})
    ref = transformers.AutoTokenizer.from_pretrained(folder)
    ours = load_tokenizer(folder)
    tools = [WEATHER, TIME]
    for messages in (ROUND_TRIP[:2], ROUND_TRIP):
        want = ref.apply_chat_template(_dict_args(messages), tools=tools, tokenize=False,
                                       add_generation_prompt=True)
        got = ours.render_chat(template_messages(messages), tools=tools)
        assert got == want
    assert "18 degrees and sunny" in got and '"city": "Paris"' in got


# ---- turns on a random-weight model ---------------------------------------------------------

@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("tool_models")
    made = {"hermes": random_chat_model(root / "hermes", QWEN25),
            "llama3": random_chat_model(root / "llama3", LLAMA31, eos="<|eot_id|>", seed=12),
            "mistral": random_chat_model(root / "mistral", MISTRAL_TOOLS, eos="</s>", seed=13),
            "no_tools": random_chat_model(root / "no_tools", LLAMA3_NO_TOOLS,
                                          eos="<|eot_id|>")}
    clients: dict[str, EngineClient] = {}

    def get(name: str) -> EngineClient:
        if name not in clients:
            clients[name] = EngineClient(made[name], timeout=120)
        return clients[name]

    get.folders = made  # type: ignore[attr-defined]
    yield get
    for c in clients.values():
        c.close()


def _validate_call(call: ToolCall, tools: list[dict[str, Any]]) -> None:
    tool = next(t for t in tools if t["function"]["name"] == call.name)
    schema = tool["function"].get("parameters") or {"type": "object"}
    jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    ).validate(json.loads(call.arguments))


@pytest.mark.parametrize("family", ["hermes", "llama3", "mistral"])
@pytest.mark.parametrize("temp,seed", [(0.0, None), (1.0, 1), (1.0, 2)])
def test_a_named_call_from_a_random_model_parses_and_validates(models, family, temp,
                                                               seed) -> None:
    client = models(family)
    named = {"type": "function", "function": {"name": "get_weather"}}
    done = client.run(ROUND_TRIP[:2], GenParams(max_tokens=80, temp=temp, seed=seed,
                                                tools=TOOLS, tool_choice=named))
    assert done.finish_reason == "tool_calls", (done.error, done.text)
    assert [c.name for c in done.tool_calls] == ["get_weather"]
    _validate_call(done.tool_calls[0], TOOLS)
    deltas = [e for e in client.events if isinstance(e, ToolCallDelta)]
    assert [(d.index, d.call) for d in deltas] == [(0, done.tool_calls[0])]
    shown = "".join(e.text for e in client.events if isinstance(e, TextDelta))
    assert shown == done.text and "get_weather" not in shown
    assert done.tool_call_offsets == [0]  # the grammar starts the reply with the call


@pytest.mark.parametrize("family", ["hermes", "mistral"])
def test_required_makes_calls_to_any_tool(models, family) -> None:
    for seed in (3, 4, 5):
        done = models(family).run(ROUND_TRIP[:2], GenParams(
            max_tokens=120, temp=1.0, seed=seed, tools=TOOLS, tool_choice="required"))
        assert done.finish_reason == "tool_calls", (done.error, done.text)
        assert done.tool_calls
        for call in done.tool_calls:
            _validate_call(call, TOOLS)


def test_round_trip_call_then_result_then_answer(models) -> None:
    client = models("hermes")
    first = client.run(ROUND_TRIP[:2], GenParams(max_tokens=80, tools=TOOLS,
                                                 tool_choice="required"))
    assert first.finish_reason == "tool_calls"
    call = first.tool_calls[0]
    history = [*ROUND_TRIP[:2],
               {"role": "assistant", "content": first.text or None,
                "tool_calls": [call.openai()]},
               {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    answer = client.run(history, GenParams(max_tokens=12, tools=TOOLS, tool_choice="none"))
    assert answer.finish_reason in ("eos", "length"), answer.error
    prompt = load_tokenizer(models.folders["hermes"]).decode(answer.prompt_ids)
    assert f'<tool_call>\n{{"name": "{call.name}", "arguments": {call.arguments}}}' in prompt
    assert "<tool_response>\n18 degrees and sunny\n</tool_response>" in prompt


def test_auto_leaves_text_alone_on_a_model_that_writes_no_calls(models) -> None:
    done = models("hermes").run(ROUND_TRIP[:2], GenParams(max_tokens=20, tools=TOOLS))
    assert done.finish_reason in ("eos", "length") and not done.tool_calls
    plain = models("hermes").run(ROUND_TRIP[:2], GenParams(max_tokens=20, tools=TOOLS,
                                                           tool_choice="none"))
    assert plain.tool_calls == []


@pytest.mark.parametrize("which", ["no_tools", "stories260k"])
def test_a_template_without_tools_is_refused_by_name(models, which) -> None:
    if which == "stories260k":
        with EngineClient(STORIES260K, timeout=60) as client:
            done = client.run(ROUND_TRIP[:2], GenParams(tools=TOOLS))
        name = "stories260K"
    else:
        done = models(which).run(ROUND_TRIP[:2], GenParams(tools=TOOLS))
        name = "no_tools"
    assert done.finish_reason == "error" and done.ids == []
    assert name in (done.error or "") and "does not support tools" in (done.error or "")


def test_forced_call_with_unenforceable_parameters_is_refused(models) -> None:
    odd = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"xs": {"type": "array", "uniqueItems": True}}}}}
    done = models("hermes").run(ROUND_TRIP[:2], GenParams(tools=[odd], tool_choice="required"))
    assert done.finish_reason == "error" and "uniqueItems" in (done.error or "")
