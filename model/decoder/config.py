"""The config resolver: a Hugging Face / mlx-community `config.json` plus its family's row
(families.py) resolved into a `ModelConfig` of plain numbers and per-layer `LayerSpec`s.

`load_config` reads and checks the file; `ModelConfig.from_dict` unwraps a multimodal
checkpoint's language model, renames the family's keys, derives the keys a family spells
differently, and resolves the quirks, the mixture of experts, latent attention and which
layers slide or go without RoPE (rope.py parses the RoPE schedules). The rest of the code
reads the result and never branches on `model_type`.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvchat.model.errors import ConfigError
from kvchat.model.gguf_file import is_gguf, read_gguf

from .config_checks import check_config
from .families import (
    ACTIVATION_NAMES,
    CHUNKED,
    FFN_KINDS,
    FFN_MOE,
    FULL,
    HYBRID,
    LAYER_KIND_ALIASES,
    LAYER_KINDS,
    RECURRENT,
    SLIDING,
    BlockKind,
    Family,
    GroupScore,
    MixerKind,
    MlpKind,
    NormKind,
    PositionKind,
    QkNormKind,
    RouterScore,
    family_of,
    no_rope_layers,
)
from .gguf import gguf_config
from .rope import RopeConfig, check_rotary, global_rope, local_rope
from .state_config import MixerConfig, resolve_mixer


@dataclass(frozen=True)
class MoeConfig:
    """The resolved mixture of one model (every sparse layer shares it)."""

    experts: int
    top_k: int
    expert_size: int  # each routed expert's intermediate size
    score: RouterScore
    norm_topk: bool
    scaling: float  # routed_scaling_factor
    groups: int
    topk_groups: int
    group_score: GroupScore | None
    correction_bias: bool
    shared_size: int  # 0: no shared expert
    shared_gate: bool
    router_bias: bool = False
    expert_bias: bool = False
    clamped_swiglu: tuple[float, float] | None = None  # (alpha, limit)
    scale_inputs: bool = False
    jitter_eps: float = 0.0  # sparsemixer: router_jitter_noise
    norm_p: float = 1.0  # norm_topk divides by this p-norm of the top-k weights (DBRX)
    gated: bool = True  # False: experts down(act(up(x))) (Nemotron-H)
    latent: int | None = None  # Nemotron-H: experts read a projection of this size


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): K and V come from one compressed
    latent of `kv_lora_rank` features plus one shared RoPE key of `rope_dim`."""

    q_lora_rank: int | None  # None: queries from one q_proj
    kv_lora_rank: int
    nope_dim: int  # per-head query/key features without RoPE
    rope_dim: int  # per-head (queries) / shared (key) features with RoPE
    v_dim: int  # per-head value features


def as_2017_block(cfg: dict[str, Any]) -> dict[str, Any]:
    """The same model (a config.json dict) with the 2017 block: the `kvchat2017` family
    (post-LayerNorm, ReLU FFN, sinusoidal positions), MHA (K/V heads = query heads) and
    an FFN 1.5x wider, so its two matrices hold as many weights as SwiGLU's three."""
    heads = int(cfg["num_attention_heads"])
    return {**cfg, "model_type": "kvchat2017", "architectures": ["kvchat2017"],
            "hidden_act": "relu", "num_key_value_heads": heads,
            "intermediate_size": int(cfg["intermediate_size"]) * 3 // 2,
            "rope_scaling": None, "rope_parameters": None, "layer_types": None}


# multimodal checkpoints whose language model kvchat runs (the vision tower is not loaded):
# model_type -> what the note says is left out
WRAPPERS: dict[str, str] = {
    "gemma3": "the vision tower",
    "mistral3": "the vision encoder",
    "llama4": "the vision model",
    "qwen3_5": "the vision tower",
    "qwen3_5_moe": "the vision tower",
}
# top-level keys of a wrapper that hold for its language model
WRAPPER_KEYS = ("quantization", "quantization_config", "torch_dtype", "dtype",
                "tie_word_embeddings")


