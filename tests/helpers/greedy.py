"""Greedy decoding from BOS through kvchat's own model and KV cache: the ids a reference
(transformers, the emulated kernels) must reproduce."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from kvchat.model import load_model
from kvchat.model.cache.kv import make_prompt_cache

BOS = 1


def greedy_ids(folder: Path, steps: int) -> list[int]:
    """Greedy argmax for `steps` tokens from BOS through our KV cache (one token per step)."""
    model = load_model(folder)
    cache = make_prompt_cache(model)
    ids = [BOS]
    for _ in range(steps):
        logits = model(mx.array([ids[-1:]]), cache=cache)
        ids.append(int(mx.argmax(logits[0, -1]).item()))
    return ids[1:]
