"""The decoder's building blocks, each small and named for the variation it carries:

- norms: `RMSNorm` (x̂·w) and `OffsetRMSNorm` (x̂·(1 + w), Gemma);
- `RoPE` (default, linear, llama3, yarn, dynamic NTK, longrope; partial rotary);
- `Attention` (grouped-query; q/k norm per head or over the projection, soft-capping,
  any scale, NoPE) and `FusedAttention` (one `qkv_proj`, Phi-3);
- `MLP` (gated: SwiGLU or GeGLU) and `FusedMLP` (one `gate_up_proj`, Phi-3); a layer
  whose spec says `moe` gets `moe.MoE` (router + gathered experts) instead;
- `mla.LatentAttention` where the config has latent attention (DeepSeek-V2/V3, Kimi
  Linear's attention layers);
- recurrent token mixers in the layers that do not attend (`MIXERS`): ssm.py's Mamba and
  Mamba-2, delta.py's gated delta rule and Kimi Delta Attention, conv.py's short
  convolution, rglru.py's RG-LRU (Griffin); a block holds either `self_attn` or `mixer`
  and runs whichever it has;
- blocks: `PreNormBlock`, `SandwichBlock` (4 norms, Gemma 2/3), `PostNormBlock` (OLMo 2),
  `MixerOnlyBlock` (Mamba: one branch, no MLP), `ParallelMixerBlock` (Falcon-H1:
  attention and the recurrent mixer side by side), `SharedBlock` (Zamba2: the mixer fed
  by a shared transformer block).

`families.FAMILIES` picks them; `make_block` is the only place that maps a resolved
config to classes. Parameter names mirror Hugging Face so checkpoints load as they are.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from kvchat import metal_kernels

from . import fast_exp, rows
from .activations import ACTIVATIONS
from .config import LayerSpec, ModelConfig
from .conv import ShortConv
from .delta import GatedDeltaNet, KimiDeltaAttention
from .families import FFN_KINDS, FULL, HYBRID, BlockKind, MixerKind, NormKind
from .kv_quant import packed_of, quantized_attention
from .mask import causal_mask
from .moe import MoE
from .rglru import RecurrentBlock
from .rope import RopeConfig
from .ssm import Mamba2Mixer, MambaMixer


# ---- norms ------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """x / RMS(x) * weight: no mean subtraction, no bias (unlike LayerNorm)."""

    def __init__(self, dims: int, eps: float = 1e-6):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def gain(self) -> mx.array:
        """The per-feature factor the kernel multiplies by."""
        return self.weight

    def __call__(self, x: mx.array) -> mx.array:
        return metal_kernels.rms_norm(x, self.gain(), self.eps)

    def add_and_norm(self, x: mx.array, residual: mx.array) -> tuple[mx.array, mx.array]:
        """(x + residual, norm(x + residual)) in one fused pass where the backend has it."""
        return metal_kernels.add_rms_norm(x, residual, self.gain(), self.eps)


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the checkpoint stores w - 1, so the gain is (1 + weight)."""

    def __init__(self, dims: int, eps: float = 1e-6):
        super().__init__(dims, eps)
        self.weight = mx.zeros((dims,))

    def gain(self) -> mx.array:
        return 1.0 + self.weight


class LayerNorm(nn.Module):
    """The 2017 norm, (x − mean) / std · w + b, in the variants the models still use:
    with or without bias (Cohere: weight only), w stored as w − 1 (Nemotron's
    LayerNorm1P), or no parameters at all (OLMo 1). `dims` may be (heads, head_dim):
    Cohere's q/k norm has one weight row per head."""

    def __init__(self, dims: int | tuple[int, ...], eps: float = 1e-5, bias: bool = True,
                 affine: bool = True, offset: bool = False):
        super().__init__()
        self.eps, self._offset = eps, offset
        if affine:
            self.weight = mx.zeros(dims) if offset else mx.ones(dims)
            if bias:
                self.bias = mx.zeros(dims)

    def __call__(self, x: mx.array) -> mx.array:
        w = self.get("weight")
        if w is not None and self._offset:
            w = 1.0 + w
        if w is None or w.ndim == 1:
            return mx.fast.layer_norm(x, w, self.get("bias"), self.eps)
        y = mx.fast.layer_norm(x, None, None, self.eps) * w
        return y + self.bias if "bias" in self else y

    def add_and_norm(self, x: mx.array, residual: mx.array) -> tuple[mx.array, mx.array]:
        h = x + residual
        return h, self(h)


class PlainRMSNorm(nn.Module):
    """x / RMS(x) with no parameters (nanochat)."""

    def __init__(self, dims: Any = None, eps: float = 1e-6):
        super().__init__()
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, None, self.eps)

    def add_and_norm(self, x: mx.array, residual: mx.array) -> tuple[mx.array, mx.array]:
        h = x + residual
        return h, self(h)


