"""Errors a user sees: each carries one clear line, never a traceback."""

from __future__ import annotations


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


# What a failing job lets through: the interpreter's and the user's wish to stop, and a
# generator being closed. Anything else fails only the job that raised it; that includes
# BaseExceptions that are not Exceptions, such as a Rust tokenizer's
# `pyo3_runtime.PanicException`.
NEVER_CAUGHT = (KeyboardInterrupt, SystemExit, GeneratorExit)
