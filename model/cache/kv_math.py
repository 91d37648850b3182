"""Pure KV-cache arithmetic: bytes per token (float or quantized), bytes at a context
length, the MHA / GQA / MQA comparison, weight bytes from safetensors headers, and how many tokens
fit in a memory budget. No MLX, no arrays: numbers in, numbers out.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from kvchat.model.decoder.config import ModelConfig
from kvchat.model.decoder.kv_format import KVQuant
from kvchat.model.decoder.state_config import RECURRENT_BYTES
from kvchat.model.errors import KVChatError

# bytes per element of the dtype names in config.json (torch_dtype) and safetensors headers
DTYPE_BYTES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8": 1,
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}

_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gib": 1024**3, "gb": 1000**3,
    "t": 1024**4, "tib": 1024**4, "tb": 1000**4,
}


class BudgetError(KVChatError):
    """A memory size the user typed that we cannot read."""


def kv_bytes_per_token(
    n_layers: int, n_kv_heads: int, head_dim: int, dtype_bytes: int, v_head_dim: int | None = None,
    q: KVQuant | None = None,
) -> int:
    """K and V of one token across all layers: layers × kv_heads × (K + V width) × bytes,
    i.e. 2 × layers × kv_heads × head_dim × bytes when V is as wide as K. Quantized
    (`q`), each width × bytes becomes the stored row (`KVQuant.row_bytes`: packed bits
    of the padded row plus scales and biases at `dtype_bytes`)."""
    v = head_dim if v_head_dim is None else v_head_dim
    if q is None:
        return n_layers * n_kv_heads * (head_dim + v) * dtype_bytes
    return n_layers * n_kv_heads * (q.row_bytes(head_dim, dtype_bytes)
                                    + q.row_bytes(v, dtype_bytes))


def kv_bytes(
    n_tokens: int, n_layers: int, n_kv_heads: int, head_dim: int, dtype_bytes: int,
    v_head_dim: int | None = None, q: KVQuant | None = None,
) -> int:
    """K and V of `n_tokens` tokens across all layers."""
    return n_tokens * kv_bytes_per_token(n_layers, n_kv_heads, head_dim, dtype_bytes,
                                         v_head_dim, q)


# query heads per K/V head of the "as GQA" figure shown for latent attention (Llama 3's 8)
GQA_GROUP = 8


@dataclass(frozen=True)
class KVWidths:
    """What one layer caches per token: `heads` K/V heads of `k` and `v` features.
    Latent attention caches one "head": the latent (k) and the shared RoPE key (v)."""

    heads: int
    k: int
    v: int

    def bytes_per_token(self, n_layers: int, dtype_bytes: int, q: KVQuant | None = None) -> int:
        return kv_bytes_per_token(n_layers, self.heads, self.k, dtype_bytes, self.v, q)


def cached_widths(cfg: ModelConfig, kv_heads: int | None = None) -> KVWidths:
    """The widths this model's cache holds (`kv_heads`: the same model with other heads)."""
    if cfg.mla is not None and kv_heads is None:
        return KVWidths(1, cfg.mla.kv_lora_rank, cfg.mla.rope_dim)
    v = cfg.mla.v_dim if cfg.mla is not None else cfg.head_dim
    return KVWidths(cfg.num_key_value_heads if kv_heads is None else kv_heads, cfg.head_dim, v)


def attention_name(cfg: ModelConfig) -> str:
    if not cfg.attention_layers:  # Mamba: every layer is recurrent
        return "none"
    if cfg.mla is not None:
        return "MLA"
    h, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    return "MHA" if kv == h else "MQA" if kv == 1 else "GQA"


