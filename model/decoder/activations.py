"""Activation names in config.json -> the function MLX computes (families.ACTIVATION_NAMES
lists the ones a config may ask for). Here, not in layers.py, so that a mixer whose
branches use the config's activation (rglru.py) reads the same table as the MLP."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from . import fast_exp

ACTIVATIONS: dict[str, Callable[[mx.array], mx.array]] = {
    "silu": fast_exp.silu,
    "relu": nn.relu,
    "relu2": lambda x: mx.square(nn.relu(x)),  # Nemotron
    "gelu_fast": fast_exp.gelu_approx,
    "gelu_pytorch_tanh": fast_exp.gelu_approx,  # 0.5x(1 + tanh(√(2/π)(x + 0.044715x³)))
    "gelu_new": fast_exp.gelu_approx,
    "gelu": nn.gelu,  # exact (erf)
}
