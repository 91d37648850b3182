"""The real app (real engine, real MLX) with the pretrained stories260K, driven by Pilot.

stories260K is a base model without a chat template, so turns use the plain fallback
template (the chat is one text the model continues). Greedy decoding (temp 0) keeps the
runs reproducible. KVCHAT_CONFIG_DIR / KVCHAT_DATA_DIR point into tmp_path.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from textual.widgets import DataTable, Input, Static

from kvchat.app.core.settings import load_settings
from kvchat.app.tui.screens import HistoryScreen, ModelPickerScreen
from kvchat.app.tui.screens.settings_form import SettingsScreen
from kvchat.app.tui.widgets.format import human_bytes
from kvchat.model.runtime.events import CacheRestored, Done, Loaded, Started
from kvchat.model.text.tokenizer import load_tokenizer
from tests.helpers.app import SIZE, busy, press_now, press_until, ready, replies, turn
from tests.helpers.paths import STORIES260K as STORIES
from tests.helpers.real_app import EndlessEngine, last, real_app, settings
from tests.helpers.scripted_engine import async_test, record_notifications, wait_for

PROMPT = "Once upon a time"


def geometry() -> tuple[int, int, int]:
    cfg = json.loads((STORIES / "config.json").read_text())
    return cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["head_dim"]


@async_test
async def test_real_turn_streams_and_panel_shows_formula_bytes(hermetic_env: Path) -> None:
    # long enough to stream for a while: the engine (its own process) is not slowed by
    # this test's polling; a cache past the 512-token context keeps every token
    app, seen = real_app(settings(max_tokens=2000, max_kv_size=4096))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        app.chat.input.load_text(PROMPT)
        # Enter as the terminal sends it; pilot.press would wait for the screen to settle
        press_now(app, "enter", "\r")
        await wait_for(pilot, lambda: busy(app))
        lengths: set[int] = set()
        while busy(app):
            r = replies(app)
            if r:
                lengths.add(len(r[-1].content))
            await asyncio.sleep(0.005)
        done = last(seen, Done)
        assert done.finish_reason in ("length", "eos")
        reply = replies(app)[-1]
        assert reply.content == done.text and done.text.strip()
        assert len(lengths - {0}) >= 2, "the reply should arrive in several pieces"
        assert app.chat.conversation.messages[-1] == {"role": "assistant", "content": done.text}

        s = done.stats
        assert s.decode_tps and s.decode_tps > 0
        layers, kv_heads, head_dim = geometry()
        expected = 2 * layers * kv_heads * s.cache_tokens * head_dim * 4  # float32
        assert s.cache_bytes == expected
        assert s.cache_tokens >= s.prompt_tokens
        cache_text = str(app.chat.query_one("#cache", Static).render())
        assert human_bytes(expected) in cache_text and "2× smaller" in cache_text
        speed = str(app.chat.query_one("#speed", Static).render())
        assert f"{s.decode_tps:,.1f} tok/s" in speed
        assert f"{s.generated_tokens:,} generated" in speed


@async_test
async def test_real_stop_regenerate_and_edit_trims_cache(hermetic_env: Path) -> None:
    # the engine decodes in its own process, faster than this test can press Esc on a
    # short reply: a long one (a cache past the model's 512-token context, so nothing
    # rotates and the trims below stay exact) leaves seconds to stop it
    app, seen = real_app(settings(max_tokens=3000, max_kv_size=4096))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        # Esc keeps the partial reply, marked as stopped
        app.chat.input.load_text(PROMPT)
        press_now(app, "enter", "\r")
        await wait_for(pilot, lambda: busy(app))
        await wait_for(pilot, lambda: bool(replies(app)) and len(replies(app)[-1].content) > 30)
        press_now(app, "escape")
        await wait_for(pilot, lambda: not busy(app))
        done = last(seen, Done)
        assert done.finish_reason == "cancelled"
        assert len(done.ids) < 3000
        reply = replies(app)[-1]
        # the reply is the text that reached the UI before the key; the engine may have
        # produced a few tokens more before it saw the stop (dropped)
        partial = reply.content
        assert reply.stopped and partial.strip() and done.text.startswith(partial)
        assert app.chat.conversation.messages[-1] == {
            "role": "assistant", "content": partial, "stopped": True}

        # regenerate: same prompt, the cache keeps it; greedy -> the same text again
        app.chat.settings.max_tokens = 40
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: not busy(app), timeout=120)
        regen = last(seen, Done)
        assert regen.finish_reason in ("length", "eos")
        assert len(app.chat.conversation.messages) == 2
        assert regen.text.strip()
        assert partial.startswith(regen.text) or regen.text.startswith(partial)
        s = regen.stats
        assert s.cached_tokens == s.prompt_tokens - 1  # all but the last prompt token
        assert f"{s.cached_tokens:,} tokens this turn" in str(
            app.chat.query_one("#cache", Static).render()
        )
        before = s.cache_tokens

        # edit and resend the first message: truncated there, the cache trimmed back
        await pilot.click(app.chat.transcript.messages[0])
        assert app.chat.edit_index == 0 and app.chat.input.text == PROMPT
        app.chat.input.load_text("Once upon a time there was a dog")
        await pilot.press("enter")
        await wait_for(pilot, lambda: not busy(app), timeout=120)
        assert [m["role"] for m in app.chat.conversation.messages] == ["user", "assistant"]
        assert app.chat.conversation.messages[0]["content"] == "Once upon a time there was a dog"
        s = last(seen, Done).stats
        assert 1 <= s.cached_tokens < s.prompt_tokens  # the shared "<s>Once upon a time"
        # only this turn's tokens are resident: the old reply was trimmed away
        assert s.cache_tokens <= s.prompt_tokens + s.generated_tokens
        assert s.cache_tokens < before + s.prompt_tokens
        layers, kv_heads, head_dim = geometry()
        assert s.cache_bytes == 2 * layers * kv_heads * s.cache_tokens * head_dim * 4


@pytest.mark.slow
@async_test
async def test_real_swap_model_and_failed_swap(hermetic_env: Path) -> None:
    copy = hermetic_env / "models" / "stories-copy"
    shutil.copytree(STORIES, copy)
    broken = hermetic_env / "models" / "broken"
    broken.mkdir()
    shutil.copy(STORIES / "config.json", broken / "config.json")  # no weights
    app, seen = real_app(settings(max_tokens=24, model_dirs=[str(hermetic_env / "models")]))
    async with app.run_test(size=SIZE) as pilot:
        notes = record_notifications(app)
        await ready(pilot)
        await turn(pilot, PROMPT)
        # the picker lists the configured folder's models with sizes; pick the copy
        await pilot.press("ctrl+o")
        picker = app.screen
        assert isinstance(picker, ModelPickerScreen)
        await wait_for(pilot, lambda: picker.scanned)
        names = [e.name for e in picker.entries]
        assert "stories-copy" in names and "broken" not in names  # no weights: not listed
        table = picker.query_one("#models", DataTable)
        table.move_cursor(row=names.index("stories-copy"))
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.chat.model_path == str(copy.resolve()), timeout=120)
        assert last(seen, Loaded).freed_bytes > 0
        assert any("freed" in m for m, _ in notes)
        assert app.chat.sub_title == "stories-copy"
        # the conversation continues on the new model (its cache starts empty)
        await turn(pilot, "The cat")
        assert len(app.chat.conversation.messages) == 4
        assert last(seen, Done).finish_reason in ("length", "eos")
        assert last(seen, Started).cached_tokens == 0

        # a typed folder that cannot load: one clear message, the picker stays open (issue
        # 21: closed, the keys typed next went to the chat) and the current model stays
        await pilot.press("ctrl+o")
        picker = app.screen
        assert isinstance(picker, ModelPickerScreen)
        path_input = picker.query_one("#path", Input)
        path_input.value = str(broken)
        path_input.focus()
        await pilot.press("enter")
        await wait_for(pilot, lambda: any(s == "error" for _, s in notes))
        assert app.screen is picker
        assert app.chat.model_path == str(copy.resolve())
        errors = [m for m, severity in notes if severity == "error"]
        assert len(errors) == 1 and "safetensors" in errors[0]
        assert "\n" not in errors[0]
        await pilot.press("escape")
        await turn(pilot, "The dog")
        assert len(app.chat.conversation.messages) == 6


@pytest.mark.slow
@async_test
async def test_real_settings_apply_from_next_turn(hermetic_env: Path) -> None:
    app, seen = real_app(settings(max_tokens=48))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("ctrl+s")
        screen = app.screen
        assert isinstance(screen, SettingsScreen)
        for name, value in (("max_tokens", "40"), ("max_kv_size", "32"), ("keep", "4"),
                            ("top_k", "-1")):
            screen.query_one(f"#{name}", Input).value = value
        await pilot.press("ctrl+s")
        assert app.screen is screen and "top-k" in str(
            screen.query_one("#settings-error", Static).render()
        )
        screen.query_one("#top_k", Input).value = "0"
        await pilot.press("ctrl+s")
        assert not isinstance(app.screen, SettingsScreen)
        saved = json.loads((hermetic_env / "config" / "settings.json").read_text())
        assert saved["max_tokens"] == 40 and saved["max_kv_size"] == 32
        assert load_settings().max_kv_size == 32
        await turn(pilot, PROMPT)
        done = last(seen, Done)
        s = done.stats
        assert s.generated_tokens == 40 or done.finish_reason == "eos"
        # the cache bound applied: a 32-token window that has rotated
        assert s.cache_capacity == 32 and s.cache_tokens == 32
        assert s.wrapped and s.evicted_tokens > 0 and s.keep == 4
        gauge = app.chat.panel.query_one("#gauge")
        assert gauge.has_class("-danger")


@pytest.mark.slow
@async_test
async def test_real_persistence_round_trip_and_export(hermetic_env: Path) -> None:
    app, seen = real_app(settings(max_tokens=24))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await turn(pilot, PROMPT)
        conv_id = app.chat.conversation.id
        first_reply = app.chat.conversation.messages[1]["content"]
        await pilot.press("ctrl+e")
        files = list((hermetic_env / "data" / "exports").glob(f"*{conv_id}.md"))
        assert len(files) == 1
        exported = files[0]
        md = exported.read_text()
        assert PROMPT in md and first_reply.strip()[:20] in md
    assert (hermetic_env / "data" / "chats" / f"{conv_id}.json").is_file()

    # a fresh app (a restart): reopen the chat from history and continue it (the
    # automatic reopening of the last chat is off here; tests/test_tui_flows*.py cover it)
    app2, seen2 = real_app(settings(max_tokens=24, restore_session=False))
    async with app2.run_test(size=SIZE) as pilot:
        notes = record_notifications(app2)
        await ready(pilot)
        assert app2.chat.conversation.messages == []
        await pilot.press("f2")
        assert isinstance(app2.screen, HistoryScreen)
        await pilot.press("enter")
        await wait_for(pilot, lambda: app2.chat.conversation.id == conv_id)
        assert [w.content for w in app2.chat.transcript.messages] == [PROMPT, first_reply]
        await turn(pilot, "Then")
        assert len(app2.chat.conversation.messages) == 4
        # the saved K/V cache came back: the whole first turn is reused, none re-prefilled
        restored = last(seen2, CacheRestored)
        assert restored.error is None and restored.tokens > len(first_reply.split())
        started = last(seen2, Started)
        assert started.cached_tokens >= restored.tokens - 1 and started.reprefilled_tokens == 0
        assert any(m.endswith("; 0 re-prefilled.") for m, _ in notes)
    saved = json.loads((hermetic_env / "data" / "chats" / f"{conv_id}.json").read_text())
    assert len(saved["messages"]) == 4


@async_test
async def test_real_chat_held_with_another_model_reopens_warm_on_it(env: Path) -> None:
    """The cold reopen the hostile sweep found: a chat continued on a second model (its
    saved K/V cache is that model's), its window wrapped, a reply stopped. Reopened while
    the first model is loaded (here `--model`), the cache cannot serve it: that is said in
    one line naming both models. Opened from History, the chat goes back to its own model
    and continues warm: every token of the saved cache reused (but the few the engine
    decoded after the stop, which the reply never showed), none re-read."""
    copy = env / "models" / "stories-copy"
    shutil.copytree(STORIES, copy)
    window = settings(max_tokens=40, max_kv_size=64, keep=4, model_dirs=[str(env / "models")])
    app, seen = real_app(window)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await turn(pilot, PROMPT)
        app.chat.load_model(str(copy))
        await wait_for(pilot, lambda: app.chat.model_path == str(copy.resolve()), timeout=120)
        await turn(pilot, "The cat")
        app.chat.settings.max_tokens = 3000
        app.chat.input.load_text("Then")
        press_now(app, "enter", "\r")
        await wait_for(pilot, lambda: busy(app))
        await wait_for(pilot, lambda: bool(replies(app)) and len(replies(app)[-1].content) > 60)
        press_now(app, "escape")
        await wait_for(pilot, lambda: not busy(app))
        stopped = last(seen, Done)
        assert stopped.finish_reason == "cancelled" and stopped.stats.wrapped
        # the tokens the engine decoded after the key are in its cache, not in the reply
        kept = replies(app)[-1].content
        tok = load_tokenizer(copy)
        after_key = len(stopped.ids) - max(
            k for k in range(len(stopped.ids) + 1) if kept.startswith(tok.decode(stopped.ids[:k])))
        conv_id = app.chat.conversation.id
        await wait_for(pilot, lambda: app.chat.store.cache_path(conv_id).is_file())

    app2, seen2 = real_app(window)  # started on the first model, the chat reopening
    async with app2.run_test(size=SIZE) as pilot:
        notes = record_notifications(app2)
        await ready(pilot)
        await wait_for(pilot, lambda: any(isinstance(e, CacheRestored) for e in seen2))
        refused = last(seen2, CacheRestored)
        assert refused.tokens == 0 and refused.error == (
            "K/V cache not restored: it was saved with another model (stories-copy, not"
            " stories260K)")
        assert app2.chat.conversation.id == conv_id
        await pilot.press("f2")
        assert isinstance(app2.screen, HistoryScreen)
        await pilot.press("enter")
        await wait_for(pilot, lambda: app2.chat.model_path == str(copy.resolve()), timeout=120)
        await wait_for(pilot, lambda: last(seen2, CacheRestored) is not refused)
        restored = last(seen2, CacheRestored)
        assert restored.error is None and restored.tokens > 64
        await turn(pilot, "The end")
        started = last(seen2, Started)
        # every token of the saved cache reused but those decoded after the stop
        assert started.cached_tokens == restored.tokens - after_key
        assert started.reprefilled_tokens == 0
        assert any(m.startswith("Reopened") or "re-prefilled" in m for m, _ in notes)


def test_start_up_picks_the_model_of_the_chat_that_reopens(env: Path) -> None:
    """Without --model the app starts on the model the reopening chat was held with, so
    it comes back warm with no second load; else on the last model used."""
    from kvchat.app.core.store import Conversation, ConversationStore
    from kvchat.app.tui.app import default_model_path
    from kvchat.app.tui.session import SessionState, save_session, session_path

    copy = env / "models" / "stories-copy"
    shutil.copytree(STORIES, copy)
    store = ConversationStore(env / "data" / "chats")
    conv = Conversation(model=str(copy))
    conv.add_message("user", PROMPT)
    store.save(conv)
    s = settings(last_model=str(STORIES.resolve()))
    assert default_model_path(s, store) == str(STORIES.resolve())  # no session yet
    save_session(session_path(store), SessionState(last_chat=conv.id))
    assert default_model_path(s, store) == str(copy)
    assert default_model_path(dataclasses.replace(s, restore_session=False), store) == str(
        STORIES.resolve())
    shutil.rmtree(copy)  # gone since: the last model used
    assert default_model_path(s, store) == str(STORIES.resolve())


@pytest.mark.slow
@async_test
async def test_real_keys_are_handled_while_decoding(hermetic_env: Path) -> None:
    """Keys are handled while tokens stream: Ctrl+S opens the settings and Esc closes
    them, typed letters reach the input box, Esc stops the reply. How long each key takes
    is measured by `python -m tests.benchmarks.key_latency --inside`."""
    # a rotating 256-token window lets the tiny model decode for several seconds (past the
    # BOS that ends its story: this is about keys, not where the story ends)
    app, seen = real_app(settings(max_tokens=20000, max_kv_size=256), EndlessEngine)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        app.chat.input.load_text(PROMPT)
        press_now(app, "enter", "\r")
        await wait_for(pilot, lambda: bool(replies(app)) and bool(replies(app)[-1].content))
        await press_until(pilot, "ctrl+s", None, lambda: isinstance(app.screen, SettingsScreen))
        assert busy(app), "the reply ended before the settings opened"
        await press_until(pilot, "escape", None,
                          lambda: not isinstance(app.screen, SettingsScreen))
        for _ in range(5):
            want = app.chat.input.text + "x"
            await press_until(pilot, "x", "x", lambda w=want: app.chat.input.text == w)
        assert busy(app), "the reply ended before five keys were typed"
        await press_until(pilot, "escape", None, lambda: not busy(app))
        assert last(seen, Done).finish_reason == "cancelled"
