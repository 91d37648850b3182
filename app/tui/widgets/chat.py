"""The chat column's widgets: one message (the transcript, widgets/transcript.py, mounts
those on screen), the input box."""

from __future__ import annotations

import asyncio
import re
from typing import Any

from markdown_it import MarkdownIt
from textual import events
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Markdown, Static, TextArea
from textual.widgets.markdown import MarkdownStream

from kvchat.app.core.text import SafeStream, visible

ROLE_TITLES = {"user": "you", "assistant": "assistant", "system": "system"}


def _typed_text() -> MarkdownIt:
    """Markdown as typed in a chat box: a newline is a line break, not a space (markdown-it's
    "breaks" option only changes its HTML renderer; Textual reads the tokens)."""
    md = MarkdownIt("gfm-like")

    def hard_breaks(state: Any) -> None:
        for token in state.tokens:
            for child in token.children or ():
                if child.type == "softbreak":
                    child.type = "hardbreak"

    md.core.ruler.push("typed_line_breaks", hard_breaks)
    return md


_LINK_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:", re.MULTILINE)


def streamed_blocks_hold(md: Markdown) -> bool:
    """Whether the blocks a stream mounted are those a full parse of the same source gives
    (same kinds, same source lines). Streaming re-parses from the last block on at every
    fragment, so they almost always are; a link definition can change earlier blocks'
    inline text, and a Textual without these internals gets the full render."""
    if _LINK_DEFINITION.search(md.source):
        return False
    try:
        from textual.widgets.markdown import MarkdownBlock

        parser = md._parser_factory() if md._parser_factory else MarkdownIt("gfm-like")
        fresh = list(md._parse_markdown(parser.parse(md.source)))
        have = [c for c in md.children if isinstance(c, MarkdownBlock)]
        return [(type(b), b.source_range) for b in fresh] == [
            (type(b), b.source_range) for b in have]
    except (AttributeError, ImportError, TypeError):
        return False


class ChatMessage(Vertical):
    """One transcript entry. Assistant replies are Markdown and can stream in.

    While streaming, text goes through a `MarkdownStream` (which appends to the last
    block and batches fragments that arrive faster than it can render); when the reply
    ends, `finish()` re-parses the whole text once, so code fences and lists that were
    split across fragments come out right.
    """

    can_focus = True

    BINDINGS = [Binding("enter", "select", "Edit / select", show=False)]

    class Selected(Message):
        """The user picked this message (click or Enter): user text -> edit and resend."""

        def __init__(self, widget: ChatMessage) -> None:
            super().__init__()
            self.widget = widget

    def __init__(
        self,
        role: str,
        content: str = "",
        *,
        index: int,
        stopped: bool = False,
        streaming: bool = False,
    ) -> None:
        super().__init__(classes=f"message -{role}")
        self.role = role
        self.content = content
        self.index = index
        self.stopped = stopped
        self.streaming = streaming
        self.stopping = False  # a stop was asked; the reply has not ended yet
        self._stream: MarkdownStream | None = None
        self._safe = SafeStream()
        self.border_title = visible(ROLE_TITLES.get(role, role))
        self._set_subtitle()

    def compose(self):
        # user text is Markdown too (code fences, lists), with every newline kept as typed
        # (Ctrl+J); the system prompt stays plain
        if self.role == "user":
            yield Markdown(visible(self.content), classes="body", parser_factory=_typed_text)
        elif self.role == "assistant":
            yield Markdown(visible(self.content), classes="body")
        else:
            yield Static(visible(self.content), markup=False, classes="body")

    @property
    def body(self) -> Markdown | Static:
        return self.query_one(".body", (Markdown, Static))

    def _set_subtitle(self, note: str = "") -> None:
        if self.streaming:
            self.border_subtitle = "stopping…" if self.stopping else "generating…"
        elif self.stopped:
            self.border_subtitle = "■ stopped"
        else:
            self.border_subtitle = note
        self.set_class(self.stopped, "-stopped")
        self.set_class(self.streaming, "-streaming")

    def mark_stopping(self) -> None:
        """A stop was asked: the header says so until the reply ends."""
        self.stopping = True
        self._set_subtitle()

    def note_progress(self, label: str) -> None:
        """How the streaming reply is getting on (prefill progress); a stop's note stays."""
        if self.streaming and not self.stopping:
            self.border_subtitle = label

    async def append(self, text: str) -> None:
        """Add streamed text (assistant only)."""
        if not text:
            return
        self.content += text
        md = self.body
        assert isinstance(md, Markdown)
        if self._stream is None:
            self._stream = Markdown.get_stream(md)
        await self._stream.write(self._safe.feed(text))

    async def finish(self, text: str, *, stopped: bool = False, note: str = "") -> None:
        """The reply ended: stop the stream, and render the full text once unless the
        streamed blocks already are what it parses to (re-mounting every block of a long
        reply holds the UI for a fifth of a second: keys wait)."""
        streamed = self._stream is not None
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        self.content = text
        self.streaming = self.stopping = False
        self.stopped = stopped
        self._safe = SafeStream()
        body = self.body
        shown = visible(text)
        if isinstance(body, Markdown):
            if not (streamed and body.source == shown and streamed_blocks_hold(body)):
                await body.update(shown)
        else:
            body.update(shown)
        self._set_subtitle(note)

    def action_select(self) -> None:
        self.post_message(self.Selected(self))

    def on_click(self, event: events.Click) -> None:
        event.stop()
        self.focus()
        self.post_message(self.Selected(self))


