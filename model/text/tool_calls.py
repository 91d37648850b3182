"""Tool calls: tools go to the model through its own chat template (the template's `tools`
variable, as transformers passes them), and the calls come back out of the reply in the
format the model's family was trained to write (docs/serve.md, "Tool calls"):

- `hermes` (Qwen 2.5/3, Hermes, and most templates that mention it):
  `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, one block per call;
- `llama3` (Llama 3.1-3.3): the reply is one JSON object
  `{"name": "f", "parameters": {...}}`, possibly after `<|python_tag|>`; also the
  format for a template that supports tools without naming a syntax of its own;
- `mistral`: `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]` (and the newer
  `[TOOL_CALLS]f[ARGS]{...}`).

`ToolCallStream` parses a reply as it streams: text pieces in, text and completed
`ToolCall`s out, in order; a marker that may be starting is held back until it is
decided, and a block that does not parse as a call is handed on as the text it was.
Whether a template can take tools at all is read from the template: one that never reads
`tools` is refused by name, never answered with plain text.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvchat.model.errors import KVChatError

from . import chat_template as _chat


class ToolCallError(KVChatError):
    """Tools, a tool choice or tool messages that cannot be used as given (one line)."""


@dataclass(frozen=True)
class ToolCall:
    """One call as OpenAI returns it: `arguments` is a JSON object's text."""

    name: str
    arguments: str
    id: str

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class CallFormat:
    """How a family writes its calls."""

    name: str
    open: str | None  # the marker before a call (hermes, mistral) or an optional one (llama3)
    close: str | None  # the marker after each call (hermes)
    args_key: str  # the arguments' key the model writes (both keys are read back)
    listed: bool = False  # mistral: one JSON list of calls after the marker


HERMES = CallFormat("hermes", "<tool_call>", "</tool_call>", "arguments")
LLAMA3 = CallFormat("llama3", "<|python_tag|>", None, "parameters")
MISTRAL = CallFormat("mistral", "[TOOL_CALLS]", None, "arguments", listed=True)
FORMATS = {f.name: f for f in (HERMES, LLAMA3, MISTRAL)}
_ARGS_KEYS = ("arguments", "parameters")
_MISTRAL_ARGS = "[ARGS]"


def call_format(template: str | None) -> CallFormat:
    """The call format a chat template teaches, by the markers it writes."""
    text = template or ""
    if "<tool_call>" in text:
        return HERMES
    if "[TOOL_CALLS]" in text:
        return MISTRAL
    return LLAMA3


def reads_tools(template: str | None) -> bool:
    """Does the template use the `tools` variable at all?"""
    return template is not None and _chat.reads_variable(template, "tools")


def marker_tokens(fmt: CallFormat) -> tuple[str, ...]:
    """The format's markers: tokens the reply's text must keep even when they are control
    tokens that decoding otherwise drops."""
    return tuple(m for m in (fmt.open, fmt.close) if m)


# ---- requests: tools, the choice, and messages for the template ----------------------------

def check_tools(tools: Any) -> list[dict[str, Any]]:
    """OpenAI `tools` checked: a list of `{"type": "function", "function": {"name",
    "description"?, "parameters"?}}` with distinct names; ToolCallError naming the field."""
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)) or not tools:
        raise ToolCallError("tools must be a non-empty list of functions")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            raise ToolCallError(f'{where}.type must be "function"')
        fn = tool.get("function")
        if not isinstance(fn, Mapping):
            raise ToolCallError(f"{where}.function must be an object")
        name = fn.get("name")
        if not isinstance(name, str) or not name or len(name) > 64:
            raise ToolCallError(f"{where}.function.name must be a name of 1 to 64 characters")
        if name in names:
            raise ToolCallError(f"{where}.function.name {name!r} is given twice")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, Mapping):
            raise ToolCallError(f"{where}.function.parameters must be a JSON schema object")
    return [dict(t) for t in tools]


def parameters(tool: Mapping[str, Any]) -> dict[str, Any]:
    """A tool's parameters schema (an object with no properties when it has none)."""
    params = tool["function"].get("parameters")
    return dict(params) if params else {"type": "object", "properties": {}}


