"""Where the newest token's attention goes in the KV cache, computed on demand.

The decode step runs fused attention (`mx.fast.scaled_dot_product_attention`) and keeps
no weights. While the chat's attention view is open the engine calls `attention_view()`
between steps: it runs the newest token through the layers before the chosen one again,
reading (never writing) the caches, takes that layer's query through the model's own
`Attention.rotated_qkv`, and computes softmax(q·Kᵀ·scale) over the cache's slots with
the model's scale, soft-capping and mask. Nothing of this runs while the view is closed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from kvchat.model.runtime.events import AttentionView

RECENT = 64  # "the last 64 tokens" of the view's shares
MAX_BINS = 512  # the strip the UI draws: at most this many slot bins per event


@dataclass
class SlotWeights:
    """The newest token's attention at one layer: weights (query heads, slots), the
    absolute position each slot holds and whether it is visible to the query."""

    weights: np.ndarray
    positions: np.ndarray
    visible: np.ndarray
    query_position: int


def _visible(cache: Any, window: int | None) -> tuple[mx.array, mx.array]:
    """(positions, visible) of the cache's written slots for the query at offset − 1:
    resident, not after the query, and inside the window; rotation's eviction is already
    in `slot_positions` (evicted ring slots are overwritten)."""
    pos, valid = cache.slot_positions()
    t = cache.offset - 1
    vis = valid & (pos <= t)
    if window is not None:
        vis = vis & (t - pos < window)
    return pos, vis


class _ReadOnly:
    """A cache as the layers see it when the newest token runs again: its query sits at
    offset − 1 and its own K/V are already written, so nothing is written."""

    def __init__(self, cache: Any):
        self.cache = cache
        self.offset = cache.offset - 1
        self.slots = int(cache.slot_positions()[0].shape[0])

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        c = self.cache
        return c.keys[..., : self.slots, :], c.values[..., : self.slots, :]

    def make_mask(self, n: int, return_array: bool = False,
                  window_size: int | None = None) -> mx.array:
        return _visible(self.cache, window_size)[1][None]


def newest_token_attention(model: Any, caches: list[Any], layer: int, token: int) -> SlotWeights:
    """Attention weights of the cache's newest token (id `token`, at position offset − 1)
    at `layer`, over that layer's cache slots."""
    cfg = model.config
    cache = caches[layer]
    h = model.embed(mx.array([[token]]), cache.offset - 1)
    h, pending = model.run_layers(h, [_ReadOnly(c) for c in caches[:layer]], range(layer))
    block = model.model.layers[layer]
    attn = block.self_attn
    q, _, _ = attn.rotated_qkv(block.attention_input(h, pending), cache.offset - 1)
    pos, vis = _visible(cache, cfg.layers[layer].window)
    S = int(pos.shape[0])
    keys = cache.keys[..., :S, :]
    B, H, _, D = q.shape
    kv = keys.shape[1]
    qg = q.reshape(B, kv, H // kv, 1, D).astype(mx.float32)
    scores = (qg @ keys[:, :, None].astype(mx.float32).swapaxes(-1, -2)) * attn.scale
    if attn.softcap is not None:
        scores = mx.tanh(scores / attn.softcap) * attn.softcap
    scores = mx.where(vis, scores, mx.array(-mx.inf, mx.float32))
    sinks = attn.get("sinks") if hasattr(attn, "get") else None
    if sinks is not None:  # gpt-oss: a learned logit per head takes its share, then drops
        sink = sinks.astype(mx.float32).reshape(1, kv, H // kv, 1, 1)
        scores = mx.concatenate([scores, sink], axis=-1)
    w = mx.softmax(scores, axis=-1)[..., :S].reshape(H, S)
    mx.eval(w, pos, vis)
    return SlotWeights(np.array(w), np.array(pos), np.array(vis), cache.offset - 1)


def _shares(sw: SlotWeights, w: np.ndarray, keep: int) -> tuple[float, float, float]:
    sink = sw.visible & (sw.positions < keep)
    recent = sw.visible & ~sink & (sw.query_position - sw.positions < RECENT)
    s, r = float(w[sink].sum()), float(w[recent].sum())
    return s, r, max(0.0, float(w[sw.visible].sum()) - s - r)


def attention_view(model: Any, caches: list[Any], layer: int, group: int | None,
                   token: int) -> AttentionView:
    """The view's event: weights of the chosen KV group's query heads (all heads when
    `group` is None) averaged, binned over the cache's capacity, and the three shares."""
    cfg = model.config
    layer = max(0, min(layer, len(caches) - 1))
    n_groups = cfg.num_key_value_heads
    per = cfg.num_attention_heads // n_groups
    if group is not None:
        group = max(0, min(group, n_groups - 1))
    cache = caches[layer]
    base = AttentionView(layer=layer, group=group, n_layers=len(caches), n_groups=n_groups)
    if hasattr(cache, "members"):  # model/cache/hybrid.py: K/V beside a state
        return AttentionView(**{**base.__dict__, "note": "this layer keeps a recurrent state"
                                " beside its K/V: its attention is not shown"})
    if getattr(cache, "keys", None) is None or cache.offset < 1:
        return AttentionView(**{**base.__dict__, "note": "the cache is empty: send a message"})
    sw = newest_token_attention(model, caches, layer, token)
    heads = sw.weights if group is None else sw.weights[group * per : (group + 1) * per]
    w = heads.mean(axis=0)
    stats = cache.stats()
    keep = int(stats.get("keep") or 0)
    capacity = int(stats.get("cache_capacity") or cfg.max_position_embeddings)
    sink, recent, rest = _shares(sw, w, keep)
    bins = min(capacity, MAX_BINS)
    per_bin = -(-capacity // bins)  # slots per bin, rounded up
    bins = -(-capacity // per_bin)
    weight = np.zeros(bins)
    np.add.at(weight, np.arange(len(w)) // per_bin, np.where(sw.visible, w, 0.0))
    # a bin is "sink" if it holds a sink, else "held" if it holds a visible key
    code = np.where(sw.visible & (sw.positions < keep), 2, sw.visible.astype(int))
    codes = np.zeros(bins, dtype=int)
    np.maximum.at(codes, np.arange(len(w)) // per_bin, code)
    kinds = [("empty", "held", "sink")[c] for c in codes]
    t = sw.query_position
    return AttentionView(
        layer=layer, group=group, n_layers=len(caches), n_groups=n_groups,
        heads=[int(i) for i in range(cfg.num_attention_heads)
               if group is None or i // per == group],
        position=t, tokens=int(sw.visible.sum()), capacity=capacity, keep=keep,
        evicted=int(stats.get("evicted_tokens") or 0), window=cfg.layers[layer].window,
        write_slot=int(cache.write_slot()), slots_per_bin=per_bin, bins=weight.tolist(),
        bin_kinds=kinds,
        sink_share=sink, recent_share=recent, rest_share=rest, recent=RECENT,
        top=[(int(sw.positions[i]), float(w[i])) for i in np.argsort(-w)[:5] if w[i] > 0],
    )
