"""RoPE settings parsed from a config.json: transformers 5's `rope_parameters` (one dict,
or one per layer kind) and the classic `rope_theta` + `rope_scaling`.

`RopeConfig` holds one schedule as plain numbers; layers.RoPE computes it. Which layers
get which schedule (or none) is the resolver's business (config.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, get_args

from kvchat.model.errors import ConfigError

from .families import FULL, SLIDING

# transformers' rope_type values kvchat computes (layers.RoPE)
RopeType = Literal["default", "linear", "llama3", "yarn", "dynamic", "longrope"]
ROPE_TYPES: tuple[str, ...] = get_args(RopeType)


@dataclass(frozen=True)
class RopeConfig:
    """One RoPE schedule, as transformers' `rope_parameters` describes it."""

    theta: float = 10000.0
    type: RopeType = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 2048  # dynamic NTK and longrope read the model's context
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    # longrope (per rotated pair)
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    @classmethod
    def from_params(
        cls,
        params: dict[str, Any],
        cfg: dict[str, Any],
        aliases: dict[str, str] | None = None,
        key: str = "rope_parameters",
    ) -> RopeConfig:
        """`params`: one rope dict (rope_type, rope_theta, factor, ...); `cfg`: the whole
        config for the keys transformers reads beside it."""
        rope_type = params.get("rope_type", params.get("type")) or "default"
        rope_type = (aliases or {}).get(rope_type, rope_type)
        if rope_type not in ROPE_TYPES:
            raise ConfigError(
                f"config.json: {key}.rope_type: unsupported RoPE type {rope_type!r};"
                f" supported: {', '.join(ROPE_TYPES)}"
            )
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        # transformers: a top-level original_max_position_embeddings wins (Phi-3)
        orig = cfg.get("original_max_position_embeddings") or params.get(
            "original_max_position_embeddings"
        ) or max_pos
        factor = params.get("factor")
        if factor is None and rope_type in ("yarn", "longrope"):
            factor = max_pos / orig
        factor = float(1.0 if factor is None else factor)
        if rope_type not in ("default", "longrope") and factor <= 0:
            raise ConfigError(f"config.json: {key}.factor must be > 0, got {factor}")
        partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor")) or 1.0
        short = params.get("short_factor")
        long = params.get("long_factor")
        if rope_type == "longrope" and (short is None or long is None):
            raise ConfigError(
                f"config.json: {key} of type longrope needs short_factor and long_factor"
            )
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        attention_factor = params.get("attention_factor")
        if "short_mscale" in params or "long_mscale" in params:
            # Phi-MoE: cos/sin × short_mscale within the original context, else × long_mscale
            mscales = {params.get("short_mscale"), params.get("long_mscale")}
            if len(mscales) != 1 or not isinstance(m := mscales.pop(), (int, float)):
                raise ConfigError(
                    f"config.json: {key}: short_mscale and long_mscale must be one number"
                    f" (got {params.get('short_mscale')!r}, {params.get('long_mscale')!r})")
            attention_factor = float(m)
        return cls(
            theta=float(theta),
            type=rope_type,
            factor=factor,
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(orig),
            partial_rotary_factor=float(partial),
            max_position_embeddings=max_pos,
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            attention_factor=attention_factor,
            truncate=bool(params.get("truncate", True)),
            short_factor=None if short is None else tuple(float(x) for x in short),
            long_factor=None if long is None else tuple(float(x) for x in long),
        )

    @classmethod
    def from_config(cls, cfg: dict[str, Any], aliases: dict[str, str] | None = None) -> RopeConfig:
        """Both spellings: transformers 5's `rope_parameters` and the classic
        `rope_theta` + `rope_scaling` (mlx-lm 0.32.2 reads only the latter)."""
        params = dict(cfg.get("rope_scaling") or {})
        params.update(cfg.get("rope_parameters") or {})
        return cls.from_params(params, cfg, aliases)

    def rotary_dims(self, head_dim: int) -> int:
        return int(head_dim * self.partial_rotary_factor)

    @property
    def attention_scaling(self) -> float:
        """The factor transformers multiplies cos and sin by (yarn's mscale, longrope's
        attention factor); 1 for the other types."""
        if self.type == "yarn":
            if self.attention_factor is not None:
                return float(self.attention_factor)

            def get_mscale(scale: float, m: float = 1.0) -> float:
                return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

            if self.mscale and self.mscale_all_dim:
                return get_mscale(self.factor, self.mscale) / get_mscale(
                    self.factor, self.mscale_all_dim
                )
            return get_mscale(self.factor)
        if self.type == "longrope":
            if self.attention_factor is not None:
                return float(self.attention_factor)
            f = self.max_position_embeddings / self.original_max_position_embeddings
            if f <= 1.0:
                return 1.0
            return math.sqrt(1 + math.log(f) / math.log(self.original_max_position_embeddings))
        return 1.0


def global_rope(cfg: dict[str, Any], aliases: dict[str, str]) -> RopeConfig:
    """The RoPE of full-attention layers (of every layer for most families)."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and FULL in params:  # transformers 5, per layer kind (Gemma 3)
        return RopeConfig.from_params(
            params[FULL] or {}, cfg, aliases, f"rope_parameters.{FULL}"
        )
    return RopeConfig.from_config(cfg, aliases)


def check_rotary(rope: RopeConfig, head_dim: int) -> None:
    """The RoPE settings that only make sense against the head size."""
    if not 0 < rope.partial_rotary_factor <= 1:
        raise ConfigError(
            "config.json: partial_rotary_factor must be in (0, 1],"
            f" got {rope.partial_rotary_factor}"
        )
    pairs = rope.rotary_dims(head_dim) // 2
    for key, factors in (("short_factor", rope.short_factor), ("long_factor", rope.long_factor)):
        if factors is not None and len(factors) != pairs:
            raise ConfigError(
                f"config.json: rope {key} has {len(factors)} entries; {pairs} rotated pairs"
                " need one each"
            )


def local_rope(cfg: dict[str, Any], aliases: dict[str, str]) -> RopeConfig:
    """Gemma 3's sliding layers: plain RoPE with `rope_local_base_freq`."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and SLIDING in params:
        return RopeConfig.from_params(
            params[SLIDING] or {}, cfg, aliases, f"rope_parameters.{SLIDING}"
        )
    return RopeConfig.from_params(
        {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq", 1e4)}, cfg
    )
