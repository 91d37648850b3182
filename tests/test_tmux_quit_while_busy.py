"""Quitting while the engine is busy, in a real terminal: the model's chat template
hangs (nested loops), the user sends a message and presses Ctrl+Q at once. The process
must end within 2 s, with status 0 and no "terminate called" abort."""

from __future__ import annotations

import os
import shlex
import shutil
import time
from pathlib import Path

import pytest

from tests.helpers.paths import STORIES260K as STORIES
from tests.helpers.tmux import NEEDS_TMUX, Tmux, chat_env, command, session

# the chat in tmux stays in the fast tier once (tests/test_tmux_chat.py)
pytestmark = [NEEDS_TMUX, pytest.mark.slow]

HANG = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"


def test_quit_while_the_engine_is_busy(tmp_path: Path) -> None:
    model = Path(shutil.copytree(STORIES, tmp_path / "slow-template"))
    (model / "chat_template.jinja").write_text(HANG)
    env, status = chat_env(tmp_path, {"temp": 0.0})
    tmux = Tmux(f"kvchat-quit-{os.getpid()}")
    target = "kvchat"
    try:
        # remain-on-exit keeps the pane, so its last screen can be read after the exit
        session(tmux, target, (120, 36), command(f"--model {shlex.quote(str(model))}", env, status))
        tmux.wait_screen(target, lambda s: "slow-template" in s and "Message" in s,
                         timeout=90)
        tmux("send-keys", "-t", target, "-l", "Once upon a time")
        tmux("send-keys", "-t", target, "Enter")
        tmux.wait_screen(target, lambda s: "generating…" in s, timeout=30)
        time.sleep(0.5)  # the template is rendering now
        t0 = time.monotonic()
        tmux("send-keys", "-t", target, "C-q")
        while not status.exists() and time.monotonic() - t0 < 30:
            time.sleep(0.02)
        took = time.monotonic() - t0
        assert status.exists(), "the app did not quit"
        assert status.read_text().strip() == "0"
        assert took < 2.0, f"quitting took {took:.1f}s"
        screen = tmux.screen(target)
        assert "terminate called" not in screen and "Traceback" not in screen, screen
    finally:
        tmux.kill_server()
