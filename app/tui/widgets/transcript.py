"""The scrolling transcript, rendered lazily: every message is an `Entry` (data), and only
the entries on screen plus about a screen either way are `ChatMessage` widgets. Two
spacers stand for the rest, so the scrollbar, the mouse wheel, PageUp/PageDown and
Home/End move through the whole chat (docs/chat.md, "How it is built").

Heights: an entry's height is measured once it has been a widget at this width (its
outer height plus the gap under it), else estimated from its text (`estimate_height`).
A spacer is the sum of its entries' heights, so scrolling back over measured entries
lands exactly; when newly mounted entries above what is on screen turn out taller or
shorter than their estimate, the view is moved by the difference (anchored on the first
message on screen that had been measured), so what is on screen stays put. The scroll
keys do not animate: an animation would undo that correction.

The reply that is streaming is always a widget (the turn controller writes into it),
wherever the view is: it is pinned after the bottom spacer until it ends.
"""

from __future__ import annotations

import itertools
from bisect import bisect_left, bisect_right
from dataclasses import dataclass

from textual import events
from textual.containers import VerticalScroll
from textual.widget import Widget

from kvchat.app.tui.widgets.chat import ChatMessage

# the transcript's padding (2) and scrollbar (1), a message's border and padding (4)
CHROME_COLUMNS = 7
CHROME_ROWS = 3  # a message's border (2) and the gap under it (1)
FALLBACK_COLUMNS = 80  # before the transcript has a size


@dataclass
class Entry:
    """One message of the transcript; `widget` while it is mounted (its text then lives
    there: a streaming reply grows)."""

    role: str
    content: str
    index: int
    stopped: bool = False
    height: int = 0  # rows, gap included: measured at `Transcript._width`, else estimated
    measured: bool = False
    widget: ChatMessage | None = None

    def sync(self) -> None:
        """Take the widget's text and marks (before it goes)."""
        if self.widget is not None:
            self.content = self.widget.content
            self.stopped = self.widget.stopped

    def make_widget(self) -> ChatMessage:
        self.widget = ChatMessage(self.role, self.content, index=self.index,
                                  stopped=self.stopped)
        return self.widget


