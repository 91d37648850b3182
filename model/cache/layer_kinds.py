"""What each layer of a model is, in the words the UI and `inspect` use: one name per
layer, from the config and, where a cache exists, from the cache the layer holds.

Attention layers are named by what their K/V cache does (docs/kv-cache.md, "Cache
kinds"): "full attention" holds every token up to the model's context, "rotating
attention" a window bounded below it (max KV size), "sliding attention" its own window,
"chunked attention" one chunk, "MLA" a latent; " NoPE" marks a layer without RoPE and
" · N-bit K/V" a quantized cache. Recurrent layers are named by their mixer (Mamba,
Mamba-2, gated delta, Kimi delta, short conv, RG-LRU), a layer that does both by both
("full attention + Mamba-2": Falcon-H1's side by side; "shared attention + Mamba-2":
Zamba2's shared block feeding its mixer), and mixer-less layers (Nemotron-H) by what is
left (MLP-only, MoE-only). No MLX: names only.
"""

from __future__ import annotations

from typing import Any

from kvchat.model.decoder.config import LayerSpec, ModelConfig
from kvchat.model.decoder.families import FFN, FFN_MOE, HYBRID

# families.MixerKind -> the name a reader knows the block by
MIXER_NAMES = {"mamba": "Mamba", "mamba2": "Mamba-2", "gated_delta": "gated delta",
               "short_conv": "short conv", "rglru": "RG-LRU", "kda": "Kimi delta"}
# the mixers whose state folds in every token seen (a short conv keeps its last K − 1
# inputs only): after rotation they still carry the start of a conversation, inexactly
# (docs/kv-cache.md, "An endless chat on a model with recurrent layers")
FOLDING_MIXERS = ("mamba", "mamba2", "gated_delta", "rglru", "kda")
# a layer without a token mixer: nothing cached (state.PassCache)
FFN_NAMES = {FFN: "MLP-only", FFN_MOE: "MoE-only"}
ATTENTION_KINDS = ("full attention", "rotating attention", "sliding attention",
                   "chunked attention", "MLA")


def _attention(cfg: ModelConfig, spec: LayerSpec, cache: Any) -> str:
    if cfg.block == "shared_block":  # Zamba2: one of the blocks its hybrid layers share
        name = "shared attention"
    elif cfg.mla is not None:
        name = "MLA"
    elif spec.chunk is not None:
        name = "chunked attention"
    elif spec.window is not None:
        name = "sliding attention"
    else:
        # a global layer's ring holds the whole context unless a max KV size bounds it
        bound = getattr(cache, "max_size", None)
        rotates = bound is not None and bound < cfg.max_position_embeddings
        name = "rotating attention" if rotates else "full attention"
    if spec.rope is None and cfg.positions == "rope":
        name += " NoPE"
    if spec.kind == HYBRID and spec.mixer is not None:  # the state kept beside the K/V
        name += f" + {MIXER_NAMES[spec.mixer]}"
    bits = getattr(getattr(cache, "quant", None), "bits", None)
    return name + (f" · {bits}-bit K/V" if bits else "")


def layer_kind(cfg: ModelConfig, index: int, cache: Any = None) -> str:
    """The name of layer `index`'s kind; `cache` (its cache, if one exists) tells a
    rotating window and a quantized K/V apart from the config's full float attention."""
    spec = cfg.layers[index]
    if spec.mixer is not None and not spec.attends:
        return MIXER_NAMES[spec.mixer]
    if spec.kind in FFN_NAMES:
        return FFN_NAMES[spec.kind]
    return _attention(cfg, spec, getattr(cache, "kv", cache))  # a hybrid layer: its K/V


def layer_kinds(cfg: ModelConfig, caches: list[Any] | None = None) -> list[str]:
    """`layer_kind` of every layer (of the caches' layers when given: a pipeline rank's)."""
    if caches is None:
        return [layer_kind(cfg, i) for i in range(len(cfg.layers))]
    return [layer_kind(cfg, i, c) for i, c in enumerate(caches) if i < len(cfg.layers)]


def kind_counts(kinds: list[str]) -> list[tuple[str, int]]:
    """(kind, layers) in the order the kinds first appear: "Mamba-2 ×2, full attention ×1"."""
    counts: dict[str, int] = {}
    for k in kinds:
        counts[k] = counts.get(k, 0) + 1
    return list(counts.items())


def layer_ranges(xs: list[int], limit: int = 12) -> str:
    """Layer indices with runs shortened: "0-3, 5, 7"; past `limit` items, "…"."""
    runs: list[list[int]] = []
    for i in xs:
        if runs and i == runs[-1][-1] + 1:
            runs[-1] = [runs[-1][0], i]
        else:
            runs.append([i])
    text = [f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs]
    return ", ".join(text[:limit]) + (", …" if len(text) > limit else "")


def kinds_line(kinds: list[str]) -> str | None:
    """The layers of each kind, e.g. "Mamba-2 0, 2; full attention 1", where a model has
    more than one kind (None: every layer is alike)."""
    counts = kind_counts(kinds)
    if len(counts) < 2:
        return None
    return "; ".join(f"{kind} {layer_ranges([i for i, k in enumerate(kinds) if k == kind])}"
                     for kind, _ in counts)
