"""The chat app driven by Pilot over the scripted engine (tests/helpers/scripted_engine.py).

Fast and deterministic: the scripted engine runs on its own thread like the real one,
so the thread hop is exercised, but its reply and statistics are fixed. The same flows
against the real engine and stories260K are in test_tui_real.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from textual import events
from textual.widgets import DataTable, Input, Markdown, Sparkline, Static
from textual.widgets.markdown import MarkdownFence

from kvchat.app.core.discovery import ModelEntry, ModelRow
from kvchat.app.core.settings import Settings, load_settings
from kvchat.app.tui.actions import ACTIONS
from kvchat.app.tui.app import KVChatApp, run_tui, validate_model_path
from kvchat.app.tui.bridge import Bridge, TextReady
from kvchat.app.tui.screens import (
    ChatScreen,
    HelpScreen,
    HistoryScreen,
    LayerCacheScreen,
    ModelPickerScreen,
)
from kvchat.app.tui.screens.settings_form import SettingsScreen
from kvchat.app.tui.turn import Phase
from kvchat.app.tui.widgets import ContextGauge
from kvchat.app.tui.widgets.format import context_level, fmt_device, fmt_saving, human_bytes
from kvchat.app.tui.widgets.stats_panel import CONTENT_W, LABEL_W
from kvchat.model.errors import ModelLoadError
from kvchat.model.runtime.events import Done, Loaded, Started, Stats, TextDelta, TurnStats
from tests.helpers.app import (
    SIZE,
    busy,
    engine,
    last_done,
    loaded,
    make_app,
    ready,
    replies,
    send,
    turn,
)
from tests.helpers.scripted_engine import (
    REPLY,
    WEIGHT_BYTES,
    ScriptedEngine,
    async_test,
    kv_bytes,
    record_notifications,
    split_reply,
    wait_for,
)


def static_text(app: KVChatApp, selector: str) -> str:
    return str(app.chat.query_one(selector, Static).render())


# ---- chat ----------------------------------------------------------------------------


@async_test
async def test_reply_streams_then_renders_markdown(env: Path) -> None:
    pieces = split_reply(REPLY)
    app = make_app(pause_after=10)
    async with loaded(app) as pilot:
        await send(pilot, "tell me a story")
        await wait_for(pilot, lambda: engine(app).paused.is_set())
        await wait_for(pilot, lambda: replies(app) and replies(app)[0].content)
        reply = replies(app)[0]
        await wait_for(pilot, lambda: reply.content == "".join(pieces[:10]))
        assert reply.streaming and reply.has_class("-streaming")
        assert app.chat.phase is Phase.DECODING
        assert app.chat.input.border_subtitle == "generating… (Esc stops)"
        engine(app).resume()
        await wait_for(pilot, lambda: not busy(app))
        assert reply.content == REPLY and not reply.streaming and not reply.stopped
        # the final full re-parse turned the fence into a code block
        assert reply.query(MarkdownFence)
        assert reply.query_one(Markdown).source == REPLY
        assert app.chat.conversation.messages == [
            {"role": "user", "content": "tell me a story"},
            {"role": "assistant", "content": REPLY},
        ]
        # autosaved after the turn
        chats = env / "data" / "chats"
        saved = json.loads((chats / f"{app.chat.conversation.id}.json").read_text())
        assert saved["messages"][1]["content"] == REPLY
        # and the K/V cache beside it, so the chat reopens warm
        kv = chats / f"{app.chat.conversation.id}.kv.safetensors"
        await wait_for(pilot, kv.is_file)
        assert app.chat.phase is Phase.IDLE and app.chat.input.border_subtitle is None


@pytest.mark.slow
@async_test
async def test_enter_sends_ctrl_j_inserts_newline(env: Path) -> None:
    app = make_app()
    async with loaded(app) as pilot:
        await pilot.press("a", "ctrl+j", "b", "shift+enter", "c")
        assert app.chat.input.text == "a\nb\nc"
        await pilot.press("enter")
        await wait_for(pilot, lambda: not busy(app) and len(app.chat.conversation.messages) == 2)
        assert app.chat.conversation.messages[0]["content"] == "a\nb\nc"
        assert app.chat.input.text == ""
        # Enter on an empty box sends nothing
        await pilot.press("enter")
        assert len(engine(app).submitted) == 1


@pytest.mark.slow
@async_test
async def test_input_history_up_down(env: Path) -> None:
    app = make_app()
    async with loaded(app) as pilot:
        await turn(pilot, "one")
        await turn(pilot, "two\nlines")
        await pilot.press("d", "r", "a", "f", "t")
        await pilot.press("up")
        assert app.chat.input.text == "two\nlines"
        await pilot.press("up")  # cursor on the last line: moves up within the text
        assert app.chat.input.text == "two\nlines"
        await pilot.press("up")  # now on the first line: older entry
        assert app.chat.input.text == "one"
        await pilot.press("up")  # oldest: stays
        assert app.chat.input.text == "one"
        await pilot.press("down")
        assert app.chat.input.text == "two\nlines"
        await pilot.press("down")
        assert app.chat.input.text == "draft"


@async_test
async def test_escape_stops_and_keeps_partial_reply(env: Path) -> None:
    app = make_app(pause_after=6)
    async with loaded(app) as pilot:
        await send(pilot, "go")
        await wait_for(pilot, lambda: engine(app).paused.is_set())
        await pilot.press("escape")
        await wait_for(pilot, lambda: not busy(app))
        # six pieces were out when Esc came; the engine emits the one it holds, then stops:
        # that seventh piece came after the key and is not part of the reply
        partial = "".join(split_reply(REPLY)[:6])
        reply = replies(app)[-1]
        assert reply.stopped and reply.content == partial
        assert reply.border_subtitle == "■ stopped"
        assert app.chat.conversation.messages[-1] == {
            "role": "assistant",
            "content": partial,
            "stopped": True,
        }
        chat_file = env / "data" / "chats" / f"{app.chat.conversation.id}.json"
        assert json.loads(chat_file.read_text())["messages"][-1]["stopped"] is True


@async_test
async def test_regenerate_replaces_last_reply(env: Path) -> None:
    app = make_app()
    async with loaded(app) as pilot:
        await turn(pilot, "hello there")
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: not busy(app) and len(engine(app).submitted) == 2)
        prompt, _ = engine(app).submitted[-1]
        assert prompt == [{"role": "user", "content": "hello there"}]
        assert len(app.chat.conversation.messages) == 2 and len(app.chat.transcript.messages) == 2
        # the cache kept the prompt: only the reply was dropped
        started = [e for e in engine(app).events if isinstance(e, Started)]
        # the cache kept "<user> hello there" (all but the last prompt token)
        assert started[-1].cached_tokens == started[-1].prompt_tokens - 1 == 3
        assert "3 tokens this turn" in static_text(app, "#cache")


@async_test
async def test_edit_and_resend_truncates_there(env: Path) -> None:
    app = make_app()
    async with loaded(app) as pilot:
        await turn(pilot, "first question")
        await turn(pilot, "second question")
        first = app.chat.transcript.messages[0]
        await pilot.click(first)
        assert app.chat.edit_index == 0 and app.chat.input.text == "first question"
        assert first.has_class("-editing")
        app.chat.input.load_text("first question, edited")
        await pilot.press("enter")
        await wait_for(pilot, lambda: not busy(app) and len(engine(app).submitted) == 3)
        assert engine(app).submitted[-1][0] == [
            {"role": "user", "content": "first question, edited"}
        ]
        assert [m["role"] for m in app.chat.conversation.messages] == ["user", "assistant"]
        assert [w.index for w in app.chat.transcript.messages] == [0, 1]
        assert app.chat.edit_index is None


@pytest.mark.slow
@async_test
async def test_escape_cancels_an_edit(env: Path) -> None:
    app = make_app()
    async with loaded(app) as pilot:
        await turn(pilot, "hi")
        app.chat.action_edit_last()
        assert app.chat.edit_index == 0
        await pilot.press("escape")
        assert app.chat.edit_index is None and app.chat.input.text == ""


@pytest.mark.slow
@async_test
async def test_autoscroll_only_while_at_bottom(env: Path) -> None:
    app = make_app(reply=REPLY * 4, pause_after=150)
    async with loaded(app, (100, 24)) as pilot:
        await send(pilot, "long one")
        await wait_for(pilot, lambda: engine(app).paused.is_set())
        await pilot.pause(0.1)
        t = app.chat.transcript
        assert t.is_anchored and t.max_scroll_y > 0 and t.is_vertical_scroll_end
        for _ in range(40):  # the user scrolls up with the mouse wheel
            t.post_message(events.MouseScrollUp(t, 2, 2, 0, -1, 0, False, False, False))
        await pilot.pause()
        assert not t.is_vertical_scroll_end  # the view left the bottom: no longer following
        engine(app).resume()
        await wait_for(pilot, lambda: not busy(app))
        await pilot.pause()
        assert t.scroll_y == 0  # the user scrolled up: the view stayed put
        assert t.max_scroll_y > 0


@pytest.mark.slow
@async_test
async def test_new_chat_copy_and_export(env: Path) -> None:
    app = make_app()
    async with loaded(app) as pilot:
        await turn(pilot, "a story please")
        await pilot.press("ctrl+y")
        assert app.clipboard == REPLY
        await pilot.press("ctrl+e")
        exports = list((env / "data" / "exports").glob("*.md"))
        assert len(exports) == 1 and app.chat.conversation.id in exports[0].name
        text = exports[0].read_text()
        assert "a story please" in text and "def remember(token):" in text
        old_id = app.chat.conversation.id
        await pilot.press("ctrl+n")
        assert app.chat.transcript.messages == [] and app.chat.conversation.messages == []
        assert app.chat.conversation.id != old_id and engine(app).resets == 1


# ---- stats panel ----------------------------------------------------------------------


@async_test
async def test_panel_numbers_follow_the_formulas(env: Path) -> None:
    app = make_app()
    async with loaded(app) as pilot:
        await turn(pilot, "numbers")
        s = last_done(app).stats
        # "<user> numbers <assistant>" + every reply piece + the EOS (the pipelined decode
        # step feeds each token before it is checked for EOS)
        assert s.cache_tokens == 3 + len(split_reply(REPLY)) + 1
        expected = kv_bytes(s.cache_tokens)  # 2 × 5 × 4 × tokens × 8 × 4
        assert s.cache_bytes == expected == 2 * 5 * 4 * s.cache_tokens * 8 * 4
        cache_text = static_text(app, "#cache")
        assert human_bytes(expected) in cache_text
        assert human_bytes(kv_bytes(s.cache_tokens, 8)) in cache_text  # MHA-equivalent
        assert f"{fmt_saving(2.0)} smaller" in cache_text
        assert len(app.chat.panel.query_one("#spark", Sparkline).data) > 3
        speed = static_text(app, "#speed")
        # TTFT = one prefill chunk (20 ms) + the first decode step (10 ms), simulated
        assert f"{s.decode_tps:,.1f} tok/s" in speed and "30 ms" in speed
        model = static_text(app, "#model")
        assert "stories260K" in model and "260.0K" in model and "llama" in model
        runtime = static_text(app, "#runtime")
        assert "fast" in runtime and human_bytes(3_407_872) in runtime


@pytest.mark.slow
@async_test
async def test_panel_is_throttled_not_per_token(env: Path) -> None:
    # a Stats event after every token, ~300 tokens: the panel must still render ~10/s
    app = make_app(reply=REPLY * 5, token_delay=0.002, stats_interval_s=0.0)
    async with loaded(app) as pilot:
        speed = app.chat.query_one("#speed", Static)
        renders: list[float] = []
        update = speed.update

        def counting(*args: Any, **kw: Any) -> None:
            renders.append(time.monotonic())
            update(*args, **kw)

        speed.update = counting  # type: ignore[method-assign]
        t0 = time.monotonic()
        await turn(pilot, "go")
        elapsed = time.monotonic() - t0
        tokens = len(split_reply(REPLY * 5))
        stats_events = sum(isinstance(e, Stats) for e in engine(app).events)
        assert stats_events >= tokens  # one per token reached the app
        assert len(renders) <= elapsed * 10 + 5, (len(renders), elapsed)
        assert len(renders) < tokens / 3


@pytest.mark.slow
@async_test
async def test_panel_keep_is_the_settings_before_and_after_the_first_turn(env: Path) -> None:
    """Unbounded (the model's 512-token context): the cache still rotates with `keep`
    sinks once that fills, so the panel says the settings' keep before the first turn
    builds the cache, and the cache's own after it."""
    app = make_app(Settings(keep=2))
    async with loaded(app) as pilot:
        await pilot.pause(0.15)
        assert "window   512 · keep 2" in static_text(app, "#cache")
        await turn(pilot, "hello")
        await pilot.pause(0.15)
        assert last_done(app).stats.keep == 2  # what the engine built
        assert "window   512 · keep 2" in static_text(app, "#cache")


@pytest.mark.parametrize(("device", "shown"), [
    ("Device(cpu, 0)", "CPU"), ("Device(gpu, 0)", "GPU"), ("Device(gpu, 1)", "GPU 1"),
    (None, "–"), ("a new kind", "a new kind"),
])
def test_device_is_said_as_a_user_says_it(device: str | None, shown: str) -> None:
    assert fmt_device(device) == shown


@async_test
async def test_panel_rows_wrap_under_their_value(env: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The slow BLAS's hint is longer than the panel: its second line starts under the
    value, not in the label column, and no line is wider than the panel (so the terminal
    never wraps one); the device is "CPU", not MLX's repr."""
    monkeypatch.setattr("kvchat.app.core.blas.active_blas",
                        lambda: {"name": "reference BLAS", "path": None, "fast": False,
                                 "fix": "sudo apt-get install libopenblas0-pthread"})
    app = make_app()
    async with loaded(app) as pilot:
        await pilot.pause(0.15)
        runtime = app.chat.panel.query_one("#runtime", Static)
        assert runtime.content_size.width >= CONTENT_W
        lines = str(runtime.render()).split("\n")
        assert "device   CPU" in lines
        at = next(i for i, ln in enumerate(lines) if ln.startswith("BLAS "))
        assert lines[at].startswith("BLAS     reference (slow)")
        assert lines[at + 1].startswith(" " * LABEL_W + "apt-get install")
        assert all(len(ln) <= CONTENT_W for ln in lines)
        on_screen = [ln.text for ln in app.screen._compositor.render_strips()]
        assert sum("apt-get install" in ln for ln in on_screen) == 1


@async_test
async def test_context_gauge_colours(env: Path) -> None:
    assert context_level(383, 512) == "ok"
    assert context_level(384, 512) == "warn"  # 75 %
    assert context_level(460, 512) == "warn"
    assert context_level(461, 512) == "danger"  # 90 %
    app = make_app()
    async with loaded(app) as pilot:
        gauge = app.query_one(ContextGauge)
        for tokens, level in ((100, "ok"), (400, "warn"), (470, "danger")):
            app.chat.panel.update_stats(TurnStats(cache_tokens=tokens, cache_capacity=512))
            await pilot.pause(0.15)
            assert gauge.has_class(f"-{level}")


# ---- screens ---------------------------------------------------------------------------


@async_test
async def test_help_lists_every_binding(env: Path) -> None:
    app = make_app()
    async with loaded(app) as pilot:
        await pilot.press("f1")
        assert isinstance(app.screen, HelpScreen)
        table = app.screen.query_one(DataTable)
        cells = [table.get_row_at(i) for i in range(table.row_count)]
        # the picker lists local folders and downloads from the Hub: help says both
        model_key = next(str(c[1]) for c in cells if "Ctrl+O" in str(c[0]) or "^o" in str(c[0]))
        assert "local folder" in model_key and "Hub" in model_key
        keys = " ".join(str(c[0]) for c in cells)
        for b in [*ChatScreen.BINDINGS, *KVChatApp.BINDINGS]:
            assert app.get_key_display(b) in keys  # type: ignore[arg-type]
        assert any("Shift+Enter" in str(c[0]) or "shift+enter" in str(c[0]) for c in cells)
        # one row per action with keys, with the table's help text
        assert {str(c[1]) for c in cells} == {a.help for a in ACTIONS if a.keys or a.key_label}
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)


@pytest.mark.slow
@async_test
async def test_every_action_is_in_the_command_palette(env: Path) -> None:
    app = make_app()
    async with loaded(app) as pilot:
        titles = {c.title for c in app.get_system_commands(app.screen)}
        assert {a.palette for a in ACTIONS if a.palette} <= titles
        assert "Quit" in titles  # Textual's own system command
        bindings = [*ChatScreen.BINDINGS, *KVChatApp.BINDINGS]
        bound = {b.action for b in bindings} - {"quit"}  # type: ignore[union-attr]
        assert bound <= {a.name for a in ACTIONS if a.palette}
        # a modal screen shadows the chat's actions, in the palette as for keys
        await pilot.press("f1")
        modal_titles = {c.title for c in app.get_system_commands(app.screen)}
        assert "New chat" not in modal_titles and "Keys (help)" in modal_titles
        await pilot.press("escape")
        await turn(pilot, "hi")
        # run one through the real palette UI
        await pilot.press("ctrl+p")
        await pilot.press(*"New chat")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await wait_for(pilot, lambda: engine(app).resets == 1)
        assert app.chat.conversation.messages == []


@pytest.mark.slow
@async_test
async def test_settings_validate_save_and_apply(env: Path) -> None:
    app = make_app()
    async with loaded(app) as pilot:
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
        assert load_settings() == app.chat.settings
        new = app.chat.settings
        assert (new.temp, new.max_tokens, new.seed) == (2.5, 5, 7)
        await turn(pilot, "now")
        prompt, params = engine(app).submitted[-1]
        assert params.max_tokens == 5 and params.temp == 2.5 and params.seed == 7
        assert prompt[0] == {"role": "system", "content": "Be brief."}
        assert last_done(app).finish_reason == "length"


@pytest.mark.slow
@async_test
async def test_history_reopens_a_chat(env: Path) -> None:
    app = make_app()
    async with loaded(app) as pilot:
        await turn(pilot, "remember me")
        first_id = app.chat.conversation.id
        await pilot.press("ctrl+n")
        await turn(pilot, "another chat")
        await pilot.press("f2")
        assert isinstance(app.screen, HistoryScreen)
        table = app.screen.query_one(DataTable)
        assert table.row_count == 2
        table.move_cursor(row=1)  # newest first: the first chat is the second row
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.chat.conversation.id == first_id)
        assert [w.content for w in app.chat.transcript.messages] == ["remember me", REPLY]
        await turn(pilot, "and more")
        assert len(app.chat.conversation.messages) == 4


