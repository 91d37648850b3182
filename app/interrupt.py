"""Ctrl+C in the chat, as in a terminal program: once stops the running reply (the
partial text is kept, as with Esc), twice within a few seconds quits. With no reply
running, a first Ctrl+C copies the selected text of the focused widget if there is any
(Textual's own meaning of the key), else says that a second one quits.

The app binds ``ctrl+c`` to ``interrupt`` with priority (so a focused input box does not
swallow it); this mixin supplies the action.
"""

from __future__ import annotations

import time
from typing import Any

QUIT_WINDOW_S = 3.0  # a second Ctrl+C within this many seconds quits


class InterruptKey:
    _interrupt_at = float("-inf")

    def action_interrupt(self) -> None:
        app: Any = self
        now = time.monotonic()
        if now - self._interrupt_at < QUIT_WINDOW_S:
            app.exit()
            return
        if getattr(app, "generating", False):
            self._interrupt_at = now
            app.action_stop()
            app.notify("Stopping the reply. Ctrl+C again quits.", title="Ctrl+C")
            return
        selected = getattr(app.focused, "selected_text", "")
        if selected:
            app.copy_to_clipboard(selected)
            return
        self._interrupt_at = now
        app.notify("Press Ctrl+C again to quit (or Ctrl+Q).", title="Ctrl+C")
