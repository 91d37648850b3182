"""Bounds on a config.json's numbers, checked before any model is built from it.

A hostile or broken config must fail with one line that names the key, not with a
ZeroDivisionError deep in a layer, a model of a million layers growing past all memory,
or silent garbage (``rms_norm_eps: -1`` or ``rope_theta: 0`` give ``<unk><unk>…``).
The checks read the raw dict with Hugging Face's key names, so every family shares them;
a key that is absent is left to the family's defaults.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from kvchat.model.errors import ConfigError

MAX_LAYERS = 1000  # the deepest real decoders have ~130
MAX_SIZE = 1 << 24  # widths, heads and vocabularies (the largest real ones are ~260k)
MAX_POSITIONS = 1 << 27  # context lengths (the longest real ones are ~10M)

# key -> (largest allowed value); every one must be an integer >= 1
POSITIVE_INTS: dict[str, int] = {
    "hidden_size": MAX_SIZE,
    "intermediate_size": MAX_SIZE,
    "vocab_size": MAX_SIZE,
    "num_attention_heads": MAX_SIZE,
    "num_key_value_heads": MAX_SIZE,
    "head_dim": MAX_SIZE,
    "num_hidden_layers": MAX_LAYERS,
    "max_position_embeddings": MAX_POSITIONS,
    # attention windows: a window of 0 tokens attends to nothing
    "sliding_window": MAX_POSITIONS,
    "attention_chunk_size": MAX_POSITIONS,
}
# numbers that must be finite and > 0
POSITIVE_FLOATS = ("rms_norm_eps", "layer_norm_eps", "rope_theta", "rope_local_base_freq")
# RoPE blocks (transformers 5's and the classic spelling): an object or null, whose
# numbers are numbers (positive where a zero or a negative means nothing)
ROPE_BLOCKS = ("rope_parameters", "rope_scaling")
ROPE_POSITIVE = ("factor", "original_max_position_embeddings")
ROPE_NUMBERS = ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
                "attention_factor", "mscale", "mscale_all_dim")


def _int(cfg: Mapping[str, Any], key: str, limit: int, where: str) -> int | None:
    v = cfg.get(key)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"{where}{key} must be a positive integer, got {v!r:.60}")
    if v < 1:
        raise ConfigError(f"{where}{key} must be >= 1, got {v}")
    if v > limit:
        raise ConfigError(f"{where}{key} is {v:,}, over the limit of {limit:,}")
    return v


def _positive_float(block: Mapping[str, Any], key: str, where: str) -> None:
    v = block.get(key)
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{where}{key} must be a number, got {v!r:.60}")
    if not math.isfinite(v) or v <= 0:
        raise ConfigError(f"{where}{key} must be a finite number > 0, got {v}")


def check_config(cfg: Mapping[str, Any], where: str = "config.json: ") -> None:
    """Raise ConfigError (one line naming the key) on the first value out of bounds."""
    ints = {key: _int(cfg, key, limit, where) for key, limit in POSITIVE_INTS.items()}
    for key in POSITIVE_FLOATS:
        _positive_float(cfg, key, where)
    for name in ROPE_BLOCKS:
        block = cfg.get(name)
        if block is None:
            continue
        if not isinstance(block, Mapping):
            raise ConfigError(f"{where}{name} must be an object or null, got {block!r:.60}")
        for key in (*POSITIVE_FLOATS, *ROPE_POSITIVE):
            _positive_float(block, key, f"{where}{name}.")
        for key in ROPE_NUMBERS:
            v = block.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                                  or not math.isfinite(v)):
                raise ConfigError(f"{where}{name}.{key} must be a finite number, got {v!r:.60}")
    hidden, heads = ints["hidden_size"], ints["num_attention_heads"]
    if hidden and heads and ints["head_dim"] is None and hidden % heads:
        raise ConfigError(
            f"{where}hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads})"
            " and no head_dim is given"
        )
    kv = ints["num_key_value_heads"]
    if heads and kv and heads % kv:
        raise ConfigError(
            f"{where}num_attention_heads ({heads}) is not a multiple of"
            f" num_key_value_heads ({kv})"
        )
    text = cfg.get("text_config")  # multimodal wrappers hold the decoder's config here
    if isinstance(text, Mapping):
        check_config(text, f"{where}text_config.")
