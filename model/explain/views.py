"""The views the engine computes for a face, on the engine's thread (where the model and
its cache live): the model's anatomy and the attention of the newest cached token.

The runtime never imports this module: whoever builds an engine hands it `VIEWS`
(`runtime.engine.Views`), and a child engine process receives it pickled by name.
"""

from __future__ import annotations

from typing import Any

from kvchat.model.cache.kv import cache_stats
from kvchat.model.cache.kv_math import dtype_bytes_of
from kvchat.model.decoder.config import ModelConfig, as_2017_block
from kvchat.model.runtime.engine import Views
from kvchat.model.runtime.events import AttentionView

from .anatomy import explain
from .attention_view import attention_view


def explain_model(model: Any, caches: list[Any] | None, info: dict[str, Any], gap: int,
                  block: str) -> dict[str, Any]:
    """`anatomy.explain` of the loaded model (or of its 2017 block) at the cache's context."""
    cfg = model.config
    stats = cache_stats(caches, cfg) if caches else None
    if block == "2017":
        cfg = ModelConfig.from_dict(as_2017_block(cfg.raw))
    split = hasattr(model, "pipeline_stats")  # a rank holds only its layers: seeded q and k
    return explain(
        cfg, dtype_bytes=dtype_bytes_of(info.get("dtype")) or 4,
        context=(stats.cache_tokens or 0) if stats else 0,
        model=None if split or block == "2017" else model, gap=gap,
        name=str(info.get("name", "")), path=str(info.get("path", "")))


def watched_attention(model: Any, caches: list[Any], layer: int, group: int | None,
                      token: int) -> AttentionView:
    return attention_view(model, caches, layer, group, token)


VIEWS = Views(explain=explain_model, attention=watched_attention)
