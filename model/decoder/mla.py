"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2; Kimi Linear's, whose "rope"
features are never rotated: the layer's spec has no RoPE).

Every head's K and V are linear maps of one small latent per token: c = norm(W_a x) of
`kv_lora_rank` features, plus one RoPE key of `rope_dim` features shared by all heads.
The cache holds exactly that (c in the `keys` slot, the rotated shared key in `values`,
one "head"), so a token costs (kv_lora_rank + rope_dim) elements per layer instead of
heads × (qk_head_dim + v_head_dim) as MHA: `kv_math.cached_widths` gives both.

Attention runs in the latent space ("absorbed" form): the per-head up-projection of the
keys, W_uk, is applied to the queries instead (q_nope·W_uk), and W_uv to the attention
output, so the cached latents are attended directly as one shared K/V head:

    scores = [q_nope W_uk, q_rope] · [c, k_rope]ᵀ,  out = (softmax(scores) c) W_uvᵀ

which equals transformers' expand-then-attend form exactly (matrix products reassociated).
W_uk and W_uv are held per head as mlx-community's DeepSeek-V3 layout has them
(`embed_q` (heads, rank, nope), `unembed_out` (heads, v, rank)); transformers' single
`kv_b_proj` is split into them on load (`split_kv_b`).
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from . import fast_exp
from .config import LayerSpec, ModelConfig
from .layers import RMSNorm, RoPE


class MultiLinear(nn.Module):
    """One (out, in) matrix per head: x (..., heads, T, in) -> (..., heads, T, out)."""

    def __init__(self, d_in: int, d_out: int, heads: int):
        super().__init__()
        self.weight = mx.zeros((heads, d_out, d_in))

    def __call__(self, x: mx.array) -> mx.array:
        return x @ self.weight.swapaxes(-1, -2)

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine"
                     ) -> QuantizedMultiLinear:
        h, d_out, d_in = self.weight.shape
        q = QuantizedMultiLinear(d_in, d_out, h, group_size, bits, mode)
        q.weight, q.scales, *rest = mx.quantize(self.weight, group_size, bits, mode=mode)
        q.biases = rest[0] if rest else None
        return q


