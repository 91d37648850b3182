"""The chat app driven by Pilot over the scripted engine (tests/scripted_engine.py).

Fast and deterministic: the scripted engine runs on its own thread like the real one,
so the thread hop is exercised, but its reply and statistics are fixed. The same flows
against the real engine and stories260K are in test_tui_real.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from textual import events
from textual.widgets import DataTable, Input, Markdown, Static
from textual.widgets._markdown import MarkdownFence

from app.models_cmd import ModelRow
from app.screens import HelpScreen, HistoryScreen, LayerCacheScreen, ModelPickerScreen
from app.screens.settings_form import SettingsScreen
from app.settings import Settings, load_settings
from app.tui import KVChatApp, TextReady, _Bridge, run_tui, validate_model_path
from app.widgets import ChatMessage, ContextGauge
from app.widgets.format import context_level, fmt_saving, human_bytes
from model.discovery import ModelEntry
from model.errors import ModelLoadError
from model.events import Done, Started, TextDelta
from tests.scripted_engine import REPLY, ScriptedEngine, async_test, kv_bytes, split_reply, wait_for

MODEL = "/models/stories260K"
SIZE = (120, 40)


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Config and data folders in tmp_path: tests never touch the user's files."""
    monkeypatch.setenv("KVCHAT_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("KVCHAT_DATA_DIR", str(tmp_path / "data"))
    return tmp_path


def make_app(settings: Settings | None = None, **engine_kw: Any) -> KVChatApp:
    def factory(on_event: Any, path: str | None) -> ScriptedEngine:
        return ScriptedEngine(on_event, path, **engine_kw)

    return KVChatApp(MODEL, settings or Settings(), engine_factory=factory)


def engine(app: KVChatApp) -> ScriptedEngine:
    assert isinstance(app.engine, ScriptedEngine)
    return app.engine


async def ready(pilot: Any) -> None:
    await wait_for(pilot, lambda: bool(pilot.app.model_info))


async def send(pilot: Any, text: str) -> None:
    app = pilot.app
    app.input.load_text(text)
    await pilot.press("enter")


async def turn(pilot: Any, text: str) -> None:
    await send(pilot, text)
    await wait_for(pilot, lambda: not pilot.app.generating)


def replies(app: KVChatApp) -> list[ChatMessage]:
    return [w for w in app.transcript.messages if w.role == "assistant"]


def static_text(app: KVChatApp, selector: str) -> str:
    return str(app.query_one(selector, Static).render())


# ---- chat ----------------------------------------------------------------------------


@async_test
async def test_reply_streams_then_renders_markdown(env: Path) -> None:
    pieces = split_reply(REPLY)
    app = make_app(pause_after=10)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "tell me a story")
        await wait_for(pilot, lambda: engine(app).paused.is_set())
        await wait_for(pilot, lambda: replies(app) and replies(app)[0].content)
        reply = replies(app)[0]
        await wait_for(pilot, lambda: reply.content == "".join(pieces[:10]))
        assert reply.streaming and reply.has_class("-streaming")
        assert app.generating
        engine(app).resume()
        await wait_for(pilot, lambda: not app.generating)
        assert reply.content == REPLY and not reply.streaming and not reply.stopped
        # the final full re-parse turned the fence into a code block
        assert reply.query(MarkdownFence)
        assert reply.query_one(Markdown).source == REPLY
        assert app.conversation.messages == [
            {"role": "user", "content": "tell me a story"},
            {"role": "assistant", "content": REPLY},
        ]
        # autosaved after the turn
        saved = json.loads((env / "data" / "chats" / f"{app.conversation.id}.json").read_text())
        assert saved["messages"][1]["content"] == REPLY


@async_test
async def test_enter_sends_ctrl_j_inserts_newline(env: Path) -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("a", "ctrl+j", "b", "shift+enter", "c")
        assert app.input.text == "a\nb\nc"
        await pilot.press("enter")
        await wait_for(pilot, lambda: not app.generating and len(app.conversation.messages) == 2)
        assert app.conversation.messages[0]["content"] == "a\nb\nc"
        assert app.input.text == ""
        # Enter on an empty box sends nothing
        await pilot.press("enter")
        assert len(engine(app).submitted) == 1


@async_test
async def test_input_history_up_down(env: Path) -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await turn(pilot, "one")
        await turn(pilot, "two\nlines")
        await pilot.press("d", "r", "a", "f", "t")
        await pilot.press("up")
        assert app.input.text == "two\nlines"
        await pilot.press("up")  # cursor on the last line: moves up within the text
        assert app.input.text == "two\nlines"
        await pilot.press("up")  # now on the first line: older entry
        assert app.input.text == "one"
        await pilot.press("up")  # oldest: stays
        assert app.input.text == "one"
        await pilot.press("down")
        assert app.input.text == "two\nlines"
        await pilot.press("down")
        assert app.input.text == "draft"


