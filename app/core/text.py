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

``--json`` output keeps the exact text: JSON escapes control characters itself.
"""

from __future__ import annotations

import re
from typing import Any

from rich.text import Text

# C0 (minus \t and \n), DEL and C1: the Unicode "Cc" category
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


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
    s = s.replace("\r\n", "\n")
    return _CONTROL.sub(_symbol, s)


def literal(text: object, style: str = "") -> Text:
    """A renderable that shows `text` exactly (no markup) with controls made visible."""
    return Text(visible(text), style=style, end="")


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
    of the CLI commands (model names from folders, error text) goes through one."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, s: str) -> int:
        self._stream.write(visible(s))
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
            visible(message), title=visible(title), severity=severity, timeout=timeout,
            markup=False,
        )

    def format_title(self, title: str, sub_title: str) -> Any:
        return super().format_title(visible(title), visible(sub_title))  # type: ignore[misc]
