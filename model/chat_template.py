"""Chat templates: the model's own Jinja template, rendered in a sandbox.

A chat template comes with the model (``chat_template`` in tokenizer_config.json, a string or a
list of ``{"name", "template"}`` of which we take ``"default"``, or a ``chat_template.jinja``
file, which wins when both exist, as in transformers 5). Templates are code from the internet,
so they run in ``jinja2.sandbox.ImmutableSandboxedEnvironment`` set up exactly as transformers
sets it up (``trim_blocks``, ``lstrip_blocks``, the ``loopcontrols`` extension, a no-op
``{% generation %}`` tag, ``raise_exception``, ``strftime_now``, the non-escaping ``tojson``
filter, a ``dict`` and a ``namespace`` that refuse underscore names), so a prompt renders to
the same text transformers' ``apply_chat_template`` gives. On top of that:

- ``{% include %}``, ``{% import %}``, ``{% from %}`` and ``{% extends %}`` are refused before
  anything runs (there is no loader either: a template cannot read files);
- reading an underscore attribute (``__globals__``, ``__subclasses__``,
  ``self._TemplateReference__context``) fails at once, where Jinja would quietly render "";
- ``*`` and ``**`` are checked, so ``'a' * 10**12`` fails instead of eating all memory (the
  sandbox already caps ``range``; a template looping long enough can still be slow);
- every failure (syntax error, sandbox ``SecurityError``, ``raise_exception``, a Python error
  inside the template) becomes one ``TemplateError`` line.

The plain fallback (``PLAIN_FALLBACK``), for base models that ship no template (such as
stories260K), treats the chat as one text that the model continues, because a base model
only ever learned to continue text; role labels such as "User:" would just be continued as
more story:

- the BOS token first (the tokenizer passes it only when it adds BOS to plain text);
- each system message, stripped, followed by a blank line (``"\\n\\n"``);
- each user message, stripped, and each assistant message as written, each followed by a
  newline, so every reply starts on a fresh line;
- ``add_generation_prompt`` adds nothing: the prompt already ends with the newline the
  reply follows.

Why newlines: a newline is its own token that never merges with its neighbours, so a reply
re-rendered in the next turn tokenizes exactly as the model generated it, and the KV cache
prefix of the previous turn stays valid (prompt reuse depends on it). Assistant text is not
stripped for the same reason.

So ``[system "A story.", user "Once upon a time", assistant "there was a cat.", user "It"]``
renders as ``"<s>A story.\\n\\nOnce upon a time\\nthere was a cat.\\nIt\\n"``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.exceptions
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from .errors import KVChatError, one_line, read_json_object

__all__ = ["PLAIN_FALLBACK", "TemplateError", "load_chat_template", "render",
           "template_from_config"]


class TemplateError(KVChatError):
    """A chat template that cannot be read, compiled or rendered, or that was refused."""


PLAIN_FALLBACK = (
    "{{- bos_token if bos_token is defined and bos_token else '' -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{{- message['content'] | trim -}}{{- '\\n\\n' -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- message['content'] -}}{{- '\\n' -}}"
    "{%- else -%}"
    "{{- message['content'] | trim -}}{{- '\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)

# Limits for the checked operators: far above anything a real template builds.
_MAX_SEQUENCE = 1_000_000
_MAX_INT_BITS = 100_000


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask tag): just the body.

    Some templates use it; without the tag they would not even parse.
    """

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class _TemplateDict:
    """``dict`` for templates, as transformers defines it: builds dicts, exposes no class."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace`` that rejects underscore names (as transformers), so no dunder can be stored."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"namespace attribute {name!r} is not allowed")


def _raise_exception(message: object) -> None:
    raise jinja2.exceptions.TemplateError(str(message))


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' filter: Jinja's own escapes HTML characters, which chat prompts must not.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Environment(ImmutableSandboxedEnvironment):
    """The sandbox plus size checks on ``*`` and ``**`` (memory and CPU blow-ups)."""

    intercepted_binops = frozenset({"*", "**"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        # Jinja returns a silent Undefined here, so `{{ self._TemplateReference__context }}`
        # would render "" and go unnoticed; a hostile template should fail loudly instead.
        raise SecurityError(
            f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is not allowed"
        )

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        ints = isinstance(left, int) and isinstance(right, int)
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if (
                    isinstance(seq, (str, list, tuple))
                    and isinstance(count, int)
                    and len(seq) * count > _MAX_SEQUENCE
                ):
                    raise SecurityError("repeating a sequence that many times is not allowed")
            if ints and left.bit_length() + right.bit_length() > _MAX_INT_BITS:
                raise SecurityError("number too large")
        elif operator == "**" and ints and right > 0 and abs(left) > 1:
            if left.bit_length() * right > _MAX_INT_BITS:
                raise SecurityError("number too large")
        # (float overflow raises OverflowError at once, which render() reports.)
        return super().call_binop(context, operator, left, right)


def _make_environment() -> _Environment:
    env = _Environment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


_ENV = _make_environment()

# Statements that would load other templates (files): refused outright.
_LOADING_NODES = (jinja2.nodes.Include, jinja2.nodes.Import, jinja2.nodes.FromImport,
                  jinja2.nodes.Extends)


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    # Cached: the same template is rendered every turn. Failures raise, so they are not cached.
    try:
        tree = _ENV.parse(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise TemplateError(
            f"chat template syntax error (line {e.lineno}): {one_line(e.message)}"
        ) from None
    except Exception as e:  # noqa: BLE001 - any parser failure is a bad template
        raise TemplateError(f"chat template cannot be parsed: {one_line(e)}") from None
    for node in tree.find_all(_LOADING_NODES):
        kind = type(node).__name__.lower()
        raise TemplateError(
            f"chat template refused: {{% {kind} %}} is not allowed (line {node.lineno}): "
            "templates cannot load files"
        )
    try:
        return _ENV.from_string(tree)
    except Exception as e:  # noqa: BLE001
        raise TemplateError(f"chat template cannot be compiled: {one_line(e)}") from None


def _plain(value: Any) -> Any:
    """Rebuild template inputs from plain JSON types (as transformers does).

    Rich objects can carry methods the sandbox does not know are dangerous; plain data cannot.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"


