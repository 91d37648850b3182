"""Errors a user sees: each carries one clear line, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class KVChatError(Exception):
    """Base for every user-facing failure; str(e) is the one line to show."""


class ModelLoadError(KVChatError):
    """A model folder, config or weight file that cannot be loaded as asked."""


class ConfigError(ModelLoadError):
    """A config.json we cannot build a model from (unknown family, bad RoPE, ...)."""


def one_line(text: object, limit: int = 300) -> str:
    """Collapse any message (a library's multi-line error, say) into one bounded line."""
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def error_line(e: BaseException) -> str:
    """One line for any exception, never empty: a KVChatError's own text; otherwise the
    type name first (a bare ``MemoryError()`` has no text at all)."""
    text = one_line(e)
    if isinstance(e, KVChatError) and text:
        return text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def read_json_object(path: Path, error: type[KVChatError]) -> dict[str, Any]:
    """A JSON object from `path`; {} when the file is absent or not an object,
    `error` (one line) when it cannot be read or parsed."""
    from .files import read_regular_text  # files.py builds on this module

    try:
        data = json.loads(read_regular_text(path))
    except FileNotFoundError:
        return {}
    except KVChatError as e:  # a FIFO, a device, a directory, an absurd size
        raise error(str(e)) from None
    except (OSError, ValueError) as e:
        raise error(f"{path}: cannot read: {one_line(e)}") from None
    return data if isinstance(data, dict) else {}
