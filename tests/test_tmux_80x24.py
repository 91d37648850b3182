"""A real 80×24 terminal (tmux), the size every laptop opens: the chat column
takes the width, a message gets its reply, the status line carries the numbers, Help and
Quit are in the footer, and F3 brings the panel back."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import pytest

from tests.helpers.paths import STORIES260K as STORIES
from tests.helpers.tmux import NEEDS_TMUX, Tmux, chat_env, command, session, wait_file

# the chat in tmux stays in the fast tier once (tests/test_tmux_chat.py)
pytestmark = [NEEDS_TMUX, pytest.mark.slow]


def test_chat_at_80x24(tmp_path: Path) -> None:
    env, status = chat_env(tmp_path, {"temp": 0.0, "max_tokens": 40, "max_kv_size": 64})
    tmux = Tmux(f"kvchat-small-{os.getpid()}")
    try:
        session(tmux, "chat", (80, 24),
                 command(f"--model {shlex.quote(str(STORIES))}", env, status))
        tmux.wait_screen("chat", lambda s: "stories260K" in s and "Message" in s, timeout=90)
        tmux("send-keys", "-t", "chat", "-l", "Once upon a time")
        tmux("send-keys", "-t", "chat", "Enter")
        done = tmux.wait_screen(
            "chat", lambda s: "assistant" in s and "generating" not in s
            and "tok/s · ctx" in s, timeout=90)
        lines = done.splitlines()
        assert len(lines) == 24 and all(len(ln) <= 80 for ln in lines)
        footer = lines[-1]
        assert footer.startswith("f1 Help ^q Quit"), footer
        assert "Speed" not in done  # the panel starts hidden at 80 columns
        status_line = next(ln for ln in lines if "tok/s · ctx" in ln)
        assert "/64" in status_line and "KV " in status_line and "GQA 2× smaller" in status_line
        reply = lines[lines.index(next(ln for ln in lines if "assistant" in ln)) + 1]
        assert len(reply.strip("│ ")) > 20  # the reply's text, at the chat column's width
        tmux("send-keys", "-t", "chat", "F3")
        tmux.wait_screen("chat", lambda s: "Speed" in s and "KV cache" in s, timeout=30)
        tmux("send-keys", "-t", "chat", "C-q")
        assert wait_file(status, 30) == "0"
    finally:
        tmux.kill_server()
