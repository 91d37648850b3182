"""How a face reports a failure: one line on stderr, a traceback only with KVCHAT_DEBUG=1."""

from __future__ import annotations

import os
import sys
import traceback

from kvchat.model.errors import KVChatError


class UsageError(KVChatError):
    """A command line or option value we cannot use: exit status 2, whichever command."""


def interrupted(e: BaseException) -> bool:
    """Whether Ctrl+C caused `e`: a native extension interrupted while it initialises
    (MLX's nanobind module) raises ImportError from the KeyboardInterrupt."""
    seen: set[int] = set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen:
        if isinstance(x, KeyboardInterrupt):
            return True
        seen.add(id(x))
        x = x.__cause__ or x.__context__
    return False


def debug() -> bool:
    return os.environ.get("KVCHAT_DEBUG") == "1"


def report(message: str) -> None:
    """One line on stderr; text from a model or a template is shown, never obeyed."""
    from kvchat.app.core.text import visible_name

    line = message.strip().splitlines()[0] if message.strip() else "unknown error"
    print(f"kvchat: error: {visible_name(line)}", file=sys.stderr)


def report_exception(e: BaseException) -> None:
    if debug():
        traceback.print_exception(e)
    report(str(e) if str(e) else type(e).__name__)
