"""exp where MLX's own is slow, and what the decoder builds on it: softmax, sigmoid,
SiLU, tanh-GELU and attention (the MLP's and experts' activations, the recurrent mixers'
gates, soft-capping).

MLX's CPU exp is a polynomial in its SIMD layer, which vectorizes on ARM but not on x86:
in the x86 wheels every element makes six calls to libm's `fmaf`, about 15-20 ns per
element, and `mx.sigmoid`, `mx.tanh` and `mx.softmax` go through it. Attention's softmax
runs it on every score and SiLU on every MLP unit, so a batched decode step or a prompt
chunk spends a large part of its time there. 2^(x·log2 e) through `mx.power` (libm's
powf) costs about a third as much, from the same first step MLX's exp takes (x·log2 e
rounded to float), so it is as close to the true exp as MLX's own
(`tests/test_fast_exp.py`).
`python -m tests.benchmarks.fast_exp` measures both and the steps built on them
(docs/performance.md, "exp on x86").

`power_exp()` decides: MLX computing on the CPU of an x86 machine. Elsewhere (a GPU, an
ARM CPU) every function here is MLX's own op or fused kernel.
"""

from __future__ import annotations

import math
import platform
from typing import Any

import mlx.core as mx
import mlx.nn as nn

LOG2E = math.log2(math.e)
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")
_GELU_2K = 2 * math.sqrt(2 / math.pi)  # tanh GELU as a sigmoid: 0.5(1 + tanh z) = σ(2z)


def power_exp() -> bool:
    """Whether exp goes through `mx.power`: MLX computes on the CPU of an x86 machine."""
    return _X86 and mx.default_device() == mx.cpu


def exp(x: mx.array) -> mx.array:
    if not power_exp():
        return mx.exp(x)
    return mx.power(mx.array(2.0, x.dtype), x * LOG2E)


def sigmoid(x: mx.array) -> mx.array:
    if not power_exp():
        return mx.sigmoid(x)
    return 1 / (1 + exp(-x))


def silu(x: mx.array) -> mx.array:
    """x·σ(x) (as `nn.silu`)."""
    return x / (1 + exp(-x)) if power_exp() else nn.silu(x)


def gelu_approx(x: mx.array) -> mx.array:
    """0.5·x·(1 + tanh(√(2/π)(x + 0.044715x³))) (as `nn.gelu_approx`), as x·σ(2z)."""
    if not power_exp():
        return nn.gelu_approx(x)
    return x * sigmoid(_GELU_2K * (x + 0.044715 * x**3))


def tanh(x: mx.array) -> mx.array:
    """tanh x = 2σ(2x) − 1 (soft-capping)."""
    return 2 * sigmoid(2 * x) - 1 if power_exp() else mx.tanh(x)


def softmax(x: mx.array, axis: int = -1) -> mx.array:
    """Softmax along `axis`, computed in float32 whatever `x` is (as `precise=True`),
    returned in x's dtype."""
    if not power_exp():
        return mx.softmax(x, axis=axis, precise=True)
    x32 = x.astype(mx.float32)
    e = exp(x32 - mx.max(x32, axis=axis, keepdims=True))
    return (e / e.sum(axis=axis, keepdims=True)).astype(x.dtype)


def attention(q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask: Any = None,
              sinks: mx.array | None = None) -> mx.array:
    """`mx.fast.scaled_dot_product_attention`. On a CPU that call is MLX's fallback of
    plain ops around one softmax; where `power_exp()`, the same ops written out here with
    `softmax` above: q·scale, grouped K/V heads (never repeated), the causal or given
    mask (a bool one keeps scores where True, else the lowest float; another is added),
    the sinks as an extra first column that takes its share and is then dropped."""
    if not power_exp():
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask,
                                                    sinks=sinks)
    dtype = mx.result_type(q, k, v)
    q, k, v = q.astype(dtype), k.astype(dtype), v.astype(dtype)
    B, H, T, D = q.shape
    kv = k.shape[1]
    n = H // kv
    q = q * mx.array(scale, dtype)
    if n > 1:  # (B, kv, n, T, D) against (B, kv, 1, S, D)
        q, k, v = q.reshape(B, kv, n, T, D), k[:, :, None], v[:, :, None]
    scores = q @ k.swapaxes(-1, -2)
    S = scores.shape[-1]
    if isinstance(mask, str):  # "causal": the T queries are the last T keys
        mask = mx.arange(S - T, S)[:, None] >= mx.arange(S)[None]
    if mask is not None:
        if n > 1 and mask.ndim >= 3:
            mask = (mx.expand_dims(mask, -3) if mask.shape[-3] == 1
                    else mask.reshape(*mask.shape[:-3], kv, n, *mask.shape[-2:]))
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(mx.finfo(dtype).min, dtype))
        else:
            scores = scores + mask.astype(dtype)
    if sinks is not None:
        column = sinks.astype(dtype).reshape(kv, n, 1, 1) if n > 1 else \
            sinks.astype(dtype).reshape(H, 1, 1)
        column = mx.broadcast_to(column, (*scores.shape[:-1], 1))
        p = softmax(mx.concatenate([column, scores], axis=-1))[..., 1:]
    else:
        p = softmax(scores)
    out = p @ v
    return out.reshape(B, H, T, -1) if n > 1 else out
