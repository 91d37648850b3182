"""One Esc, or one Ctrl+C, stops a long reply in a real terminal (tmux): pressed once
0.4 s after the message is sent, within a few seconds the reply is marked stopped, its
text stops growing (on screen and in the panel's token count) and the saved chat keeps
the partial text the screen shows."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tests.helpers.tmux import NEEDS_TMUX, Tmux, generated_tokens, start_chat

pytestmark = NEEDS_TMUX

# greedy, no repetition penalty, a 4096-token window: stories260K's reply to "One day"
# runs 875 tokens (seconds), and the window never overflows, so no "Context full" toast
# covers the stopped mark
LONG_REPLY = {"temp": 0.0, "repetition_penalty": 1.0, "max_tokens": 4000, "max_kv_size": 4096}
MAX_TOKENS = 4000
STOP_WITHIN_S = 10.0  # "a few seconds": the Ctrl+C toast covers the mark for 3
LEFT = 50  # columns of the transcript no toast covers at 120 columns


def _reply_text(screen: str) -> list[str]:
    """The transcript's left part, top to the input box (the stats panel and toasts are
    to the right)."""
    lines = screen.splitlines()
    end = next((i for i, ln in enumerate(lines) if "Message…" in ln), len(lines))
    return [ln[:LEFT] for ln in lines[:end]]


def _last_reply_row(screen: str) -> str:
    """The text of the reply's last row: the line above its bottom border ("" for a
    reply stopped before its first word)."""
    lines = screen.splitlines()
    bottom = next(i for i, ln in enumerate(lines) if "■ stopped" in ln)
    above = lines[bottom - 1]
    return above.split("│")[1].strip() if "│" in above else ""


@pytest.mark.parametrize("key", ["Escape", "C-c"])
def test_one_key_stops_a_long_reply(tmp_path: Path, key: str) -> None:
    tmux = Tmux(f"kvchat-stop-{os.getpid()}-{key}")
    try:
        status = start_chat(tmux, "chat", tmp_path, LONG_REPLY)
        tmux("send-keys", "-t", "chat", "-l", "One day")
        tmux("send-keys", "-t", "chat", "Enter")
        time.sleep(0.4)
        tmux("send-keys", "-t", "chat", key)  # once
        stopped = tmux.wait_screen("chat", lambda s: "■ stopped" in s, timeout=STOP_WITHIN_S)
        assert "generating…" not in stopped
        n = generated_tokens(stopped)
        assert n is not None and n < MAX_TOKENS, stopped
        time.sleep(1.5)
        later = tmux.screen("chat")
        assert generated_tokens(later) == n  # the engine generates no more
        assert _reply_text(later) == _reply_text(stopped)  # nor does the reply grow
        # the whole last row, once no toast covers it
        shown = tmux.wait_screen("chat", lambda s: "Stopping the reply" not in s, timeout=10)
        last_row = _last_reply_row(shown)
        tmux("send-keys", "-t", "chat", "C-q")  # one Ctrl+C did not quit: this does
        deadline = time.monotonic() + 30
        while not status.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert status.read_text().strip() == "0"
    finally:
        tmux.kill_server()
    chats = list((tmp_path / "data" / "chats").glob("*.json"))
    assert len(chats) == 1
    reply = json.loads(chats[0].read_text())["messages"][-1]
    assert reply["role"] == "assistant" and reply["stopped"] is True
    # the partial text is kept: it ends as the stopped reply did on screen
    text = " ".join(reply["content"].split())
    assert text.endswith(last_row) and bool(text) == bool(last_row), (last_row, reply)
