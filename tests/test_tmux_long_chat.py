"""A 10,000-message chat, saved as the app saves chats, reopens in the real app in a real
terminal: its last message shows, a typed key reaches the input box, and Ctrl+Q ends the
process with status 0 (app/tui/widgets/transcript.py mounts only what is on screen).
Timings: `python -m tests.benchmarks.long_chat`, docs/performance.md."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import pytest

from tests.helpers.paths import STORIES260K
from tests.helpers.saved_chats import save_as_last_open, short_chat
from tests.helpers.tmux import NEEDS_TMUX, Tmux, chat_env, command, session, wait_file

pytestmark = [NEEDS_TMUX, pytest.mark.slow]

N = 10_000


def test_a_long_chat_reopens_and_quits(tmp_path: Path) -> None:
    env, status = chat_env(tmp_path, {"temp": 0.0})
    env["HOME"] = str(tmp_path / "home")
    conv = short_chat(N, STORIES260K)
    save_as_last_open(conv, Path(env["KVCHAT_DATA_DIR"]))
    last = conv.messages[-1]["content"][:40]
    tmux = Tmux(f"kvchat-long-{os.getpid()}")
    try:
        session(tmux, "c", (120, 36),
                command(f"--model {shlex.quote(str(STORIES260K))}", env, status))
        tmux.wait_screen("c", lambda s: last in s, timeout=120)
        tmux("send-keys", "-t", "c", "-l", "x7q7x")
        tmux.wait_screen("c", lambda s: "x7q7x" in "".join(s.splitlines()[-6:]), timeout=60)
        tmux("send-keys", "-t", "c", "C-q")
        assert wait_file(status, timeout=60) == "0"
    finally:
        tmux.kill_server()
