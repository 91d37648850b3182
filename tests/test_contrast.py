"""Every text the app shows reaches WCAG's 4.5:1 against its background, in the dark and the
light theme.

The colours are the ones on screen: each scene is exported with Textual's public
`export_screenshot()` (Rich's SVG: one <text> per run with its fill, one <rect> behind it
with the resolved background, and "dim" already blended as Rich draws it), and the ratio is
computed here from WCAG 2's definition of relative luminance, independently of
app/tui/readable.py. Inactive footer keys (greyed out on purpose) and whatever a modal
dims behind itself are not text the user is meant to read, so only the dialog is checked.
"""

from __future__ import annotations

import html
import re
from pathlib import Path
from typing import Any

import pytest
from textual.color import Color
from textual.geometry import Region

from kvchat.app.core.settings import Settings
from kvchat.app.tui import readable
from kvchat.app.tui.app import KVChatApp
from kvchat.app.tui.turn_notices import overflow_message
from kvchat.model.runtime.events import Overflow
from tests.helpers.scripted_engine import ScriptedEngine, async_test, wait_for

MODEL = "/models/stories260K"
THEMES = ["textual-dark", "textual-light"]
LINE_H, CHAR_W, BASELINE = 24.4, 12.2, 20  # Rich's SVG grid
# box drawing, block elements and geometric shapes: borders, bars, sparkline, not text
DECORATION = re.compile(r"^[\s\u2500-\u25ff⭘]*$")


def wcag_ratio(fg: str, bg: str) -> float:
    def lum(hex_: str) -> float:
        rgb = [int(hex_[i:i + 2], 16) / 255 for i in (1, 3, 5)]
        lin = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb]
        return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]

    hi, lo = sorted((lum(fg), lum(bg)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def text_runs(svg: str) -> list[tuple[str, str, str, int, int]]:
    """(text, foreground, background, column, row) of every run of text on screen."""
    fills = dict(re.findall(r"\.([\w-]+-r\d+) \{ fill: (#[0-9a-fA-F]{6})", svg))
    backs = {(x, round((float(y) - 1.5) / LINE_H)): fill for fill, x, y in re.findall(
        r'<rect fill="(#[0-9a-fA-F]{6})" x="([\d.]+)" y="([\d.]+)" width="[\d.]+" '
        r'height="[\d.]+" shape-rendering', svg)}
    runs = []
    for cls, x, y, raw in re.findall(
            r'<text class="([\w-]+-r\d+)" x="([\d.]+)" y="([\d.]+)" [^>]*>([^<]*)</text>', svg):
        text = html.unescape(raw).replace("\xa0", " ")
        if DECORATION.match(text):  # also the line ends, which have no background
            continue
        row = round((float(y) - BASELINE) / LINE_H)
        runs.append((text, fills[cls], backs[(x, row)], round(float(x) / CHAR_W), row))
    return runs


def low_contrast(app: KVChatApp, scene: str, checked: list[str]) -> list[str]:
    """The runs of text below 4.5:1 in the current scene (and every text checked)."""
    screen = app.screen
    dialogs = list(screen.query(".dialog")) or list(screen.query("#--container"))
    area: Region | None = dialogs[0].region if dialogs else None
    inactive = [w.region for w in app.chat.query("FooterKey.-disabled")]
    bad = []
    for text, fg, bg, col, row in text_runs(app.export_screenshot()):
        if area is not None and not area.contains(col, row):
            continue
        if any(r.contains(col, row) for r in inactive):
            continue
        checked.append(text)
        ratio = wcag_ratio(fg, bg)
        if ratio < readable.MIN_CONTRAST:
            bad.append(f"{app.theme} {scene}: {text.strip()!r} {fg} on {bg} = {ratio:.2f}:1")
    return bad


@pytest.mark.slow  # every text of two themes: the longest UI check
@pytest.mark.parametrize("theme", THEMES)
@async_test
async def test_every_text_reaches_4_5_to_1(env: Path, theme: str) -> None:
    def factory(on_event: Any, path: str | None) -> ScriptedEngine:
        return ScriptedEngine(on_event, path)

    app = KVChatApp(MODEL, Settings(max_kv_size=64), engine_factory=factory)
    bad: list[str] = []
    checked: list[str] = []

    async def scene(name: str, key: str | None = None, settle: float = 0.3) -> None:
        if key:
            await pilot.press(key)
        await pilot.pause(settle)
        # the footer recomposes when the keys change: read it whole, with its inactive
        # (greyed) keys known, not half-way
        await wait_for(pilot, lambda: len(app.chat.query("FooterKey")) > 3)
        bad.extend(low_contrast(app, name, checked))

    async with app.run_test(size=(120, 40), notifications=True) as pilot:
        app.theme = theme
        await wait_for(pilot, lambda: bool(app.chat.model_info))
        await scene("empty chat")  # placeholder, panel before the first turn
        app.chat.input.load_text("Tell me a story")
        await pilot.press("enter")
        await wait_for(pilot, lambda: not app.chat.phase.generating)
        await scene("chat")  # "you" / "assistant" labels, headings, gauge, footer, header
        app.notify("Saved; applied from the next turn.", title="Settings")
        app.notify(overflow_message(Overflow(capacity=64, dropped=12, during="prompt")),
                   severity="warning", title="Context full")
        app.notify("generation failed", severity="error", title="Error")
        await scene("notices")
        app.clear_notifications()
        await pilot.resize_terminal(80, 24)
        await scene("narrow")  # the status line instead of the panel
        await pilot.resize_terminal(120, 40)
        await scene("settings", "ctrl+s")
        app.screen.query_one("#top_p").value = "1.5"
        await pilot.press("ctrl+s")
        app.clear_notifications()
        await scene("settings error")
        await pilot.press("escape")
        await scene("help", "f1")
        await pilot.press("f1")
        await scene("history", "f2", settle=0.5)
        await pilot.press("escape")
        await scene("layers", "ctrl+l", settle=0.5)
        await pilot.press("escape")
        await scene("picker", "ctrl+o", settle=1.0)
        await pilot.press("escape")
        await scene("palette", "ctrl+p", settle=0.5)
    shown = " ".join(checked)
    # the texts this issue found unreadable were among those checked
    # the placeholder by its tail: a blinking cursor on its first letter splits "Message…"
    # into two runs in half of the screenshots
    for text in ("Speed", " you ", " assistant ", "tokens", "(Enter send", "Context full",
                 "Settings", "must be", "Help", "Quit", "tok/s · ctx"):
        assert text in shown, f"{text!r} was not on screen"
    assert not bad, "\n".join(bad)


def test_readable_moves_only_what_falls_short() -> None:
    light = [Color.parse("#E0E0E0"), Color.parse("#D0D0D0")]
    assert readable.readable("#1F1F1F", light) == "#1F1F1F"  # 12:1 already
    fixed = readable.readable("#FEA62B", light)  # Textual's orange accent: 1.5:1
    assert all(wcag_ratio(fixed, bg.hex) >= 4.5 for bg in light)
    assert wcag_ratio(fixed, "#E0E0E0") < 6  # moved just far enough, not to black
    dark = [Color.parse("#121212")]
    lifted = readable.readable("#0178D4", dark)  # 4.1:1 on the dark background
    assert wcag_ratio(lifted, "#121212") >= 4.5 and lifted != "#FFFFFF"
    assert readable.readable("$not-a-colour", light) == "$not-a-colour"
