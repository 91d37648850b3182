"""kvchat's decoder and runtime. `from model import load_model`."""

from .config import ModelConfig, load_config
from .errors import ConfigError, KVChatError, ModelLoadError
from .tokenizer import Tokenizer, load_tokenizer
from .transformer import Transformer
from .weights import load_model

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
