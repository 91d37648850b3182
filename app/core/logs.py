"""Where kvchat's logs go: `platformdirs.user_log_dir("kvchat")` (on Linux
~/.local/state/kvchat/log, on macOS ~/Library/Logs/kvchat), or $KVCHAT_LOG_DIR when set.

The chat's engine process writes its stderr (fd 2, native libraries included) to
`engine.log` there instead of the chat's terminal (docs/reliability.md, "The engine's
messages").
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

ENGINE_LOG = "engine.log"
ENGINE_LOG_MAX_BYTES = 4 * 2**20  # past this the log starts afresh (the old one: .1)


def log_dir() -> Path:
    env = os.environ.get("KVCHAT_LOG_DIR")
    return Path(env).expanduser() if env else Path(platformdirs.user_log_dir("kvchat"))


def engine_log() -> Path:
    """The engine's stderr log, its folder made; a log past ENGINE_LOG_MAX_BYTES is moved
    aside to engine.log.1 first. OSError when the folder cannot be made."""
    folder = log_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / ENGINE_LOG
    try:
        if path.stat().st_size > ENGINE_LOG_MAX_BYTES:
            path.replace(path.with_name(ENGINE_LOG + ".1"))
    except FileNotFoundError:
        pass
    return path