def unwrap(cfg: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """(the language model's config, the wrapper's model_type or None)."""
    wrapper = cfg.get("model_type")
    text = cfg.get("text_config")
    if wrapper not in WRAPPERS or not isinstance(text, dict):
        return cfg, None
    return {**text, **{k: cfg[k] for k in WRAPPER_KEYS if k in cfg}}, wrapper


@dataclass(frozen=True)
class LayerSpec:
    """What differs between the layers of one model."""

    # FULL, SLIDING, CHUNKED, RECURRENT (the family's recurrent mixer), HYBRID (attention and
    # the recurrent mixer side by side, Falcon-H1), or one of FFN_KINDS (Nemotron-H: the
    # layer is its MLP or mixture of experts alone)
    kind: str
    window: int | None  # keys a query sees (None: all of them)
    rope: RopeConfig | None  # None: a NoPE layer (no rotary embedding)
    moe: bool = False  # the FFN is the model's mixture of experts (ModelConfig.moe)
    chunk: int | None = None  # chunked attention: keys of the query's own chunk only
    # the token mixer when it is not attention (ModelConfig.mixer holds its sizes): the
    # layer keeps a fixed-size state instead of K/V
    mixer: MixerKind | None = None

    @property
    def attends(self) -> bool:
        return self.kind == HYBRID or (self.mixer is None and self.kind not in FFN_KINDS)


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    max_position_embeddings: int
    sliding_window: int | None = None  # the window of the sliding layers, if any
    # mlx-community block: {"group_size": 64, "bits": 4, "<layer path>": {...} | False}
    quantization: dict[str, Any] | None = None
    torch_dtype: str | None = None
    # resolved family quirks (see Family)
    norm: NormKind = "rms"
    mlp: MlpKind = "gated"
    lm_head_bias: bool = False
    activation: str = "silu"
    block: BlockKind = "pre"
    recurrent_block: BlockKind | None = None  # the recurrent layers' block, where not `block`
    qk_norm: QkNormKind | None = None
    fused_proj: bool = False
    positions: PositionKind = "rope"
    embed_scale: float = 1.0
    residual_scale: float = 1.0
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None
    final_softcap: float | None = None
    logits_divisor: float = 1.0
    clip_qkv: float | None = None
    embed_norm: bool = False
    rope_traditional: bool = False
    rope_negative: bool = False
    moe: MoeConfig | None = None
    # set: every layer that attends is latent attention (cache kind "latent")
    mla: MlaConfig | None = None
    # the recurrent mixer's sizes (state_config.py) where some layers have one (LayerSpec.mixer)
    mixer: MixerConfig | None = None
    attention_gate: bool = False  # Qwen3-Next: attention output × sigmoid(gate)
    q_position_scale: tuple[float, int] | None = None  # Ministral 3: (beta, period), see layers
    attention_sinks: bool = False
    temperature: tuple[float, float] | None = None  # Llama 4: (floor_scale, attn_scale)
    # Falcon-H1's µP multipliers (families.Family.mup_multipliers): keys × key_scale (folded
    # into the attention scale), the MLP's gate and output × mlp_scales, and in a
    # "parallel_mixer" block the attention input, its output and the mixer's output ×
    # branch_scales
    key_scale: float = 1.0
    mlp_scales: tuple[float, float] | None = None
    branch_scales: tuple[float, float, float] | None = None
    # Zamba2 (block "shared_block"): shared transformer blocks taken in turn by the hybrid
    # layers, each use's low-rank adapters' rank, and whether q, k, v have adapters too
    shared_blocks: int = 0
    adapter_rank: int = 0
    qkv_adapters: bool = False
    wrapper: str | None = None  # a multimodal checkpoint's model_type (its text part runs)
    layers: tuple[LayerSpec, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def note(self) -> str | None:
        """The one line a multimodal checkpoint gets: what is not loaded."""
        if self.wrapper is None:
            return None
        return (f"{self.wrapper} checkpoint: kvchat runs its language model"
                f" ({self.model_type}); {WRAPPERS[self.wrapper]} is not loaded")

    @property
    def attention_layers(self) -> int:
        """Layers that attend (hold K/V)."""
        return sum(spec.attends for spec in self.layers)

    @property
    def recurrent_layers(self) -> int:
        """Layers with a recurrent mixer (they hold a state of fixed size)."""
        return sum(spec.mixer is not None for spec in self.layers)

    @property
    def gqa_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def layer_kinds(self) -> list[str]:
        return [spec.kind for spec in self.layers]

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        cfg, wrapper = unwrap(cfg)
        fam = family_of(cfg)
        model_type = cfg["model_type"]
        cfg = {**fam.defaults, **aliased(cfg, fam)}
        cfg = _derived_keys(cfg, fam)
        try:
            hidden = int(cfg["hidden_size"])
            if fam.attention == "none":
                # no attention layer (Mamba): one nominal head as wide as the model, so the
                # K/V ratios stay defined (1.0); kv_math names the attention "none"
                heads = kv_heads = 1
                head_dim = hidden
            else:
                heads = int(cfg["num_attention_heads"])
                kv_heads = int(cfg.get("num_key_value_heads") or heads)
                head_dim = int(cfg.get("head_dim") or hidden // heads)
            n_layers = int(cfg["num_hidden_layers"])
            inter = int(cfg[fam.dense_size_key]) if fam.dense_size_key else 0
            vocab = int(cfg["vocab_size"])
        except KeyError as e:
            raise ConfigError(f"config.json lacks required key {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ConfigError(f"config.json has a malformed value: {e}") from None
        if heads % kv_heads:
            raise ConfigError(
                f"num_attention_heads ({heads}) is not a multiple of"
                f" num_key_value_heads ({kv_heads})"
            )
        if cfg.get("use_bidirectional_attention"):
            raise ConfigError(
                "config.json: use_bidirectional_attention is set; kvchat runs causal decoders only"
            )
        attn_bias = bool(cfg.get(fam.bias_key, False))
        try:
            mla = _mla(cfg) if fam.attention == "mla" else None
            moe, sparse = _moe(cfg, fam, n_layers)
            quirks = _quirks(cfg, fam, hidden)
            mixer = resolve_mixer(cfg, fam, hidden, float(cfg.get(fam.eps_key) or 1e-6))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"config.json has a malformed value: {e}") from None
        if mla is not None:
            head_dim = mla.nope_dim + mla.rope_dim
        rope = global_rope(cfg, fam.rope_aliases)
        layers, window = _layer_specs(cfg, fam, n_layers, rope, sparse)
        for r in [rope] + [spec.rope for spec in layers if spec.rope is not None]:
            check_rotary(r, mla.rope_dim if mla is not None else head_dim)
        return cls(
            model_type=model_type,
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=inter,
            vocab_size=vocab,
            rms_norm_eps=float(cfg.get(fam.eps_key) or 1e-6),
            rope=rope,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", fam.tie_word_embeddings)),
            qkv_bias=attn_bias if fam.qkv_bias is None else fam.qkv_bias,
            o_bias=bool(cfg.get(fam.o_bias_key or fam.bias_key, False))
            if fam.o_bias is None else fam.o_bias,
            mlp_bias=bool(cfg.get(fam.mlp_bias_key, False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            sliding_window=window,
            quantization=cfg.get("quantization") or cfg.get("quantization_config"),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            layers=layers,
            moe=moe,
            mla=mla,
            mixer=mixer,
            wrapper=wrapper,
            raw=cfg,
            **quirks,
        )


def aliased(cfg: dict[str, Any], fam: Family) -> dict[str, Any]:
    """config.json under the names kvchat reads: the family's `key_aliases`, a dotted one
    read from nested objects (DBRX's attn_config.kv_n_heads) where they hold it."""
    out = {fam.key_aliases.get(k, k): v for k, v in cfg.items()}
    for path, key in fam.key_aliases.items():
        if "." not in path:
            continue
        node: Any = cfg
        parts = path.split(".")
        for i, part in enumerate(parts):
            if node is None:
                break
            if not isinstance(node, dict):
                raise ConfigError(f"config.json: {'.'.join(parts[:i])} must be an object,"
                                  f" got {node!r:.60}")
            if part not in node:
                break
            node = node[part]
        else:
            out[key] = node
    return out


def _derived_keys(cfg: dict[str, Any], fam: Family) -> dict[str, Any]:
    """Keys a family spells as something else to derive (GPT-J: n_inner = null, rotary_dim)."""
    try:
        if cfg.get("num_hidden_layers") is None and isinstance(cfg.get("layer_types"), list):
            # Nemotron-H (transformers 5) writes the layer list alone
            cfg = {**cfg, "num_hidden_layers": len(cfg["layer_types"])}
        if fam.ffn_auto_adjust and cfg.get("block_auto_adjust_ff_dim", True):
            cfg = {**cfg, "intermediate_size": _adjusted_ffn(cfg)}
        if fam.block == "shared_block" and cfg.get("head_dim") is None:
            # Zamba2: heads split the shared block's input, [x, embeddings]
            cfg = {**cfg, "head_dim": 2 * int(cfg["hidden_size"]) // int(
                cfg["num_attention_heads"])}
        if fam.ffn_half and cfg.get("intermediate_size") is not None:
            cfg = {**cfg, "intermediate_size": int(cfg["intermediate_size"]) // 2}
        if fam.ffn_mult and cfg.get("intermediate_size") is None and "hidden_size" in cfg:
            cfg = {**cfg, "intermediate_size": fam.ffn_mult * int(cfg["hidden_size"])}
        if "multi_query" in cfg:  # StarCoder 1: one K/V head
            heads = int(cfg["num_attention_heads"])
            cfg = {**cfg, "num_key_value_heads": 1 if cfg["multi_query"] else heads}
        if cfg.get("scale_attn_by_inverse_layer_idx"):
            raise ConfigError("config.json: scale_attn_by_inverse_layer_idx is not supported")
        if fam.rotary_dim_key and cfg.get(fam.rotary_dim_key) is not None:
            head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) //
                           int(cfg["num_attention_heads"]))
            cfg = {**cfg, "partial_rotary_factor": int(cfg[fam.rotary_dim_key]) / head_dim}
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise ConfigError(f"config.json has a malformed value: {e}") from None
    return cfg


def _adjusted_ffn(cfg: dict[str, Any]) -> int:
    """LFM2's MLP size: ⅔ of intermediate_size, × block_ffn_dim_multiplier (if set) and
    then rounded up to a multiple of block_multiple_of (transformers' Lfm2MLP)."""
    size = int(2 * int(cfg["intermediate_size"]) / 3)
    mult = cfg.get("block_ffn_dim_multiplier", 1.0)  # null: no multiplier, no rounding
    if mult is not None:
        size = int(float(mult) * size)
        step = int(cfg.get("block_multiple_of", 256))
        size = step * ((size + step - 1) // step)
    return size


def _positive(cfg: dict[str, Any], key: str, default: Any = None) -> int:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"config.json: {key} must be a positive integer, got {v!r:.60}")
    return v


def _first_key(cfg: dict[str, Any], keys: tuple[str, ...]) -> str:
    """The first of `keys` config.json sets (families spell the expert count differently)."""
    return next((k for k in keys if cfg.get(k) is not None), keys[0])


def _moe(cfg: dict[str, Any], fam: Family, n: int) -> tuple[MoeConfig | None, list[bool]]:
    """The mixture (None: a dense family) and which layers use it."""
    spec = fam.moe
    count_key = None if spec is None else spec.count_key or _first_key(
        cfg, ("num_local_experts", "num_experts", "n_routed_experts"))
    if spec is None or (spec.dense_when_none and cfg.get(count_key) == 0):
        return None, [False] * n
    experts = _positive(cfg, count_key)
    top_k = _positive(cfg, spec.top_k_key)
    if top_k > experts:
        raise ConfigError(
            f"config.json: {spec.top_k_key} ({top_k}) exceeds the {experts} experts"
        )
    if spec.score == "sparsemixer" and top_k != 2:  # transformers' mixer always picks two
        raise ConfigError(f"config.json: the sparse mixer routes each token to 2 experts;"
                          f" {spec.top_k_key} is {top_k}")
    groups, topk_groups = 1, 1
    grouped = spec.group_score is not None and (
        spec.group_key is None or cfg.get(spec.group_key) == "group_limited_greedy"
    )
    if grouped and cfg.get("n_group"):
        groups, topk_groups = _positive(cfg, "n_group"), _positive(cfg, "topk_group")
        if experts % groups or topk_groups > groups:
            raise ConfigError(
                f"config.json: n_group ({groups}) must divide the {experts} experts and be"
                f" >= topk_group ({topk_groups})"
            )
    shared_size = 0
    if spec.shared == "gated":
        shared_size = int(cfg.get("shared_expert_intermediate_size") or 0)
    elif spec.shared == "plain" and spec.shared_size_key is not None:  # Granite 4
        shared_size = _positive(cfg, spec.shared_size_key)
    elif spec.shared == "plain":
        shared_size = int(cfg.get(spec.shared_count_key) or 0) * _positive(
            cfg, spec.expert_size_key)
    norm_topk = spec.norm_topk_always or bool(cfg.get("norm_topk_prob"))
    norm_p = 1.0
    if spec.norm_p_key is not None:
        p = cfg.get(spec.norm_p_key)
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float))
                              or not p > 0):  # NaN fails too
            raise ConfigError(f"config.json: {spec.norm_p_key} must be a number > 0 or null,"
                              f" got {p!r:.60}")
        norm_topk, norm_p = p is not None, float(p or 1.0)
    moe = MoeConfig(
        experts=experts, top_k=top_k, expert_size=_positive(cfg, spec.expert_size_key),
        score=spec.score, norm_topk=norm_topk, norm_p=norm_p,
        scaling=float(cfg.get("routed_scaling_factor") or 1.0), groups=groups,
        topk_groups=topk_groups, group_score=spec.group_score if groups > 1 else None,
        correction_bias=spec.correction_bias and (
            spec.correction_bias_flag is None or bool(cfg.get(spec.correction_bias_flag, True))),
        shared_size=shared_size,
        shared_gate=spec.shared == "gated", router_bias=spec.router_bias,
        expert_bias=spec.expert_bias,
        clamped_swiglu=(float(cfg.get("swiglu_alpha", 1.702)), float(cfg.get("swiglu_limit", 7.0)))
        if spec.clamped_swiglu else None, scale_inputs=spec.scale_inputs,
        jitter_eps=_sparsemixer_eps(cfg) if spec.score == "sparsemixer" else 0.0,
        gated=spec.gated, latent=_positive(cfg, spec.latent_key)
        if spec.latent_key and cfg.get(spec.latent_key) is not None else None,
    )
    if spec.sparse_layers == "step":
        step = _positive(cfg, "decoder_sparse_step", 1)
        dense = set(cfg.get("mlp_only_layers") or [])
        sparse = [i not in dense and (i + 1) % step == 0 for i in range(n)]
    elif spec.sparse_layers == "first_dense":
        first = int(cfg.get("first_k_dense_replace") or 0)
        every = int(cfg.get("moe_layer_freq") or 1)
        sparse = [i >= first and i % every == 0 for i in range(n)]
    elif spec.sparse_layers == "listed":  # Llama 4: moe_layers, else every step-th
        step = _positive(cfg, "interleave_moe_layer_step", 1)
        listed = cfg.get("moe_layers")
        listed = set(range(step - 1, n, step) if listed is None else listed)
        sparse = [i in listed for i in range(n)]
    elif spec.sparse_layers == "types":
        # mlp_layer_types, else the first first_k_dense_replace layers dense (EXAONE-MoE,
        # Kimi Linear; GLM-4.7-Flash's one dense layer when neither is given)
        first = cfg.get("first_k_dense_replace", 1)
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise ConfigError(f"config.json: first_k_dense_replace must be an integer >= 0,"
                              f" got {first!r:.60}")
        types = cfg.get("mlp_layer_types") or ["dense" if i < first else "sparse"
                                               for i in range(n)]
        if not isinstance(types, list) or len(types) != n:
            raise ConfigError(f"config.json: mlp_layer_types must list {n} entries")
        sparse = [t == "sparse" for t in types]
    elif spec.sparse_layers == "interval":
        every = _positive(cfg, "moe_layer_interval", 1)
        start, end = int(cfg.get("moe_layer_start_index") or 0), cfg.get("moe_layer_end_index")
        end = n - 1 if end is None or end < 0 else int(end)
        sparse = [(i + 1) % every == 0 and start <= i <= end for i in range(n)]
    elif spec.sparse_layers == "kinds":  # Nemotron-H: the layer kinds say (FFN_MOE)
        sparse = [False] * n
    elif spec.sparse_layers == "period":  # Jamba
        every = _positive(cfg, "expert_layer_period", 2)
        first = int(cfg.get("expert_layer_offset") or 0)
        sparse = [i % every == first for i in range(n)]
    else:
        sparse = [True] * n
    return moe, sparse


