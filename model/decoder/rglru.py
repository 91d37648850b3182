"""Griffin's recurrent block (RecurrentGemma): the RG-LRU, a real-gated linear recurrence
with one decay per feature, behind a short causal convolution and beside a gated branch,

    y = act(linear_y(x)),   u = conv(linear_x(x)),
    r_t = σ(W_a u_t + b_a),  i_t = σ(W_x u_t + b_x)      (block-diagonal: one W per head),
    a_t = exp(−8·r_t·softplus(Λ)),
    h_t = a_t·h_{t−1} + √(1 − a_t²)·(i_t·u_t),
    out = linear_out(h · y),

with the √(1 − a²) factor 1 (and no h_{t−1}) at position 0, where the reference resets the
state. A prompt runs the recurrence as ssm.py's parallel prefix scan, per block of
SCAN_BLOCK tokens, the state carried between blocks; one token runs it as is. The state
(features wide) and the scan are float32 whatever the compute dtype (as ssm.py's).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from . import fast_exp
from .activations import ACTIVATIONS
from .conv import CausalConv1d
from .ssm import F32, SCAN_BLOCK, linear_scan
from .state_config import RgLruConfig


class RgLru(nn.Module):
    """The gates and the recurrence (transformers' `rg_lru` and its parameter names)."""

    def __init__(self, cfg: RgLruConfig):
        super().__init__()
        heads, per = cfg.heads, cfg.width // cfg.heads
        self.recurrent_param = mx.zeros((cfg.width,))
        self.input_gate_weight = mx.zeros((heads, per, per))
        self.input_gate_bias = mx.zeros((heads, per))
        self.recurrent_gate_weight = mx.zeros((heads, per, per))
        self.recurrent_gate_bias = mx.zeros((heads, per))

    def _gate(self, x: mx.array, w: mx.array, b: mx.array) -> mx.array:
        """σ(x·W_h + b_h) per head h of x (B, T, heads, per), flat again (B, T, width)."""
        y = (x[..., None, :] @ w.astype(F32))[..., 0, :] + b.astype(F32)
        return fast_exp.sigmoid(y).reshape(*x.shape[:2], -1)

    def __call__(self, u: mx.array, offset: int | mx.array, h0: mx.array | None
                 ) -> tuple[mx.array, mx.array]:
        """u (B, T, width) -> (h (B, T, width) float32, the last state (B, width))."""
        B, T, W = u.shape
        u = u.astype(F32)
        heads = self.input_gate_weight.shape[0]
        per_head = u.reshape(B, T, heads, W // heads)
        i = self._gate(per_head, self.input_gate_weight, self.input_gate_bias)
        r = self._gate(per_head, self.recurrent_gate_weight, self.recurrent_gate_bias)
        log_a = -8.0 * r * nn.softplus(self.recurrent_param.astype(F32))
        first = ((offset + mx.arange(T)) == 0)[None, :, None]  # the reference's reset
        scale = mx.where(first, 1.0, mx.sqrt(1 - mx.exp(2 * log_a)))
        a = mx.where(first, 0.0, mx.exp(log_a))
        b = u * i * scale
        hs, h = [], h0
        for s in range(0, T, SCAN_BLOCK):
            block = linear_scan(a[:, s : s + SCAN_BLOCK], b[:, s : s + SCAN_BLOCK], h)
            hs.append(block)
            h = block[:, -1]
        return (mx.concatenate(hs, axis=1) if len(hs) > 1 else hs[0]), h


class RecurrentBlock(nn.Module):
    """Griffin's temporal block around the RG-LRU (transformers' RecurrentGemmaRecurrentBlock;
    its `conv_1d` is our `conv1d`, weights.py's layout applies)."""

    def __init__(self, cfg: RgLruConfig, hidden: int):
        super().__init__()
        self.act = ACTIVATIONS[cfg.activation]
        self.linear_y = nn.Linear(hidden, cfg.width)
        self.linear_x = nn.Linear(hidden, cfg.width)
        self.linear_out = nn.Linear(cfg.width, hidden)
        self.conv1d = CausalConv1d(cfg.width, cfg.conv_kernel, bias=True)
        self.rg_lru = RgLru(cfg)

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        y = self.act(self.linear_y(x))
        u, conv_state = self.conv1d(self.linear_x(x), cache.conv if cache is not None else None)
        h, state = self.rg_lru(u, cache.offset if cache is not None else 0,
                               cache.recurrent if cache is not None else None)
        if cache is not None:
            cache.update(x.shape[1], conv_state, state)
        return self.linear_out(h.astype(x.dtype) * y)
