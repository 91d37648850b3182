"""The decoder: embedding (optionally scaled), N blocks of the family's layout, final
norm, tied or separate LM head (optionally soft-capped or scaled)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from . import fast_exp
from .config import LayerSpec, ModelConfig
from .layers import make_block, make_norm
from .mask import causal_mask
from .mla import attention_class
from .rows import Rows


def sinusoidal_positions(T: int, dims: int, offset: int | mx.array = 0) -> mx.array:
    """2017's absolute positions: sin(p / 10000^(2i/d)) on even features, cos on odd."""
    pos = mx.arange(T, dtype=mx.float32) + mx.array(offset, dtype=mx.float32)
    inv = 10000.0 ** (-mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    angles = pos[:, None] * inv[None]
    return mx.stack([mx.sin(angles), mx.cos(angles)], axis=-1).reshape(T, -1)[:, :dims]


class DecoderModel(nn.Module):
    """HF's `model.*` sub-tree: embed_tokens, layers, norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        if cfg.positions == "learned":  # GPT-2: one learned vector per position
            self.embed_positions = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.layers = [make_block(cfg, spec, attention_class(cfg)) for spec in cfg.layers]
        self.norm = make_norm(cfg, cfg.hidden_size)


def layer_masks(
    specs: Sequence[LayerSpec], T: int, cache: list[Any] | None
) -> dict[int | None, Any]:
    """One mask per distinct window among these layers (a model with sliding and global
    layers needs two), each built from the first cache of that kind (`cache[j]` belongs
    to `specs[j]`)."""
    masks: dict[Any, Any] = {}
    for j, spec in enumerate(specs):
        w = spec.window
        key = mask_key(spec)
        if key in masks:
            continue
        if not spec.attends:  # a recurrent layer: causal by construction
            masks[key] = None
        elif cache is not None and hasattr(cache[j], "make_mask"):
            # return_array named: mlx-lm's caches require it (their helper always passes it)
            masks[key] = cache[j].make_mask(T, window_size=w, return_array=False)
        elif spec.chunk is not None and T > 1:  # the query's own chunk only
            q, k = mx.arange(T)[:, None], mx.arange(T)[None]
            masks[key] = causal_mask(T) & (q // spec.chunk == k // spec.chunk)
        elif w is not None and T > w:
            masks[key] = causal_mask(T, window=w)
        else:
            masks[key] = "causal" if T > 1 else None
    return masks


def mask_key(spec: LayerSpec) -> tuple[int | None, int | None, bool]:
    """Attention layers with the same window and chunk share one mask."""
    return spec.window, spec.chunk, spec.attends


class Transformer(nn.Module):
    """`Transformer(tokens (B, T), cache=None) -> logits (B, T, vocab)`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model_type = cfg.model_type  # mlx-lm's tools read this
        self.model = DecoderModel(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=cfg.lm_head_bias)

    @property
    def layers(self) -> list[nn.Module]:
        return self.model.layers

    def embed(self, tokens: mx.array, offset: int | mx.array = 0) -> mx.array:
        """Token embeddings (scaled where the family asks); with learned (GPT-2) or 2017's
        sinusoidal positions, plus those of positions offset, offset + 1, ..."""
        h = self.model.embed_tokens(tokens)
        if self.config.positions == "learned":
            h = h + self.model.embed_positions(offset + mx.arange(tokens.shape[1]))
        if self.config.embed_scale != 1.0:  # in the compute dtype, as the reference rounds it
            h = h * mx.array(self.config.embed_scale, dtype=h.dtype)
        if self.config.embed_norm:  # nanochat: the final norm also normalizes the embeddings
            h = self.model.norm(h)
        if self.config.positions == "sinusoidal":
            h = h + sinusoidal_positions(tokens.shape[-1], h.shape[-1], offset).astype(h.dtype)
        return h

    def run_layers(
        self, h: mx.array, cache: list[Any] | None, layers: range | None = None
    ) -> tuple[mx.array, mx.array | None]:
        """Blocks `layers` (all by default; a pipeline rank runs its slice), `cache` holding
        one cache per block run. Returns the residual stream as (h, pending): its value is
        h + pending, the last add left to the next norm (which fuses it, see Block).
        Blocks that read the token embeddings (Zamba2) get `h` as it enters layer 0."""
        cfg = self.config
        layers = range(len(cfg.layers)) if layers is None else layers
        masks = layer_masks(cfg.layers[layers.start : layers.stop], h.shape[1], cache)
        emb = h if layers.start == 0 else None
        pending = None
        for j, i in enumerate(layers):
            c = cache[j] if cache is not None else None
            block = self.model.layers[i]
            extra = {"emb": emb} if getattr(block, "reads_embeddings", False) else {}
            h, pending = block.deferred(h, pending, masks[mask_key(cfg.layers[i])], c, **extra)
        return h, pending

    def head(self, h: mx.array, pending: mx.array | None = None) -> mx.array:
        """Final norm (fused with the last block's pending add) and LM head (tied or not),
        then the family's logit scaling/capping."""
        cfg = self.config
        h = self.model.norm(h) if pending is None else self.model.norm.add_and_norm(pending, h)[1]
        if cfg.tie_word_embeddings:
            logits = self.model.embed_tokens.as_linear(h)
        else:
            logits = self.lm_head(h)
        if cfg.logits_divisor != 1.0:
            logits = logits / cfg.logits_divisor
        if cfg.final_softcap is not None:
            logits = fast_exp.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return logits

    def __call__(
        self, tokens: mx.array, cache: list[Any] | None = None, logits_to_keep: int = 0,
        at: mx.array | None = None,
    ) -> mx.array:
        """Logits for every position, or only the last `logits_to_keep` (as HF names it):
        prefill then skips the vocab-sized head matmul for all but the position it samples;
        or (B, 1, V) at `at` (B,), each row's own position (rows of different lengths
        prefilled together, model/runtime/batch.py)."""
        if cache and isinstance(cache[0], Rows) and self.config.positions != "rope":
            # absolute positions: each row's own (model/decoder/rows.py)
            h = mx.concatenate([self.embed(tokens[i : i + 1], o)
                                for i, o in enumerate(cache[0].offsets)])
        else:
            offset = cache[0].offset if cache and not isinstance(cache[0], Rows) else 0
            h = self.embed(tokens, offset)
        h, pending = self.run_layers(h, cache)
        if at is not None:
            idx = at.astype(mx.int32)[:, None, None]
            h = mx.take_along_axis(h, idx, axis=1)
            pending = None if pending is None else mx.take_along_axis(pending, idx, axis=1)
        elif logits_to_keep:
            h = h[:, -logits_to_keep:, :]
            pending = None if pending is None else pending[:, -logits_to_keep:, :]
        return self.head(h, pending)