def _sparsemixer_eps(cfg: dict[str, Any]) -> float:
    eps = cfg.get("router_jitter_noise", 0.01)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < 1:
        raise ConfigError(f"config.json: router_jitter_noise must be a number in [0, 1),"
                          f" got {eps!r}")
    return float(eps)


def _mla(cfg: dict[str, Any]) -> MlaConfig:
    q_rank = cfg.get("q_lora_rank")
    return MlaConfig(
        q_lora_rank=None if q_rank is None else _positive(cfg, "q_lora_rank"),
        kv_lora_rank=_positive(cfg, "kv_lora_rank"),
        nope_dim=_positive(cfg, "qk_nope_head_dim"),
        rope_dim=_positive(cfg, "qk_rope_head_dim"),
        v_dim=_positive(cfg, "v_head_dim") if cfg.get("v_head_dim") is not None
        else int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]),  # MiniCPM3's default
    )


def _layer_specs(
    cfg: dict[str, Any], fam: Family, n: int, rope: RopeConfig, sparse: list[bool]
) -> tuple[tuple[LayerSpec, ...], int | None]:
    window = cfg.get("sliding_window")
    if not fam.window_used(cfg):
        window = None
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ConfigError(
                f"config.json: sliding_window must be a positive integer, got {window!r}"
            )
    kinds = cfg.get("layer_types")
    allowed = (*LAYER_KINDS, *((RECURRENT, HYBRID) if fam.mixer else ()),
               *(FFN_KINDS if fam.ffn_layers else ()))
    if kinds is not None:
        if not isinstance(kinds, list) or len(kinds) != n:
            got = len(kinds) if isinstance(kinds, list) else type(kinds).__name__
            raise ConfigError(
                f"config.json: layer_types has {got} entries for num_hidden_layers {n}"
            )
        if fam.mixer:
            kinds = [LAYER_KIND_ALIASES.get(k, k) if isinstance(k, str) else k for k in kinds]
        bad = [k for k in kinds if k not in allowed]
        if bad:
            raise ConfigError(
                f"config.json: layer_types holds {bad[0]!r}; allowed: {', '.join(allowed)}"
            )
    elif fam.mixer_rule is not None:
        kinds = fam.mixer_rule(cfg, n)
    elif fam.layer_rule is not None:
        kinds = fam.layer_rule(cfg, n)
    else:
        kinds = [FULL] * n
    if window is None:  # no window: a "sliding" layer sees everything (as transformers)
        kinds = [FULL if k == SLIDING else k for k in kinds]
    chunk = cfg.get("attention_chunk_size")
    if chunk is None:
        kinds = [FULL if k == CHUNKED else k for k in kinds]
    local = local_rope(cfg, fam.rope_aliases) if fam.local_rope else rope
    if fam.nope == "listed":
        rope_on = no_rope_layers(cfg, n)
    elif fam.nope == "global" and window is not None:
        rope_on = [int(k == SLIDING) for k in kinds]
    elif fam.rope_flag is not None:  # Granite 4: RoPE only when the config says so
        key, value = fam.rope_flag
        rope_on = [int(cfg.get(key) == value)] * n
    else:
        rope_on = [int(fam.positions == "rope")] * n
    specs = tuple(
        LayerSpec(
            kind=k,
            window=window if k == SLIDING else None,
            rope=(local if k == SLIDING else rope)
            if rope_on[i] and (k in LAYER_KINDS or k == HYBRID) else None,
            moe=sparse[i] or k == FFN_MOE,
            chunk=int(chunk) if k == CHUNKED else None,
            mixer=fam.mixer if k in (RECURRENT, HYBRID) else None,
        )
        for i, k in enumerate(kinds)
    )
    return specs, window if SLIDING in kinds else None


