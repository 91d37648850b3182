"""What a native library in the engine's child writes to fd 2 (a Rust tokenizer's panic)
never reaches the chat's screen: it goes to the engine log (app/core/logs.py), and the
child's death is one line in the chat that names the log."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest

from tests.helpers.native_noise import AT_START, DIE_STATUS, PANIC, noisy_child_env
from tests.helpers.paths import STORIES260K
from tests.helpers.tmux import NEEDS_TMUX, Tmux, chat_env, command, session

pytestmark = [NEEDS_TMUX, pytest.mark.slow]


def test_native_stderr_stays_off_the_chat_screen(tmp_path: Path) -> None:
    flag = tmp_path / "die"
    env, status = chat_env(tmp_path, {"temp": 0.0})
    env.update(noisy_child_env(tmp_path / "site", flag))
    log = Path(env["KVCHAT_LOG_DIR"]) / "engine.log"
    tmux = Tmux(f"kvchat-stderr-{os.getpid()}")
    target = "kvchat"
    try:
        session(tmux, target, (160, 40),
                command(f"--model {shlex.quote(str(STORIES260K))}", env, status))
        screen = tmux.wait_screen(target, lambda s: "stories260K" in s and "Message" in s,
                                  timeout=90)
        assert AT_START in log.read_text()  # written while the chat was on the screen
        assert "NATIVE-NOISE" not in screen, screen
        flag.touch()  # the child panics and dies
        screen = tmux.wait_screen(
            target, lambda s: f"status {DIE_STATUS}" in " ".join(s.split()), timeout=30)
        assert "NATIVE-NOISE" not in screen and "panicked" not in screen, screen
        # the one line names the log (the toast wraps it: its lines, without the breaks)
        toast = "".join(line.rpartition("▌")[2] for line in screen.splitlines())
        flat = re.sub(r"\s+", "", toast)
        assert re.sub(r"\s+", "", f"its messages are in {log}") in flat, screen
        assert PANIC in log.read_text()
    finally:
        tmux.kill_server()
