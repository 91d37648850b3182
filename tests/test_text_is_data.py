"""Text is data in the app: markup-looking text and terminal control characters from a
model, a user, a saved chat, a settings file, a model folder or an error are shown
literally, never parsed as Textual/Rich markup and never written raw to the terminal.

The app runs headless under Pilot over the scripted engine; what the terminal would get
is read from the app's SVG screenshot (every widget, toast, title and table on screen).
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path
from typing import Any

import pytest
from textual.widgets import DataTable, Input

from kvchat.app.core.discovery import ModelEntry, ModelRow
from kvchat.app.core.settings import Settings, load_settings
from kvchat.app.core.store import Conversation, ConversationStore
from kvchat.app.core.text import SafeStream, literal, visible
from kvchat.app.tui.app import KVChatApp
from kvchat.app.tui.screens import HistoryScreen, LayerCacheScreen, ModelPickerScreen
from kvchat.app.tui.screens.settings_form import SettingsScreen
from kvchat.app.tui.turn import Phase
from kvchat.model.runtime.events import Done, TurnStats
from tests.helpers.hostile_text import CONTROLS, MARKUP, RAW_CONTROL
from tests.helpers.scripted_engine import ScriptedEngine, async_test, wait_for

HOSTILE = f"{MARKUP} {CONTROLS}"
SIZE = (160, 50)


def screen_text(app: KVChatApp) -> str:
    """What the terminal shows now (all layers: screens, toasts, header), as text."""
    svg = app.export_screenshot()
    return html.unescape(svg).replace("\xa0", " ")


def assert_safe(app: KVChatApp, *shown: str) -> None:
    text = screen_text(app)
    raw = RAW_CONTROL.findall(text)
    assert not raw, f"raw control characters reach the terminal: {raw!r}"
    for s in shown:
        assert s in text, f"{s!r} is not shown literally: " + "\n".join(
            ln for ln in re.sub(r"<[^>]+>", "", text).splitlines() if ln.strip())
    assert app.is_running, "the app quit (an [@click=app.quit] ran?)"


def toasts(app: KVChatApp) -> str:
    """The text of every toast on screen, as rendered."""
    # by type name: Textual exports no Toast class publicly
    return "\n".join(str(t.render()) for t in app.screen.query("Toast"))


def make_app(path: str, settings: Settings | None = None, **kw: Any) -> KVChatApp:
    def factory(on_event: Any, p: str | None) -> ScriptedEngine:
        return ScriptedEngine(on_event, p, **kw)

    return KVChatApp(path, settings or Settings(), engine_factory=factory)


# ---- the helper ------------------------------------------------------------------------


def test_visible_keeps_text_and_makes_controls_visible() -> None:
    assert visible("a\tb\nc") == "a\tb\nc"
    assert visible("line\r\n") == "line\n"
    out = visible(CONTROLS)
    assert not RAW_CONTROL.search(out)
    assert out.startswith("␛]52;c;aGVsbG8=␇")
    assert "<9B>2J" in out and "␡" in out and "␀end" in out
    assert visible(MARKUP) == MARKUP  # markup characters are not touched, only shown
    assert literal(MARKUP).plain == MARKUP  # a Text: never parsed as markup


def test_safe_stream_joins_crlf_split_across_pieces() -> None:
    s = SafeStream()
    assert s.feed("a\r") + s.feed("\nb\x1b") + s.flush() == "a\nb␛"
    assert s.feed("x\r") + s.flush() == "x␍"


# ---- every widget, toast, title and table ----------------------------------------------


@async_test
async def test_hostile_text_everywhere_is_shown_literally(env: Path) -> None:
    model_dir = env / "models" / "[bold]m[@click=app.quit]q\x1b]0;t\x07"
    bad = Settings()
    bad.warnings.append(f"temp must be a number (got {MARKUP!r}\x1b[31m)")
    app = make_app(str(model_dir), bad, reply=HOSTILE, fail_paths=[f"/nope/[/INST]{CONTROLS}"])
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await wait_for(pilot, lambda: bool(app.chat.model_info))
        await pilot.pause()
        # settings warning toast, model name in the header and the side panel
        assert_safe(app, "[@click=app.quit]q␛]0;t␇")
        assert f"(got {MARKUP!r}␛[31m)" in toasts(app)

        # a user message and a model reply full of markup and escapes
        await app.chat.send(HOSTILE)
        await wait_for(pilot, lambda: not app.chat.generating)
        await pilot.pause()
        assert_safe(app, "[/INST]? [bold]b[/bold] [@click=app.quit]x[/]", "␛]52;c;aGVsbG8=␇")
        assert app.chat.conversation.messages[0]["content"] == HOSTILE  # saved exactly
        assert app.chat.conversation.messages[1]["content"] == HOSTILE

        # an error from the engine (e.g. a template's raise_exception('[/INST]'))
        eng = app.chat.engine
        eng._turn = lambda *_: eng._emit(
            Done("error", "", [], [], TurnStats(), error=f"chat template error: {HOSTILE}"))
        await app.chat.send("why")
        await wait_for(pilot, lambda: not app.chat.generating)
        await pilot.pause()
        # a model that fails to load, its path in the loading label and the toast
        app.chat.load_model(f"/nope/[/INST]{CONTROLS}")
        await wait_for(pilot, lambda: app.chat.phase is not Phase.LOADING)
        await pilot.pause()
        assert_safe(app)
        assert f"chat template error: {visible(HOSTILE)}" in toasts(app)
        assert f"/nope/[/INST]{visible(CONTROLS)}" in toasts(app)

        # export (path toast) and copy (count toast) still work with such a title
        app.chat.action_export()
        await pilot.pause()
        assert_safe(app)


@async_test
async def test_chat_with_inst_opens_from_history(env: Path) -> None:
    store = ConversationStore()
    conv = Conversation()
    conv.add_message("user", HOSTILE)
    conv.add_message("assistant", f"Because {CONTROLS} [/INST]")
    conv.model = f"/models/[/INST]{CONTROLS}"
    store.save(conv)
    app = make_app("/models/plain")
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await wait_for(pilot, lambda: bool(app.chat.model_info))
        await pilot.press("f2")
        await wait_for(pilot, lambda: isinstance(app.screen, HistoryScreen))
        await pilot.pause()
        assert_safe(app, "Why does Llama 2 use [INST] and [/INST]?")
        table = app.screen.query_one(DataTable)
        assert table.row_count == 1
        await pilot.press("enter")
        await wait_for(pilot, lambda: not isinstance(app.screen, HistoryScreen))
        await pilot.pause()
        assert app.chat.conversation.id == conv.id
        assert [m["content"] for m in app.chat.conversation.messages] == [
            HOSTILE, f"Because {CONTROLS} [/INST]"]
        assert_safe(app, "Because ␛]52;c;aGVsbG8=␇")
        assert "Opened “Why does Llama 2 use [INST] and [/INST]?" in toasts(app)
        # the edit box gets the message too (controls shown, markup literal)
        app.chat.begin_edit(0)
        await pilot.pause()
        assert_safe(app, "[@click=app.quit]x[/]")


@async_test
async def test_settings_form_picker_and_layers_show_text_literally(env: Path) -> None:
    app = make_app("/models/plain")
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await wait_for(pilot, lambda: bool(app.chat.model_info))
        # a settings field with markup in it: the error line and toast show it literally
        app.push_screen(SettingsScreen(app.chat.settings))
        await wait_for(pilot, lambda: isinstance(app.screen, SettingsScreen))
        await pilot.pause()
        app.screen.query_one("#temp", Input).value = "[/]x"
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert isinstance(app.screen, SettingsScreen)  # not saved, still open
        # in the form's words: the label, not the field name
        assert_safe(app, "temperature must be a number (got '[/]x')")
        assert "temperature must be a number (got '[/]x')" in toasts(app)
        await pilot.press("escape")

        # model names from folders on disk
        picker = ModelPickerScreen([], None, include_defaults=False)
        app.push_screen(picker)
        await wait_for(pilot, lambda: picker.scanned)
        entry = ModelEntry(f"[/INST]{CONTROLS}", Path("/m/[/]"), "[bold]x", 1, None, "config")
        picker._fill([ModelRow(entry, None, None)])
        await pilot.pause()
        assert_safe(app, "[/INST]␛]52", "[bold]x")
        await pilot.press("escape")

        app.push_screen(LayerCacheScreen(app.chat._layer_rows))
        await pilot.pause()
        assert_safe(app)


def test_a_settings_file_with_markup_values_loads(env: Path) -> None:
    cfg = env / "config"
    cfg.mkdir()
    (cfg / "settings.json").write_text(json.dumps({"temp": "[/]", "system_prompt": HOSTILE}))
    s = load_settings()
    assert s.system_prompt == HOSTILE and s.temp == Settings().temp
    assert any("[/]" in w for w in s.warnings)


# ---- Ctrl+C ---------------------------------------------------------------------------


@async_test
async def test_ctrl_c_once_stops_the_reply_twice_quits(env: Path) -> None:
    app = make_app("/models/m", pause_after=2)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: bool(app.chat.model_info))
        await app.chat.send("tell me a story")
        await wait_for(pilot, lambda: app.chat.engine.paused.is_set())
        app.chat.input.focus()  # the input box has focus, as when typing
        await pilot.press("ctrl+c")
        await wait_for(pilot, lambda: not app.chat.generating)
        done = [e for e in app.chat.engine.events if isinstance(e, Done)]
        assert [d.finish_reason for d in done] == ["cancelled"] and app.is_running
        reply = app.chat.conversation.messages[-1]
        assert reply["role"] == "assistant" and reply.get("stopped")
        await pilot.press("ctrl+c")
        await wait_for(pilot, lambda: not app.is_running)


@pytest.mark.slow
@async_test
async def test_ctrl_c_without_a_reply_warns_then_quits(env: Path) -> None:
    app = make_app("/models/m")
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: bool(app.chat.model_info))
        await pilot.press("ctrl+c")
        await pilot.pause()
        assert app.is_running
        await pilot.press("ctrl+c")
        await wait_for(pilot, lambda: not app.is_running)