def gqa_heads(cfg: ModelConfig) -> int:
    """K/V heads of the GQA figure: the model's own, or for latent attention (whose
    configs say kv heads = heads) one per GQA_GROUP query heads."""
    if cfg.mla is None:
        return cfg.num_key_value_heads
    return max(1, cfg.num_attention_heads // GQA_GROUP)


def kv_saving(cfg: ModelConfig) -> float:
    """How much smaller the cache is than MHA with the same heads (heads / kv_heads for
    GQA; (heads × (qk + v)) / (latent + rope) for latent attention)."""
    mha = cached_widths(cfg, cfg.num_attention_heads).bytes_per_token(1, 1)
    return mha / cached_widths(cfg).bytes_per_token(1, 1)


@dataclass(frozen=True)
class LayerKindBytes:
    """K/V of the layers of one kind at a context length."""

    kind: str  # "global", "sliding", "chunked" or "latent"
    layers: int
    window: int | None  # sliding: the window; chunked: the chunk
    tokens: int  # resident per layer: the context, or the window when it is shorter
    bytes: int


def kv_bytes_by_kind(
    cfg: ModelConfig, context: int, dtype_bytes: int, kv_heads: int | None = None,
    q: KVQuant | None = None,
) -> list[LayerKindBytes]:
    """Bytes at `context` tokens per layer kind: a global layer holds every token, a
    sliding layer at most its window (so bytes per token fall as the context grows)."""
    per_layer = cached_widths(cfg, kv_heads).bytes_per_token(1, dtype_bytes, q)
    groups: dict[tuple[int | None, int | None], int] = {}
    for spec in cfg.layers:
        if not spec.attends:  # a recurrent layer holds no K/V (state_bytes counts it)
            continue
        key = (spec.window, spec.chunk)
        groups[key] = groups.get(key, 0) + 1
    rows = []
    for (window, chunk), n in sorted(groups.items(), key=lambda item: item[0] != (None, None)):
        bound = window if window is not None else chunk  # a chunked ring holds one chunk
        tokens = context if bound is None else min(context, bound)
        kind = ("sliding" if window is not None else "chunked" if chunk is not None
                else "latent" if cfg.mla is not None and kv_heads is None else "global")
        rows.append(LayerKindBytes(kind, n, bound, tokens, n * tokens * per_layer))
    return rows


def state_bytes(cfg: ModelConfig, dtype_bytes: int) -> int:
    """Bytes of the recurrent layers' states (one sequence): the conv state at
    `dtype_bytes`, the recurrent one in float32; the same at every context length, beside
    the attention layers' K/V (model/cache/state.py)."""
    if cfg.mixer is None:
        return 0
    conv, *recurrent = cfg.mixer.state_shapes()
    per_layer = math.prod(conv) * dtype_bytes + sum(
        math.prod(shape) for shape in recurrent) * RECURRENT_BYTES
    return per_layer * cfg.recurrent_layers


def kv_bytes_at(
    cfg: ModelConfig, context: int, dtype_bytes: int, kv_heads: int | None = None,
    q: KVQuant | None = None,
) -> int:
    """K and V of every layer at `context` tokens, sliding windows included."""
    return sum(r.bytes for r in kv_bytes_by_kind(cfg, context, dtype_bytes, kv_heads, q))


def tokens_that_fit(budget_bytes: int, bytes_per_token: int, reserved_bytes: int = 0) -> int:
    """Whole tokens of KV cache that fit in `budget_bytes` after `reserved_bytes`
    (e.g. the weights); 0 when nothing fits."""
    if bytes_per_token <= 0:
        raise ValueError("bytes_per_token must be positive")
    return max(0, budget_bytes - reserved_bytes) // bytes_per_token


def context_that_fits(
    cfg: ModelConfig, budget_bytes: int, dtype_bytes: int, reserved_bytes: int = 0,
    q: KVQuant | None = None,
) -> int | None:
    """The longest context whose K/V (sliding windows included) fits in the budget after
    `reserved_bytes`; None when any length fits (every layer slides and the windows fit)."""
    room = max(0, budget_bytes - reserved_bytes)
    rows = kv_bytes_by_kind(cfg, 1, dtype_bytes, q=q)
    if not rows:  # no attention layer: nothing grows with the context
        return None
    if all(r.window is not None for r in rows):
        longest = max(r.window or 0 for r in rows)
        if kv_bytes_at(cfg, longest, dtype_bytes, q=q) <= room:
            return None
    lo, hi = 0, 1
    while kv_bytes_at(cfg, hi, dtype_bytes, q=q) <= room:  # bytes grow with the context
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if kv_bytes_at(cfg, mid, dtype_bytes, q=q) <= room else (lo, mid)
    return lo


@dataclass(frozen=True)
class AttentionRow:
    """One line of the MHA / GQA / MQA table."""

    name: str
    kv_heads: int  # latent attention: 1 (the shared latent)
    bytes_per_token: int  # while every layer still grows (before any window fills)
    bytes_at_context: int  # sliding layers counted at most their window
    saving_vs_mha: float  # MHA bytes / these bytes (n_heads / kv_heads for GQA)


def attention_table(cfg: ModelConfig, dtype_bytes: int, context: int,
                    q: KVQuant | None = None) -> list[AttentionRow]:
    """The same model with MHA (kv = heads), its own KV heads, and MQA (kv = 1); for
    latent attention: MHA, GQA (one K/V head per GQA_GROUP query heads) and the latent."""
    h, L = cfg.num_attention_heads, cfg.attention_layers
    if not L:  # no attention layer: no K/V in any form
        return []
    mha = cached_widths(cfg, h).bytes_per_token(L, dtype_bytes, q)
    own = f"{attention_name(cfg)} (this model)"
    if cfg.mla is not None:
        g = gqa_heads(cfg)
        variants: tuple[tuple[str, int | None], ...] = (
            ("MHA", h), (f"GQA (group {h // g})", g), (own, None))
    else:
        variants = (("MHA", h), (own, cfg.num_key_value_heads), ("MQA", 1))
    rows = []
    for name, k in variants:
        per = cached_widths(cfg, k).bytes_per_token(L, dtype_bytes, q)
        rows.append(AttentionRow(name, 1 if k is None else k, per,
                                 kv_bytes_at(cfg, context, dtype_bytes, k, q), mha / per))
    return rows


def dtype_bytes_of(torch_dtype: str | None) -> int | None:
    """Bytes per element of a config's torch_dtype (None when absent or unknown)."""
    if not torch_dtype:
        return None
    return DTYPE_BYTES.get(str(torch_dtype).removeprefix("torch."))


def parse_size(text: str | int) -> int:
    """'8GiB', '512 MiB', '1.5G' (binary), '8GB' (decimal), '123456' -> bytes."""
    if isinstance(text, int):
        return text
    s = str(text).strip().replace("_", "").replace(",", "")
    m = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)", s)
    if not m or m.group(2).lower() not in _UNITS:
        raise BudgetError(f"cannot read memory size {text!r} (try 8GiB, 512MiB or a byte count)")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not math.isfinite(value):
        raise BudgetError(f"memory size {text!r} is out of range")
    return int(value)


def human_bytes(n: int | float) -> str:
    """Binary units, up to 3 significant decimals: 2684354560 -> '2.5 GiB'."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{int(n)} B"
            return f"{n:.3f}".rstrip("0").rstrip(".") + f" {unit}"
        n /= 1024
    raise AssertionError("unreachable")
