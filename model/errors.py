"""Errors a user sees: each carries one clear line, never a traceback."""


class KVChatError(Exception):
    """Base for every user-facing failure; str(e) is the one line to show."""


class ModelLoadError(KVChatError):
    """A model folder, config or weight file that cannot be loaded as asked."""


class ConfigError(ModelLoadError):
    """A config.json we cannot build a model from (unknown family, bad RoPE, ...)."""
