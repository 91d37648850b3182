"""Model configuration parsed from a Hugging Face / mlx-community `config.json`.

Every difference between the supported families lives in `FAMILIES`; the rest of the
code reads the resolved `ModelConfig` and never branches on `model_type`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config_checks import check_config
from .errors import ConfigError


@dataclass(frozen=True)
class Family:
    """Per-family quirks: what the family's HF config implies when a key is absent."""

    qkv_bias: bool | None = None  # None: read `attention_bias` from the config
    o_bias: bool | None = None  # None: read `attention_bias` from the config
    tie_word_embeddings: bool = False  # default when config.json does not say
    # sliding_window applies only when this config flag is true (None: whenever set)
    sliding_window_flag: str | None = None


FAMILIES: dict[str, Family] = {
    "llama": Family(),  # Llama 2, 3, 3.1, 3.2, SmolLM, TinyLlama, stories260K
    "mistral": Family(qkv_bias=False, o_bias=False),
    "qwen2": Family(qkv_bias=True, o_bias=False, sliding_window_flag="use_sliding_window"),
}

ROPE_TYPES = ("default", "llama3", "linear")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> RopeConfig:
        """Both spellings: transformers 5's `rope_parameters` and the classic
        `rope_theta` + `rope_scaling` (mlx-lm 0.32.2 reads only the latter)."""
        params = dict(cfg.get("rope_scaling") or {})
        params.update(cfg.get("rope_parameters") or {})
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ConfigError(
                f"unsupported RoPE type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
            )
        factor = float(params.get("factor", 1.0))
        if rope_type != "default" and factor <= 0:
            raise ConfigError(f"RoPE scaling factor must be > 0, got {factor}")
        return cls(
            theta=float(theta),
            type=rope_type,
            factor=factor,
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings", 8192)
            ),
        )


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    max_position_embeddings: int
    sliding_window: int | None = None
    # mlx-community block: {"group_size": 64, "bits": 4, "<layer path>": {...} | False}
    quantization: dict[str, Any] | None = None
    torch_dtype: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def gqa_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        model_type = cfg.get("model_type")
        if model_type not in FAMILIES:
            raise ConfigError(
                f"unknown architecture {model_type!r}; supported: {', '.join(sorted(FAMILIES))}"
            )
        fam = FAMILIES[model_type]
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            kv_heads = int(cfg.get("num_key_value_heads") or heads)
            head_dim = int(cfg.get("head_dim") or hidden // heads)
            layers = int(cfg["num_hidden_layers"])
            inter = int(cfg["intermediate_size"])
            vocab = int(cfg["vocab_size"])
        except KeyError as e:
            raise ConfigError(f"config.json lacks required key {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ConfigError(f"config.json has a malformed value: {e}") from None
        if heads % kv_heads:
            raise ConfigError(
                f"num_attention_heads ({heads}) is not a multiple of"
                f" num_key_value_heads ({kv_heads})"
            )
        attn_bias = bool(cfg.get("attention_bias", False))
        window = cfg.get("sliding_window")
        if fam.sliding_window_flag is not None and not cfg.get(fam.sliding_window_flag, False):
            window = None
        return cls(
            model_type=model_type,
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=inter,
            vocab_size=vocab,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_config(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", fam.tie_word_embeddings)),
            qkv_bias=attn_bias if fam.qkv_bias is None else fam.qkv_bias,
            o_bias=attn_bias if fam.o_bias is None else fam.o_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            sliding_window=int(window) if window else None,
            quantization=cfg.get("quantization") or cfg.get("quantization_config"),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            raw=cfg,
        )


def load_config(path: str | Path) -> ModelConfig:
    """Read `config.json` (a file, or the folder holding it)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ConfigError(f"no config.json in {p.parent}")
    try:
        cfg = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {p}: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{p} is not a JSON object")
    check_config(cfg)
    return ModelConfig.from_dict(cfg)
