"""Issue 21 in the chat, driven with Pilot on the scripted engine: small terminals (the
panel key, the status line, the footer), and the paper cuts a new user hit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from textual.widgets import Input, Markdown, Static

from kvchat.app.core.settings import Settings
from kvchat.app.core.store import ConversationStore
from kvchat.app.tui.app import KVChatApp
from kvchat.app.tui.screens import HistoryScreen, ModelPickerScreen
from kvchat.app.tui.screens.settings_form import SettingsScreen
from kvchat.app.tui.session import SESSION_FILE
from kvchat.app.tui.widgets.format import human_bytes
from kvchat.app.tui.widgets.status_line import status_text
from kvchat.model.runtime.events import CacheRestored, Overflow, Started, TurnStats
from tests.helpers.app import engine, loaded, replies, turn
from tests.helpers.scripted_engine import (
    ScriptedEngine,
    async_test,
    kv_bytes,
    record_notifications,
    wait_for,
)

MODEL = "/models/stories260K"


@pytest.fixture
def env(env: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """conftest's private folders, run from tmp_path: a file written to the working
    directory by mistake lands there, not in the repository."""
    monkeypatch.chdir(env)
    return env


def make_app(**settings: Any) -> KVChatApp:
    return KVChatApp(MODEL, Settings(**settings),
                     engine_factory=lambda cb, p: ScriptedEngine(cb, p, token_delay=0.001))


def panel_text(app: KVChatApp, part: str) -> str:
    return str(app.chat.panel.query_one(part, Static).render())


def status_line(app: KVChatApp) -> Static:
    return app.chat.query_one("#status-line", Static)


def footer_keys(app: KVChatApp) -> list[tuple[str, Any]]:
    """(action, region) of each key the footer shows, left to right."""
    keys = [k for k in app.screen.query("FooterKey") if "-command-palette" not in k.classes]
    return [(k.action, k.region) for k in sorted(keys, key=lambda k: k.region.x)]


# ---- a layout for every size -------------------------------------------------------------


# the fast tier keeps 80×24, the size terminals open at
@pytest.mark.parametrize("size", [pytest.param((60, 20), marks=pytest.mark.slow), (80, 24),
                                  pytest.param((99, 30), marks=pytest.mark.slow)])
@async_test
async def test_narrow_starts_with_the_status_line_and_the_key_shows_the_panel(
        env: Path, size: tuple[int, int]) -> None:
    app = make_app(max_kv_size=64)
    async with loaded(app, size) as pilot:
        await turn(pilot, "Tell me a story")
        await pilot.pause(0.3)
        panel, line = app.chat.panel, status_line(app)
        assert not panel.display and line.display
        s = panel.stats  # the status line carries the panel's own numbers
        assert s.cache_bytes == kv_bytes(s.cache_tokens)
        assert str(line.render()) == (f"{s.decode_tps:,.1f} tok/s · ctx {s.cache_tokens}/64"
                                      f" · KV {human_bytes(s.cache_bytes)} · GQA 2× smaller")
        # Help and Quit are whole on screen, whatever else the width cuts
        shown = {a: r for a, r in footer_keys(app) if r.right <= size[0] - 12}
        assert "help" in shown and "quit" in shown
        await pilot.press("f3")
        await pilot.pause(0.1)
        assert panel.display and not line.display
        assert app.chat.query_one("#transcript").region.width > 0
        await pilot.press("ctrl+g")  # the second key (F-keys are taken on some laptops)
        await pilot.pause(0.1)
        assert not panel.display and line.display


@async_test
async def test_wide_shows_the_panel_and_the_choice_survives_a_resize(env: Path) -> None:
    app = make_app()
    async with loaded(app, (120, 40)) as pilot:
        assert app.chat.panel.display and not status_line(app).display
        await pilot.press("f3")
        await pilot.pause(0.1)
        assert not app.chat.panel.display and status_line(app).display
        await pilot.resize_terminal(200, 60)
        await pilot.pause(0.1)
        assert not app.chat.panel.display  # hidden by the user: the width does not undo it
        await pilot.press("f3")
        await pilot.resize_terminal(80, 24)
        await pilot.pause(0.1)
        assert app.chat.panel.display  # shown by the user: stays at 80 columns
        titles = [c.title for c in app.get_system_commands(app.chat)]
        assert "Hide or show the stats panel" in titles


def test_keys_that_fit_stop_at_the_first_that_does_not() -> None:
    from kvchat.app.tui.widgets.footer import keys_that_fit

    keys = [(7, 1), (7, 1), (9, 1), (3, 1)]
    assert keys_that_fit(keys, 100) == 4
    assert keys_that_fit(keys, 7) == 1  # its margin may run past the room
    assert keys_that_fit(keys, 15) == 2 and keys_that_fit(keys, 14) == 1
    assert keys_that_fit(keys, 20) == 2  # not the short fourth key out of order
    assert keys_that_fit(keys, 0) == 0


@async_test
async def test_footer_shows_whole_keys_at_every_width(env: Path) -> None:
    """From 50 to 130 columns: the keys shown are the first ones of the footer's order,
    each whole before the palette key, and each label is on screen in full."""
    from kvchat.app.tui.actions import footer_rank

    app = make_app()
    async with loaded(app, (130, 20)) as pilot:
        footer = app.chat.query_one("ActionFooter")
        for width in (50, 55, 60, 72, 80, 99, 100, 120, 130):
            await pilot.resize_terminal(width, 20)
            await pilot.pause(0.1)
            every = sorted((k for k in footer.query_children("FooterKey")
                            if "-command-palette" not in k.classes),
                           key=lambda k: footer_rank(k.action))
            palette = footer.query_one(".-command-palette")
            shown = [k for k in every if k.display]
            assert shown == every[:len(shown)], width  # hidden from the end only
            assert [k.action for k in shown][:2] == ["help", "quit"], width
            line = app.screen._compositor.render_strips()[-1].text
            for k in shown:
                assert k.region.right <= palette.region.x, (width, k.action)
                assert f"{k.key_display} {k.description}" in line, (width, line)
            for k in every[len(shown):]:  # a hidden key would not have fitted
                assert not k.description or k.description not in line, (width, line)
        assert len([k for k in every if k.display]) == len(every)  # 130: all of them


@async_test
async def test_footer_keeps_one_order_as_focus_moves(env: Path) -> None:
    app = make_app()
    async with loaded(app, (200, 40)) as pilot:
        await turn(pilot, "hello")
        await pilot.pause(0.2)
        in_input = [a for a, _ in footer_keys(app)]
        replies(app)[-1].focus()
        await pilot.pause(0.2)
        await wait_for(pilot, lambda: bool(footer_keys(app)))  # recomposed for the new focus
        on_message = [a for a, _ in footer_keys(app)]
        assert in_input == on_message
        assert in_input[:2] == ["help", "quit"] and "toggle_panel" in in_input


# ---- readable, typed, remembered ---------------------------------------------------------


@pytest.mark.slow
@async_test
async def test_settings_open_in_the_first_field(env: Path) -> None:
    app = make_app()
    async with loaded(app, (120, 40)) as pilot:
        await pilot.press("ctrl+s")
        assert isinstance(app.screen, SettingsScreen)
        await pilot.press(*"You are a pirate")
        await pilot.press("ctrl+s")  # saves: nothing landed in temperature
        await wait_for(pilot, lambda: not isinstance(app.screen, SettingsScreen))
        assert app.chat.settings.system_prompt == "You are a pirate"
        assert app.chat.settings.temp == Settings().temp


@async_test
async def test_sent_messages_keep_their_newlines(env: Path) -> None:
    app = make_app()
    async with loaded(app, (120, 40)) as pilot:
        await turn(pilot, "first line\nsecond line")
        mine = next(w for w in app.chat.transcript.messages if w.role == "user")
        lines = [str(b.render()) for b in mine.query_one(Markdown).query("MarkdownBlock")]
        assert "first line\nsecond line" in "\n".join(lines)


@pytest.mark.slow
@async_test
async def test_reopening_a_chat_adds_no_duplicates_to_the_input_history(env: Path) -> None:
    app = make_app()
    async with loaded(app, (120, 40)) as pilot:
        await turn(pilot, "one")
        await turn(pilot, "two")
        first = app.chat.conversation.id
        await pilot.press("ctrl+n")
        await turn(pilot, "one")  # the same text in another chat
        for _ in range(3):
            assert await app.chat.open_conversation(first)
        assert app.chat.input.sent_history == ["one", "two"]
        await turn(pilot, "three")  # saves session.json
    saved = json.loads((env / "data" / SESSION_FILE).read_text())["input_history"]
    assert saved == ["one", "two", "three"] and len(saved) == len(set(saved))


# ---- the panel and the notices -------------------------------------------------------------


@pytest.mark.slow
@async_test
async def test_panel_shows_the_configured_bound_from_the_start(env: Path) -> None:
    app = make_app(max_kv_size=64, keep=4)
    async with loaded(app, (120, 40)) as pilot:
        await pilot.pause(0.2)
        assert "0 / 64 tokens" in panel_text(app, "#gauge")
        assert "window   64 · keep 4" in panel_text(app, "#cache")
        await turn(pilot, "hello")
        await pilot.press("ctrl+n")  # a new chat: the bound again, not the model's 512
        await pilot.pause(0.2)
        assert "0 / 64 tokens" in panel_text(app, "#gauge")
        assert "window   64 · keep 4" in panel_text(app, "#cache")


@pytest.mark.slow
@async_test
async def test_speed_resets_with_the_chat_and_peak_says_its_scope(env: Path) -> None:
    app = make_app()
    async with loaded(app, (120, 40)) as pilot:
        await pilot.pause(0.2)
        assert "at load" in panel_text(app, "#runtime")
        await turn(pilot, "hello")
        await pilot.pause(0.2)
        assert "this turn" in panel_text(app, "#runtime")
        assert "average  –" not in panel_text(app, "#speed")
        await pilot.press("ctrl+n")
        await pilot.pause(0.2)
        speed = panel_text(app, "#speed")
        assert "average  –" in speed and "now      –" in speed and "– generated" in speed
        assert "last turn" in panel_text(app, "#runtime")


@pytest.mark.slow
@async_test
async def test_reused_counts_only_what_the_window_holds(env: Path) -> None:
    app = make_app(max_kv_size=64)
    seen = record_notifications(app)
    async with loaded(app, (120, 40)) as pilot:
        app.chat.bridge(CacheRestored("chat.kv.safetensors", tokens=415))  # a reopened chat
        app.chat.bridge(Started(prompt_tokens=430, cached_tokens=415))
        await pilot.pause(0.3)
        assert "reused   64 tokens this turn" in panel_text(app, "#cache")
        assert any(m.startswith("64 tokens from the saved cache") for m, _ in seen)
        app.chat.bridge(Started(prompt_tokens=30, cached_tokens=20))
        await pilot.pause(0.3)
        assert "reused   20 tokens this turn" in panel_text(app, "#cache")


@pytest.mark.slow
@async_test
async def test_one_context_notice_per_chat(env: Path) -> None:
    app = make_app(max_kv_size=64)
    seen = record_notifications(app)
    async with loaded(app, (120, 40)) as pilot:

        def notices() -> list[str]:
            return [m for m, _ in seen if "window" in m]

        for dropped in (5, 9, 14):  # a small window overflows every turn
            app.chat.bridge(Overflow(dropped, 64, "prompt"))
        await wait_for(pilot, lambda: len(notices()) == 1)
        # what rotation means for the reply, and what to change, said once
        assert "no longer sees the start of the conversation" in notices()[0]
        assert "max KV size" in notices()[0]
        await pilot.pause(0.3)
        assert len(notices()) == 1
        assert "window full: oldest tokens dropped" in panel_text(app, "#gauge")
        await pilot.press("ctrl+n")
        await pilot.pause(0.2)
        assert "window full" not in panel_text(app, "#gauge")
        app.chat.bridge(Overflow(3, 64, "reply"))
        await wait_for(pilot, lambda: len(notices()) == 2)  # a new chat: told again, once


# ---- picker, palette, history, copy ---------------------------------------------------------


@pytest.mark.slow
@async_test
async def test_picker_stays_open_on_a_folder_it_cannot_load(env: Path) -> None:
    bad = env / "not-a-model"
    bad.mkdir()
    (bad / "notes.txt").write_text("no config here")
    app = make_app()
    async with loaded(app, (120, 40)) as pilot:
        await pilot.press("ctrl+o")
        picker = app.screen
        assert isinstance(picker, ModelPickerScreen)
        await wait_for(pilot, lambda: picker.scanned)
        for typed in (str(env / "missing"), str(bad)):
            field = picker.query_one("#path", Input)
            field.value = typed
            await pilot.press("enter")
            await pilot.pause(0.2)
            assert app.screen is picker, typed
            assert "✗" in str(picker.query_one("#picker-status", Static).render())
        await pilot.press(*"hi", "enter")  # typed keys stay in the picker
        await pilot.pause(0.2)
        assert app.screen is picker and not app.chat.conversation.messages
        assert engine(app).loads == [MODEL]  # nothing else was sent to the engine


@async_test
async def test_palette_lists_only_working_commands_and_screenshot_goes_to_data(
        env: Path) -> None:
    app = make_app()
    async with loaded(app, (120, 40)):
        titles = [c.title for c in app.get_system_commands(app.chat)]
        assert len(titles) == len(set(titles))
        assert "Maximize" not in titles and "Keys" not in titles
        assert {"Theme", "Quit", "Screenshot", "Keys (help)"} <= set(titles)
        path = app.take_screenshot()
        assert path is not None and path.parent == env / "data" / "screenshots"
        assert path.read_text().startswith("<svg")


@pytest.mark.slow
@async_test
async def test_undo_in_history_brings_back_the_kv_file(env: Path) -> None:
    app = make_app()
    async with loaded(app, (120, 40)) as pilot:
        await turn(pilot, "keep my cache")
        doomed = app.chat.conversation.id
        store: ConversationStore = app.chat.store
        await wait_for(pilot, lambda: store.cache_path(doomed).is_file())
        cache = store.cache_path(doomed).read_bytes()
        await pilot.press("ctrl+n")
        await pilot.press("f2")
        history = app.screen
        assert isinstance(history, HistoryScreen)
        await pilot.pause(0.2)
        table = history.query_one("#chats")
        table.move_cursor(row=[c.id for c in store.list()].index(doomed))
        await pilot.press("delete", "delete")
        await pilot.pause(0.1)
        assert not store.path_for(doomed).exists() and not store.cache_path(doomed).exists()
        await pilot.press("ctrl+z")
        await pilot.pause(0.1)
        assert store.cache_path(doomed).read_bytes() == cache
        assert store.load(doomed).messages[0]["content"] == "keep my cache"
        await pilot.press("delete", "delete", "escape")  # closing makes a delete final
        await wait_for(pilot, lambda: not isinstance(app.screen, HistoryScreen))
        assert not store.trash_dir.exists() and not store.cache_path(doomed).exists()


@pytest.mark.slow
@async_test
async def test_copy_says_it_goes_through_the_terminal(env: Path) -> None:
    app = make_app()
    seen = record_notifications(app)
    async with loaded(app, (120, 40)) as pilot:
        await turn(pilot, "hello")
        await pilot.press("ctrl+y")
        note = next(m for m, _ in seen if "clipboard" in m)
        assert "OSC 52" in note and "set -g set-clipboard on" in note


def test_status_text_by_hand() -> None:
    s = TurnStats(decode_tps=1234.56, cache_tokens=52, cache_bytes=20 * 1024, gqa_saving=4.0)
    assert status_text(s, 64) == "1,234.6 tok/s · ctx 52/64 · KV 20 KiB · GQA 4× smaller"
    assert status_text(s, 64, full=True).startswith("1,234.6 tok/s · ctx 52/64 full · ")
    assert status_text(TurnStats(), None) == "– tok/s · ctx 0/– · KV 0 B · GQA –"
