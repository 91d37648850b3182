"""The decoder's building blocks: RMSNorm, RoPE, grouped-query attention, SwiGLU, block.

Parameter names mirror Hugging Face so checkpoints load without renaming.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn

import metal_kernels

from .config import ModelConfig, RopeConfig


class RMSNorm(nn.Module):
    """x / RMS(x) * weight: no mean subtraction, no bias (unlike LayerNorm)."""

    def __init__(self, dims: int, eps: float = 1e-6):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return metal_kernels.rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: mx.array, residual: mx.array) -> tuple[mx.array, mx.array]:
        """(x + residual, norm(x + residual)) in one fused pass where the backend has it."""
        return metal_kernels.add_rms_norm(x, residual, self.weight, self.eps)


def rope_periods(dims: int, rope: RopeConfig) -> mx.array | None:
    """Per-pair periods for scaled RoPE (`None` for the plain base-theta schedule).

    llama3 scaling stretches long wavelengths by `factor`, keeps short ones, and blends
    in between, as in the Llama 3.1 reference (and transformers' `_compute_llama3_parameters`).
    """
    if rope.type != "llama3":
        return None
    periods = rope.theta ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    wavelens = 2 * math.pi * periods
    old_ctx = rope.original_max_position_embeddings
    low_wavelen = old_ctx / rope.low_freq_factor
    high_wavelen = old_ctx / rope.high_freq_factor
    scaled = mx.where(wavelens > low_wavelen, periods * rope.factor, periods)
    smooth = (old_ctx / wavelens - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = scaled / ((1 - smooth) / rope.factor + smooth)
    medium = (wavelens > high_wavelen) & (wavelens < low_wavelen)
    return mx.where(medium, smoothed, scaled)


class RoPE(nn.Module):
    """Rotary position embedding in the HF "rotate_half" layout; positions start at `offset`."""

    def __init__(self, dims: int, rope: RopeConfig):
        super().__init__()
        self.dims = dims
        self.base = None if rope.type == "llama3" else rope.theta
        # linear scaling divides positions by `factor`
        self.scale = 1.0 / rope.factor if rope.type == "linear" else 1.0
        self._periods = rope_periods(dims, rope)  # underscore: not a parameter

    def __call__(
        self, q: mx.array, k: mx.array, offset: int | mx.array = 0
    ) -> tuple[mx.array, mx.array]:
        """Q and K rotated together (one kernel launch where the backend fuses them)."""
        return metal_kernels.rope_qk(
            q,
            k,
            self.dims,
            traditional=False,
            base=self.base,
            scale=self.scale,
            offset=offset,
            freqs=self._periods,
        )


class Attention(nn.Module):
    """Grouped-query attention: `n_heads` queries share `n_kv_heads` K/V heads.

    MHA (kv = heads), GQA and MQA (kv = 1) are this one code path; K/V stay at
    `n_kv_heads` (never repeated) and the fused SDPA kernel does the grouping.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, h, kv, hd = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.n_heads, self.n_kv_heads, self.head_dim = h, kv, hd
        self.scale = hd**-0.5
        self.q_proj = nn.Linear(d, h * hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(d, kv * hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(d, kv * hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(h * hd, d, bias=cfg.o_bias)
        self.rope = RoPE(hd, cfg.rope)

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        B, T, _ = x.shape
        q = self.q_proj(x).reshape(B, T, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(B, T, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, T, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, k, offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, T, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); SiLU on the gate path only."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, f, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(d, f, bias=b)
        self.up_proj = nn.Linear(d, f, bias=b)
        self.down_proj = nn.Linear(f, d, bias=b)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then h + mlp(norm(h))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        h, normed = self.post_attention_layernorm.add_and_norm(
            self.self_attn(self.input_layernorm(x), mask, cache), x
        )
        return h + self.mlp(normed)
