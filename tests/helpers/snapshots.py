"""Steady screens for SVG snapshots: the app loaded, the input focused, no blinking cursor
(conftest's `pinned_machine` pins what the stats panel says about the machine)."""

from __future__ import annotations

from typing import Any

from textual.app import App

from tests.helpers.scripted_engine import wait_for


def no_blink(app: App[Any]) -> None:
    """A blinking cursor is not a stable pixel."""
    for w in app.screen.query("Input, TextArea"):
        w.cursor_blink = False  # type: ignore[attr-defined]


async def settle(pilot: Any) -> None:
    await wait_for(pilot, lambda: bool(pilot.app.chat.model_info))
    # only once the input has focus: switching blinking off pins the cursor's visibility
    # to whether the box has focus at that moment
    await wait_for(pilot, lambda: pilot.app.chat.input.has_focus)
    no_blink(pilot.app)
    await pilot.pause()
