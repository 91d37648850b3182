"""Opening files from folders we do not control: regular files only, sizes bounded.

A FIFO named ``model.safetensors`` or ``chat.json`` blocks a plain ``open()`` forever, a
device never ends, a directory fails with an obscure error. `open_regular` opens without
blocking (O_NONBLOCK), checks the opened descriptor is a regular file (no race between a
check and the open), then hands back an ordinary blocking file object.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

from .errors import KVChatError

# text files a model folder or the app reads whole (configs, templates, chats): far above
# any real one (the biggest tokenizer.json files are tens of MB)
MAX_TEXT_BYTES = 256 * 1024 * 1024


class NotRegularFile(KVChatError):
    """A path that exists but is a FIFO, device, socket or directory."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """Open `path` for binary reading; NotRegularFile (one line) unless it is a regular
    file. OSError (FileNotFoundError, PermissionError) passes through for the caller."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(
                f"{Path(path).name} is not a regular file ({_kind(st.st_mode)});"
                " refusing to read it"
            )
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular_text(path: str | os.PathLike[str], limit: int = MAX_TEXT_BYTES) -> str:
    """The UTF-8 text of a regular file of at most `limit` bytes (NotRegularFile or
    KVChatError otherwise; OSError and UnicodeDecodeError pass through)."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise KVChatError(
                f"{Path(path).name} is {size:,} bytes, over the {limit:,}-byte limit"
            )
        return f.read(limit + 1).decode("utf-8")


__all__ = ["MAX_TEXT_BYTES", "NotRegularFile", "open_regular", "read_regular_text"]