def chosen_tools(tools: Sequence[Mapping[str, Any]], choice: Any
                 ) -> list[Mapping[str, Any]] | None:
    """The tools a call must use under `tool_choice`: None when the model may answer in
    text (`auto`, absent) or must not call (`none` gives []); all of them for
    `required`; the named one for `{"type": "function", "function": {"name": ...}}`."""
    if choice is None or choice == "auto":
        return None
    if choice == "none":
        return []
    if choice == "required":
        return list(tools)
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
        for tool in tools:
            if tool["function"]["name"] == name:
                return [tool]
        raise ToolCallError(f"tool_choice names {name!r}, which is not among the tools")
    raise ToolCallError('tool_choice must be "auto", "none", "required" or'
                        ' {"type": "function", "function": {"name": ...}}')


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: an assistant's `tool_calls` keep OpenAI's
    shape, but their `arguments` become the object the JSON text holds (templates write
    `arguments | tojson`, as transformers documents)."""
    out = []
    for message in messages:
        msg = dict(message)
        calls = msg.get("tool_calls")
        if isinstance(calls, Sequence) and not isinstance(calls, str):
            msg["tool_calls"] = [_template_call(c) for c in calls]
        out.append(msg)
    return out


def _template_call(call: Any) -> Any:
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        return call
    fn = dict(call["function"])
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            fn["arguments"] = parsed
    return {**call, "function": fn}


# ---- replies: calls parsed out of the text ------------------------------------------------

def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _call_from(obj: Any) -> ToolCall | None:
    """A ToolCall from one parsed JSON value `{"name": ..., "arguments"|"parameters": {...}}`."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    keys = [k for k in _ARGS_KEYS if k in obj]
    if len(obj) != 1 + len(keys) or len(keys) > 1:
        return None  # other keys: some JSON answer, not a call
    args = obj[keys[0]] if keys else {}
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), new_call_id())


def _calls_from_json(text: str, listed: bool) -> list[ToolCall] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    items = value if listed and isinstance(value, list) else [value]
    calls = [_call_from(v) for v in items]
    if not calls or any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]


class _JsonEnd:
    """Finds where one JSON value (an object or a list) ends, a character at a time."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = self.escaped = False
        self.started = False

    def feed(self, text: str) -> int | None:
        """The index just past the value's end in `text`, or None if it goes on."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
                self.started = True
            elif ch in "}]":
                self.depth -= 1
                if self.started and self.depth <= 0:
                    return i + 1
        return None


Piece = str | ToolCall


