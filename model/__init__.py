"""kvchat's decoder and runtime. `from model import load_model`.

Names are imported on first use (PEP 562), so `import model.events` or `model.kv_math`
does not pull in MLX: only the modules that compute import it.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "ConfigError": "errors",
    "KVChatError": "errors",
    "ModelLoadError": "errors",
    "ModelConfig": "config",
    "load_config": "config",
    "Tokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
    "Transformer": "transformer",
    "load_model": "weights",
}

__all__ = [
    "ConfigError",
    "KVChatError",
    "ModelConfig",
    "ModelLoadError",
    "Tokenizer",
    "Transformer",
    "load_config",
    "load_model",
    "load_tokenizer",
]

if TYPE_CHECKING:
    from .config import ModelConfig, load_config
    from .errors import ConfigError, KVChatError, ModelLoadError
    from .tokenizer import Tokenizer, load_tokenizer
    from .transformer import Transformer
    from .weights import load_model


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
