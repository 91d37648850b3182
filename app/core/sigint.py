"""Ctrl+C in the command line's main thread, never lost inside an import.

Python raises KeyboardInterrupt wherever the main thread is when SIGINT arrives. Inside the
import machinery that can be a weakref callback (`_get_module_lock`'s), where an exception
cannot propagate: Python prints "Exception ignored … KeyboardInterrupt" and the
interrupt is gone (seen: `generate` went on to reply). kvchat imports lazily, at start-up
and when a command first needs MLX, so the handler here raises KeyboardInterrupt as
Python's own does, except inside an import: there it asks again a moment later
(`_thread.interrupt_main`), until the import is done.
"""

from __future__ import annotations

import _thread
import signal
import threading
from types import FrameType

RETRY_S = 0.02  # how soon an interrupt that landed inside an import is delivered again


def _in_import(frame: FrameType | None) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    if _in_import(frame):
        timer = threading.Timer(RETRY_S, _thread.interrupt_main, args=(signal.SIGINT,))
        timer.daemon = True
        timer.start()
        return
    raise KeyboardInterrupt


def install() -> None:
    """Use the handler above for SIGINT, where SIGINT is Python's default (not ignored
    by whoever started us, not a handler someone set)."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)
