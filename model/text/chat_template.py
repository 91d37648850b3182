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
- rendering is bounded (`RENDER_TIME_LIMIT_S`, `RENDER_OUTPUT_LIMIT`): it runs on a worker
  thread that traces its own lines and stops itself past the deadline or when the caller's
  ``should_stop()`` says so; the caller waits at most the limit, then abandons the worker
  and the next render gets a fresh sandbox. Rendering is pure Python (no MLX), so a worker
  thread is safe here. C-level work cannot be interrupted, so it is capped before it
  starts: ``*``, ``+`` and ``~`` results, namespace values, ``join``, ``replace``, padding
  (``center``, ``ljust``, ``indent``...), format widths (``%``, ``format``, ``str.format``),
  ``tojson`` indents, ``lipsum`` and ``range`` (the sandbox's 100,000);
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
import re
import string
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache, wraps
from pathlib import Path
from typing import Any

import jinja2
import jinja2.exceptions
import jinja2.ext
import jinja2.filters
import jinja2.nodes
import jinja2.utils
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from kvchat.model.errors import KVChatError, one_line
from kvchat.model.files import read_json_object

__all__ = ["PLAIN_FALLBACK", "RENDER_OUTPUT_LIMIT", "RENDER_TIME_LIMIT_S", "TemplateCancelled",
           "TemplateError", "load_chat_template", "render", "template_from_config"]


class TemplateError(KVChatError):
    """A chat template that cannot be read, compiled or rendered, or that was refused."""


class TemplateCancelled(TemplateError):
    """The caller's should_stop() asked the render to stop (the user cancelled the turn)."""


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

# Bounds on one render: real chat templates take milliseconds and write kilobytes.
RENDER_TIME_LIMIT_S = 5.0
RENDER_OUTPUT_LIMIT = 8_000_000  # characters of prompt text (millions of tokens)
# Limits for the checked operations: far above anything a real template builds.
_MAX_SEQUENCE = 1_000_000
_MAX_INT_BITS = 100_000
_MAX_WIDTH = 10_000  # format widths, padding, indents
_MAX_LIPSUM = (100, 1_000)  # paragraphs, words per paragraph


class _Aborted(Exception):
    """Raised inside the worker to end a render: the deadline passed or the caller stopped."""


class _Bounds(threading.local):
    """The running render's deadline and stop request (per worker thread)."""

    deadline = float("inf")
    should_stop: Callable[[], bool] | None = None
    ticks = 0


_BOUNDS = _Bounds()


def _tick() -> None:
    """Called on every traced line: stop the render past its deadline or when asked."""
    b = _BOUNDS
    b.ticks += 1
    if b.ticks & 255:
        return
    if time.monotonic() > b.deadline:
        raise _Aborted("time")
    if b.should_stop is not None and b.should_stop():
        raise _Aborted("cancelled")


def _trace(frame: Any, event: str, arg: Any) -> Any:
    _tick()
    return _trace


def _weight(x: Any, budget: int = RENDER_OUTPUT_LIMIT) -> int:
    """Roughly how many characters `x` turns into (stops counting past `budget`)."""
    if isinstance(x, str):
        return len(x)
    if isinstance(x, (list, tuple, dict)):
        total = len(x)
        for item in (x.items() if isinstance(x, dict) else x):
            total += _weight(item, budget - total)
            if total > budget:
                break
        return total
    return 1


def _check_size(x: Any, what: str) -> Any:
    if _weight(x) > RENDER_OUTPUT_LIMIT:
        raise SecurityError(f"{what} would be larger than {RENDER_OUTPUT_LIMIT:,} characters")
    return x


def _check_width(n: Any, what: str) -> None:
    if isinstance(n, int) and abs(n) > _MAX_WIDTH:
        raise SecurityError(f"{what} of {n:,} is over the limit of {_MAX_WIDTH:,}")


# a printf-style conversion: flags, width, precision
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[a-zA-Z%]")


def _check_percent_format(fmt: str) -> None:
    for width, precision in _PERCENT_SPEC.findall(fmt):
        for n in (width, precision):
            if n == "*":
                raise SecurityError("'*' widths in % formatting are not allowed")
            if n:
                _check_width(int(n), "a format width")


def _check_str_format(fmt: str) -> None:
    for _, _, spec, _ in string.Formatter().parse(fmt):
        if spec:
            if "{" in spec:
                raise SecurityError("nested fields in a format spec are not allowed")
            for n in re.findall(r"\d+", spec):
                _check_width(int(n), "a format width")


def _capped_lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
    if n > _MAX_LIPSUM[0] or max > _MAX_LIPSUM[1] or min > _MAX_LIPSUM[1]:
        raise SecurityError(
            f"lipsum is limited to {_MAX_LIPSUM[0]} paragraphs of {_MAX_LIPSUM[1]} words"
        )
    return jinja2.utils.generate_lorem_ipsum(n, html, min, max)


def _capped_filter(name: str, check: Callable[..., None]) -> Callable[..., Any]:
    original = jinja2.filters.FILTERS[name]

    @wraps(original)  # keeps Jinja's pass_context/pass_environment marks
    def capped(*args: Any, **kwargs: Any) -> Any:
        check(*args, **kwargs)
        return original(*args, **kwargs)

    return capped


def _check_center(value: Any, width: int = 80) -> None:
    _check_width(width, "a padding width")


def _check_indent(value: Any, width: Any = 4, *args: Any, **kwargs: Any) -> None:
    if isinstance(width, str):
        _check_size(width, "the indent")
    else:
        _check_width(width, "an indent")


def _check_wordwrap(env: Any, value: Any, width: int = 79, *args: Any, **kwargs: Any) -> None:
    _check_width(width, "a wrap width")


def _check_format_filter(value: Any, *args: Any, **kwargs: Any) -> None:
    if isinstance(value, str):
        _check_percent_format(value)


def _check_join(ctx: Any, value: Any, d: str = "", attribute: Any = None) -> None:
    items = list(value) if not isinstance(value, (str, list, tuple)) else value
    if _weight(items) + len(d) * len(items) > RENDER_OUTPUT_LIMIT:
        raise SecurityError(f"the join would be larger than {RENDER_OUTPUT_LIMIT:,} characters")


def _check_replace(ctx: Any, s: Any, old: Any, new: Any, count: Any = None) -> None:
    _check_replace_sizes(str(s), str(old), str(new))


def _check_replace_sizes(s: str, old: str, new: str) -> None:
    hits = s.count(old) if old else len(s) + 1
    if len(s) + hits * max(0, len(new) - len(old)) > RENDER_OUTPUT_LIMIT:
        raise SecurityError(
            f"the replace would be larger than {RENDER_OUTPUT_LIMIT:,} characters"
        )


_PADDING_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs"})


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
        _check_size(value, f"namespace value {name!r}")  # the only state a loop can grow
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
    _check_width(indent, "a tojson indent")
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _CodeGenerator(CodeGenerator):
    """Compiles ``a ~ b`` to a size-checked join (Jinja's own is a bare "".join)."""

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Any) -> None:
        self.write("environment.checked_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _Environment(ImmutableSandboxedEnvironment):
    """The sandbox plus size checks on the operations that can blow up memory or CPU."""

    code_generator_class = _CodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    @staticmethod
    def checked_concat(parts: Sequence[Any]) -> str:
        out = "".join(map(str, parts))
        return _check_size(out, "a ~ concatenation")

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):
            name = getattr(__obj, "__name__", "")
            if name in _PADDING_METHODS:
                for n in (*args, *kwargs.values()):
                    _check_width(n, f"a {name} width")
            elif name == "replace" and len(args) >= 2:
                _check_replace_sizes(owner, str(args[0]), str(args[1]))
            elif name == "join" and args:
                _check_join(None, args[0], owner)
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        _check_str_format(value.__self__)  # `'{:>9999999999}'.format` fails at lookup
        return wrapped

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
        elif operator == "+" and isinstance(left, (str, list, tuple)):
            if _weight(left) + _weight(right) > RENDER_OUTPUT_LIMIT:
                raise SecurityError(
                    f"a + result would be larger than {RENDER_OUTPUT_LIMIT:,} characters"
                )
        elif operator == "%" and isinstance(left, str):
            _check_percent_format(left)
            _check_size(right, "the % arguments")
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
    env.globals["lipsum"] = _capped_lipsum
    env.filters["center"] = _capped_filter("center", _check_center)
    env.filters["indent"] = _capped_filter("indent", _check_indent)
    env.filters["wordwrap"] = _capped_filter("wordwrap", _check_wordwrap)
    env.filters["format"] = _capped_filter("format", _check_format_filter)
    env.filters["join"] = _capped_filter("join", _check_join)
    env.filters["replace"] = _capped_filter("replace", _check_replace)
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


