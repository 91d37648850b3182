"""K/V quantization: how a cache stores K and V in 8 or 4 bits, and attention on them.

A quantized buffer is the triple `mx.quantize` returns, (packed uint32, scales, biases),
each shaped (B, n_kv_heads, slots, ·) so every slot operation of the float cache (grow,
write a run of slots, read the first n) applies to each part alike. `mx.quantize` takes
group sizes 32, 64 and 128 only: the default is 64 where head_dim allows, else 32, and a
head_dim no group size divides (the shipped model's 24) is zero-padded to the next
multiple of the group. The padding is stored, so it is counted in the bytes; queries
are padded with zeros too (q·k is unchanged) and the output's padded features dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from . import fast_exp
from .kv_format import KVQuant, kv_quant

__all__ = ["KVQuant", "Packed", "kv_quant", "packed_of", "quantized_attention"]

@dataclass(frozen=True)
class Packed:
    """One quantized K or V chunk / buffer layout, bound to a head_dim."""

    bits: int
    group_size: int
    head_dim: int  # the model's (unpadded)
    dim: int  # stored (padded)

    @classmethod
    def of(cls, q: KVQuant, head_dim: int) -> Packed:
        return cls(q.bits, q.group_for(head_dim), head_dim, q.padded_dim(head_dim))

    def encode(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """(B, H, T, head_dim) floats -> (packed, scales, biases)."""
        if self.dim != x.shape[-1]:
            x = mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, self.dim - x.shape[-1])])
        w, s, b = mx.quantize(x, group_size=self.group_size, bits=self.bits)
        return w, s, b

    def decode(self, parts: tuple[mx.array, ...]) -> mx.array:
        x = mx.dequantize(*parts, group_size=self.group_size, bits=self.bits)
        return x[..., : self.head_dim]

    def state(self) -> tuple[int, int, int]:
        return self.group_size, self.bits, self.head_dim


def packed_of(cache: Any, keys: Sequence[mx.array], head_dim: int) -> Packed:
    """The layout of a quantized cache's K/V: ours knows it (`packed()`); mlx-lm's
    QuantizedKVCache names bits and group_size, and never pads."""
    if hasattr(cache, "packed"):
        return cache.packed()
    bits = cache.bits
    return Packed(bits, cache.group_size, head_dim, keys[0].shape[-1] * 32 // bits)


def quantized_attention(
    q: mx.array, k: Sequence[mx.array], v: Sequence[mx.array], packed: Packed,
    scale: float, mask: Any, softcap: float | None = None,
) -> mx.array:
    """softmax(q·kᵀ·scale (soft-capped), masked)·v with K/V left packed: two
    `mx.quantized_matmul`s, K/V heads grouped (never repeated), as mlx-lm's
    quantized_scaled_dot_product_attention, plus padding and Gemma 2's soft-capping."""
    B, H, T, D = q.shape
    kv = k[0].shape[1]
    S = k[0].shape[2]
    if packed.dim != D:
        q = mx.pad(q, [(0, 0), (0, 0), (0, 0), (0, packed.dim - D)])
    q = (q * scale).reshape(B, kv, H // kv, T, packed.dim)
    k = tuple(p[:, :, None] for p in k)
    v = tuple(p[:, :, None] for p in v)
    g, bits = packed.group_size, packed.bits
    scores = mx.quantized_matmul(q, *k, transpose=True, group_size=g, bits=bits)
    if softcap is not None:
        scores = fast_exp.tanh(scores / softcap) * softcap
    if isinstance(mask, str):  # "causal": the T queries are the last T keys
        mask = mx.arange(S - T, S)[:, None] >= mx.arange(S)[None]
    if mask is not None:
        scores = mx.where(mask, scores, mx.array(-mx.inf, scores.dtype))
    p = fast_exp.softmax(scores).astype(q.dtype)
    out = mx.quantized_matmul(p, *v, transpose=False, group_size=g, bits=bits)
    return out.reshape(B, H, T, packed.dim)[..., :D]