class QuantizedMultiLinear(nn.Module):
    def __init__(self, d_in: int, d_out: int, heads: int, group_size: int = 64, bits: int = 4,
                 mode: str = "affine"):
        super().__init__()
        self.group_size, self.bits, self.mode = group_size, bits, mode
        self.weight = mx.zeros((heads, d_out, d_in * bits // 32), dtype=mx.uint32)
        self.scales = mx.zeros((heads, d_out, d_in // group_size))
        self.biases = mx.zeros((heads, d_out, d_in // group_size)) if mode == "affine" else None
        self.freeze()

    def __call__(self, x: mx.array) -> mx.array:
        return mx.quantized_matmul(x, self.weight, self.scales, self.get("biases"),
                                   transpose=True, group_size=self.group_size, bits=self.bits,
                                   mode=self.mode)

    def dequantized(self) -> MultiLinear:
        w = mx.dequantize(self.weight, self.scales, self.get("biases"), self.group_size,
                          self.bits, mode=self.mode).astype(self.scales.dtype)
        out = MultiLinear(w.shape[2], w.shape[1], w.shape[0])
        out.weight = w
        return out


def split_kv_b(cfg: ModelConfig, weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """transformers' `self_attn.kv_b_proj` (heads × (nope + v), rank), float or quantized
    (mlx-lm's DeepSeek-V2 keeps it), -> float `embed_q` and `unembed_out` per head."""
    mla = cfg.mla
    assert mla is not None
    out = dict(weights)
    for name in [k for k in weights if k.endswith(".kv_b_proj.weight")]:
        prefix = name[: -len(".kv_b_proj.weight")]
        w = out.pop(name)
        scales = out.pop(f"{prefix}.kv_b_proj.scales", None)
        if scales is not None:
            biases = out.pop(f"{prefix}.kv_b_proj.biases", None)
            bits = w.shape[-1] * 32 // mla.kv_lora_rank  # as mlx-lm infers them
            w = mx.dequantize(w, scales, biases, mla.kv_lora_rank // scales.shape[-1], bits
                              ).astype(scales.dtype)
        w = w.reshape(cfg.num_attention_heads, mla.nope_dim + mla.v_dim, -1)
        out[f"{prefix}.embed_q.weight"] = mx.contiguous(w[:, : mla.nope_dim].swapaxes(-1, -2))
        out[f"{prefix}.unembed_out.weight"] = mx.contiguous(w[:, mla.nope_dim :])
    return out


def _yarn_mscale(factor: float, m: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


class LatentAttention(nn.Module):
    """Parameter names as transformers' DeepseekV3Attention (q_a_proj, q_a_layernorm,
    q_b_proj or q_proj; kv_a_proj_with_mqa, kv_a_layernorm; o_proj), with kv_b_proj
    as mlx-community's embed_q and unembed_out."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec):
        super().__init__()
        mla = cfg.mla
        assert mla is not None
        self.mla = mla
        h, d = cfg.num_attention_heads, cfg.hidden_size
        self.n_heads = h
        qk = mla.nope_dim + mla.rope_dim
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(d, h * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, mla.q_lora_rank, bias=cfg.qkv_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, h * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, mla.kv_lora_rank + mla.rope_dim, bias=cfg.qkv_bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, 1e-6)
        self.embed_q = MultiLinear(mla.nope_dim, mla.kv_lora_rank, h)  # W_ukᵀ per head
        self.unembed_out = MultiLinear(mla.kv_lora_rank, mla.v_dim, h)  # W_uv per head
        self.o_proj = nn.Linear(h * mla.v_dim, d, bias=cfg.o_bias)
        self.scale = qk**-0.5
        self.rope = None
        self._pe_gain = 1.0
        rope = spec.rope
        if rope is not None:
            self.rope = RoPE(mla.rope_dim, rope, cfg.rope_traditional)
            if rope.type != "default" and rope.mscale_all_dim:
                # transformers (yarn_apply_mscale): softmax scale × mscale(all_dim)²
                self.scale *= _yarn_mscale(rope.factor, float(rope.mscale_all_dim)) ** 2
            m = rope.attention_scaling  # cos/sin × m: the rotated q·k part gains m²
            self._pe_gain = m * m

    def _queries(self, x: mx.array) -> mx.array:
        if "q_proj" in self:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        mla = self.mla
        B, T, _ = x.shape
        q = self._queries(x).reshape(B, T, self.n_heads, -1).transpose(0, 2, 1, 3)
        q_nope, q_pe = mx.split(q, [mla.nope_dim], axis=-1)
        c, k_pe = mx.split(self.kv_a_proj_with_mqa(x), [mla.kv_lora_rank], axis=-1)
        c = self.kv_a_layernorm(c)[:, None]  # (B, 1, T, rank): one shared "head"
        k_pe = k_pe[:, None]
        offset = cache.offset if cache is not None else 0
        if self.rope is not None:
            q_pe, k_pe = self.rope(q_pe, k_pe, offset)
        if self._pe_gain != 1.0:
            q_pe = q_pe * self._pe_gain
        if cache is not None:
            c, k_pe = cache.update_and_fetch(c, k_pe)
        queries = mx.concatenate([self.embed_q(q_nope), q_pe], axis=-1)  # (B, H, T, r + rope)
        keys = mx.concatenate([c, k_pe], axis=-1)
        out = fast_exp.attention(queries, keys, c, scale=self.scale, mask=mask)
        out = self.unembed_out(out)  # (B, H, T, v)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, T, -1))


def attention_class(cfg: ModelConfig) -> type | None:
    """The attention block `layers.make_block` should use for this config (None: GQA)."""
    return LatentAttention if cfg.mla is not None else None
