"""The cache's own figures (docs/design.md, "Statistics"): what `cache_stats` reads from
the caches' metadata. Light (no MLX): the runtime's `TurnStats` extends it with the
turn's and the runtime's numbers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CacheStats:
    """None means "not measured" (no cache yet)."""

    cache_offset: int | None = None
    cache_tokens: int | None = None
    cache_capacity: int | None = None
    cache_bytes: int | None = None
    mha_bytes: int | None = None
    gqa_saving: float | None = None
    evicted_tokens: int | None = None
    keep: int | None = None
    wrapped: bool | None = None
    # sliding-window layers (Gemma 2/3, Mistral): how many, their bytes, and how much
    # smaller the cache is than if they held every token the global layers hold
    sliding_layers: int | None = None
    sliding_bytes: int | None = None
    window_saving: float | None = None
    # K/V quantization (model/decoder/kv_quant.py): bits and group size (None = float),
    # the bytes the same tokens take unquantized, and float_bytes / cache_bytes
    kv_bits: int | None = None
    kv_group_size: int | None = None
    float_bytes: int | None = None
    kv_saving: float | None = None
    # recurrent layers (Mamba, gated delta, short conv; model/cache/state.py): how many, and
    # the bytes of their states, apart from cache_bytes (K/V) and constant as tokens grow
    state_bytes: int | None = None
    state_layers: int | None = None
    # their checkpoints (model/cache/checkpoints.py): how many this conversation keeps,
    # and the bytes of the states they hold
    checkpoints: int | None = None
    checkpoint_bytes: int | None = None