class ToolCallStream:
    """Parse a reply as it arrives: `feed(text)` and `finish()` return text pieces and
    completed ToolCalls in reply order; the text pieces joined are the reply without its
    calls and the whitespace around them (a reply without calls comes out whole), the
    same however the text was split.

    States: `lead` (llama3: the reply's start, or just after a call, where a JSON call
    may begin), `text`, `call` (hermes: up to the closing marker), `json` (one JSON value
    after a marker or at the lead), `named` (mistral's `name[ARGS]{...}`)."""

    def __init__(self, fmt: CallFormat) -> None:
        self.fmt = fmt
        self.calls: list[ToolCall] = []
        self._buf = ""  # text not yet decided
        self._state = "lead" if fmt.name == "llama3" else "text"
        self._raw = ""  # the current call's marker and what preceded it
        self._value = ""  # the rest of its text: handed on as text if it is no call
        self._json = _JsonEnd()
        self._space = ""  # whitespace held until text follows it (a call drops it)
        self._after_call = False  # whitespace from here on is dropped until text comes

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        out: list[Piece] = []
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> list[Piece]:
        """The end of the reply: what was held back, as text or calls."""
        out: list[Piece] = []
        while self._step(out, final=True):
            pass
        self._emit(out, self._raw + self._value + self._buf)  # an unfinished call is text
        self._buf = self._raw = self._value = ""
        if self._space and not self.calls:
            out.append(self._space)
        self._space = ""
        return out

    # -- output
    def _emit(self, out: list[Piece], text: str) -> None:
        """Text out, but whitespace next to a call never: trailing whitespace waits for
        what follows it, and whitespace just after a call is dropped (so the pieces do
        not depend on where the stream was split)."""
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        body = text.rstrip()
        if not body:
            self._space += text
            return
        out.append(self._space + body)
        self._space = text[len(body):]

    def _done(self, out: list[Piece], calls: list[ToolCall] | None, rest: str) -> None:
        """The current call's text is read: its calls out (its text, if it was none)."""
        if calls is None:
            self._emit(out, self._raw + self._value)
        else:
            self._space, self._after_call = "", True
            self.calls.extend(calls)
            out.extend(calls)
        self._buf, self._raw, self._value = rest, "", ""
        self._state = "lead" if self.fmt.name == "llama3" else "text"

    def _enter(self, state: str, raw: str, rest: str) -> None:
        self._raw, self._value, self._buf = raw, "", rest
        self._state, self._json = state, _JsonEnd()

    # -- the machine: one move over the buffer; True if there may be another
    def _step(self, out: list[Piece], final: bool) -> bool:
        return {"lead": self._lead, "text": self._text, "call": self._call,
                "json": self._json_value, "named": self._named}[self._state](out, final)

    def _lead(self, out: list[Piece], final: bool) -> bool:
        buf, marker = self._buf, self.fmt.open or ""
        head = buf.lstrip()
        if self.calls and head.startswith(";"):  # Llama's separator between calls
            head = head[1:].lstrip()
        if not head:
            if final:
                self._state = "text"
            return False
        if not final and marker.startswith(head) and head != marker:
            return False  # part of the marker: undecided
        skipped = buf[: len(buf) - len(head)]
        if marker and head.startswith(marker):
            self._enter("json", skipped + marker, head[len(marker):])
        elif head.startswith("{"):
            self._enter("json", skipped, head)
        else:
            self._state = "text"
        return True

    def _text(self, out: list[Piece], final: bool) -> bool:
        """Plain text, passed on; a marker's possible start is held until decided."""
        fmt, buf = self.fmt, self._buf
        if fmt.name == "llama3" or not fmt.open:
            self._emit(out, buf)
            self._buf = ""
            return False
        i = buf.find(fmt.open)
        if i >= 0:
            self._emit(out, buf[:i])
            self._enter("call" if fmt.close else "json", fmt.open, buf[i + len(fmt.open):])
            return True
        keep = 0 if final else _partial_suffix(buf, fmt.open)
        self._emit(out, buf[: len(buf) - keep])
        self._buf = buf[len(buf) - keep:]
        return False

    def _call(self, out: list[Piece], final: bool) -> bool:
        """hermes: the call's JSON, up to the closing marker."""
        close = self.fmt.close or ""
        i = self._buf.find(close)
        if i < 0:
            return False
        body = self._buf[:i]
        self._value = body + close
        self._done(out, _calls_from_json(body.strip(), listed=False),
                   self._buf[i + len(close):])
        return True

    def _json_value(self, out: list[Piece], final: bool) -> bool:
        buf = self._buf
        lead = (self._value + buf).lstrip()
        if self.fmt.listed and lead and lead[0] not in "[{":
            self._state = "named"
            return True
        end = self._json.feed(buf)
        if end is None:
            self._value += buf
            self._buf = ""
            return False
        self._value += buf[:end]
        self._done(out, _calls_from_json(self._value.strip(), self.fmt.listed), buf[end:])
        return True

    def _named(self, out: list[Piece], final: bool) -> bool:
        """mistral's `name[ARGS]{...}`: a name, then its arguments' object."""
        text = self._value + self._buf
        i = text.find(_MISTRAL_ARGS)
        rest = text[i + len(_MISTRAL_ARGS):] if i >= 0 else ""
        end = _JsonEnd().feed(rest) if i >= 0 else None
        if end is None:
            self._value, self._buf = text, ""
            if i < 0 and len(text) > 200:  # no [ARGS] after a name's worth: plain text
                self._done(out, None, "")
            return False
        self._value = text[: i + len(_MISTRAL_ARGS) + end]
        call = _call_from({"name": text[:i].strip(), "arguments": _loads(rest[:end])})
        self._done(out, None if call is None else [call], rest[end:])
        return True


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _partial_suffix(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def parse_tool_calls(text: str, fmt: CallFormat) -> tuple[str, list[ToolCall]]:
    """A whole reply split into its text and its calls."""
    stream = ToolCallStream(fmt)
    pieces = stream.feed(text) + stream.finish()
    return "".join(p for p in pieces if isinstance(p, str)), stream.calls
