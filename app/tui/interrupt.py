"""Ctrl+C in the chat, as in a terminal program: once stops the running reply (the
partial text is kept, as with Esc), twice within a few seconds quits. With no reply
running, a first Ctrl+C copies the selected text of the focused widget if there is any
(Textual's own meaning of the key), else says that a second one quits.

The chat screen binds ``ctrl+c`` to ``interrupt`` (app/tui/actions.py) with priority, so a
focused input box does not swallow it; this mixin supplies the action.
"""

from __future__ import annotations

import time
from typing import Any

QUIT_WINDOW_S = 3.0  # a second Ctrl+C within this many seconds quits


class InterruptKey:
    """Mixed into the chat screen, which has `generating` and `action_stop`."""

    _interrupt_at = float("-inf")

    def action_interrupt(self) -> None:
        screen: Any = self
        now = time.monotonic()
        if now - self._interrupt_at < QUIT_WINDOW_S:
            screen.app.action_quit()  # which asks first when the chat is not saved
            return
        if screen.generating:
            self._interrupt_at = now
            screen.action_stop()
            # each toast lasts as long as what it says is true (a longer one also covered
            # the reply's stopped mark)
            screen.notify("Stopping the reply. Ctrl+C again quits.", title="Ctrl+C",
                          timeout=QUIT_WINDOW_S)
            return
        selected = getattr(screen.focused, "selected_text", "")
        if selected:
            screen.app.copy_to_clipboard(selected)
            return
        self._interrupt_at = now
        screen.notify("Press Ctrl+C again to quit (or Ctrl+Q).", title="Ctrl+C",
                      timeout=QUIT_WINDOW_S)