class ChatInput(TextArea):
    """Multi-line input: Enter sends (the chat screen's binding, app/tui/actions.py);
    Shift+Enter or Ctrl+J inserts a newline; Up on the first line / Down on the last line
    walk the input history."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(
            id=id,
            soft_wrap=True,
            show_line_numbers=False,
            highlight_cursor_line=False,
            placeholder="Message…  (Enter send · Ctrl+J newline · ↑ history)",
        )
        # ctrl+e (export) and ctrl+y (copy reply) are priority bindings of the chat screen,
        # so TextArea's aliases for line end and redo never see them (End and ctrl+z remain)
        self.sent_history: list[str] = []
        self._hist_pos: int | None = None  # index into history while browsing
        self._draft = ""

    async def _on_key(self, event: events.Key) -> None:
        # Runs before TextArea._on_key (MRO order)
        if event.key in ("shift+enter", "ctrl+j"):
            event.stop()
            event.prevent_default()
            self.insert("\n")

    async def settled(self) -> None:
        """Return once the keys already sent to this box are in its text: a priority
        binding (Enter) runs as soon as the app reads its key, before this box has taken
        the keys typed just before it."""
        done = asyncio.Event()
        self.call_later(done.set)
        await done.wait()

    # ---- history --------------------------------------------------------------------
    def remember(self, text: str) -> None:
        """`text` becomes the newest entry; an earlier copy of it is dropped, so the
        history (and session.json) never holds one message twice."""
        if text.strip():
            if text in self.sent_history:
                self.sent_history.remove(text)
            self.sent_history.append(text)
        self._hist_pos = None
        self._draft = ""

    def remember_all(self, texts: list[str]) -> None:
        """`texts` become the newest entries, in order, each once (a reopened chat's
        messages: one pass, however long the chat)."""
        fresh = list(dict.fromkeys(reversed([t for t in texts if t.strip()])))[::-1]
        seen = set(fresh)
        self.sent_history = [t for t in self.sent_history if t not in seen] + fresh
        self._hist_pos = None
        self._draft = ""

    def load_text(self, text: str) -> None:
        # a message from a saved chat may hold control characters: shown, never sent raw
        super().load_text(visible(text))

    def _show(self, text: str) -> None:
        self.load_text(text)
        self.move_cursor(self.document.end)

    def history_prev(self) -> bool:
        if not self.sent_history:
            return False
        if self._hist_pos is None:
            self._draft = self.text
            self._hist_pos = len(self.sent_history) - 1
        elif self._hist_pos > 0:
            self._hist_pos -= 1
        else:
            return True  # at the oldest entry: stay
        self._show(self.sent_history[self._hist_pos])
        return True

    def history_next(self) -> bool:
        if self._hist_pos is None:
            return False
        if self._hist_pos < len(self.sent_history) - 1:
            self._hist_pos += 1
            self._show(self.sent_history[self._hist_pos])
        else:
            self._hist_pos = None
            self._show(self._draft)
        return True

    def action_cursor_up(self, select: bool = False) -> None:
        if not select and self.navigator.is_first_wrapped_line(self.cursor_location):
            if self.history_prev():
                return
        super().action_cursor_up(select)

    def action_cursor_down(self, select: bool = False) -> None:
        if not select and self.navigator.is_last_wrapped_line(self.cursor_location):
            if self.history_next():
                return
        super().action_cursor_down(select)
