"""The chat in a real terminal: a private tmux server (-L, never a user's session), the
screen read back with capture-pane, and `python -m kvchat.app` started in it with its own
settings and data folders. Every pane's process group is killed with the server, so an
app that ignores the hang-up cannot outlive a failed test or benchmark."""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests import processes
from tests.conftest import REPO_ROOT, STORIES260K


class Tmux:
    def __init__(self, socket: str) -> None:
        self.socket = socket

    def __call__(self, *args: str, check: bool = True) -> str:
        out = processes.run(
            ["tmux", "-L", self.socket, "-f", "/dev/null", *args],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if check and out.returncode != 0:
            raise AssertionError(f"tmux {' '.join(args)} failed: {out.stderr.strip()}")
        return out.stdout

    def kill_server(self) -> None:
        """End the server and every pane's process group: the app and its engine process
        (an app that ignores the hang-up must not outlive a failed test)."""
        panes = self("list-panes", "-a", "-F", "#{pane_pid}", check=False).split()
        self("kill-server", check=False)
        for pid in panes:
            processes.kill_process_group(int(pid))

    def screen(self, target: str) -> str:
        return self("capture-pane", "-p", "-t", target)

    def wait_screen(self, target: str, pred: Callable[[str], bool], timeout: float) -> str:
        deadline = time.monotonic() + timeout
        text = ""
        while time.monotonic() < deadline:
            text = self.screen(target)
            if pred(text):
                return text
            time.sleep(0.1)
        size = self("display", "-p", "-t", target, "#{window_width}x#{window_height}")
        raise AssertionError(f"timed out; the screen ({size.strip()}) was:\n{text}")


def start_chat(tmux: Tmux, target: str, root: Path, settings: dict[str, Any],
               size: tuple[int, int] = (120, 36), model: Path = STORIES260K) -> Path:
    """`python -m kvchat.app --model MODEL` in a new session `target` of `size`, with
    settings.json holding `settings` and every folder it writes under `root`; returns the
    file its exit status goes to. Returns once the model is loaded."""
    config, data = root / "config", root / "data"
    config.mkdir(parents=True)
    (config / "settings.json").write_text(json.dumps(settings))
    status = root / "exit_status"
    env = {"KVCHAT_CONFIG_DIR": str(config), "KVCHAT_DATA_DIR": str(data),
           "TERM": "xterm-256color", "LD_PRELOAD": os.environ.get("LD_PRELOAD", "")}
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    # COLUMNS/LINES can leak in from the test process; they would override the pane size
    command = (f"cd {shlex.quote(str(REPO_ROOT))} && env -u COLUMNS -u LINES {exports}"
               f" {shlex.quote(sys.executable)} -m kvchat.app --model {shlex.quote(str(model))};"
               f" echo $? > {shlex.quote(str(status))}")
    w, h = size
    # the size is set before the window exists, so the app starts at that size
    tmux("start-server", ";", "set-option", "-g", "default-size", f"{w}x{h}", ";",
         "new-session", "-d", "-s", target, "-x", str(w), "-y", str(h), command)
    tmux.wait_screen(target, lambda s: model.name in s and "Message" in s, timeout=90)
    return status


_GENERATED = re.compile(r"tokens\s+([\d,]+|–) generated")


def generated_tokens(screen: str) -> int | None:
    """The stats panel's count of tokens generated this turn ("–", none yet: 0; None:
    the panel is not shown)."""
    m = _GENERATED.search(screen)
    if m is None:
        return None
    return 0 if m.group(1) == "–" else int(m.group(1).replace(",", ""))
