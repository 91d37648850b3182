"""The real app in a real terminal: a private tmux server (-L, no user config) runs a
command in a pane of a given size; tests type with send-keys and read the screen with
capture-pane. Every pane's process group ends with the server."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import processes
from tests.helpers.paths import REPO_ROOT, STORIES260K

NEEDS_TMUX = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


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
           "KVCHAT_LOG_DIR": str(data.parent / "log"),
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


def command(args: str, env: dict[str, str], status: Path) -> str:
    """A shell line that runs `python -m kvchat.app ARGS` from the repository with `env`
    and writes its exit status to `status`."""
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    # COLUMNS/LINES can leak in from the test process and would override the pane size;
    # other test modules set HF_HUB_OFFLINE=1 for the whole process and tmux inherits it
    return (f"cd {shlex.quote(str(REPO_ROOT))} && env -u COLUMNS -u LINES -u HF_HUB_OFFLINE"
            f" -u TRANSFORMERS_OFFLINE {exports}"
            f" {shlex.quote(sys.executable)} -m kvchat.app {args};"
            f" echo $? > {shlex.quote(str(status))}")


def session(tmux: Tmux, name: str, size: tuple[int, int], command: str) -> None:
    """A detached session `name` of `size` (columns, rows) running `command`."""
    w, h = size
    # remain-on-exit: a command that ends early leaves its output to read
    tmux("start-server", ";", "set-option", "-g", "default-size", f"{w}x{h}", ";",
         "set-option", "-g", "remain-on-exit", "on", ";",
         "new-session", "-d", "-s", name, "-x", str(w), "-y", str(h), command)


def chat_env(tmp_path: Path, settings: dict[str, object]) -> tuple[dict[str, str], Path]:
    """(the environment, the exit-status file) for the chat in tmux with its own settings
    and data folders under tmp_path."""
    config, data = tmp_path / "config", tmp_path / "data"
    config.mkdir()
    (config / "settings.json").write_text(json.dumps(settings))
    env = {"KVCHAT_CONFIG_DIR": str(config), "KVCHAT_DATA_DIR": str(data),
           "KVCHAT_LOG_DIR": str(data.parent / "log"),
           "TERM": "xterm-256color", "LD_PRELOAD": os.environ.get("LD_PRELOAD", "")}
    return env, tmp_path / "status"


def wait_file(path: Path, timeout: float) -> str:
    """The stripped text of `path` once it exists (an exit-status file)."""
    deadline = time.monotonic() + timeout
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert path.exists(), f"{path} never appeared"
    return path.read_text().strip()
