"""A Messages API request's conversation and tools in the OpenAI shapes the engine takes
(docs/serve.md, Anthropic's Messages API), so the chat template renders them exactly as
it renders /v1/chat/completions:

- `tools` (name, description, input_schema) become functions (`parameters`);
- `tool_choice` `auto` / `any` / `tool` / `none` becomes `auto` / `required` / a named
  function / `none`; `disable_parallel_tool_use` becomes `parallel_tool_calls` false;
- an assistant's `tool_use` blocks become its `tool_calls` (the input as JSON
  `arguments`), a user's `tool_result` blocks `role: "tool"` messages (`tool_call_id`),
  in the order the blocks come;
- a reply's calls come back as `tool_use` blocks (`toolu_` ids).

Pure functions, no I/O; every problem is an ApiError naming the field.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from kvchat.app.serve import fields as known
from kvchat.app.serve.errors import bad
from kvchat.model.text.tool_calls import ToolCall

ROLES = ("user", "assistant")
BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use")}
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # Anthropic's rule for a tool's name
# a tool_result's `is_error` as the model reads it: a tool message is text only (OpenAI's
# has no error flag, nor does any chat template)
ERROR_PREFIX = "Error: "


# ---- requests --------------------------------------------------------------------------
def text_blocks(value: Any, param: str) -> str:
    """A string, or a list of text blocks joined; any other block refused by name."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad(f"'{param}' must be a string or a list of content blocks", param)
    return "".join(_text(_block(b, f"{param}[{j}]", ("text",)), f"{param}[{j}]")
                   for j, b in enumerate(value))


def _block(block: Any, where: str, kinds: tuple[str, ...]) -> Mapping[str, Any]:
    if not isinstance(block, dict):
        raise bad(f"'{where}' must be a content block object", where)
    kind = block.get("type")
    if kind not in kinds:
        raise known.refused(f"only {', '.join(kinds)} blocks are supported here"
                            f" (got {kind!r})", f"{where}.type")
    return block


def _text(block: Mapping[str, Any], where: str) -> str:
    known.check(block, known.TEXT_BLOCK, f"{where}.")
    if not isinstance(block.get("text"), str):
        raise bad(f"'{where}.text' must be a string", f"{where}.text")
    return str(block["text"])


def _string(block: Mapping[str, Any], name: str, where: str) -> str:
    v = block.get(name)
    if not isinstance(v, str) or not v:
        raise bad(f"'{where}.{name}' must be a non-empty string", f"{where}.{name}")
    return v


