"""The short causal convolution every recurrent mixer puts in front of its state update
(Mamba, Mamba-2, the gated delta rule) and LFM2's gated short-convolution block.

A depthwise convolution of K taps sees the current token and the K − 1 before it. Across
calls those K − 1 inputs are the layer's conv state (model/cache/state.py): a prompt
prefilled in chunks, or decoded one token at a time, gives the same outputs as one call
over the whole sequence.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .state_config import ShortConvConfig
from .state_steps import hand_back, keeps_steps


class CausalConv1d(nn.Module):
    """Depthwise causal convolution over the last axis of (B, T, channels).

    The weight is stored (channels, K, 1), MLX's Conv1d layout (mlx-community's files);
    transformers' (channels, 1, K) is transposed on load (weights.py)."""

    def __init__(self, channels: int, kernel: int, bias: bool):
        super().__init__()
        self.kernel = kernel
        self.weight = mx.zeros((channels, kernel, 1))
        if bias:
            self.bias = mx.zeros((channels,))

    def __call__(self, x: mx.array, state: mx.array | None, steps: bool = False
                 ) -> tuple[mx.array, mx.array]:
        """(output (B, T, channels), the next state: the last K − 1 inputs; with `steps`
        the state after each position, stacked (T, B, K − 1, channels): state_steps.py).
        `state` None: nothing came before (zeros, as the reference's left padding)."""
        B, T, C = x.shape
        K = self.kernel
        if state is None:
            state = mx.zeros((B, K - 1, C), x.dtype)
        full = mx.concatenate([state, x], axis=1)  # (B, K − 1 + T, C)
        w = self.weight[:, :, 0].T.astype(x.dtype)  # (K, C): tap k reads input t − (K − 1 − k)
        y = full[:, :T] * w[0]
        for k in range(1, K):
            y = y + full[:, k : k + T] * w[k]
        if "bias" in self:
            y = y + self.bias.astype(x.dtype)
        if steps:
            return y, mx.stack([full[:, t + 1 : t + K] for t in range(T)])
        return y, full[:, T:]


class ShortConv(nn.Module):
    """LFM2's token mixer: B, C, x = in_proj(h); y = C · conv(B · x); out_proj(y).
    Its state is the convolution's alone."""

    def __init__(self, cfg: ShortConvConfig, hidden: int):
        super().__init__()
        d = hidden
        self.in_proj = nn.Linear(d, 3 * d, bias=cfg.bias)
        self.conv = CausalConv1d(d, cfg.kernel, cfg.bias)
        self.out_proj = nn.Linear(d, d, bias=cfg.bias)

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        b, c, h = mx.split(self.in_proj(x), 3, axis=-1)
        steps = keeps_steps(cache, x.shape[1])
        y, conv_state = self.conv(b * h, cache.conv if cache is not None else None, steps)
        hand_back(cache, x.shape[1], conv_state, None, steps)
        return self.out_proj(c * y)