@pytest.mark.slow
@async_test
async def test_reopened_chat_continues_warm(env: Path) -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        notes = record_notifications(app)
        await ready(pilot)
        await turn(pilot, "remember me")
        first_id = app.chat.conversation.id
        kv = app.chat.store.cache_path(first_id)
        await wait_for(pilot, kv.is_file)
        # "<user> remember me <assistant>" + the reply's pieces (+ its EOS, which the next
        # prompt does not contain)
        held = 4 + len(split_reply(REPLY))
        await pilot.press("ctrl+n")  # the engine's cache now holds another chat
        await turn(pilot, "another chat")
        await pilot.press("f2")
        table = app.screen.query_one(DataTable)
        row = table.get_row(first_id)
        assert str(row[4]) == human_bytes(kv.stat().st_size)  # History shows the cache size
        table.move_cursor(row=table.get_row_index(first_id))
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.chat.conversation.id == first_id)
        await turn(pilot, "and more")
        started = [e for e in engine(app).events if isinstance(e, Started)][-1]
        assert started.cached_tokens == held  # nothing of the reopened chat prefilled again
        assert started.prompt_tokens == held + 4  # + "<user> and more <assistant>"
        assert (f"{held:,} tokens from the saved cache; 0 re-prefilled.", "information") in notes


