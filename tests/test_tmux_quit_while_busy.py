"""Quitting while the engine is busy, in a real terminal: the model's chat template
hangs (nested loops), the user sends a message and presses Ctrl+Q at once. The process
must end within 2 s, with status 0 and no "terminate called" abort."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

from .test_tmux_chat import REPO, STORIES, Tmux, pytestmark  # noqa: F401

HANG = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"


def test_quit_while_the_engine_is_busy(tmp_path: Path) -> None:
    model = Path(shutil.copytree(STORIES, tmp_path / "slow-template"))
    (model / "chat_template.jinja").write_text(HANG)
    config = tmp_path / "config"
    config.mkdir()
    (config / "settings.json").write_text(json.dumps({"temp": 0.0}))
    status = tmp_path / "exit_status"
    env = {"KVCHAT_CONFIG_DIR": str(config), "KVCHAT_DATA_DIR": str(tmp_path / "data"),
           "TERM": "xterm-256color", "LD_PRELOAD": os.environ.get("LD_PRELOAD", "")}
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    command = (
        f"cd {shlex.quote(str(REPO))} && env -u COLUMNS -u LINES {exports}"
        f" {shlex.quote(sys.executable)} -m kvchat.app --model {shlex.quote(str(model))};"
        f" echo $? > {shlex.quote(str(status))}; sleep 30"
    )
    tmux = Tmux(f"kvchat-quit-{os.getpid()}")
    target = "kvchat"
    try:
        tmux("start-server", ";", "set-option", "-g", "default-size", "120x36", ";",
             "new-session", "-d", "-s", target, "-x", "120", "-y", "36", command)
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