@lru_cache(maxsize=32)
def reads_variable(template: str, name: str) -> bool:
    """Does `template` read the variable `name` anywhere (`tools`, say)? Parsed only,
    never run; a template that does not parse reads nothing."""
    import jinja2.meta

    try:
        tree = _ENV.parse(template)
    except Exception:  # noqa: BLE001 - a bad template is reported when it renders
        return False
    return name in jinja2.meta.find_undeclared_variables(tree)


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
    should_stop: Callable[[], bool] | None = None,
    **extra: Any,
) -> str:
    """Render ``messages`` with ``template`` in the sandbox; any failure is one ``TemplateError``
    (``TemplateCancelled`` when ``should_stop()`` turned true while rendering).

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
    return _render_bounded(compiled, context, should_stop)


def _render_bounded(compiled: jinja2.Template, context: dict[str, Any],
                    should_stop: Callable[[], bool] | None) -> str:
    """Render on a worker thread that stops itself past the deadline; wait at most the
    time limit (plus a moment), then abandon it and start the next render afresh."""
    limit = RENDER_TIME_LIMIT_S
    deadline = time.monotonic() + limit
    result: dict[str, Any] = {}

    def work() -> None:
        _BOUNDS.deadline, _BOUNDS.should_stop = deadline, should_stop
        sys.settrace(_trace)
        try:
            result["text"] = _render_checked(compiled, context)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            result["error"] = e
        finally:
            sys.settrace(None)

    worker = threading.Thread(target=work, name="kvchat-template", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.05)
        if should_stop is not None and should_stop():
            _abandon(worker)
            raise TemplateCancelled("chat template rendering cancelled")
        if time.monotonic() > deadline + 0.5:
            _abandon(worker)
            raise TemplateError(f"chat template took longer than {limit:g} s; refused")
    if "error" in result:
        raise _template_error(result["error"], limit)
    return result["text"]


def _abandon(worker: threading.Thread) -> None:
    """A worker stuck past its deadline: leave it (it stops at its next traced line) and
    give the next render a fresh sandbox and compile cache."""
    global _ENV
    if worker.is_alive():
        _ENV = _make_environment()
        _compile.cache_clear()


def _render_checked(compiled: jinja2.Template, context: dict[str, Any]) -> str:
    parts: list[str] = []
    size = 0
    for chunk in compiled.generate(**context):
        size += len(chunk)
        if size > RENDER_OUTPUT_LIMIT:
            raise SecurityError(
                f"output over the {RENDER_OUTPUT_LIMIT:,} character limit"
            )
        parts.append(chunk)
    return "".join(parts)


def _template_error(e: BaseException, limit: float) -> TemplateError:
    """One TemplateError line for whatever ended a render."""
    if isinstance(e, _Aborted):
        if e.args[0] == "cancelled":
            return TemplateCancelled("chat template rendering cancelled")
        return TemplateError(f"chat template took longer than {limit:g} s; refused")
    if isinstance(e, SecurityError):
        return TemplateError(
            f"chat template refused: {one_line(e).rstrip('.')} (templates run sandboxed: "
            "no file, private attribute or import access, bounded sizes)"
        )
    if isinstance(e, jinja2.exceptions.TemplateError):
        # raise_exception(...) from the template lands here, as do undefined-value errors.
        return TemplateError(f"chat template error: {one_line(e.message or e)}")
    if isinstance(e, RecursionError):
        return TemplateError("chat template error: recursion too deep")
    if isinstance(e, MemoryError):
        return TemplateError("chat template error: out of memory")
    # a template must never crash the app
    return TemplateError(f"chat template error: {type(e).__name__}: {one_line(e)}")


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


def named_template(value: Any, name: str) -> str | None:
    """The template called `name` in a named-list ``chat_template`` (``tool_use``: the one
    transformers renders when tools are given), or None."""
    if not isinstance(value, list):
        return None
    for t in value:
        if isinstance(t, Mapping) and t.get("name") == name and isinstance(t.get("template"), str):
            return t["template"]
    return None


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