@async_test
async def test_escape_stops_and_keeps_partial_reply(env: Path) -> None:
    app = make_app(pause_after=6)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "go")
        await wait_for(pilot, lambda: engine(app).paused.is_set())
        await pilot.press("escape")
        await wait_for(pilot, lambda: not app.generating)
        partial = "".join(split_reply(REPLY)[:6])
        reply = replies(app)[-1]
        assert reply.stopped and reply.content == partial
        assert reply.border_subtitle == "■ stopped"
        assert app.conversation.messages[-1] == {
            "role": "assistant",
            "content": partial,
            "stopped": True,
        }
        saved = json.loads((env / "data" / "chats" / f"{app.conversation.id}.json").read_text())
        assert saved["messages"][-1]["stopped"] is True


@async_test
async def test_regenerate_replaces_last_reply(env: Path) -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await turn(pilot, "hello there")
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: not app.generating and len(engine(app).submitted) == 2)
        prompt, _ = engine(app).submitted[-1]
        assert prompt == [{"role": "user", "content": "hello there"}]
        assert len(app.conversation.messages) == 2 and len(app.transcript.messages) == 2
        # the cache kept the prompt: only the reply was dropped
        assert app.panel.stats["cached_tokens"] == len(prompt[0]["content"].split()) + 1


@async_test
async def test_edit_and_resend_truncates_there(env: Path) -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await turn(pilot, "first question")
        await turn(pilot, "second question")
        first = app.transcript.messages[0]
        await pilot.click(first)
        assert app.edit_index == 0 and app.input.text == "first question"
        assert first.has_class("-editing")
        app.input.load_text("first question, edited")
        await pilot.press("enter")
        await wait_for(pilot, lambda: not app.generating and len(engine(app).submitted) == 3)
        assert engine(app).submitted[-1][0] == [
            {"role": "user", "content": "first question, edited"}
        ]
        assert [m["role"] for m in app.conversation.messages] == ["user", "assistant"]
        assert [w.index for w in app.transcript.messages] == [0, 1]
        assert app.edit_index is None


@async_test
async def test_escape_cancels_an_edit(env: Path) -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await turn(pilot, "hi")
        await app.action_edit_last()
        assert app.edit_index == 0
        await pilot.press("escape")
        assert app.edit_index is None and app.input.text == ""


@async_test
async def test_autoscroll_only_while_at_bottom(env: Path) -> None:
    app = make_app(reply=REPLY * 4, pause_after=150)
    async with app.run_test(size=(100, 24)) as pilot:
        await ready(pilot)
        await send(pilot, "long one")
        await wait_for(pilot, lambda: engine(app).paused.is_set())
        await pilot.pause(0.1)
        t = app.transcript
        assert t.following and t.max_scroll_y > 0 and t.scroll_y == t.max_scroll_y
        for _ in range(40):  # the user scrolls up with the mouse wheel
            t.post_message(events.MouseScrollUp(t, 2, 2, 0, -1, 0, False, False, False))
        await pilot.pause()
        assert not t.following
        engine(app).resume()
        await wait_for(pilot, lambda: not app.generating)
        await pilot.pause()
        assert t.scroll_y == 0  # the user scrolled up: the view stayed put
        assert t.max_scroll_y > 0


@async_test
async def test_new_chat_copy_and_export(env: Path) -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await turn(pilot, "a story please")
        await pilot.press("ctrl+y")
        assert app.clipboard == REPLY
        await pilot.press("ctrl+e")
        path = app.last_export
        assert path is not None and path.parent == env / "data" / "exports"
        text = path.read_text()
        assert "a story please" in text and "def remember(token):" in text
        old_id = app.conversation.id
        await pilot.press("ctrl+n")
        assert app.transcript.messages == [] and app.conversation.messages == []
        assert app.conversation.id != old_id and engine(app).resets == 1


# ---- stats panel ----------------------------------------------------------------------


