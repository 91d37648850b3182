"""One Esc (or one Ctrl+C) stops the reply, however far behind the engine the UI is.

The UI process can handle a key long after it was pressed (a busy machine, a long reply
to lay out), when the engine has already ended the turn on its own and its Done waits in
the chat screen's queue. These tests hold the chat screen's queue shut while the scripted
engine finishes, press the key, then let the screen catch up: the key must be acted on at
once (not queued behind the turn's end) and the reply must end marked stopped with its
text kept. The real terminal is in tests/test_tmux_stop.py.

The keys that start and stop a turn also act in the order they were pressed: a UI that
reads a message, its Enter and an Esc all at once sends the message, then stops its reply.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from textual import events

from kvchat.app.tui.turn import Phase
from kvchat.model.runtime.events import Done
from tests.helpers.app import SIZE, busy, engine, last_done, make_app, ready, replies, send
from tests.helpers.scripted_engine import REPLY, async_test, split_reply, wait_for


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVCHAT_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("KVCHAT_DATA_DIR", str(tmp_path / "data"))
    return tmp_path


async def _until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll with plain sleeps: Pilot's waits would wait for the held screen."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {predicate}")
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("key", [("escape", "\x1b"), ("ctrl+c", "\x03")], ids=["esc", "ctrl+c"])
@async_test
async def test_a_stop_pressed_before_the_ui_saw_the_end_marks_the_reply(
    env: Path, key: tuple[str, str]
) -> None:
    app = make_app(pause_after=3)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "go")
        await wait_for(pilot, lambda: engine(app).paused.is_set())
        await wait_for(pilot, lambda: app.chat.phase is Phase.DECODING)
        # the chat screen falls behind: its queue waits on `gate`
        gate = asyncio.Event()
        app.chat.call_later(gate.wait)
        await asyncio.sleep(0.05)
        # meanwhile the engine ends the turn on its own (EOS); its events queue up
        engine(app).resume()
        await _until(lambda: any(isinstance(e, Done) for e in engine(app).events))
        app.post_message(events.Key(*key))
        reply = replies(app)[-1]
        try:
            await _until(lambda: reply.stopping)  # acted on with the screen still behind
        finally:
            gate.set()
        await wait_for(pilot, lambda: not busy(app))
        assert last_done(app).finish_reason == "eos"
        assert reply.stopped and not reply.streaming and reply.border_subtitle == "■ stopped"
        assert reply.content == REPLY  # the text the engine had produced is kept
        assert app.chat.phase is Phase.STOPPED
        saved = {"role": "assistant", "content": REPLY, "stopped": True}
        assert app.chat.conversation.messages[-1] == saved
        chat_file = env / "data" / "chats" / f"{app.chat.conversation.id}.json"
        assert json.loads(chat_file.read_text())["messages"][-1] == saved
        assert app.is_running  # one Ctrl+C stops; it does not quit


@async_test
async def test_a_stop_in_time_keeps_the_next_token_and_the_label_says_stopping(
    env: Path,
) -> None:
    # prefill progress that arrives after the stop does not put "generating…" back
    app = make_app(pause_after=4)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "go")
        await wait_for(pilot, lambda: engine(app).paused.is_set())
        reply = replies(app)[-1]
        gate = asyncio.Event()
        app.chat.call_later(gate.wait)
        await asyncio.sleep(0.05)
        app.post_message(events.Key("escape", "\x1b"))
        try:
            await _until(lambda: reply.border_subtitle == "stopping…")
            reply.note_progress("generating…")
            assert reply.border_subtitle == "stopping…"
        finally:
            gate.set()
        await wait_for(pilot, lambda: not busy(app))
        assert last_done(app).finish_reason == "cancelled"
        # four pieces were out; the engine emits the one it holds, then stops
        assert reply.content == "".join(split_reply(REPLY)[:5])
        assert reply.stopped and reply.border_subtitle == "■ stopped"


@async_test
async def test_keys_read_together_act_in_the_order_typed(env: Path) -> None:
    app = make_app(pause_after=2)  # the reply waits after two pieces: only a stop ends it
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        # all four are queued before the app reads the first (it was busy meanwhile)
        for key, char in [("h", "h"), ("i", "i"), ("enter", "\r"), ("escape", "\x1b")]:
            app.post_message(events.Key(key, char))
        await wait_for(pilot, lambda: bool(engine(app).submitted) and not busy(app),
                       timeout=10)
        assert engine(app).submitted == [([{"role": "user", "content": "hi"}],
                                          engine(app).submitted[0][1])]
        assert last_done(app).finish_reason == "cancelled"
        assert app.chat.conversation.messages[-1]["stopped"] is True
        assert replies(app)[-1].stopped
