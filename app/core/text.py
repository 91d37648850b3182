"""Text from a model, a user, a file or an error, made safe to show in a terminal.

Two dangers, one place that handles both:

- markup: Textual/Rich parse ``[bold]``, ``[/INST]`` or ``[@click=app.quit]`` in plain
  strings handed to ``notify()``, ``Static.update()`` or a DataTable cell; a stray
  ``[/]`` raises ``MarkupError`` and an ``@click`` runs an action. `literal()` returns
  a ``rich.text.Text``, which is never parsed; toasts go through `SafeNotify`.
- control characters: ESC, BEL, CSI/OSC sequences (``ESC ] 52`` sets the clipboard,
  others retitle the window or recolour it) reach the terminal as bytes. `visible()`
  replaces every C0/C1 control character except newline and tab with a visible symbol
  (``ESC`` -> ``␛``); a CR before a newline is dropped (Windows line ends).

Names and titles (model folders, files, repos, chats, error lines) get one more step,
`visible_name()`: bidi controls (U+202A–U+202E, U+2066–U+2069, the marks U+200E/F, U+061C)
reorder what follows, so a name can read as something else ("Trojan Source"), and
zero-width characters hide inside a name; both are shown as ``<U+202E>``. Replies and
typed text keep them (a ZWJ joins an emoji, a ZWNJ is part of Persian spelling).
Bytes of a file name that are not UTF-8 reach Python as lone surrogates: every helper
here shows them as U+FFFD, so printing or rendering a name never fails.

``--json`` output keeps the exact text, escaped: `json_text()` is what every command's
``--json`` prints. JSON escapes C0 itself, but leaves DEL, C1 (a raw U+009B is a CSI to
many terminals) and bidi / zero-width characters raw; those are written as ``\\uXXXX``
escapes, which read back as the same text.

The plain output of the commands goes through `VisibleWriter` (app/main.py): names only
(`names=True`, every command but ``generate``, whose output is a reply) are shown as
`visible_name()` shows them.
"""

from __future__ import annotations

import json
import re
from typing import Any

from rich.text import Text

from kvchat.model.files import replace_surrogates

# C0 (minus \t and \n), DEL and C1: the Unicode "Cc" category
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
# bidi embeddings/overrides/isolates and marks, zero-width characters, the BOM
_INVISIBLE = re.compile("[\u061c\u200b-\u200f\u202a-\u202e\u2060-\u2069\ufeff]")


def _symbol(m: re.Match[str]) -> str:
    c = ord(m.group())
    if c < 0x20:
        return chr(0x2400 + c)  # the Control Pictures block: ␀ … ␟ (␛ for ESC)
    if c == 0x7F:
        return "␡"
    return f"<{c:02X}>"  # C1 has no pictures: show the code (CSI 0x9B -> <9B>)


def visible(text: object) -> str:
    """`text` with control characters (except newline and tab) made visible."""
    s = text if isinstance(text, str) else str(text)
    s = replace_surrogates(s.replace("\r\n", "\n"))
    return _CONTROL.sub(_symbol, s)


def visible_name(text: object) -> str:
    """`visible(text)` with bidi controls and zero-width characters shown as <U+XXXX>:
    for names and titles, which must read as what they are."""
    return _INVISIBLE.sub(lambda m: f"<U+{ord(m.group()):04X}>", visible(text))


# what JSON leaves raw and a terminal acts on or reorders: DEL and C1, the invisible
# characters above, and the line/paragraph separators
_JSON_RAW = re.compile("[\x7f-\x9f\u061c\u200b-\u200f\u2028\u2029\u202a-\u202e"
                       "\u2060-\u2069\ufeff]")


def json_text(obj: Any, **kw: Any) -> str:
    """`json.dumps(obj)` for a terminal: UTF-8 text as it is (ensure_ascii off), lone
    surrogates (bytes of a name that are not UTF-8) as U+FFFD, and DEL, C1, bidi and
    zero-width characters as \\uXXXX escapes. Only strings can hold them, so the escape
    is valid JSON that reads back as the same text."""
    out = replace_surrogates(json.dumps(obj, ensure_ascii=False, **kw))
    return _JSON_RAW.sub(lambda m: f"\\u{ord(m.group()):04x}", out)


def clipboard_text(text: str) -> str:
    """What Ctrl+Y copies: the text as shown, control characters (ESC, BEL, ...) removed,
    so a paste can never replay a terminal sequence; newlines and tabs stay."""
    return _CONTROL.sub("", replace_surrogates(text.replace("\r\n", "\n")))


def literal(text: object, style: str = "") -> Text:
    """A renderable that shows `text` exactly (no markup) with controls made visible:
    names, titles and labels, so bidi and zero-width characters are shown too."""
    return Text(visible_name(text), style=style, end="")


class SafeStream:
    """`visible()` for text that arrives in pieces: a CR at the end of one piece may be
    the first half of a CRLF, so it waits for the next piece."""

    def __init__(self) -> None:
        self._cr = False

    def feed(self, piece: str) -> str:
        if self._cr:
            piece = "\r" + piece
        self._cr = piece.endswith("\r")
        return visible(piece[:-1] if self._cr else piece)

    def flush(self) -> str:
        out, self._cr = ("␍" if self._cr else ""), False
        return out


class VisibleWriter:
    """A text stream whose write() makes control characters visible: the plain output
    of the CLI commands (model names from folders, error text) goes through one;
    `names`: the output is names and figures, never a reply, so bidi and zero-width
    characters are shown too (`visible_name`)."""

    def __init__(self, stream: Any, names: bool = False) -> None:
        self._stream = stream
        self._show = visible_name if names else visible

    def write(self, s: str) -> int:
        self._stream.write(self._show(s))
        return len(s)

    def write_control(self, seq: str) -> None:
        """The program's own terminal control sequence (e.g. a progress bar's cursor
        moves), written as it is; never text from elsewhere."""
        self._stream.write(seq)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class SafeNotify:
    """App mixin: every toast and the header title show their text literally, whoever
    calls ``notify()`` (screens and widgets delegate to the app's)."""

    def notify(self, message: str, *, title: str = "", severity: Any = "information",
               timeout: float | None = None, markup: bool = False) -> None:
        super().notify(  # type: ignore[misc]
            visible_name(message), title=visible_name(title), severity=severity,
            timeout=timeout, markup=False,
        )

    def format_title(self, title: str, sub_title: str) -> Any:
        return super().format_title(  # type: ignore[misc]
            visible_name(title), visible_name(sub_title))
