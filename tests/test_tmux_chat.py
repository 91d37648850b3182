"""End to end in a real terminal: tmux runs `python -m kvchat.app --model stories260K`, we type
a prompt, read the screen with capture-pane while the reply streams, stop it with Esc
and quit with Ctrl+Q. A private tmux server (-L) keeps it away from any user session.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.tmux import Tmux

from .conftest import STORIES260K

REPO = Path(__file__).resolve().parents[1]
STORIES = STORIES260K

pytestmark = [
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
]


def test_chat_in_tmux(tmp_path: Path) -> None:
    config, data = tmp_path / "config", tmp_path / "data"
    config.mkdir()
    # a long greedy reply, so Esc lands while it streams: with the chat's sampling and a
    # rotating 256-token window, "One day" runs 857 tokens before the model's BOS ends it
    # ("Once upon a time" only 366: a few tenths of a second on an idle machine)
    (config / "settings.json").write_text(
        json.dumps({"temp": 0.0, "max_tokens": 3000, "max_kv_size": 256})
    )
    status = tmp_path / "exit_status"
    env = {
        "KVCHAT_CONFIG_DIR": str(config),
        "KVCHAT_DATA_DIR": str(data),
        "TERM": "xterm-256color",
        "LD_PRELOAD": os.environ.get("LD_PRELOAD", ""),
    }
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    command = (
        # COLUMNS/LINES can leak in from the test process (set below os.environ, by C
        # code); they would override the pane size, so the app must not see them
        f"cd {shlex.quote(str(REPO))} && env -u COLUMNS -u LINES {exports}"
        f" {shlex.quote(sys.executable)} -m kvchat.app"
        f" --model {shlex.quote(str(STORIES))}; echo $? > {shlex.quote(str(status))}"
    )
    tmux = Tmux(f"kvchat-e2e-{os.getpid()}")
    target = "kvchat"
    try:
        # the size is set before the window exists, so the app starts at 120x36
        tmux(
            "start-server", ";", "set-option", "-g", "default-size", "120x36", ";",
            "new-session", "-d", "-s", target, "-x", "120", "-y", "36", command,
        )
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
        deadline = time.monotonic() + 30
        while not status.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert status.exists(), "the app did not quit on Ctrl+Q"
        assert status.read_text().strip() == "0"
    finally:
        tmux.kill_server()

    # the stopped turn was autosaved
    chats = list((data / "chats").glob("*.json"))
    assert len(chats) == 1
    saved = json.loads(chats[0].read_text())
    assert saved["messages"][0]["content"] == "One day"
    assert saved["messages"][1]["stopped"] is True