def estimate_height(text: str, columns: int) -> int:
    """Rows a message of `text` takes at a transcript `columns` wide, before it has been
    laid out: each line wrapped at the text's width, plus the border and the gap."""
    width = max(1, columns - CHROME_COLUMNS)
    rows = sum(max(1, -(-len(line) // width)) for line in text.split("\n"))
    return rows + CHROME_ROWS


def window_around(prefix: list[int], top: float, bottom: float) -> tuple[int, int]:
    """[lo, hi): the entries that overlap rows [top, bottom), given the running sums of
    their heights (`prefix[i]` is where entry i starts, `prefix[-1]` the total)."""
    n = len(prefix) - 1
    lo = max(0, min(n, bisect_right(prefix, top) - 1))
    hi = max(lo, min(n, bisect_left(prefix, bottom)))
    return lo, hi


class _Spacer(Widget):
    """Stands for the unmounted entries above or below the window: only a height."""

    DEFAULT_CSS = "_Spacer { height: 0; margin: 0; padding: 0; border: none; }"

    def set_rows(self, rows: int) -> None:
        # hidden at zero, so a chat that fits lays out exactly as its widgets alone
        if self.styles.height is None or self.styles.height.value != rows:
            self.styles.height = rows
        self.display = rows > 0


class Transcript(VerticalScroll):
    """The scrolling list of messages. Anchored: it follows new text only while the
    view is at the bottom; scrolling up releases the anchor, scrolling back re-takes it."""

    can_focus = False

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._entries: list[Entry] = []
        self._lo = self._hi = 0  # the window: entries [lo, hi) are widgets
        self._prefix: list[int] | None = None  # running sums of the heights (None: stale)
        self._width = 0  # the columns the heights are for
        self._top = _Spacer()
        self._bottom = _Spacer()
        self._updating = False
        self._again = False
        self._scheduled = False
        self._generation = 0  # bumped when entries go or move: a window move in flight stops

    def compose(self):
        yield self._top
        yield self._bottom

    def on_mount(self) -> None:
        self.anchor()

    # ---- what the chat reads ------------------------------------------------------------
    @property
    def messages(self) -> list[ChatMessage]:
        """The messages mounted now (the window and a streaming reply), top to bottom."""
        return list(self.query_children(ChatMessage))

    @property
    def entries(self) -> list[Entry]:
        """Every message of the transcript, mounted or not."""
        return self._entries

    def last_reply(self) -> str:
        """The text of the newest assistant message ("" when none)."""
        for entry in reversed(self._entries):
            if entry.role == "assistant":
                entry.sync()
                return entry.content
        return ""

    @property
    def window(self) -> tuple[int, int]:
        return self._lo, self._hi

    # ---- changing it ----------------------------------------------------------------------
    async def add(self, widget: ChatMessage) -> ChatMessage:
        """A new message at the end. It is mounted when the window reaches the end, or
        when it streams (the reply is written into `widget`)."""
        entry = Entry(widget.role, widget.content, widget.index, widget.stopped,
                      estimate_height(widget.content, self._columns()))
        at_end = self._hi == len(self._entries)
        self._entries.append(entry)
        self._prefix = None
        if at_end or widget.streaming:
            entry.widget = widget
            if at_end:
                self._hi = len(self._entries)
            await self.mount(widget, before=self._bottom if at_end else None)
        self._set_spacers()
        self._request_window()
        return widget

    async def show(self, entries: list[Entry]) -> None:
        """Replace the transcript with `entries` (a reopened chat), at its end."""
        await self.clear()
        width = self._columns()
        if self.size.width:
            self._width = width  # the estimates below are for it
        for e in entries:
            e.height, e.measured, e.widget = estimate_height(e.content, width), False, None
        self._entries = list(entries)
        self._prefix = None
        self._generation += 1
        self._lo = self._hi = len(entries)
        self.anchor()
        # the view alone first, so the screen (and the keys) come back sooner; the margin
        # either way follows after that frame
        self._updating = True
        try:
            await self._move_window(*self._wanted(0.0))
        finally:
            self._updating = False
        self.call_after_refresh(self._request_window)
        self.call_after_refresh(self._settle)

    async def clear(self) -> None:
        """No messages (a new chat)."""
        await self.remove_children(self.messages)
        self._entries = []
        self._lo = self._hi = 0
        self._prefix = None
        self._generation += 1
        self._set_spacers()

    async def truncate(self, index: int) -> None:
        """Remove every message whose conversation index is >= index."""
        keep = bisect_left([e.index for e in self._entries], index)
        doomed = [e.widget for e in self._entries[keep:] if e.widget is not None]
        del self._entries[keep:]
        self._generation += 1
        self._lo, self._hi = min(self._lo, keep), min(self._hi, keep)
        self._prefix = None
        if doomed:
            await self.remove_children(doomed)
        self._set_spacers()
        self._request_window()

    async def remove_message(self, widget: ChatMessage) -> None:
        """Take one message out (a reply that failed before any text)."""
        pos = next((i for i, e in enumerate(self._entries) if e.widget is widget), None)
        if pos is not None:
            del self._entries[pos]
            self._generation += 1
            self._lo -= pos < self._lo
            self._hi -= pos < self._hi
            self._prefix = None
        await widget.remove()
        self._set_spacers()
        self._request_window()

    def follow(self) -> None:
        """Jump to the bottom and follow again (after the user sends a message)."""
        self.anchor()
        self._request_window()

    def mark_editing(self, index: int | None) -> None:
        """The user message being edited (None: none), marked wherever it is mounted."""
        self._editing = index
        for w in self.messages:
            w.set_class(w.index == index, "-editing")

    _editing: int | None = None

    # ---- keys: no animation (through thousands of rows, or against a correction that keeps
    # the view put while messages above it are measured) --------------------------------
    def action_scroll_home(self) -> None:
        self.scroll_home(animate=False)

    def action_scroll_end(self) -> None:
        self.scroll_end(animate=False)

    def action_page_up(self) -> None:
        self.scroll_page_up(animate=False)

    def action_page_down(self) -> None:
        self.scroll_page_down(animate=False)

    def action_scroll_up(self) -> None:
        self.scroll_up(animate=False)

    def action_scroll_down(self) -> None:
        self.scroll_down(animate=False)

    # ---- the window -----------------------------------------------------------------------
    def _columns(self) -> int:
        return self.size.width or FALLBACK_COLUMNS

    def _heights_prefix(self) -> list[int]:
        if self._prefix is None:
            self._prefix = list(itertools.accumulate((e.height for e in self._entries),
                                                     initial=0))
        return self._prefix

    def _pinned(self) -> Entry | None:
        """The streaming reply when it lies past the window."""
        if self._entries and self._hi < len(self._entries):
            last = self._entries[-1]
            if last.widget is not None and last.widget.streaming:
                return last
        return None

    def _set_spacers(self) -> None:
        prefix = self._heights_prefix()
        end = len(self._entries) - (self._pinned() is not None)
        self._top.set_rows(prefix[self._lo])
        self._bottom.set_rows(prefix[end] - prefix[min(self._hi, end)])

    def _following(self) -> bool:
        return self._anchored and not self._anchor_released

    def _wanted(self, margin: float) -> tuple[int, int]:
        """The entries over the view and `margin` screens either way."""
        prefix = self._heights_prefix()
        view = max(1, self.scrollable_content_region.height or self.size.height or 24)
        y = max(0, prefix[-1] - view) if self._following() else self.scroll_y
        return window_around(prefix, y - margin * view, y + view + margin * view)

    def _request_window(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self.call_later(self._update_window)

    def watch_scroll_y(self, old_value: float, new_value: float) -> None:
        super().watch_scroll_y(old_value, new_value)
        if self._entries:
            lo, hi = self._wanted(0.5)
            if lo < self._lo or hi > self._hi:
                self._request_window()

    def on_resize(self, event: events.Resize) -> None:
        self.call_after_refresh(self._settle)

    async def _update_window(self) -> None:
        """Mount the entries the view needs (a screen either way), unmount the rest."""
        self._scheduled = False
        if self._updating:
            self._again = True
            return
        self._updating = True
        try:
            await self._move_window(*self._wanted(1.0))
        finally:
            self._updating = False
        if self._again:
            self._again = False
            self._request_window()
        self.call_after_refresh(self._settle)

    async def _move_window(self, lo: int, hi: int) -> None:
        entries = self._entries
        hi = min(hi, len(entries))
        if (lo, hi) == (self._lo, self._hi) and all(
                entries[i].widget is not None for i in range(lo, hi)):
            return
        pinned = entries[-1] if entries and entries[-1].widget is not None \
            and entries[-1].widget.streaming else None
        doomed = [e for i, e in enumerate(entries)
                  if e.widget is not None and not lo <= i < hi and e is not pinned]
        focused = self.screen.focused if self.is_mounted else None
        lost_focus = any(e.widget is focused for e in doomed)
        generation = self._generation
        for e in doomed:
            e.sync()
        if doomed:
            await self.remove_children([e.widget for e in doomed])  # type: ignore[misc]
            for e in doomed:
                e.widget = None
        if generation != self._generation or not await self._mount_runs(lo, hi, generation):
            self._again = True  # the entries changed meanwhile: place the window again
            return
        self._lo, self._hi = lo, hi
        tail = self._pinned()
        if tail is not None and tail.widget is not None:
            self.move_child(self._bottom, before=tail.widget)
        elif self.children and self.children[-1] is not self._bottom:
            self.move_child(self._bottom, after=self.children[-1])
        self._set_spacers()
        if lost_focus:
            shown = self.messages
            if shown:
                shown[len(shown) // 2].focus(scroll_visible=False)

    async def _mount_runs(self, lo: int, hi: int, generation: int) -> bool:
        """Mount every unmounted entry of [lo, hi), a run at a time, in its place; False
        when the entries changed meanwhile."""
        entries = self._entries
        i = lo
        while i < hi:
            if generation != self._generation:
                return False
            if entries[i].widget is not None:
                i += 1
                continue
            j = i
            while j < hi and entries[j].widget is None:
                j += 1
            run = [entries[k].make_widget() for k in range(i, j)]
            for w in run:
                w.set_class(w.index == self._editing, "-editing")
            if j < hi:
                await self.mount_all(run, before=entries[j].widget)
            elif i > lo:
                await self.mount_all(run, after=entries[i - 1].widget)
            else:
                await self.mount_all(run, after=self._top)
            i = j
        return True

    def _settle(self) -> None:
        """Measure the mounted messages; keep the view where it was when entries above it
        changed height (an estimate replaced, or a new width)."""
        if not self.is_mounted or not self._entries:
            return
        columns = self._columns()
        if columns != self._width:  # every height was for another width
            self._width = columns
            for e in self._entries:
                e.sync()
                e.height, e.measured = estimate_height(e.content, columns), False
            self._prefix = None
        prefix = self._heights_prefix()
        y = self.scroll_y
        n = len(self._entries)
        mounted = range(min(self._lo, n), min(self._hi, n))
        changes: list[tuple[int, int]] = []  # (entry, rows more than its height said)
        anchor = None  # the first entry on screen (or below) that had been measured
        for i in itertools.chain(mounted, [n - 1] if self._hi < n else []):
            e = self._entries[i]
            w = e.widget
            if w is None or not w.is_mounted or w.outer_size.height <= 0:
                continue
            if anchor is None and e.measured and prefix[i + 1] > y:
                anchor = i
            rows = w.outer_size.height + w.styles.margin.bottom
            if rows != e.height:
                changes.append((i, rows - e.height))
                e.height = rows
            e.measured = True
        changed = bool(changes)
        # what was on screen stays put: the entries above it moved it by their change (with
        # none measured yet, those wholly above the view's top)
        shift = sum(d for i, d in changes
                    if (i < anchor if anchor is not None else prefix[i + 1] <= y))
        if not changed:
            return
        self._prefix = None
        self._set_spacers()
        if shift and not self._following():
            self.scroll_to(y=y + shift, animate=False, immediate=True, release_anchor=False)
        self._request_window()
