"""Activation names in config.json -> the function MLX computes (families.ACTIVATION_NAMES
lists the ones a config may ask for). Here, not in layers.py, so that a mixer whose
branches use the config's activation (rglru.py) reads the same table as the MLP."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

ACTIVATIONS: dict[str, Callable[[mx.array], mx.array]] = {
    "silu": nn.silu,
    "relu": nn.relu,
    "relu2": lambda x: mx.square(nn.relu(x)),  # Nemotron
    "gelu_fast": nn.gelu_approx,
    "gelu_pytorch_tanh": nn.gelu_approx,  # 0.5x(1 + tanh(√(2/π)(x + 0.044715x³)))
    "gelu_new": nn.gelu_approx,
    "gelu": nn.gelu,  # exact (erf)
}
