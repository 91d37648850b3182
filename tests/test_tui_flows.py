"""Paper cuts, driven through the real app with Pilot (scripted engine where
the model does not matter) and through the CLI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from textual.widgets import Button, DataTable, Input, OptionList, Select, Static, Switch

from kvchat.app.core.settings import load_settings
from kvchat.app.tui.screens import HistoryScreen, ModelPickerScreen
from kvchat.app.tui.screens.settings_form import SettingsScreen
from kvchat.model.files import model_name
from kvchat.model.runtime.events import Overflow, PrefillProgress
from tests.helpers.app import (
    engine,
    folder_app,
    last_done,
    loaded,
    open_picker,
    replies,
    turn,
)
from tests.helpers.fake_hub import FakeHub, FakeRepo
from tests.helpers.paths import MINI
from tests.helpers.scripted_engine import async_test, record_notifications, wait_for


async def new_chat(pilot: Any, text: str) -> str:
    """Ctrl+N, one turn; the new chat's id."""
    await pilot.press("ctrl+n")
    await turn(pilot, text)
    return pilot.app.chat.conversation.id


def messages(seen: list[tuple[str, str]]) -> list[str]:
    """The texts of the notifications record_notifications() saw."""
    return [m for m, _severity in seen]


# ---- 1. the picker --------------------------------------------------------------------


@pytest.mark.slow
@async_test
async def test_picker_typed_path_cursor_current_and_no_reload(models_env: Path) -> None:
    app = folder_app(models_env)
    seen = record_notifications(app)
    async with loaded(app) as pilot:
        picker = await open_picker(pilot)
        table = picker.query_one("#models", DataTable)
        names = [e.name for e in picker.entries]
        # the cursor starts on the model in use
        assert names[table.cursor_row] == "mini"
        # Enter on the current model: no reload, one line saying so
        await pilot.press("enter")
        await wait_for(pilot, lambda: not isinstance(app.screen, ModelPickerScreen))
        assert engine(app).loads == [str((models_env / "models" / "mini").resolve())]
        assert "That model is already loaded." in messages(seen)
        # typing goes to the path box (focus starts there), Enter loads what was typed
        picker = await open_picker(pilot)
        await pilot.press(*str(models_env / "models" / "mini-2"))
        assert picker.query_one("#path", Input).value == str(models_env / "models" / "mini-2")
        await pilot.press("enter")
        want = str((models_env / "models" / "mini-2").resolve())
        await wait_for(pilot, lambda: app.chat.model_path == want)


@pytest.mark.slow
@async_test
async def test_picker_lists_a_model_opened_by_its_path(models_env: Path) -> None:
    """A model opened by a path outside every searched folder is in the list, marked ●
    and under the cursor, as "by path"; it is listed once."""
    elsewhere = models_env / "elsewhere" / "stories260K"
    shutil.copytree(MINI, elsewhere)
    app = folder_app(models_env, model=str(elsewhere))
    async with loaded(app) as pilot:
        picker = await open_picker(pilot)
        table = picker.query_one("#models", DataTable)
        rows = [table.get_row_at(i) for i in range(table.row_count)]
        mine = [r for r in rows if str(r[1]) == "stories260K"]
        assert len(mine) == 1 and str(mine[0][0]) == "●" and str(mine[0][-1]) == "by path"
        assert str(table.get_row_at(table.cursor_row)[1]) == "stories260K"
        assert sum(str(r[0]) == "●" for r in rows) == 1
        await pilot.press("enter")  # the model in use: nothing to reload
        await wait_for(pilot, lambda: not isinstance(app.screen, ModelPickerScreen))
        assert engine(app).loads == [str(elsewhere.resolve())]


@async_test
async def test_picker_arrows_move_the_list_and_unloadable_is_refused(models_env: Path) -> None:
    app = folder_app(models_env)
    seen = record_notifications(app)
    async with loaded(app) as pilot:
        picker = await open_picker(pilot)
        table = picker.query_one("#models", DataTable)
        names = [e.name for e in picker.entries]
        bad = names.index("no-tokenizer")
        assert table.get_row_at(bad)[0] == "✗"
        while table.cursor_row != bad:
            await pilot.press("up" if table.cursor_row > bad else "down")
        status = str(picker.query_one("#picker-status", Static).render())
        assert "no-tokenizer: no tokenizer.json or tokenizer.model" in status
        await pilot.press("enter")
        assert isinstance(app.screen, ModelPickerScreen)  # refused, still open
        assert len(engine(app).loads) == 1
        assert any("no tokenizer" in m for m in messages(seen))