@async_test
async def test_panel_numbers_follow_the_formulas(env: Path) -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await turn(pilot, "numbers")
        panel = app.panel
        s = panel.stats
        expected = kv_bytes(s["cache_tokens"])  # 2 × 5 × 4 × tokens × 8 × 4
        assert s["cache_bytes"] == expected == 2 * 5 * 4 * s["cache_tokens"] * 8 * 4
        cache_text = static_text(app, "#cache")
        assert human_bytes(expected) in cache_text
        assert human_bytes(kv_bytes(s["cache_tokens"], 8)) in cache_text  # MHA-equivalent
        assert f"{fmt_saving(2.0)} smaller" in cache_text
        assert panel.decode_now is not None and panel.decode_now > 0
        assert len(panel.query_one("#spark").data) > 3
        speed = static_text(app, "#speed")
        assert f"{s['decode_tps']:,.1f} tok/s" in speed and "42 ms" in speed
        model = static_text(app, "#model")
        assert "stories260K" in model and "260.0K" in model and "llama" in model
        runtime = static_text(app, "#runtime")
        assert "mx.fast" in runtime and human_bytes(3_407_872) in runtime


@async_test
async def test_panel_is_throttled_not_per_token(env: Path) -> None:
    # a Stats event after every token, ~300 tokens: the panel must still render ~10/s
    app = make_app(reply=REPLY * 5, token_delay=0.002, stats_every=1)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        before = app.panel.renders
        import time

        t0 = time.monotonic()
        await turn(pilot, "go")
        elapsed = time.monotonic() - t0
        tokens = len(split_reply(REPLY * 5))
        renders = app.panel.renders - before
        assert renders <= elapsed * 10 + 5, (renders, elapsed)
        assert renders < tokens / 3


@async_test
async def test_context_gauge_colours(env: Path) -> None:
    assert context_level(383, 512) == "ok"
    assert context_level(384, 512) == "warn"  # 75 %
    assert context_level(460, 512) == "warn"
    assert context_level(461, 512) == "danger"  # 90 %
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        gauge = app.query_one(ContextGauge)
        for tokens, level in ((100, "ok"), (400, "warn"), (470, "danger")):
            app.panel.update_stats({"cache_tokens": tokens, "cache_capacity": 512})
            await pilot.pause(0.15)
            assert gauge.has_class(f"-{level}") and gauge.level == level


# ---- screens ---------------------------------------------------------------------------


@async_test
async def test_help_lists_every_binding(env: Path) -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("f1")
        assert isinstance(app.screen, HelpScreen)
        table = app.screen.query_one(DataTable)
        cells = [table.get_row_at(i) for i in range(table.row_count)]
        keys = " ".join(str(c[0]) for c in cells)
        for b in app.BINDINGS:
            assert app.get_key_display(b) in keys
        assert any("Shift+Enter" in str(c[0]) or "shift+enter" in str(c[0]) for c in cells)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)


@async_test
async def test_every_action_is_in_the_command_palette(env: Path) -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        titles = {c.title for c in app.get_system_commands(app.screen)}
        # quit: Textual's own "Quit"; interrupt: Ctrl+C's alias of "Stop generation"
        bound = {b.action for b in app.BINDINGS} - {"quit", "interrupt"}
        palette = {action for _t, action, _cb in app._palette_actions()}
        assert bound <= palette | {"help"}
        assert "Quit" in titles  # Textual's own system command
        assert "New chat" in titles and "Swap model" in titles
        await turn(pilot, "hi")
        # run one through the real palette UI
        await pilot.press("ctrl+p")
        await pilot.press(*"New chat")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await wait_for(pilot, lambda: engine(app).resets == 1)
        assert app.conversation.messages == []


@async_test
async def test_settings_validate_save_and_apply(env: Path) -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("ctrl+s")
        screen = app.screen
        assert isinstance(screen, SettingsScreen)
        screen.query_one("#temp", Input).value = "abc"
        screen.query_one("#max_tokens", Input).value = "5"
        await pilot.press("ctrl+s")
        assert app.screen is screen  # not closed
        error = str(screen.query_one("#settings-error", Static).render())
        assert error == "temperature must be a number (got 'abc')"  # the form's label
        assert screen.query_one("#temp", Input).value == "abc"  # nothing lost
        screen.query_one("#temp", Input).value = "2.5"
        screen.query_one("#top_p", Input).value = "1.5"
        await pilot.press("ctrl+s")
        error = str(screen.query_one("#settings-error", Static).render())
        assert error.startswith("top-p ") and "top_p" not in error
        assert screen.focused is screen.query_one("#top_p", Input)
        screen.query_one("#top_p", Input).value = "0.9"
        screen.query_one("#seed", Input).value = "7"
        screen.query_one("#system_prompt").load_text("Be brief.")
        await pilot.press("ctrl+s")
        assert not isinstance(app.screen, SettingsScreen)
        assert load_settings() == app.settings
        assert (app.settings.temp, app.settings.max_tokens, app.settings.seed) == (2.5, 5, 7)
        await turn(pilot, "now")
        prompt, params = engine(app).submitted[-1]
        assert params.max_tokens == 5 and params.temp == 2.5 and params.seed == 7
        assert prompt[0] == {"role": "system", "content": "Be brief."}
        assert app.last_done is not None and app.last_done.finish_reason == "length"


