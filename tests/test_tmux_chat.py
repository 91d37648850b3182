"""End to end in a real terminal: tmux runs `python -m kvchat.app --model stories260K`, we type
a prompt, read the screen with capture-pane while the reply streams, stop it with Esc
and quit with Ctrl+Q. A private tmux server (-L) keeps it away from any user session.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

from tests.helpers.paths import STORIES260K
from tests.helpers.tmux import NEEDS_TMUX, Tmux, chat_env, command, session, wait_file

pytestmark = NEEDS_TMUX


def test_chat_in_tmux(tmp_path: Path) -> None:
    # a long greedy reply, so Esc lands while it streams: with the chat's sampling and a
    # rotating 256-token window, "One day" runs 857 tokens before the model's BOS ends it
    # ("Once upon a time" only 366: a few tenths of a second on an idle machine)
    env, status = chat_env(tmp_path, {"temp": 0.0, "max_tokens": 3000, "max_kv_size": 256})
    tmux = Tmux(f"kvchat-e2e-{os.getpid()}")
    target = "kvchat"
    try:
        # the size is set before the window exists, so the app starts at 120x36
        session(tmux, target, (120, 36),
                command(f"--model {shlex.quote(str(STORIES260K))}", env, status))
        tmux.wait_screen(
            target, lambda s: "stories260K" in s and "Message" in s and "f1 Help" in s,
            timeout=90,
        )

        tmux("send-keys", "-t", target, "-l", "One day")
        tmux("send-keys", "-t", target, "Enter")
        # Esc as soon as the reply streams (the panel's speed may lag a frame behind)
        streaming = tmux.wait_screen(target, lambda s: "generating…" in s, timeout=60)
        tmux("send-keys", "-t", target, "Escape")
        assert "assistant" in streaming, streaming
        assert "One day" in streaming

        stopped = tmux.wait_screen(target, lambda s: "■ stopped" in s, timeout=30)
        assert "generating…" not in stopped
        assert "tok/s" in stopped  # the panel counted the stopped reply's tokens

        tmux("send-keys", "-t", target, "C-q")
        assert wait_file(status, 30) == "0", "the app did not quit on Ctrl+Q"
    finally:
        tmux.kill_server()

    # the stopped turn was autosaved
    chats = list((tmp_path / "data" / "chats").glob("*.json"))
    assert len(chats) == 1
    saved = json.loads(chats[0].read_text())
    assert saved["messages"][0]["content"] == "One day"
    assert saved["messages"][1]["stopped"] is True
