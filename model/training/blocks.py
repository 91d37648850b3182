"""`python -m kvchat.model.training blocks RUN RUN`: the 2017 and 2024 blocks trained on
the same data, side by side: validation loss, K/V cache bytes per token, training tok/s
and greedy decode tok/s (one process, one after the other, so under the same load)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from kvchat.model.cache.kv import make_prompt_cache
from kvchat.model.cache.kv_math import kv_bytes_per_token
from kvchat.model.decoder.config import ModelConfig
from kvchat.model.runtime.generate import generate_step

from .data import TrainError
from .loop import build_model, load_checkpoint_meta


def _decode_tps(run: Path, cfg: dict[str, Any], tokens: int) -> float:
    model = build_model(cfg, 0)
    model.load_weights(str(run / "ckpt" / "model.safetensors"))
    mx.eval(model.parameters())
    caches = make_prompt_cache(model)
    steps = generate_step(model, [1], caches, max_tokens=tokens + 1)
    next(steps)  # the first token: prefill and the step's trace
    t = time.perf_counter()
    n = sum(1 for _ in steps)
    return n / max(time.perf_counter() - t, 1e-9)


def compare_blocks(runs: list[Path], gen_tokens: int = 128) -> str:
    rows = []
    for run in runs:
        meta = load_checkpoint_meta(run)
        if "val_loss" not in meta:
            raise TrainError(f"{run} has not finished training (no val_loss)")
        cfg = ModelConfig.from_dict(meta["config"])
        rows.append((
            meta["args"].get("block", "2024"), meta["params"], meta["step"], meta["val_loss"],
            kv_bytes_per_token(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 2),
            meta["tokens_per_s"], _decode_tps(run, meta["config"], gen_tokens),
        ))
    out = ["| block | parameters | steps | val loss | K/V bytes/token (fp16) | train tok/s"
           " | decode tok/s |", "|---|---:|---:|---:|---:|---:|---:|"]
    for block, params, steps, vl, kv, train_tps, dec in rows:
        out.append(f"| {block} | {params:,} | {steps} | {vl:.4f} | {kv:,} | {train_tps:,.0f}"
                   f" | {dec:,.0f} |")
    return "\n".join(out)
