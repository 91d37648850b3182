"""The footer: Textual's, with its keys in one fixed order (app/tui/actions.py's
footer_rank), so they no longer move as focus moves between the input and the messages
and Help and Quit are never the keys a narrow terminal cuts off."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.widgets import Footer

from kvchat.app.tui.actions import NARROW_FOOTER, footer_rank


class ActionFooter(Footer):
    def compose(self) -> ComposeResult:
        keys = list(super().compose())
        for key in keys:  # kvchat.tcss hides these below 100 columns
            if getattr(key, "action", None) not in NARROW_FOOTER and \
                    "-command-palette" not in key.classes:
                key.add_class("-wide-only")
        # sorted is stable: the docked palette key and anything unranked keep their order
        yield from sorted(keys, key=lambda w: footer_rank(str(getattr(w, "action", ""))))
