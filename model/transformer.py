"""The decoder: embedding, N pre-norm blocks, final norm, tied or separate LM head."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .cache import causal_mask, make_cache
from .config import ModelConfig
from .layers import RMSNorm, TransformerBlock


def attention_mask(cfg: ModelConfig, cache: list[Any] | None, T: int) -> Any:
    """The mask every layer uses for the next T queries (None, "causal" or an array)."""
    if cache is not None and hasattr(cache[0], "make_mask"):
        return cache[0].make_mask(T, window_size=cfg.sliding_window)
    if cfg.sliding_window is not None and T > cfg.sliding_window:
        return causal_mask(T, window=cfg.sliding_window)
    return "causal" if T > 1 else None


class DecoderModel(nn.Module):
    """HF's `model.*` sub-tree: embed_tokens, layers, norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [TransformerBlock(cfg) for _ in range(cfg.num_hidden_layers)]
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    """`Transformer(tokens (B, T), cache=None) -> logits (B, T, vocab)`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model_type = cfg.model_type  # mlx-lm's tools read this
        self.model = DecoderModel(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def layers(self) -> list[TransformerBlock]:
        return self.model.layers

    def make_cache(self, max_kv_size: int | None = None, keep: int = 4) -> list[Any]:
        return make_cache(self.config, max_kv_size=max_kv_size, keep=keep)

    def __call__(
        self, tokens: mx.array, cache: list[Any] | None = None, logits_to_keep: int = 0
    ) -> mx.array:
        """Logits for every position, or only the last `logits_to_keep` (as HF names it):
        prefill then skips the vocab-sized head matmul for all but the position it samples."""
        h = self.model.embed_tokens(tokens)
        mask = attention_mask(self.config, cache, h.shape[1])
        for i, layer in enumerate(self.model.layers):
            h = layer(h, mask, cache[i] if cache is not None else None)
        if logits_to_keep:
            h = h[:, -logits_to_keep:, :]
        h = self.model.norm(h)
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)
