"""An engine child that writes to fd 2 from C, as a Rust tokenizer's panic does: a
`sitecustomize` put on PYTHONPATH that, only in the engine's child process
(model/runtime/engine_process.py), calls libc's write(2, ...) at start-up and, once
`die_flag` exists, writes a panic line and exits with DIE_STATUS."""

from __future__ import annotations

import os
from pathlib import Path

AT_START = "NATIVE-NOISE-AT-START from libc write"
PANIC = "thread 'tokenizer' panicked at NATIVE-NOISE-PANIC"
DIE_STATUS = 101

_SITE = '''
import ctypes, os, sys, threading, time

if any(a.endswith("engine_process") for a in sys.orig_argv):
    _libc = ctypes.CDLL(None)

    def _say(text):
        data = (text + "\\n").encode()
        _libc.write(2, data, len(data))

    _say({start!r})
    _flag = {flag!r}

    def _watch():
        while not os.path.exists(_flag):
            time.sleep(0.05)
        _say({panic!r})
        os._exit({status})

    if _flag:
        threading.Thread(target=_watch, daemon=True).start()
'''


def noisy_child_env(folder: Path, die_flag: Path | None = None) -> dict[str, str]:
    """Writes the sitecustomize into `folder`; returns {"PYTHONPATH": ...} for the app's
    environment (the engine child inherits it)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(_SITE.format(
        start=AT_START, panic=PANIC, status=DIE_STATUS,
        flag=str(die_flag) if die_flag is not None else ""))
    rest = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": f"{folder}{os.pathsep}{rest}" if rest else str(folder)}
