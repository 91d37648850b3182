"""kvchat's decoder and runtime: `from kvchat.model import load_model`.

Subpackages by job, imports pointing down (docs/design.md, "Layout"): `decoder` <- `cache`
<- `distributed` <- `runtime` <- `explain` <- `training`; `text` beside them; `errors` and
`files` under all. Names here are imported on first use (PEP 562), so importing a light
module (events, kv_math) does not pull in MLX.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "ConfigError": "errors",
    "KVChatError": "errors",
    "ModelLoadError": "errors",
    "ModelConfig": "decoder.config",
    "load_config": "decoder.config",
    "Tokenizer": "text.tokenizer",
    "load_tokenizer": "text.tokenizer",
    "Transformer": "decoder.transformer",
    "load_model": "decoder.weights",
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
    from kvchat.model.decoder.config import ModelConfig, load_config
    from kvchat.model.decoder.transformer import Transformer
    from kvchat.model.decoder.weights import load_model
    from kvchat.model.text.tokenizer import Tokenizer, load_tokenizer

    from .errors import ConfigError, KVChatError, ModelLoadError


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