@pytest.mark.slow
@async_test
async def test_picker_relative_path_is_saved_absolute(models_env: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(models_env)
    app = folder_app(models_env)
    async with loaded(app) as pilot:
        picker = await open_picker(pilot)
        picker.query_one("#path", Input).value = "models/mini-2"
        await pilot.press("enter")
        want = str((models_env / "models" / "mini-2").resolve())
        await wait_for(pilot, lambda: load_settings().last_model == want)
    assert Path(load_settings().last_model or "").is_absolute()


@pytest.mark.slow
@async_test
async def test_picker_pulls_a_repo_id_then_offers_it(models_env: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    repo = "kvchat-test/mini"
    with FakeHub({repo: FakeRepo.from_folder(MINI)}, throttle_bps=2_000_000) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        app = folder_app(models_env)
        async with loaded(app) as pilot:
            picker = await open_picker(pilot)
            shown: list[str] = []
            show = picker._show_progress
            picker._show_progress = lambda text: (shown.append(text), show(text))  # type: ignore
            picker.query_one("#path", Input).value = repo
            await pilot.press("enter")
            box = picker.query_one("#pull-progress", Static)
            await wait_for(pilot, lambda: picker.pulled is not None, timeout=60)
            assert str(box.render()) == f"✓ {repo} downloaded and checked · Enter loads it"
            # per file and in total, with speed and ETA, ending at 100 %
            assert "model.safetensors" in "".join(shown)
            last_total = shown[-1].splitlines()[1]
            assert "total 7/7 files" in last_total and "100%" in last_total
            assert "/s · ETA" in last_total
            await wait_for(pilot, lambda: repo in [e.name for e in picker.entries])
            table = picker.query_one("#models", DataTable)
            assert picker.entries[table.cursor_row].name == repo  # offered: cursor on it
            await pilot.press("enter")
            await wait_for(pilot, lambda: app.chat.model_path == str(picker.pulled))
            assert model_name(app.chat.model_path) == repo  # org/name, not the snapshot hash
    assert picker.pulled is not None and (picker.pulled / "model.safetensors").is_file()


@pytest.mark.slow
@async_test
async def test_picker_pull_error_is_one_line(models_env: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    with FakeHub({}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        app = folder_app(models_env)
        async with loaded(app) as pilot:
            picker = await open_picker(pilot)
            picker.query_one("#path", Input).value = "nobody/nothing"
            await pilot.press("enter")
            box = picker.query_one("#pull-progress", Static)
            await wait_for(pilot, lambda: "✗" in str(box.render()), timeout=30)
            assert str(box.render()) == f"✗ no model nobody/nothing on {hub.url} (or it is" \
                " private: log in first)"
            assert isinstance(app.screen, ModelPickerScreen)


# ---- 3. numbers: the panel's GQA factor and the cache figures after History ----------


@pytest.mark.slow
@async_test
async def test_panel_takes_the_new_models_gqa_factor(models_env: Path) -> None:
    app = folder_app(models_env)
    async with loaded(app) as pilot:
        app.chat.panel.set_model({**app.chat.model_info, "n_heads": 8, "n_kv_heads": 2})
        await pilot.pause()
        assert app.chat.panel.stats.gqa_saving == 4.0
        assert "4× smaller" in str(app.chat.panel.query_one("#cache", Static).render())


@pytest.mark.slow
@async_test
async def test_opening_a_chat_clears_the_previous_chats_cache_figures(models_env: Path) -> None:
    app = folder_app(models_env)
    async with loaded(app) as pilot:
        first = await new_chat(pilot, "first chat")
        await new_chat(pilot, "second chat, longer so the cache holds more tokens")
        assert app.chat.panel.stats.cache_tokens
        await app.chat.open_conversation(first)
        await pilot.pause()
        stats = app.chat.panel.stats
        assert stats.cache_tokens is None and stats.cache_bytes is None


# ---- 6. prefill progress and the overflow notice ---------------------------------------


@async_test
async def test_prefill_progress_and_overflow_notice(models_env: Path) -> None:
    app = folder_app(models_env)
    seen = record_notifications(app)
    async with loaded(app) as pilot:
        engine(app).pause_after = 0
        app.chat.input.load_text("x " * 100)
        await pilot.press("enter")
        await wait_for(pilot, lambda: bool(replies(app)) and replies(app)[-1].streaming)
        reply = replies(app)[-1]
        # a fast prompt shows nothing, a slow one tokens done / total and the rate
        app.chat.bridge(PrefillProgress(512, 1471, 0.2))
        await pilot.pause(0.2)
        assert "512" not in str(app.chat.panel.query_one("#speed", Static).render())
        app.chat.bridge(PrefillProgress(1024, 1471, 3.3))
        await wait_for(pilot, lambda: "1,024/1,471" in str(
            app.chat.panel.query_one("#speed", Static).render()))
        assert reply is not None
        assert reply.border_subtitle == "reading the prompt: 1,024/1,471 tokens · 310 tok/s"
        app.chat.bridge(Overflow(447, 1024, "prompt"))
        await wait_for(pilot, lambda: any("447" in m for m in messages(seen)))
        note = next(m for m in messages(seen) if "447" in m)
        assert "1,024-token window" in note and "max KV size" in note
        assert "Settings" in note and "\n" not in note
        engine(app).resume()
        await wait_for(pilot, lambda: not app.chat.generating)


# ---- 7. keys and labels ------------------------------------------------------------------


@pytest.mark.slow
@async_test
async def test_ctrl_c_stops_generation_and_is_harmless_otherwise(models_env: Path) -> None:
    # i11's Ctrl+C: once stops the running reply, a second within 3 s quits; with no
    # reply running it only warns. Never Textual's own "press ctrl+q" notice.
    app = folder_app(models_env)
    seen = record_notifications(app)
    async with loaded(app) as pilot:
        engine(app).pause_after = 3
        app.chat.input.load_text("tell me a story")
        await pilot.press("enter")
        await wait_for(pilot, lambda: engine(app).paused.is_set())
        await pilot.press("ctrl+c")
        await wait_for(pilot, lambda: not app.chat.generating)
        assert app.is_running
        assert last_done(app).finish_reason == "cancelled"
        assert app.chat.conversation.messages[-1]["stopped"] is True
        assert not any("to quit the app" in m for m in messages(seen))
        await pilot.press("ctrl+c")  # the second within 3 s
        await wait_for(pilot, lambda: not app.is_running)
    idle = folder_app(models_env)
    seen = record_notifications(idle)
    async with loaded(idle) as pilot:
        await pilot.press("ctrl+c")  # idle: nothing stops, nothing quits, one warning
        await pilot.pause()
        assert idle.is_running and not idle.chat.generating
        assert not engine(idle).submitted
        assert "Press Ctrl+C again to quit (or Ctrl+Q)." in messages(seen)
        assert not any("to quit the app" in m for m in messages(seen))


def test_history_preview_and_time() -> None:
    from datetime import datetime

    from kvchat.app.tui.screens.history import _when, preview

    chat = [{"role": "user", "content": "Once upon a time"},
            {"role": "assistant", "content": " there was a little  girl\nnamed Lily. She liked"}]
    assert preview(chat, 80) == "there was a little girl named Lily. She liked"
    assert preview(chat, 24) == "there was a little girl…"
    assert preview(chat[:1], 80) == "Once upon a time"  # no reply yet: the message
    assert preview([], 80) == ""
    now = datetime(2026, 3, 4, 15, 0, 0).timestamp()
    assert _when(datetime(2026, 3, 4, 9, 8, 7).timestamp(), now) == "today 09:08:07"
    assert _when(datetime(2026, 3, 3, 9, 8, 7).timestamp(), now) == "2026-03-03 09:08"


@async_test
async def test_history_tells_chats_with_one_title_apart(models_env: Path) -> None:
    """Three chats begun with the same words: each row shows the opening of its reply
    under the title, and today's times to the second."""
    import re

    app = folder_app(models_env)
    async with loaded(app, (80, 24)) as pilot:
        scripted = engine(app)
        for pet, name in (("cat", "Tom"), ("dog", "Sam"), ("bird", "Kiv")):
            # the scripted model's next reply
            scripted.model.reply_ids = scripted.tokenizer.encode(f"there was a {pet} named {name}.")
            await new_chat(pilot, "Once upon a time")
        await pilot.press("f2")
        table = app.screen.query_one("#chats", DataTable)
        cells = [str(table.get_row_at(i)[1]) for i in range(table.row_count)]
        assert cells == [f"Once upon a time\nthere was a {pet} named {name}." for pet, name in
                         (("bird", "Kiv"), ("dog", "Sam"), ("cat", "Tom"))]
        for i in range(table.row_count):
            assert re.fullmatch(r"today \d\d:\d\d:\d\d", str(table.get_row_at(i)[2]))
        on_screen = "\n".join(ln.text for ln in app.screen._compositor.render_strips())
        assert "there was a dog named Sam." in on_screen


@pytest.mark.slow
@async_test
async def test_history_keys_cursor_confirm_and_undo(models_env: Path) -> None:
    app = folder_app(models_env)
    async with loaded(app) as pilot:
        oldest = await new_chat(pilot, "oldest chat")
        middle = await new_chat(pilot, "middle chat")
        await new_chat(pilot, "newest chat")
        await app.chat.open_conversation(middle)
        for key in ("f2", "ctrl+t"):  # both open the history (Ctrl+H is Backspace)
            await pilot.press(key)
            assert isinstance(app.screen, HistoryScreen)
            await pilot.press("escape")
        await pilot.press("ctrl+t")
        screen = app.screen
        assert isinstance(screen, HistoryScreen)
        table = screen.query_one("#chats", DataTable)
        keys = [r.key.value for r in table.ordered_rows]
        assert keys[table.cursor_row] == middle  # the open chat, not the first row
        table.move_cursor(row=keys.index(oldest))
        await pilot.press("delete")  # asks first
        status = str(screen.query_one("#history-status", Static).render())
        assert status.startswith("Delete “oldest chat”? Press Delete again")
        assert app.chat.store.path_for(oldest).exists()
        await pilot.press("delete")
        assert not app.chat.store.path_for(oldest).exists()
        assert table.row_count == 2
        await pilot.press("ctrl+z")
        assert app.chat.store.path_for(oldest).exists() and table.row_count == 3
        assert app.chat.store.load(oldest).messages[0]["content"] == "oldest chat"
        # moving away after the first Delete cancels it
        table.move_cursor(row=[r.key.value for r in table.ordered_rows].index(oldest))
        await pilot.press("delete")
        await pilot.press("up")
        await pilot.press("delete")
        assert table.row_count == 3


@pytest.mark.slow
@async_test
async def test_title_follows_an_edited_first_message(models_env: Path) -> None:
    app = folder_app(models_env)
    async with loaded(app) as pilot:
        await turn(pilot, "tell me about cats")
        await turn(pilot, "and dogs")
        assert app.chat.conversation.title == "tell me about cats"
        assert app.chat.begin_edit(0)
        app.chat.input.load_text("tell me about owls")
        await pilot.press("enter")
        await wait_for(pilot, lambda: not app.chat.generating)
        assert app.chat.conversation.title == "tell me about owls"
        assert app.chat.store.load(app.chat.conversation.id).title == "tell me about owls"
        # editing a later message keeps the title
        assert app.chat.begin_edit(0) is True
        await pilot.press("escape")
        await turn(pilot, "and birds")
        assert app.chat.begin_edit(2)
        app.chat.input.load_text("and fish")
        await pilot.press("enter")
        await wait_for(pilot, lambda: not app.chat.generating)
        assert app.chat.conversation.title == "tell me about owls"


@pytest.mark.slow
@async_test
async def test_settings_errors_use_labels_and_folders_theme_restore_are_saved(
    models_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = folder_app(models_env)
    async with loaded(app) as pilot:
        await pilot.press("ctrl+s")
        screen = app.screen
        assert isinstance(screen, SettingsScreen)
        screen.query_one("#top_p", Input).value = "lots"  # a parse error carries its field
        await pilot.press("ctrl+s")
        assert app.focused is screen.query_one("#top_p", Input)
        screen.query_one("#top_p", Input).value = "0.95"
        screen.query_one("#max_kv_size", Input).value = "4"
        screen.query_one("#keep", Input).value = "4"
        await pilot.press("ctrl+s")
        error = str(screen.query_one("#settings-error", Static).render())
        assert error.startswith("max KV size (4) must be at least keep + 1")
        assert "max_kv_size" not in error
        assert app.focused is screen.query_one("#max_kv_size", Input)  # the error's field
        screen.query_one("#max_kv_size", Input).value = ""
        # model folders: add (saved absolute), remove
        extra = models_env / "more-models"
        extra.mkdir()
        monkeypatch.chdir(models_env)
        screen.query_one("#new_dir", Input).value = "more-models"
        add = screen.query_one("#add_dir", Button)
        add.scroll_visible(animate=False)  # the form is taller than the window
        await pilot.pause()
        await pilot.click("#add_dir")
        dirs = screen.query_one("#model_dirs", OptionList)
        assert dirs.option_count == 2
        dirs.highlighted = 0
        await pilot.pause()
        screen.query_one("#remove_dir", Button).press()
        await pilot.pause()
        assert screen.model_dirs == [str(extra.resolve())]
        screen.query_one("#theme", Select).value = "nord"
        screen.query_one("#restore_session", Switch).value = False
        await pilot.press("ctrl+s")
        assert not isinstance(app.screen, SettingsScreen)
        assert app.theme == "nord"
    saved = json.loads((models_env / "config" / "settings.json").read_text())
    assert saved["model_dirs"] == [str(extra.resolve())]
    assert saved["theme"] == "nord" and saved["restore_session"] is False


# ---- 8. restored at start: theme, input history, the open chat ----------------------


@pytest.mark.slow
@async_test
async def test_theme_input_history_and_last_chat_come_back(models_env: Path) -> None:
    app = folder_app(models_env)
    async with loaded(app) as pilot:
        await turn(pilot, "first question")
        await turn(pilot, "second question")
        app.theme = "gruvbox"  # e.g. from the palette's "Change theme"
        chat = app.chat.conversation.id
    assert load_settings().theme == "gruvbox"
    again = folder_app(models_env, theme="gruvbox")
    loads: list[str] = []
    read = again.chat.store.load
    again.chat.store.load = lambda conv_id: loads.append(conv_id) or read(conv_id)  # type: ignore
    async with loaded(again) as pilot:
        await wait_for(pilot, lambda: again.chat.conversation.id == chat)
        assert again.theme == "gruvbox"
        assert [w.content for w in again.chat.transcript.messages][0] == "first question"
        await pilot.press("up")
        assert again.chat.input.text == "second question"
        # once each, although reopening the chat also offers its messages
        assert again.chat.input.sent_history == ["first question", "second question"]
        assert loads == [chat]  # the last chat is read from disk once
    # turned off: a fresh chat and an empty history
    off = folder_app(models_env, restore_session=False)
    async with loaded(off) as pilot:
        await pilot.pause(0.2)
        assert off.chat.conversation.id != chat and not off.chat.transcript.messages
        assert off.chat.input.sent_history == []


@pytest.mark.slow
@async_test
async def test_user_messages_render_as_markdown(models_env: Path) -> None:
    from textual.widgets import Markdown

    app = folder_app(models_env)
    async with loaded(app) as pilot:
        await turn(pilot, "see **this** and `code`\n\n- one\n- two")
        mine = next(w for w in app.chat.transcript.messages if w.role == "user")
        body = mine.body
        assert isinstance(body, Markdown)
        assert body.source == "see **this** and `code`\n\n- one\n- two"  # data, kept as typed
        await pilot.pause()
        rendered = " ".join(str(b.render()) for b in body.children)
        assert "**" not in rendered and "this" in rendered