def _quirks(cfg: dict[str, Any], fam: Family, hidden: int) -> dict[str, Any]:
    """The family's numeric quirks, resolved from config.json."""
    act = cfg.get(fam.activation_key) or "silu"
    act = fam.activation_aliases.get(act, act)
    if act not in ACTIVATION_NAMES:
        raise ConfigError(
            f"config.json: {fam.activation_key} {act!r} is not supported;"
            f" supported: {', '.join(ACTIVATION_NAMES)}"
        )
    out: dict[str, Any] = {
        "norm": fam.norm, "activation": act,
        "block": fam.parallel_block if fam.parallel_flag and cfg.get(fam.parallel_flag)
        else fam.block,
        "qk_norm": fam.qk_norm if fam.qk_norm_flag is None or cfg.get(fam.qk_norm_flag)
        else None,
        "fused_proj": fam.fused_proj, "rope_traditional": fam.rope_traditional,
        "mlp": fam.mlp, "lm_head_bias": fam.head_bias
        or bool(fam.head_bias_key and cfg.get(fam.head_bias_key)), "embed_norm": fam.embed_norm,
        "rope_negative": fam.rope_negative, "attention_sinks": fam.attention_sinks,
        "positions": fam.positions, "attention_gate": fam.attention_gate,
        "recurrent_block": fam.recurrent_block,
    }
    if fam.temperature_tuning and cfg.get("attn_temperature_tuning", True):
        out["temperature"] = (float(cfg.get("floor_scale", 8192)),
                              float(cfg.get("attn_scale", 0.1)))
    if fam.depth_scaled:
        out["embed_scale"] = float(cfg.get("scale_emb", 1.0))
        out["residual_scale"] = float(cfg.get("scale_depth", 1.0)) / math.sqrt(
            int(cfg["num_hidden_layers"]))
        out["logits_divisor"] = hidden / float(cfg.get("dim_model_base") or hidden)
    rope = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    if fam.position_scaled_queries and rope.get("llama_4_scaling_beta"):
        out["q_position_scale"] = (float(rope["llama_4_scaling_beta"]),
                                   int(rope["original_max_position_embeddings"]))
    if fam.logit_scale:
        out["logits_divisor"] = 1.0 / float(cfg.get("logit_scale", 1.0))
    if fam.rope_traditional and cfg.get("rope_interleave") is False:
        out["rope_traditional"] = False  # DeepSeek-V3 configs may turn the interleave off
    if fam.clip_qkv and cfg.get("clip_qkv") is not None:
        out["clip_qkv"] = float(cfg["clip_qkv"])
    if fam.embed_scale_sqrt_hidden:
        out["embed_scale"] = _bfloat16(hidden**0.5) if fam.embed_scale_bf16 else hidden**0.5
    if fam.query_pre_attn_scalar:
        out["attn_scale"] = float(cfg["query_pre_attn_scalar"]) ** -0.5
    if fam.multipliers:
        out["embed_scale"] = float(cfg.get("embedding_multiplier", 1.0))
        out["attn_scale"] = float(cfg.get("attention_multiplier", 1.0))
        out["residual_scale"] = float(cfg.get("residual_multiplier", 1.0))
        out["logits_divisor"] = float(cfg.get("logits_scaling", 1.0))
        if out["logits_divisor"] == 0:
            raise ConfigError("config.json: logits_scaling must not be 0")
    if fam.mup_multipliers:
        out.update(_mup(cfg))
    if fam.block == "shared_block":
        out.update(shared_blocks=_positive(cfg, "num_mem_blocks", 1),
                   adapter_rank=_positive(cfg, "adapter_rank", 128),
                   qkv_adapters=bool(cfg.get("use_shared_attention_adapter", False)))
    if fam.softcaps:
        for key, name in (("attn_logit_softcapping", "attn_softcap"),
                          ("final_logit_softcapping", "final_softcap")):
            cap = cfg.get(key)
            if cap is not None and float(cap) <= 0:
                raise ConfigError(f"config.json: {key} must be > 0 (or null), got {cap}")
            out[name] = None if cap is None else float(cap)
    return out