def _messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TemplateError("chat messages must be a list of {role, content} dicts")
    out = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise TemplateError(
                "each chat message must be a dict with role and content, "
                f"got {type(message).__name__}"
            )
        # Like transformers: keys set to None are dropped (templates test for missing keys).
        out.append({k: _plain(v) for k, v in message.items() if v is not None})
    return out


def render(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    bos_token: str | None = None,
    eos_token: str | None = None,
    add_generation_prompt: bool = True,
    **extra: Any,
) -> str:
    """Render ``messages`` with ``template`` in the sandbox; any failure is one ``TemplateError``.

    ``bos_token``/``eos_token`` (and special tokens passed in ``extra``, such as ``unk_token``)
    that are None are left undefined, as transformers leaves unset special tokens out. ``tools``
    and ``documents`` default to None, as in transformers, so ``tools is not none`` tests work.
    """
    compiled = _compile(template)
    context: dict[str, Any] = {"tools": None, "documents": None}
    context.update({k: _plain(v) for k, v in extra.items()})
    for name, token in (("bos_token", bos_token), ("eos_token", eos_token)):
        if token is not None:
            context[name] = str(token)
    for name in [k for k, v in context.items() if k.endswith("_token") and v is None]:
        del context[name]
    context["messages"] = _messages(messages)
    context["add_generation_prompt"] = bool(add_generation_prompt)
    try:
        return compiled.render(**context)
    except SecurityError as e:
        raise TemplateError(
            f"chat template refused: {one_line(e).rstrip('.')} (templates run sandboxed: "
            "no file, private attribute or import access)"
        ) from None
    except jinja2.exceptions.TemplateError as e:
        # raise_exception(...) from the template lands here, as do undefined-value errors.
        raise TemplateError(f"chat template error: {one_line(e.message or e)}") from None
    except RecursionError:
        raise TemplateError("chat template error: recursion too deep") from None
    except Exception as e:  # noqa: BLE001 - a template must never crash the app
        raise TemplateError(f"chat template error: {type(e).__name__}: {one_line(e)}") from None


def template_from_config(value: Any, source: str = "tokenizer_config.json") -> str | None:
    """The template string from a ``chat_template`` config value (string, or named list)."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {
            t.get("name"): t.get("template")
            for t in value
            if isinstance(t, Mapping) and isinstance(t.get("template"), str)
        }
        if "default" in named:
            return named["default"]
        if named:
            # No "default": the first one is the best guess (tool/RAG variants come later).
            return next(iter(named.values()))
    raise TemplateError(f"{source}: chat_template must be a string or a list of {{name, template}}")


def load_chat_template(folder: str | Path, tokenizer_config: Mapping[str, Any] | None = None
                       ) -> str | None:
    """The model's chat template, or None for a model without one (a base model).

    ``chat_template.jinja`` wins over ``tokenizer_config.json``'s ``chat_template``.
    """
    folder = Path(folder)
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            return jinja_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TemplateError(f"{jinja_file}: cannot read: {one_line(e)}") from None
    if tokenizer_config is None:
        tokenizer_config = read_json_object(folder / "tokenizer_config.json", TemplateError)
    return template_from_config(tokenizer_config.get("chat_template"))