@async_test
async def test_history_reopens_a_chat(env: Path) -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await turn(pilot, "remember me")
        first_id = app.conversation.id
        await pilot.press("ctrl+n")
        await turn(pilot, "another chat")
        await pilot.press("f2")
        assert isinstance(app.screen, HistoryScreen)
        table = app.screen.query_one(DataTable)
        assert table.row_count == 2
        table.move_cursor(row=1)  # newest first: the first chat is the second row
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.conversation.id == first_id)
        assert [w.content for w in app.transcript.messages] == ["remember me", REPLY]
        await turn(pilot, "and more")
        assert len(app.conversation.messages) == 4


@async_test
async def test_swap_model_via_picker_and_failed_swap(
    env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entries = [
        ModelEntry("other-model", Path("/models/other-model"), "llama", 1_040_128, None,
                   "configured"),
    ]
    monkeypatch.setattr("app.screens.picker.model_rows",
                        lambda *a, **k: [ModelRow(e, None, None) for e in entries])
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await turn(pilot, "before the swap")
        await pilot.press("ctrl+o")
        assert isinstance(app.screen, ModelPickerScreen)
        await wait_for(pilot, lambda: app.screen.scanned)
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.model_path == "/models/other-model")
        assert app.last_freed_bytes == 1_040_128
        assert any("freed" in n.message for n in app._notifications)
        assert app.panel.freed_bytes == 1_040_128
        # the chat continues on the new model
        await turn(pilot, "after the swap")
        assert len(app.conversation.messages) == 4
        assert app.conversation.model == "/models/other-model"
        # a failing swap keeps the current model and says so once
        app.load_model("/models/broken")
        await wait_for(pilot, lambda: app.loading_path is None)
        assert app.model_path == "/models/other-model"
        errors = [n for n in app._notifications if n.severity == "error"]
        assert len(errors) == 1 and "no config.json" in errors[0].message


@async_test
async def test_layer_view(env: Path) -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await turn(pilot, "fill the cache")
        await pilot.press("ctrl+l")
        assert isinstance(app.screen, LayerCacheScreen)
        table = app.screen.query_one(DataTable)
        assert table.row_count == 5
        await pilot.press("escape")
        assert not isinstance(app.screen, LayerCacheScreen)


@async_test
async def test_keys_work_while_generating(env: Path) -> None:
    app = make_app(pause_after=3)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "go")
        await wait_for(pilot, lambda: engine(app).paused.is_set())
        await pilot.press("x", "y")
        assert app.input.text == "xy"
        await pilot.press("enter")  # refused while generating, text kept
        assert app.input.text == "xy" and len(engine(app).submitted) == 1
        await pilot.press("ctrl+s")
        assert isinstance(app.screen, SettingsScreen)
        await pilot.press("escape")
        await pilot.press("ctrl+r")  # refused politely
        assert len(engine(app).submitted) == 1
        engine(app).resume()
        await wait_for(pilot, lambda: not app.generating)


@async_test
async def test_no_model_is_a_clear_message(env: Path) -> None:
    app = KVChatApp(None, Settings(), engine_factory=lambda cb, p: ScriptedEngine(cb, p))
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "anyone?")
        assert app.conversation.messages == []
        assert any("Ctrl+O" in n.message for n in app._notifications)


def test_bad_model_folder_fails_before_the_ui(tmp_path: Path, env: Path) -> None:
    with pytest.raises(ModelLoadError, match="model folder not found"):
        run_tui(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        validate_model_path(tmp_path / "empty")


# ---- the engine -> UI bridge -------------------------------------------------------------


class _FakeApp:
    def __init__(self) -> None:
        self.posted: list[Any] = []

    def post_message(self, m: Any) -> bool:
        self.posted.append(m)
        return True


def test_bridge_batches_text_and_keeps_turns_apart() -> None:
    fake = _FakeApp()
    bridge = _Bridge(fake)  # type: ignore[arg-type]
    bridge(Started(3, 0))
    for t in ("a", "b", "c"):
        bridge(TextDelta(t, 1))
    bridge(Done("eos", "abc", [1, 1, 1], [0, 0, 0]))
    bridge(Started(6, 3))  # the next turn starts before the UI drained turn 1
    bridge(TextDelta("z", 1))
    assert sum(isinstance(m, TextReady) for m in fake.posted) == 1  # one wake-up, not 4
    assert bridge.take(1) == "abc"
    assert bridge.take(2) == "z"
    assert bridge.take(2) == ""