def _mup(cfg: dict[str, Any]) -> dict[str, Any]:
    """Falcon-H1's µP multipliers (transformers' FalconH1Config names; absent: 1)."""

    def num(key: str) -> float:
        v = cfg.get(key)
        return 1.0 if v is None else float(v)

    mlp = cfg.get("mlp_multipliers") or [1.0, 1.0]
    if not isinstance(mlp, list) or len(mlp) != 2:
        raise ConfigError(f"config.json: mlp_multipliers must list 2 numbers, got {mlp!r:.60}")
    head = num("lm_head_multiplier")
    if head == 0:
        raise ConfigError("config.json: lm_head_multiplier must not be 0")
    return {"embed_scale": num("embedding_multiplier"), "logits_divisor": 1.0 / head,
            "key_scale": num("key_multiplier"), "mlp_scales": (float(mlp[0]), float(mlp[1])),
            "branch_scales": (num("attention_in_multiplier"), num("attention_out_multiplier"),
                              num("ssm_out_multiplier"))}
def _bfloat16(x: float) -> float:
    """x rounded to the nearest bfloat16 (ties to even), as torch rounds a float32."""
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return float(struct.unpack("<f", struct.pack("<I", bits))[0])


def load_config(path: str | Path) -> ModelConfig:
    """Read `config.json` (a file, or the folder holding it), or a GGUF file's metadata
    as the config.json it stands for (gguf.py)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if is_gguf(p) or p.suffix == ".gguf":  # a .gguf that is not one: read_gguf says why
        cfg = gguf_config(read_gguf(p))
    else:
        cfg = _read_config_json(p)
    text, _ = unwrap(cfg)
    fam = family_of(text)
    # the family first, then its checks: keys the family ignores are not checked
    text = aliased(text, fam)
    check_config(text if fam.window_used(text) else
                 {k: v for k, v in text.items() if k != "sliding_window"})
    return ModelConfig.from_dict(cfg)


def _read_config_json(p: Path) -> dict[str, Any]:
    if not p.is_file():
        raise ConfigError(f"no config.json in {p.parent}")
    try:
        cfg = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {p}: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{p} is not a JSON object")
    return cfg
