"""The grammar of a forced tool call (`tool_choice` "required" or a named function):
the family's call syntax (model/text/tool_calls.py) around a JSON schema built from the
functions' parameters, so that even a tiny model writes a call that parses and whose
arguments validate (docs/serve.md, "Tool calls").

Written in llguidance's Lark dialect: `%json {...}` embeds a JSON schema, and a marker
that is a control token in the vocabulary (Mistral's `[TOOL_CALLS]`) is named by id
(`<[5]>`), since no text spells a control token.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from kvchat.model.text.tokenizer import Tokenizer
from kvchat.model.text.tool_calls import CallFormat, parameters

from .constrained import JSON_OPTIONS, lark_grammar


def call_schema(fmt: CallFormat, tools: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One call to any of `tools`: `{"name": <its name>, <args key>: <its parameters>}`."""
    options = [{
        "type": "object",
        "properties": {"name": {"const": t["function"]["name"]}, fmt.args_key: parameters(t)},
        "required": ["name", fmt.args_key],
        "additionalProperties": False,
    } for t in tools]
    return options[0] if len(options) == 1 else {"anyOf": options}


def _marker(tokenizer: Tokenizer, text: str) -> str:
    token = tokenizer.token_to_id(text)
    if token is not None and token in tokenizer.special_ids:
        return f"<[{token}]>"
    return json.dumps(text)  # a Lark string literal


def _json(schema: Mapping[str, Any]) -> str:
    return "%json " + json.dumps({"x-guidance": JSON_OPTIONS, **schema})


def tool_call_grammar(fmt: CallFormat, tools: Sequence[Mapping[str, Any]],
                      tokenizer: Tokenizer, many: bool) -> str:
    """The llguidance grammar of one call (`many`: one or more) in `fmt`'s syntax;
    GrammarError naming a parameters keyword it cannot enforce."""
    schema = call_schema(fmt, tools)
    if fmt.name == "hermes":
        assert fmt.open and fmt.close
        repeat = ' ("\\n"? call)*' if many else ""
        lark = (f"start: call{repeat}\n"
                f'call: {_marker(tokenizer, fmt.open)} "\\n"? body "\\n"?'
                f' {_marker(tokenizer, fmt.close)}\n'
                f"body: {_json(schema)}\n")
    elif fmt.name == "mistral":
        assert fmt.open
        calls = {"type": "array", "items": schema, "minItems": 1}
        if not many:
            calls["maxItems"] = 1
        lark = f"start: {_marker(tokenizer, fmt.open)} body\nbody: {_json(calls)}\n"
    else:  # llama3: the reply is the call's JSON object
        lark = f"start: body\nbody: {_json(schema)}\n"
    return lark_grammar(lark, "tools[].function.parameters")
