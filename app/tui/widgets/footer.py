"""The footer: Textual's, with its keys in one fixed order (app/tui/actions.py's
footer_rank), so they no longer move as focus moves between the input and the messages
and Help and Quit are never the keys a narrow terminal cuts off.

Keys that do not fit whole are hidden, from the end of that order: a terminal of any
width shows whole labels only (every key stays in F1's help and the palette)."""

from __future__ import annotations

from collections.abc import Sequence

from textual.app import ComposeResult
from textual.widget import Widget
from textual.widgets import Footer

from kvchat.app.tui.actions import footer_rank


def keys_that_fit(widths: Sequence[tuple[int, int]], room: int) -> int:
    """How many of the keys, (cells, margin after it) each, fit whole in `room` cells, in
    order: every key up to the first that does not (a later, shorter one is not shown out
    of order). The last key's margin may run past the room: it is blank."""
    used = 0
    for n, (cells, margin) in enumerate(widths):
        if used + cells > room:
            return n
        used += cells + margin
    return len(widths)


class ActionFooter(Footer):
    def compose(self) -> ComposeResult:
        keys = list(super().compose())
        # sorted is stable: the docked palette key and anything unranked keep their order
        yield from sorted(keys, key=lambda w: footer_rank(str(getattr(w, "action", ""))))
        self.call_after_refresh(self._fit)

    def on_resize(self) -> None:
        self._fit()

    def _fit(self) -> None:
        if not self.is_attached:
            return
        every = list(self.query_children("FooterKey"))
        keys = [k for k in every if "-command-palette" not in k.classes]
        palette = [k for k in every if "-command-palette" in k.classes]
        room = self.size.width - sum(sum(_width(k)) for k in palette)
        shown = keys_that_fit([_width(k) for k in keys], room)
        for i, key in enumerate(keys):
            key.display = i < shown


def _width(key: Widget) -> tuple[int, int]:
    """(cells, margin after it) of a key in the footer row: its label, padding, border and
    left margin, then its right margin."""
    styles = key.styles
    cells = (key.get_content_width(key.size, key.size) + styles.margin.left
             + styles.padding.left + styles.padding.right
             + (1 if styles.border_left[0] else 0) + (1 if styles.border_right[0] else 0))
    return cells, styles.margin.right