@pytest.mark.slow
@async_test
async def test_kv_cache_saving_can_be_turned_off(env: Path) -> None:
    app = make_app(Settings(save_kv_cache=False))
    async with loaded(app) as pilot:
        await turn(pilot, "forget me")
        conv_id = app.chat.conversation.id
        await pilot.press("ctrl+n")
        await wait_for(pilot, lambda: engine(app).resets == 1)
        await app.chat.open_conversation(conv_id)
        await turn(pilot, "and more")
        started = [e for e in engine(app).events if isinstance(e, Started)][-1]
        assert started.cached_tokens == 0
        assert not app.chat.store.cache_path(conv_id).exists()


@async_test
async def test_swap_model_via_picker_and_failed_swap(
    env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entries = [
        ModelEntry("other-model", Path("/models/other-model"), "llama", 1_040_128, None,
                   "configured"),
    ]
    monkeypatch.setattr("kvchat.app.tui.screens.picker.model_rows",
                        lambda *a, **k: [ModelRow(e, None, None) for e in entries])
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        notes = record_notifications(app)
        await ready(pilot)
        await turn(pilot, "before the swap")
        await pilot.press("ctrl+o")
        assert isinstance(app.screen, ModelPickerScreen)
        await wait_for(pilot, lambda: app.screen.scanned)
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.chat.model_path == "/models/other-model")
        assert app.chat.sub_title == "other-model"
        # the old scripted model's weights and its K/V were released (measured by MLX)
        loaded = [e for e in engine(app).events if isinstance(e, Loaded)]
        assert loaded[-1].freed_bytes >= WEIGHT_BYTES
        freed = human_bytes(loaded[-1].freed_bytes)
        assert any(m.startswith("Loaded other-model · freed") and freed in m for m, _ in notes)
        assert f"freed {freed}" in static_text(app, "#runtime")
        # the chat continues on the new model
        await turn(pilot, "after the swap")
        assert len(app.chat.conversation.messages) == 4
        assert app.chat.conversation.model == "/models/other-model"
        # a failing swap keeps the current model and says so once
        app.chat.load_model("/models/broken")
        await wait_for(pilot, lambda: app.chat.phase is Phase.ERROR)
        assert app.chat.model_path == "/models/other-model"
        errors = [m for m, severity in notes if severity == "error"]
        assert len(errors) == 1 and "no config.json" in errors[0]
        assert "(still on other-model)" in errors[0]