def _tool_use(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    """An assistant's past call, as OpenAI's `tool_calls` item."""
    known.check(block, known.TOOL_USE_BLOCK, f"{where}.")
    call_id, name = _string(block, "id", where), _string(block, "name", where)
    if not isinstance(block.get("input"), dict):
        raise bad(f"'{where}.input' must be an object", f"{where}.input")
    return {"id": call_id, "type": "function",
            "function": {"name": name,
                         "arguments": json.dumps(block["input"], ensure_ascii=False)}}


def _tool_result(block: Mapping[str, Any], where: str, calls: set[str]) -> dict[str, Any]:
    """A tool's result, as OpenAI's `role: "tool"` message."""
    known.check(block, known.TOOL_RESULT_BLOCK, f"{where}.")
    call_id = _string(block, "tool_use_id", where)
    if call_id not in calls:
        raise bad(f"'{where}.tool_use_id' names no tool_use block before it ({call_id!r})",
                  f"{where}.tool_use_id")
    content = block.get("content")
    text = "" if content is None else text_blocks(content, f"{where}.content")
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise bad(f"'{where}.is_error' must be a boolean", f"{where}.is_error")
    return {"role": "tool", "tool_call_id": call_id,
            "content": ERROR_PREFIX + text if is_error else text}


def _turn(m: Mapping[str, Any], i: int, calls: set[str]) -> list[dict[str, Any]]:
    """One Anthropic message as OpenAI messages: a user's tool results split it into
    `tool` messages and user text, in block order; an assistant's calls ride with its
    text. `calls`: the tool_use ids so far (a result must answer one)."""
    role, content, param = m["role"], m.get("content"), f"messages[{i}].content"
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad(f"'{param}' must be a string or a list of content blocks", param)
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    tool_calls: list[dict[str, Any]] = []
    for j, raw in enumerate(content):
        where = f"{param}[{j}]"
        block = _block(raw, where, BLOCKS[role])
        if block["type"] == "text":
            texts.append(_text(block, where))
        elif block["type"] == "tool_use":
            tool_calls.append(_tool_use(block, where))
            calls.add(tool_calls[-1]["id"])
        else:
            if texts:
                out.append({"role": role, "content": "".join(texts)})
                texts = []
            out.append(_tool_result(block, where, calls))
    if texts or tool_calls or not out:
        out.append({"role": role, "content": "".join(texts)})
    if tool_calls:
        out[-1]["tool_calls"] = tool_calls
    return out


def _append(out: list[dict[str, Any]], msg: dict[str, Any], first: int) -> None:
    """Consecutive turns of a role are one turn (tool results stay apart)."""
    last = out[-1] if len(out) > first else None
    if last is None or msg["role"] == "tool" or last["role"] != msg["role"]:
        out.append(msg)
        return
    last["content"] = "\n\n".join(t for t in (last["content"], msg["content"]) if t)
    if msg.get("tool_calls"):
        last["tool_calls"] = [*last.get("tool_calls", []), *msg["tool_calls"]]


def conversation(body: Mapping[str, Any]) -> tuple[list[dict[str, Any]], bool]:
    """`system` and `messages` as OpenAI messages, and whether any block was a tool's."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list of {role, content} objects", "messages")
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": text_blocks(system, "system")})
    first, calls = len(out), set[str]()
    tool_blocks = False
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object", f"messages[{i}]")
        if m.get("role") not in ROLES:
            raise bad(f"messages[{i}].role must be 'user' or 'assistant'", f"messages[{i}].role")
        extra = sorted(set(m) - {"role", "content"})
        if extra:
            raise bad(f"unknown field 'messages[{i}].{extra[0]}'", f"messages[{i}].{extra[0]}")
        for msg in _turn(m, i, calls):
            tool_blocks = tool_blocks or msg["role"] == "tool" or "tool_calls" in msg
            _append(out, msg, first)
    if out[-1]["role"] == "assistant":
        raise known.refused("a last assistant message (a prefill to continue)", "messages")
    if out[-1]["role"] == "user" and not out[-1]["content"].strip():
        raise bad("the last message is empty: nothing to reply to", "messages")
    return out, tool_blocks


def tools(value: Any) -> list[dict[str, Any]]:
    """Anthropic's `tools` as OpenAI functions ([] for none)."""
    if value is None or value == []:
        return []
    if not isinstance(value, list):
        raise bad("'tools' must be a list of tools", "tools")
    out: list[dict[str, Any]] = []
    names: set[str] = set()
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad(f"'{where}' must be a tool object", where)
        if tool.get("type") not in (None, "custom"):  # web search, bash, a computer…
            raise known.refused(f"only custom tools are supported, no server tools"
                                f" (got {tool['type']!r})", f"{where}.type")
        known.check(tool, known.TOOL, f"{where}.")
        name = tool.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise bad(f"'{where}.name' must be 1 to 64 letters, digits, '_' or '-'",
                      f"{where}.name")
        if name in names:
            raise bad(f"'{where}.name' {name!r} is given twice", f"{where}.name")
        names.add(name)
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            raise bad(f"'{where}.description' must be a string", f"{where}.description")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict) or schema.get("type") != "object":
            raise bad(f"'{where}.input_schema' must be a JSON schema of type object",
                      f"{where}.input_schema")
        # the key order of OpenAI's function objects: templates print them as JSON
        fn: dict[str, Any] = {"name": name}
        if description:
            fn["description"] = description
        fn["parameters"] = schema
        out.append({"type": "function", "function": fn})
    return out


CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def tool_choice(value: Any, functions: list[dict[str, Any]]
                ) -> tuple[str | dict[str, Any] | None, bool]:
    """Anthropic's `tool_choice` as OpenAI's, and whether calls may be parallel."""
    if value is None:
        return None, True
    if not isinstance(value, dict):
        raise bad("'tool_choice' must be an object with a 'type'", "tool_choice")
    known.check(value, known.TOOL_CHOICE, "tool_choice.")
    kind, name = value.get("type"), value.get("name")
    disable = value.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise bad("'tool_choice.disable_parallel_tool_use' must be a boolean",
                  "tool_choice.disable_parallel_tool_use")
    choice: str | dict[str, Any]
    if kind == "tool":
        if not isinstance(name, str) or name not in {f["function"]["name"] for f in functions}:
            raise bad(f"'tool_choice.name' names {name!r}, which is not among the tools",
                      "tool_choice.name")
        choice = {"type": "function", "function": {"name": name}}
    elif kind in CHOICES:
        if name is not None:
            raise bad(f"'tool_choice.name' goes only with type 'tool', not {kind!r}",
                      "tool_choice.name")
        choice = CHOICES[kind]
    else:
        raise bad("'tool_choice.type' must be 'auto', 'any', 'tool' or 'none'",
                  "tool_choice.type")
    if choice != "none" and choice != "auto" and not functions:
        raise bad(f"'tool_choice' {kind!r} needs tools", "tool_choice")
    return choice, not disable


# ---- answers ---------------------------------------------------------------------------
def tool_use_id(call: ToolCall) -> str:
    """Anthropic's id for a call: the engine's id with Anthropic's prefix."""
    return "toolu_" + call.id.removeprefix("call_")


def tool_use_block(call: ToolCall) -> dict[str, Any]:
    """A call as a `tool_use` content block (its `input` the arguments' object)."""
    return {"type": "tool_use", "id": tool_use_id(call), "name": call.name,
            "input": json.loads(call.arguments)}