NORMS: dict[NormKind, Callable[[Any, float], nn.Module]] = {
    "rms": RMSNorm,
    "rms_noparam": PlainRMSNorm,
    "offset": OffsetRMSNorm,
    "layer": LayerNorm,
    "layer_nobias": lambda dims, eps: LayerNorm(dims, eps, bias=False),
    "layer1p": lambda dims, eps: LayerNorm(dims, eps, offset=True),
    "layer_noparam": lambda dims, eps: LayerNorm(dims, eps, affine=False),
}


def make_norm(cfg: ModelConfig, dims: int | tuple[int, ...]) -> Any:
    return NORMS[cfg.norm](dims, cfg.rms_norm_eps)


# ---- RoPE -------------------------------------------------------------------------------
def _base_periods(dims: int, theta: float | mx.array) -> mx.array:
    return theta ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)


def rope_periods(dims: int, rope: RopeConfig) -> mx.array | None:
    """Per-pair periods (1 / inverse frequency) of a scaled RoPE that does not depend on
    the sequence length; `None` where a plain base-theta schedule does (default, linear,
    dynamic within the trained context). Formulas as transformers' `modeling_rope_utils`."""
    if rope.type == "llama3":
        # stretch long wavelengths by `factor`, keep short ones, blend in between
        periods = _base_periods(dims, rope.theta)
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
    if rope.type == "yarn":
        # interpolate (÷ factor) the low frequencies, extrapolate the high ones, ramp between
        def correction_dim(rotations: float) -> float:
            return (dims * math.log(rope.original_max_position_embeddings /
                                    (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

        low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
        if rope.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dims - 1)
        if low == high:
            high += 0.001  # as the reference: avoid a zero-width ramp
        ramp = mx.clip((mx.arange(dims // 2, dtype=mx.float32) - low) / (high - low), 0, 1)
        inv = 1.0 / _base_periods(dims, rope.theta)
        extrapolate = 1 - ramp
        inv = (inv / rope.factor) * (1 - extrapolate) + inv * extrapolate
        return 1.0 / inv
    return None


class RoPE(nn.Module):
    """Rotary position embedding in the HF "rotate_half" layout over the first `dims`
    features; positions start at `offset`.

    Two schedules depend on how far the sequence reaches (`offset + T`), as in
    transformers: longrope uses its short factors up to `original_max_position_embeddings`
    and its long factors past it; dynamic NTK raises the base past the trained context.
    """

    def __init__(self, dims: int, rope: RopeConfig, traditional: bool = False,
                 negative: bool = False):
        super().__init__()
        self.dims = dims
        self.traditional = traditional  # adjacent pairs (DeepSeek) instead of rotate_half
        self._cfg = rope
        self.base = None if rope.type in ("llama3", "yarn", "longrope") else rope.theta
        self.scale = 1.0 / rope.factor if rope.type == "linear" else 1.0  # positions ÷ factor
        self._periods = rope_periods(dims, rope)  # underscore: not a parameter
        if negative:  # nanochat rotates the other way: negative periods, negative angles
            periods = self._periods if self._periods is not None else _base_periods(
                dims, rope.theta)
            self.base, self._periods = None, -periods
        if rope.type == "longrope":
            base = _base_periods(dims, rope.theta)
            self._short = mx.array(rope.short_factor, dtype=mx.float32) * base
            self._long = mx.array(rope.long_factor, dtype=mx.float32) * base

    @property
    def rotates_rows(self) -> bool:
        """Whether an offset array (B,) rotates each row at its own position: not where
        the schedule itself depends on the position (longrope, dynamic NTK)."""
        return self._cfg.type not in ("longrope", "dynamic")

    def _schedule(self, end: int | mx.array) -> tuple[float | None, mx.array | None]:
        """(base, periods) for a call whose last position is `end - 1`."""
        rope = self._cfg
        if rope.type == "longrope":
            orig = rope.original_max_position_embeddings
            if isinstance(end, int):
                return None, self._long if end > orig else self._short
            return None, mx.where(end > orig, self._long, self._short)
        if rope.type == "dynamic":
            ctx = rope.max_position_embeddings
            if isinstance(end, int) and end <= ctx:
                return self.base, None
            seq = mx.maximum(mx.array(end, dtype=mx.float32), ctx)
            base = rope.theta * ((rope.factor * seq / ctx) - (rope.factor - 1)) ** (
                self.dims / (self.dims - 2)
            )
            return None, _base_periods(self.dims, base)
        return self.base, self._periods

    def __call__(
        self, q: mx.array, k: mx.array, offset: int | mx.array = 0
    ) -> tuple[mx.array, mx.array]:
        """Q and K rotated together (one kernel launch where the backend fuses them)."""
        base, periods = self._schedule(offset + q.shape[-2])
        return metal_kernels.rope_qk(
            q, k, self.dims, traditional=self.traditional, base=base, scale=self.scale,
            offset=offset, freqs=periods,
        )

    def rotate(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        """One tensor rotated (tests, tools)."""
        base, periods = self._schedule(offset + x.shape[-2])
        return metal_kernels.rope(
            x, self.dims, traditional=self.traditional, base=base, scale=self.scale, offset=offset,
            freqs=periods,
        )


# ---- attention --------------------------------------------------------------------------
def softcapped_attention(
    q: mx.array, k: mx.array, v: mx.array, scale: float, cap: float, mask: Any
) -> mx.array:
    """Attention with Gemma 2's logit soft-capping, cap·tanh(s / cap) before the mask;
    the fused SDPA kernel has no such step. K/V stay at n_kv_heads (grouped, not repeated)."""
    B, H, T, D = q.shape
    kv = k.shape[1]
    S = k.shape[2]
    qg = q.reshape(B, kv, H // kv, T, D)
    scores = (qg @ k[:, :, None].swapaxes(-1, -2)) * scale
    scores = fast_exp.tanh(scores / cap) * cap
    if isinstance(mask, str):
        mask = causal_mask(T, S - T)
    if mask is not None:
        scores = mx.where(mask, scores, mx.array(-mx.inf, scores.dtype))
    p = fast_exp.softmax(scores).astype(v.dtype)
    return (p @ v[:, :, None]).reshape(B, H, T, -1)


class Attention(nn.Module):
    """Grouped-query attention: `n_heads` queries share `n_kv_heads` K/V heads.

    MHA (kv = heads), GQA and MQA (kv = 1) are this one code path; K/V stay at
    `n_kv_heads` (never repeated) and the fused SDPA kernel does the grouping.
    Extras from the config: q/k RMSNorm per head (Qwen3, Gemma 3) or over the whole
    projection (OLMo 2), a scale other than head_dim^-0.5, soft-capping, no RoPE.
    """

    takes_rows = True  # a batch's `Rows` in one call (rows.mix)

    def __init__(self, cfg: ModelConfig, spec: LayerSpec | None = None):
        super().__init__()
        spec = spec or LayerSpec(FULL, None, cfg.rope)
        d, h, kv, hd = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.n_heads, self.n_kv_heads, self.head_dim = h, kv, hd
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else hd**-0.5
        self.scale *= cfg.key_scale  # Falcon-H1: k × key_multiplier, q·k scales alike
        self.softcap = cfg.attn_softcap
        self.clip = cfg.clip_qkv
        self._pos_scale = cfg.q_position_scale
        # Llama 4's temperature tuning applies to its NoPE layers only
        self._temperature = cfg.temperature if spec.rope is None else None
        self._projections(cfg)
        self.o_proj = nn.Linear(h * hd, d, bias=cfg.o_bias)
        if cfg.attention_sinks:  # gpt-oss: one more logit per head that takes probability
            self.sinks = mx.zeros((h,))
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm == "each_head":  # Cohere: a weight row per head
            self.q_norm, self.k_norm = make_norm(cfg, (h, hd)), make_norm(cfg, (kv, hd))
        elif cfg.qk_norm == "plain_after_rope":  # Llama 4: parameter-free, RoPE layers only
            self.qk_norm = "head_after_rope" if spec.rope is not None else None
            if self.qk_norm is not None:
                self.q_norm = self.k_norm = PlainRMSNorm(hd, cfg.rms_norm_eps)
        elif cfg.qk_norm is not None:
            per_head = cfg.qk_norm != "proj"
            self.q_norm = make_norm(cfg, hd if per_head else h * hd)
            self.k_norm = make_norm(cfg, hd if per_head else kv * hd)
        self.rope = None
        self._q_gain = None  # yarn/longrope attention factor on the rotated features
        if spec.rope is not None:
            dims = spec.rope.rotary_dims(hd)
            self.rope = RoPE(dims, spec.rope, cfg.rope_traditional, cfg.rope_negative)
            m = spec.rope.attention_scaling
            if m != 1.0:
                # transformers scales cos and sin by m, i.e. q and k's rotated features:
                # q·k gains m² there. Fold it into the scale, or into q where partial.
                if dims == hd:
                    self.scale *= m * m
                else:
                    self._q_gain = mx.concatenate([mx.full((dims,), m * m), mx.ones((hd - dims,))])

    def _projections(self, cfg: ModelConfig) -> None:
        d, h, kv, hd = cfg.hidden_size, self.n_heads, self.n_kv_heads, self.head_dim
        self.q_proj = nn.Linear(d, h * hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(d, kv * hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(d, kv * hd, bias=cfg.qkv_bias)

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def rotated_qkv(
        self, x: mx.array, offset: int | mx.array = 0
    ) -> tuple[mx.array, mx.array, mx.array]:
        """Q, K, V (B, heads, T, head_dim) as attention uses them: projected, q/k-normed,
        rotated from position `offset` (model/explain/attention_view.py reads Q through this)."""
        return self._heads(*self.project(x), offset)

    def _heads(self, q: mx.array, k: mx.array, v: mx.array, offset: int | mx.array
               ) -> tuple[mx.array, mx.array, mx.array]:
        """`rotated_qkv` after the projections: `offset` an int, or (B,) for each row's."""
        B, T, _ = q.shape
        if self.qk_norm == "proj":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:  # OLMoE: after the norms, as transformers clamps
            q, k, v = (mx.clip(t, -self.clip, self.clip) for t in (q, k, v))
        q = q.reshape(B, T, self.n_heads, -1)
        k = k.reshape(B, T, self.n_kv_heads, -1)
        if self.qk_norm in ("head", "each_head"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
        v = v.reshape(B, T, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if self.rope is not None:
            q, k = self.rope(q, k, offset)
        if self.qk_norm == "head_after_rope":  # Hunyuan: q/k normed once rotated
            q, k = self.q_norm(q), self.k_norm(k)
        if self._temperature is not None:
            floor_scale, attn_scale = self._temperature
            pos = (offset + mx.arange(T)).astype(mx.float32)
            t = mx.log1p(mx.floor((pos + 1.0) / floor_scale)) * attn_scale + 1.0
            q = q * t[:, None].astype(q.dtype)
        if self._pos_scale is not None:
            beta, period = self._pos_scale
            pos = (offset + mx.arange(T)).astype(mx.float32)
            q = q * (1 + beta * mx.log(1 + mx.floor(pos / period)))[:, None].astype(q.dtype)
        if self._q_gain is not None:
            q = q * self._q_gain.astype(q.dtype)
        return q, k, v

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        if isinstance(cache, rows.Rows):
            return self._rows(x, mask, cache)
        B, T, _ = x.shape
        q, k, v = self.rotated_qkv(x, cache.offset if cache is not None else 0)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = self.attend(q, k, v, mask, cache)
        return self.o_proj(self.gated(out.transpose(0, 2, 1, 3).reshape(B, T, -1)))

    def attend(self, q: mx.array, k: Any, v: Any, mask: Any, cache: Any) -> mx.array:
        """Attention (B, heads, T, head_dim) of rotated Q over the cache's K/V."""
        if isinstance(k, (tuple, list)):  # a quantized cache: attention on the packed K/V
            return quantized_attention(q, k, v, packed_of(cache, k, self.head_dim), self.scale,
                                       mask, self.softcap)
        if self.softcap is not None:
            return softcapped_attention(q, k, v, self.scale, self.softcap, mask)
        return fast_exp.attention(q, k, v, scale=self.scale, mask=mask, sinks=self.get("sinks"))

    def _rows(self, x: mx.array, masks: Any, cache: rows.Rows) -> mx.array:
        """A batch's rows, each over its own cache (model/decoder/rows.py): projections
        and RoPE once for all rows (each at its own position), each row's K/V written to
        its own cache, attention in one call where the rows' K/V line up (rows.stacked),
        else row by row."""
        B, T, _ = x.shape
        q, k, v = self.project(x)
        if self._rotates_batched():
            q, k, v = self._heads(q, k, v, rows.offset_array(cache))
        else:
            heads = [self._heads(q[i : i + 1], k[i : i + 1], v[i : i + 1], o)
                     for i, o in enumerate(cache.offsets)]
            q, k, v = (mx.concatenate(t) for t in zip(*heads, strict=True))
        kvs = [c.update_and_fetch(k[i : i + 1], v[i : i + 1])
               for i, c in enumerate(cache.caches)]
        row_masks = rows.row_masks(masks, len(cache))
        joint = rows.stacked(kvs, row_masks, T) if self.softcap is None else None
        if joint is not None:
            out = self.attend(q, *joint, None)
        else:
            out = mx.concatenate([self.attend(q[i : i + 1], ki, vi, m, c) for i, ((ki, vi), m, c)
                                  in enumerate(zip(kvs, row_masks, cache.caches, strict=True))])
        return self.o_proj(self.gated(out.transpose(0, 2, 1, 3).reshape(B, T, -1)))

    def _rotates_batched(self) -> bool:
        """Whether one (B,) offset array rotates every row as its own offset would: not
        where the rotation's schedule or a position scale reads the position as a scalar."""
        return ((self.rope is None or self.rope.rotates_rows) and self._temperature is None
                and self._pos_scale is None)

    def gated(self, out: mx.array) -> mx.array:
        """The heads' output before o_proj (GatedAttention multiplies in its gate)."""
        return out


class FusedAttention(Attention):
    """Phi-3: Q, K and V come from one `qkv_proj` matmul (as the checkpoint stores it)."""

    def _projections(self, cfg: ModelConfig) -> None:
        h, kv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, (h + 2 * kv) * hd, bias=cfg.qkv_bias)

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        q_end = self.n_heads * self.head_dim
        q, k, v = mx.split(self.qkv_proj(x), [q_end, q_end + self.n_kv_heads * self.head_dim], -1)
        return q, k, v


class GatedAttention(Attention):
    """Qwen3-Next: q_proj yields each head's query and a gate of the same width (interleaved
    per head); the attention output is multiplied by sigmoid(gate) before o_proj."""

    def _projections(self, cfg: ModelConfig) -> None:
        super()._projections(cfg)
        self.q_proj = nn.Linear(cfg.hidden_size, 2 * self.n_heads * self.head_dim,
                                bias=cfg.qkv_bias)

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        q, k, v = super().project(x)
        B, T, _ = q.shape
        q = q.reshape(B, T, self.n_heads, 2, self.head_dim)
        self._gate = q[..., 1, :].reshape(B, T, -1)  # read by `gated` later in the same call
        return q[..., 0, :].reshape(B, T, -1), k, v

    def gated(self, out: mx.array) -> mx.array:
        return out * fast_exp.sigmoid(self._gate)


# ---- recurrent token mixers ----------------------------------------------------------------
MIXERS: dict[MixerKind, Callable[[Any, int], nn.Module]] = {
    "mamba": MambaMixer,
    "mamba2": Mamba2Mixer,
    "gated_delta": GatedDeltaNet,
    "short_conv": ShortConv,
    "rglru": RecurrentBlock,
    "kda": KimiDeltaAttention,
}


# ---- MLP --------------------------------------------------------------------------------
class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); SwiGLU with SiLU, GeGLU with GELU.
    `size`: the intermediate size when not the config's (a shared expert)."""

    def __init__(self, cfg: ModelConfig, size: int | None = None):
        super().__init__()
        self.act = ACTIVATIONS[cfg.activation]
        self.size = size or cfg.intermediate_size
        self._projections(cfg)
        self.down_proj = nn.Linear(self.size, cfg.hidden_size, bias=cfg.mlp_bias)
        self._scales = cfg.mlp_scales  # Falcon-H1: gate × first, output × second

    def _projections(self, cfg: ModelConfig) -> None:
        d, f, b = cfg.hidden_size, self.size, cfg.mlp_bias
        self.gate_proj = nn.Linear(d, f, bias=b)
        self.up_proj = nn.Linear(d, f, bias=b)

    def gate_and_up(self, x: mx.array) -> tuple[mx.array, mx.array]:
        return self.gate_proj(x), self.up_proj(x)

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = self.gate_and_up(x)
        if self._scales is None:
            return self.down_proj(self.act(gate) * up)
        return self.down_proj(self.act(gate * self._scales[0]) * up) * self._scales[1]


class XIELU(nn.Module):
    """Apertus' xIELU, a learned activation (per layer: alpha_p, alpha_n, beta, eps):
    αp·x² + β·x for x > 0, else (expm1(min(x, eps)) − x)·αn + β·x, with αp = softplus(a_p)
    and αn = β + softplus(a_n)."""

    def __init__(self) -> None:
        super().__init__()
        self.alpha_p = mx.zeros((1,))
        self.alpha_n = mx.zeros((1,))
        self.beta = mx.array(0.5)
        self.eps = mx.array(-1e-6)

    def __call__(self, x: mx.array) -> mx.array:
        ap = nn.softplus(self.alpha_p)
        an = self.beta + nn.softplus(self.alpha_n)
        neg = (mx.expm1(mx.minimum(x, self.eps)) - x) * an + self.beta * x
        return mx.where(x > 0, ap * x * x + self.beta * x, neg)


class PlainMLP(nn.Module):
    """The ungated MLP, down(act(up(x))) (Phi-2's fc1/fc2, StarCoder2's c_fc/c_proj,
    Nemotron's relu², Apertus' learned xIELU), biases as the config says."""

    def __init__(self, cfg: ModelConfig, size: int | None = None):
        super().__init__()
        f = size or cfg.intermediate_size
        if cfg.activation == "xielu":
            self.act_fn = XIELU()  # parameters: a module, as the checkpoint names it
        else:
            self.act = ACTIVATIONS[cfg.activation]
        self.up_proj = nn.Linear(cfg.hidden_size, f, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(f, cfg.hidden_size, bias=cfg.mlp_bias)

    def __call__(self, x: mx.array) -> mx.array:
        act = self.act_fn if "act_fn" in self else self.act
        return self.down_proj(act(self.up_proj(x)))


class FusedMLP(MLP):
    """Phi-3: gate and up from one `gate_up_proj` matmul (gate first, as the checkpoint)."""

    def _projections(self, cfg: ModelConfig) -> None:
        f = self.size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * f, bias=cfg.mlp_bias)

    def gate_and_up(self, x: mx.array) -> tuple[mx.array, mx.array]:
        gate, up = mx.split(self.gate_up_proj(x), 2, axis=-1)
        return gate, up


# ---- blocks -----------------------------------------------------------------------------
class Block(nn.Module):
    """A layer's two branches, self_attn and mlp, in the projection layout the config asks.

    `deferred(x, pending, ...)` is the same layer with the residual stream split in two,
    x + pending: a block may leave its last residual add to whoever norms next (the next
    block's input norm, or the final norm), which does add and norm in one fused pass."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, attention: type | None = None):
        super().__init__()
        if spec.attends:
            self.self_attn = make_attention(cfg, spec, attention)
        else:
            self.mixer = make_mixer(cfg, spec)
        self.mlp = make_ffn(cfg, spec)

    def mix(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        """The token mixer this layer has: attention, or the family's recurrent mixer."""
        return rows.mix(self.self_attn if "self_attn" in self else self.mixer, x, mask, cache)

    def deferred(
        self, x: mx.array, pending: mx.array | None, mask: Any = None, cache: Any = None
    ) -> tuple[mx.array, mx.array | None]:
        return self(x if pending is None else x + pending, mask, cache), None

    def attention_input(self, x: mx.array, pending: mx.array | None) -> mx.array:
        """What self_attn reads from the residual stream x + pending: its norm (pre-norm
        and sandwich blocks)."""
        return self.input_layernorm(x if pending is None else x + pending)


class PreNormBlock(Block):
    """x + r·attn(norm(x)), then h + r·mlp(norm(h)); r = residual multiplier (Granite)."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, attention: type | None = None):
        super().__init__(cfg, spec, attention)
        self.input_layernorm = make_norm(cfg, cfg.hidden_size)
        self.post_attention_layernorm = make_norm(cfg, cfg.hidden_size)
        self._r = None if cfg.residual_scale == 1.0 else cfg.residual_scale

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        h, m = self.deferred(x, None, mask, cache)
        return h + m

    def deferred(
        self, x: mx.array, pending: mx.array | None, mask: Any = None, cache: Any = None
    ) -> tuple[mx.array, mx.array]:
        """The previous block's last add fused with this block's input norm, the mid-block
        add with the second norm; the MLP branch is left pending for the next norm."""
        if pending is None:
            normed = self.input_layernorm(x)
        else:
            x, normed = self.input_layernorm.add_and_norm(pending, x)
        a = self.mix(normed, mask, cache)
        if self._r is not None:
            a = a * self._r
        h, normed = self.post_attention_layernorm.add_and_norm(a, x)
        m = self.mlp(normed)
        return h, (m if self._r is None else m * self._r)


class SandwichBlock(PreNormBlock):
    """Gemma 2/3: each branch normed on the way in and on the way out (four norms)."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, attention: type | None = None):
        super().__init__(cfg, spec, attention)
        self.pre_feedforward_layernorm = make_norm(cfg, cfg.hidden_size)
        self.post_feedforward_layernorm = make_norm(cfg, cfg.hidden_size)

    def deferred(
        self, x: mx.array, pending: mx.array | None, mask: Any = None, cache: Any = None
    ) -> tuple[mx.array, mx.array]:
        if pending is None:
            normed = self.input_layernorm(x)
        else:
            x, normed = self.input_layernorm.add_and_norm(pending, x)
        a = self.post_attention_layernorm(self.mix(normed, mask, cache))
        h, normed = self.pre_feedforward_layernorm.add_and_norm(a, x)
        return h, self.post_feedforward_layernorm(self.mlp(normed))


class PostNormBlock(Block):
    """OLMo 2: no norm on the way in; each branch's output is normed before the add."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, attention: type | None = None):
        super().__init__(cfg, spec, attention)
        self.post_attention_layernorm = make_norm(cfg, cfg.hidden_size)
        self.post_feedforward_layernorm = make_norm(cfg, cfg.hidden_size)

    def attention_input(self, x: mx.array, pending: mx.array | None) -> mx.array:
        return x if pending is None else x + pending  # no norm on the way in

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        h = x + self.post_attention_layernorm(self.mix(x, mask, cache))
        return h + self.post_feedforward_layernorm(self.mlp(h))


class PostLNBlock(PostNormBlock):
    """The 2017 block: LayerNorm of each residual sum, LN(x + attn(x)), LN(h + mlp(h))."""

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        h = self.post_attention_layernorm(x + self.mix(x, mask, cache))
        return self.post_feedforward_layernorm(h + self.mlp(h))


class ParallelBlock(Block):
    """Phi-2, Cohere, GPT-NeoX: both branches read the same input, x + attn(n(x)) +
    mlp(n'(x)), with n' = n (one norm) or its own post_attention_layernorm."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, attention: type | None = None):
        super().__init__(cfg, spec, attention)
        self.input_layernorm = make_norm(cfg, cfg.hidden_size)
        if cfg.block == "parallel2":
            self.post_attention_layernorm = make_norm(cfg, cfg.hidden_size)

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        normed = self.input_layernorm(x)
        a = self.mix(normed, mask, cache)
        if "post_attention_layernorm" in self:
            normed = self.post_attention_layernorm(x)
        return x + a + self.mlp(normed)


class MixerOnlyBlock(Block):
    """Mamba, Mamba-2, Nemotron-H: one branch per layer, x + mixer(norm(x)), no separate
    MLP (transformers' names: `norm`, `mixer`); the branch is the recurrent mixer,
    attention, or (Nemotron-H's FFN layers) an MLP or the mixture of experts alone. The add
    is left pending for the next norm, as PreNormBlock."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, attention: type | None = None):
        nn.Module.__init__(self)
        self.norm = make_norm(cfg, cfg.hidden_size)
        self._ffn = spec.kind in FFN_KINDS
        self.mixer = (make_ffn(cfg, spec) if self._ffn else make_attention(cfg, spec, attention)
                      if spec.attends else make_mixer(cfg, spec))

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        h, m = self.deferred(x, None, mask, cache)
        return h + m

    def attention_input(self, x: mx.array, pending: mx.array | None) -> mx.array:
        return self.norm(x if pending is None else x + pending)

    def deferred(
        self, x: mx.array, pending: mx.array | None, mask: Any = None, cache: Any = None
    ) -> tuple[mx.array, mx.array]:
        if pending is None:
            normed = self.norm(x)
        else:
            x, normed = self.norm.add_and_norm(pending, x)
        if not self._ffn:
            return x, rows.mix(self.mixer, normed, mask, cache)
        if cache is not None:  # a state.PassCache: it only counts the tokens
            cache.advance(x.shape[1])
        return x, self.mixer(normed)


class ParallelMixerBlock(Block):
    """Falcon-H1: attention and the recurrent mixer read the same normed input side by
    side, x + a_out·attn(a_in·n(x)) + m_out·mixer(n(x)) (branch_scales), then the MLP
    pre-norm as PreNormBlock. Its cache holds both: K/V and a state
    (model/cache/hybrid.py: `kv`, `mixer`)."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, attention: type | None = None):
        nn.Module.__init__(self)
        self.self_attn = make_attention(cfg, spec, attention)
        self.mixer = make_mixer(cfg, spec)
        self.mlp = make_ffn(cfg, spec)
        self.input_layernorm = make_norm(cfg, cfg.hidden_size)
        self.post_attention_layernorm = make_norm(cfg, cfg.hidden_size)
        self._scales = cfg.branch_scales or (1.0, 1.0, 1.0)

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        h, m = self.deferred(x, None, mask, cache)
        return h + m

    def deferred(
        self, x: mx.array, pending: mx.array | None, mask: Any = None, cache: Any = None
    ) -> tuple[mx.array, mx.array]:
        if pending is None:
            normed = self.input_layernorm(x)
        else:
            x, normed = self.input_layernorm.add_and_norm(pending, x)
        a_in, a_out, m_out = self._scales
        attn_in = normed if a_in == 1.0 else normed * a_in
        a = rows.mix(self.self_attn, attn_in, mask, rows.part(cache, "kv"))
        s = rows.mix(self.mixer, normed, None, rows.part(cache, "mixer"))
        h, normed = self.post_attention_layernorm.add_and_norm(a * a_out + s * m_out, x)
        return h, self.mlp(normed)

    def attention_input(self, x: mx.array, pending: mx.array | None) -> mx.array:
        normed = self.input_layernorm(x if pending is None else x + pending)
        return normed if self._scales[0] == 1.0 else normed * self._scales[0]


# ---- Zamba2: layers fed by shared transformer blocks ---------------------------------------
# A hybrid layer (families.HYBRID) runs shared block b = (its rank among the hybrid layers)
# mod num_mem_blocks on [x, e] (the residual stream beside the token embeddings, 2 × hidden
# wide): RMSNorm, attention over that width (head_dim 2·hidden / heads, scale
# (head_dim / 2)^-0.5, no residual), RMSNorm, a fused gated MLP; each use adds its own
# low-rank adapters (q, k, v when use_shared_attention_adapter; gate_up always). The block's
# output goes through the layer's own `linear` into the mixer's input:
# x + mixer(norm(x + linear(block(x, e)))); a plain layer is x + mixer(norm(x)). Every
# hybrid layer holds its own module tree (weights.share_blocks binds the stored block to
# each user, the same arrays).
def _adapter(d_in: int, rank: int, d_out: int) -> list[nn.Linear]:
    """A low-rank adapter, up(down(x)) (transformers' Sequential of two Linear)."""
    return [nn.Linear(d_in, rank, bias=False), nn.Linear(rank, d_out, bias=False)]


def _run(adapter: list[nn.Linear], x: mx.array) -> mx.array:
    return adapter[1](adapter[0](x))


class SharedAttention(Attention):
    """Attention over [x, e] (2 × hidden), q, k and v each plus its adapter."""

    def _projections(self, cfg: ModelConfig) -> None:
        d, h, kv, hd = 2 * cfg.hidden_size, self.n_heads, self.n_kv_heads, self.head_dim
        self.scale = (hd / 2) ** -0.5
        self.q_proj = nn.Linear(d, h * hd, bias=False)
        self.k_proj = nn.Linear(d, kv * hd, bias=False)
        self.v_proj = nn.Linear(d, kv * hd, bias=False)
        if cfg.qkv_adapters:
            rank = cfg.adapter_rank
            self.linear_q_adapter = _adapter(d, rank, h * hd)
            self.linear_k_adapter = _adapter(d, rank, kv * hd)
            self.linear_v_adapter = _adapter(d, rank, kv * hd)

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        q, k, v = super().project(x)
        if "linear_q_adapter" in self:
            q = q + _run(self.linear_q_adapter, x)
            k = k + _run(self.linear_k_adapter, x)
            v = v + _run(self.linear_v_adapter, x)
        return q, k, v


class SharedMLP(FusedMLP):
    """The shared block's fused gated MLP, gate_up plus this use's adapter."""

    def _projections(self, cfg: ModelConfig) -> None:
        super()._projections(cfg)
        self.gate_up_proj_adapter = _adapter(cfg.hidden_size, cfg.adapter_rank, 2 * self.size)

    def gate_and_up(self, x: mx.array) -> tuple[mx.array, mx.array]:
        gate_up = self.gate_up_proj(x) + _run(self.gate_up_proj_adapter, x)
        gate, up = mx.split(gate_up, 2, axis=-1)
        return gate, up


class SharedTransformer(nn.Module):
    """norm([x, e]) -> attention -> norm -> MLP, no residual (transformers' names)."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec):
        super().__init__()
        self.input_layernorm = make_norm(cfg, 2 * cfg.hidden_size)
        self.self_attn = SharedAttention(cfg, spec)
        self.pre_ff_layernorm = make_norm(cfg, cfg.hidden_size)
        self.feed_forward = SharedMLP(cfg)

    def __call__(self, x: mx.array, emb: mx.array, mask: Any, cache: Any) -> mx.array:
        a = rows.mix(self.self_attn, self.input_layernorm(mx.concatenate([x, emb], axis=-1)),
                     mask, cache)
        return self.feed_forward(self.pre_ff_layernorm(a))


class SharedBlock(Block):
    """One Zamba2 layer: x + mixer(norm(x [+ linear(shared(x, e))])). It reads the token
    embeddings (`reads_embeddings`: transformer.run_layers passes them)."""

    reads_embeddings = True

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, attention: type | None = None):
        nn.Module.__init__(self)
        self.input_layernorm = make_norm(cfg, cfg.hidden_size)
        self.mixer = make_mixer(cfg, spec)
        if spec.kind == HYBRID:
            self.shared_transformer = SharedTransformer(cfg, spec)
            self.linear = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None,
                 emb: mx.array | None = None) -> mx.array:
        h, m = self.deferred(x, None, mask, cache, emb)
        return h + m

    def attention_input(self, x: mx.array, pending: mx.array | None) -> mx.array:
        raise NotImplementedError("the attention view does not show a shared block's input")

    def deferred(
        self, x: mx.array, pending: mx.array | None, mask: Any = None, cache: Any = None,
        emb: mx.array | None = None,
    ) -> tuple[mx.array, mx.array]:
        x = x if pending is None else x + pending
        if "shared_transformer" not in self:
            return x, rows.mix(self.mixer, self.input_layernorm(x), None, cache)
        if emb is None:
            raise ValueError("a Zamba2 hybrid layer needs the token embeddings")
        t = self.linear(self.shared_transformer(x, emb, mask, rows.part(cache, "kv")))
        m = rows.mix(self.mixer, self.input_layernorm(x + t), None, rows.part(cache, "mixer"))
        return x, m


BLOCKS: dict[BlockKind, type[Block]] = {
    "pre": PreNormBlock,
    "sandwich": SandwichBlock,
    "post": PostNormBlock,
    "parallel": ParallelBlock,
    "parallel2": ParallelBlock,
    "post_ln": PostLNBlock,
    "mixer_only": MixerOnlyBlock,
    "parallel_mixer": ParallelMixerBlock,
    "shared_block": SharedBlock,
}


def make_attention(cfg: ModelConfig, spec: LayerSpec, attention: type | None = None) -> nn.Module:
    """The attention of a layer that attends: `attention` (mla.LatentAttention) or GQA in
    the projection layout the config asks (fused, gated)."""
    attn = attention or (FusedAttention if cfg.fused_proj else GatedAttention
                         if cfg.attention_gate else Attention)
    return attn(cfg, spec)


def make_ffn(cfg: ModelConfig, spec: LayerSpec) -> nn.Module:
    """The layer's feed-forward: its MLP in the config's layout, or the mixture of experts
    (with such MLPs as shared experts) where the spec says `moe`."""
    mlp = (PlainMLP if cfg.mlp == "plain" else FusedMLP if cfg.fused_proj or cfg.mlp == "fused"
           else MLP)
    return MoE(cfg, ACTIVATIONS[cfg.activation], mlp) if spec.moe else mlp(cfg)


def make_mixer(cfg: ModelConfig, spec: LayerSpec) -> nn.Module:
    """The recurrent token mixer of a layer that does not attend."""
    assert spec.mixer is not None and cfg.mixer is not None
    return MIXERS[spec.mixer](cfg.mixer, cfg.hidden_size)


def make_block(cfg: ModelConfig, spec: LayerSpec, attention: type | None = None) -> Block:
    """The layer the config asks for; `attention` replaces the GQA block (mla.py's latent
    attention builds on this module's RoPE and norms, so it is passed in, not imported).
    A recurrent layer takes the family's `recurrent_block` layout where it has one."""
    block = cfg.recurrent_block if spec.mixer is not None and cfg.recurrent_block else cfg.block
    return BLOCKS[block](cfg, spec, attention)