@pytest.mark.slow
@async_test
async def test_layer_view(env: Path) -> None:
    app = make_app()
    async with loaded(app) as pilot:
        await turn(pilot, "fill the cache")
        await pilot.press("ctrl+l")
        assert isinstance(app.screen, LayerCacheScreen)
        table = app.screen.query_one(DataTable)
        assert table.row_count == 5
        titles = [str(c.label) for c in table.ordered_columns]
        # what a layer holds and costs first; a float cache's "as float" would repeat
        # "bytes", and a model without windows has no window to show
        assert titles[:6] == ["layer", "kind", "tokens", "capacity", "bytes", "as MHA"]
        assert "attention" not in titles and "state" not in titles  # "kind" says it
        assert "as float" not in titles and "window" not in titles
        await pilot.press("escape")
        assert not isinstance(app.screen, LayerCacheScreen)


@pytest.mark.slow
@async_test
async def test_layer_view_scrolls_a_column_per_key(env: Path) -> None:
    app = make_app()
    async with loaded(app, (80, 24)) as pilot:
        await turn(pilot, "fill the cache")
        await pilot.press("ctrl+l")
        table = app.screen.query_one(DataTable)
        await pilot.pause()
        starts, x = [], 0
        for column in table.ordered_columns:
            starts.append(x)
            x += column.get_render_width(table)
        assert table.max_scroll_x > 0  # 80 columns show only some of them
        await pilot.press("right")
        await pilot.pause()
        assert table.scroll_x == starts[1]  # the second column at the left edge
        await pilot.press("right")
        await pilot.pause()
        assert table.scroll_x == min(starts[2], table.max_scroll_x)
        await pilot.press("left")
        await pilot.pause()
        assert table.scroll_x == starts[1]
        for _ in range(len(starts)):
            await pilot.press("right")
        await pilot.pause()
        assert table.scroll_x == table.max_scroll_x  # the last column in view
        await pilot.press("left")
        await pilot.pause()
        assert table.scroll_x in starts and table.scroll_x < table.max_scroll_x


@async_test
async def test_keys_work_while_generating(env: Path) -> None:
    app = make_app(pause_after=3)
    async with loaded(app) as pilot:
        await send(pilot, "go")
        await wait_for(pilot, lambda: engine(app).paused.is_set())
        await pilot.press("x", "y")
        assert app.chat.input.text == "xy"
        await pilot.press("enter")  # refused while generating, text kept
        assert app.chat.input.text == "xy" and len(engine(app).submitted) == 1
        await pilot.press("ctrl+s")
        assert isinstance(app.screen, SettingsScreen)
        await pilot.press("escape")
        await pilot.press("ctrl+r")  # refused politely
        assert len(engine(app).submitted) == 1
        engine(app).resume()
        await wait_for(pilot, lambda: not busy(app))


@async_test
async def test_no_model_is_a_clear_message(env: Path) -> None:
    app = KVChatApp(None, Settings(), engine_factory=lambda cb, p: ScriptedEngine(cb, p))
    async with app.run_test(size=SIZE) as pilot:
        notes = record_notifications(app)
        await send(pilot, "anyone?")
        assert app.chat.conversation.messages == []
        assert any("Ctrl+O" in m for m, _ in notes)


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
    bridge = Bridge(fake)  # type: ignore[arg-type]
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
