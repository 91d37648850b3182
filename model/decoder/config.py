"""Model configuration parsed from a Hugging Face / mlx-community `config.json`.

Every difference between the supported families lives in `FAMILIES`: one `Family` row
per `model_type` naming its building blocks (norm, MLP, block layout, attention extras)
and the defaults transformers assumes when a key is absent. `ModelConfig.from_dict`
resolves a row plus a config.json into plain numbers and per-layer `LayerSpec`s; the
rest of the code reads those and never branches on `model_type`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvchat.model.errors import ConfigError

from .config_checks import check_config

FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"
LAYER_KINDS = (FULL, SLIDING, CHUNKED)

# activation names in config.json -> the function mlx computes (layers.ACTIVATIONS)
ACTIVATION_NAMES = ("silu", "gelu_pytorch_tanh", "gelu_new", "gelu", "gelu_fast", "relu",
                    "relu2", "xielu")


# ---- which layers slide: one rule per family, used when config.json has no layer_types
LayerRule = Callable[[dict[str, Any], int], list[str]]


def _all_layers(cfg: dict[str, Any], n: int) -> list[str]:
    """Every layer uses the window when one is set (Mistral, Phi-3)."""
    return [SLIDING] * n


def _from_max_window_layers(cfg: dict[str, Any], n: int) -> list[str]:
    """Qwen2/3: layers from `max_window_layers` on slide (transformers' rule)."""
    first = int(cfg.get("max_window_layers", 28))
    return [SLIDING if i >= first else FULL for i in range(n)]


def _every_nth_global(period_key: str | None, default: int) -> LayerRule:
    """Gemma 2 / 3: every n-th layer is global (n from `period_key`), the others slide."""

    def rule(cfg: dict[str, Any], n: int) -> list[str]:
        period = int((cfg.get(period_key) if period_key else None) or default)
        return [FULL if (i + 1) % period == 0 else SLIDING for i in range(n)]

    return rule


def _chunked_rope_layers(cfg: dict[str, Any], n: int) -> list[str]:
    """Llama 4: the RoPE layers attend within chunks of attention_chunk_size, the NoPE
    layers globally."""
    rope_on = _no_rope_layers(cfg, n)
    chunked = cfg.get("attention_chunk_size") is not None
    return [CHUNKED if r and chunked else FULL for r in rope_on]


def _pattern_layers(cfg: dict[str, Any], n: int) -> list[str]:
    """EXAONE 4: `sliding_window_pattern` "LLLG" (L slides, G is global) repeated, or an
    int n (every n-th layer global)."""
    pattern = cfg.get("sliding_window_pattern", 4)
    if isinstance(pattern, str) and pattern and set(pattern) <= {"L", "G"}:
        return [SLIDING if pattern[i % len(pattern)] == "L" else FULL for i in range(n)]
    return _every_nth_global(None, int(pattern or 4))(cfg, n)


def _nope_layers_slide(cfg: dict[str, Any], n: int) -> list[str]:
    """SmolLM3: with use_sliding_window, the NoPE layers slide."""
    rope_on = _no_rope_layers(cfg, n)
    return [FULL if r else SLIDING for r in rope_on]


def _no_rope_layers(cfg: dict[str, Any], n: int) -> list[int]:
    """SmolLM3's `no_rope_layers` (1 = RoPE, 0 = NoPE), else every interval-th is NoPE."""
    given = cfg.get("no_rope_layers")
    if given is None:
        every = int(cfg.get("no_rope_layer_interval") or 4)
        return [int((i + 1) % every != 0) for i in range(n)]
    if not isinstance(given, list) or len(given) < n:
        raise ConfigError(
            f"config.json: no_rope_layers must list at least {n} entries (one per layer)"
        )
    return [int(bool(x)) for x in given[:n]]


@dataclass(frozen=True)
class MoeFamily:
    """How one family routes tokens to experts (see moe.py) and which config keys say so."""

    # router scores: "softmax" | "sigmoid" (DeepSeek-V3) | "sparsemixer" (Phi-MoE: each
    # pick a softmax over the experts still within router_jitter_noise of the best, see
    # moe.route)
    score: str = "softmax"
    # grouped top-k: experts split in n_group groups, only the topk_group best groups
    # compete; a group's score is its best expert ("max", V2) or its best two ("top2", V3)
    group_score: str | None = None
    group_key: str | None = None  # config key that switches grouping on (V2: topk_method)
    correction_bias: bool = False  # V3: e_score_correction_bias picks experts, never weighs
    shared: str | None = None  # None | "gated" (Qwen2-MoE: sigmoid gate) | "plain" (DeepSeek)
    count_key: str | None = None  # None: num_local_experts / num_experts / n_routed_experts
    top_k_key: str = "num_experts_per_tok"
    shared_count_key: str = "n_shared_experts"  # "plain": shared size = count × expert size
    expert_size_key: str = "moe_intermediate_size"
    norm_topk_always: bool = False  # Mixtral renormalises the top-k weights unconditionally
    # DBRX: the top-k weights ÷ their p-norm, p from this config key (null: no division)
    norm_p_key: str | None = None
    router_bias: bool = False  # gpt-oss: the router Linear has a bias
    expert_bias: bool = False  # gpt-oss: every expert projection has a bias
    clamped_swiglu: bool = False  # gpt-oss: swiglu_alpha / swiglu_limit (moe.clamped_swiglu)
    scale_inputs: bool = False  # Llama 4: each expert's input × its weight (not its output)
    # how transformers stores fused experts (`experts.gate_up_proj`): gate and up
    # "interleaved" column by column (gpt-oss) or as two "halves" (Llama 4); or "rows"
    # (DBRX): one (experts × size, hidden) matrix per projection (moe.unfuse_experts)
    fused_experts: str = "interleaved"
    # which layers are sparse: "all" | "step" (decoder_sparse_step, mlp_only_layers) |
    # "first_dense" (first_k_dense_replace dense layers, then MoE) | "interval" (ERNIE:
    # every moe_layer_interval-th from moe_layer_start_index to moe_layer_end_index)
    sparse_layers: str = "all"


@dataclass(frozen=True)
class MoeConfig:
    """The resolved mixture of one model (every sparse layer shares it)."""

    experts: int
    top_k: int
    expert_size: int  # each routed expert's intermediate size
    score: str
    norm_topk: bool
    scaling: float  # routed_scaling_factor
    groups: int
    topk_groups: int
    group_score: str | None
    correction_bias: bool
    shared_size: int  # 0: no shared expert
    shared_gate: bool
    router_bias: bool = False
    expert_bias: bool = False
    clamped_swiglu: tuple[float, float] | None = None  # (alpha, limit)
    scale_inputs: bool = False
    jitter_eps: float = 0.0  # sparsemixer: router_jitter_noise
    norm_p: float = 1.0  # norm_topk divides by this p-norm of the top-k weights (DBRX)


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): K and V come from one compressed
    latent of `kv_lora_rank` features plus one shared RoPE key of `rope_dim`."""

    q_lora_rank: int | None  # None: queries from one q_proj
    kv_lora_rank: int
    nope_dim: int  # per-head query/key features without RoPE
    rope_dim: int  # per-head (queries) / shared (key) features with RoPE
    v_dim: int  # per-head value features


@dataclass(frozen=True)
class Family:
    """One model type's quirks: which building blocks it uses and what transformers
    assumes when a config key is absent (`defaults`, merged under config.json)."""

    qkv_bias: bool | None = None  # None: read `bias_key` from the config
    o_bias: bool | None = None  # None: read `o_bias_key` from the config
    bias_key: str = "attention_bias"  # ERNIE: use_bias (attention and MLP)
    o_bias_key: str | None = None  # None: as bias_key (Seed-OSS: attention_out_bias)
    mlp_bias_key: str = "mlp_bias"
    tie_word_embeddings: bool = False  # default when config.json does not say
    # sliding_window applies only when this config flag is true (None: whenever set)
    sliding_window_flag: str | None = None
    # which layers slide when config.json has no `layer_types`; None: the family has
    # no sliding attention (a sliding_window key is ignored, as transformers does)
    layer_rule: LayerRule | None = _all_layers
    # "rms": x̂·w | "offset": x̂·(1 + w) (Gemma) | "layer": LayerNorm (mean removed), w and b
    # | "layer_nobias" (Cohere) | "layer1p": w stored as w − 1 (Nemotron) | "layer_noparam"
    norm: str = "rms"
    eps_key: str = "rms_norm_eps"  # the config key of the norms' epsilon
    # "gated": down(act(gate)·up) | "fused": the same from one gate_up_proj (GLM) |
    # "plain": down(act(up)) (see PlainMLP)
    mlp: str = "gated"
    head_bias: bool = False  # the LM head has a bias (Phi-2)
    head_bias_key: str | None = None  # or when this config flag is true (Phi-MoE)
    logit_scale: bool = False  # Cohere: logits × logit_scale
    embed_norm: bool = False  # nanochat: the embeddings pass through the final norm first
    # MiniCPM3: embeddings × scale_emb, each branch × scale_depth / √layers
    depth_scaled: bool = False
    activation_key: str = "hidden_act"  # config key naming the MLP's gate activation
    activation_aliases: dict[str, str] = field(default_factory=dict)
    # "pre" | "sandwich" (4 norms) | "post" (norms after each branch) | "parallel"
    # (attention and MLP read the same normed input) | "parallel2" (each its own norm) |
    # "post_ln" (2017: LayerNorm of the residual sum after each branch)
    block: str = "pre"
    # "rope" | "sinusoidal" (2017: added to the embeddings) | "learned" (GPT-2: a table)
    positions: str = "rope"
    # None | "head" (per head) | "proj" (over the projection) | "head_after_rope" (Hunyuan)
    qk_norm: str | None = None
    qk_norm_flag: str | None = None  # qk_norm applies only when this config flag is true
    # Ministral 3: queries × 1 + β·log(1 + ⌊position / original context⌋), β from the rope
    # parameters' llama_4_scaling_beta
    position_scaled_queries: bool = False
    attention_sinks: bool = False  # gpt-oss: a learned sink logit per head (self_attn.sinks)
    dense_size_key: str = "intermediate_size"  # Llama 4: the dense layers' intermediate_size_mlp
    # Llama 4: NoPE layers' queries × 1 + attn_scale·log(1 + ⌊(pos + 1) / floor_scale⌋)
    temperature_tuning: bool = False
    # StableLM, GPT-NeoX: this config flag makes the block `parallel_block`
    parallel_flag: str | None = None
    parallel_block: str = "parallel"
    fused_proj: bool = False  # one qkv_proj and one gate_up_proj (Phi-3)
    embed_scale_sqrt_hidden: bool = False  # Gemma: embeddings × √hidden_size
    multipliers: bool = False  # Granite: embedding/attention/residual multipliers, logits_scaling
    query_pre_attn_scalar: bool = False  # Gemma 2/3: attention scale = scalar^-0.5
    softcaps: bool = False  # Gemma 2/3: attn/final logit soft-capping keys are honoured
    local_rope: bool = False  # Gemma 3: sliding layers have their own RoPE base
    # layers without RoPE: None | "listed" (SmolLM3's `no_rope_layers`) | "global" (the
    # full-attention layers of a model with sliding ones: EXAONE 4, Command R7B)
    nope: str | None = None
    rope_aliases: dict[str, str] = field(default_factory=dict)  # Phi-3: "su" -> "longrope"
    moe: MoeFamily | None = None  # the FFN of (some) layers is a mixture of experts
    attention: str = "gqa"  # "gqa" (MHA/GQA/MQA) | "mla" (latent, DeepSeek-V2/V3)
    rope_traditional: bool = False  # RoPE rotates adjacent pairs (DeepSeek's interleave)
    rope_negative: bool = False  # nanochat: its rotate_half turns the other way
    clip_qkv: bool = False  # OLMoE: config's clip_qkv clamps q, k and v
    # classic config keys -> the names transformers 5 (and kvchat) reads; a dotted key
    # reads a nested object (DBRX: "attn_config.kv_n_heads"), and wins over a top-level one
    key_aliases: dict[str, str] = field(default_factory=dict)
    ffn_mult: int | None = None  # GPT-J: intermediate_size absent (null) means ffn_mult × hidden
    # one fused c_attn holding q, k, v one after the other (GPT-2, StarCoder 1), split on
    # load; "conv1d": stored (in, out) as GPT-2's Conv1D, transposed first
    fused_qkv: str | None = None
    rotary_dim_key: str | None = None  # GPT-J: rotated features per head, as a count
    # checkpoint tensor names -> ours (substring replacements, applied in order)
    renames: tuple[tuple[str, str], ...] = ()
    defaults: dict[str, Any] = field(default_factory=dict)

    def window_used(self, cfg: dict[str, Any]) -> bool:
        """Whether this family reads `sliding_window` at all with this config (transformers
        ignores it otherwise, e.g. Qwen2-MoE's `sliding_window: 0` with the flag off)."""
        return self.layer_rule is not None and (
            self.sliding_window_flag is None or bool(cfg.get(self.sliding_window_flag, False))
        )


_GEMMA_DEFAULTS: dict[str, Any] = {"head_dim": 256, "rms_norm_eps": 1e-6}

_GPT2_KEYS = {"n_embd": "hidden_size", "n_layer": "num_hidden_layers",
              "n_head": "num_attention_heads", "n_positions": "max_position_embeddings",
              "n_inner": "intermediate_size", "layer_norm_epsilon": "layer_norm_eps",
              "activation_function": "hidden_act"}
# GPT-2-style checkpoint names: the body (also EXAONE 3's), then GPT-2's own layers
_GPT_BODY_NAMES = (("transformer.wte.", "model.embed_tokens."),
                   ("transformer.h.", "model.layers."), ("transformer.ln_f.", "model.norm."),
                   (".ln_1.", ".input_layernorm."), (".ln_2.", ".post_attention_layernorm."),
                   (".mlp.c_proj.", ".mlp.down_proj."))
_GPT2_NAMES = (*_GPT_BODY_NAMES, ("transformer.wpe.", "model.embed_positions."),
               (".attn.c_proj.", ".self_attn.o_proj."), (".attn.c_attn.", ".self_attn.c_attn."),
               (".mlp.c_fc.", ".mlp.up_proj."))

# Mixtral's checkpoint names (Phi-MoE saves the same)
_MIXTRAL_NAMES = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."),
                  (".w2.", ".down_proj."), (".w3.", ".up_proj."))

FAMILIES: dict[str, Family] = {
    # Llama 2, 3, 3.1, 3.2, SmolLM 1/2, TinyLlama, stories260K
    "llama": Family(),
    "mistral": Family(qkv_bias=False, o_bias=False, defaults={"sliding_window": 4096}),
    "qwen2": Family(
        qkv_bias=True, o_bias=False, sliding_window_flag="use_sliding_window",
        layer_rule=_from_max_window_layers,
    ),
    "qwen3": Family(
        sliding_window_flag="use_sliding_window", layer_rule=_from_max_window_layers,
        qk_norm="head",
    ),
    "gemma": Family(
        tie_word_embeddings=True, layer_rule=None, norm="offset",
        activation_aliases={"gelu": "gelu_pytorch_tanh"},  # transformers: legacy name
        embed_scale_sqrt_hidden=True,
        defaults={**_GEMMA_DEFAULTS, "hidden_act": "gelu_pytorch_tanh"},
    ),
    "gemma2": Family(
        tie_word_embeddings=True, layer_rule=_every_nth_global(None, 2), norm="offset",
        activation_key="hidden_activation", block="sandwich", embed_scale_sqrt_hidden=True,
        query_pre_attn_scalar=True, softcaps=True,
        defaults={
            **_GEMMA_DEFAULTS, "hidden_activation": "gelu_pytorch_tanh",
            "sliding_window": 4096, "query_pre_attn_scalar": 256,
            "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
        },
    ),
    "gemma3_text": Family(
        tie_word_embeddings=True, layer_rule=_every_nth_global("sliding_window_pattern", 6),
        norm="offset", activation_key="hidden_activation", block="sandwich", qk_norm="head",
        embed_scale_sqrt_hidden=True, query_pre_attn_scalar=True, softcaps=True,
        local_rope=True,
        defaults={
            **_GEMMA_DEFAULTS, "hidden_activation": "gelu_pytorch_tanh",
            "sliding_window": 4096, "query_pre_attn_scalar": 256, "rope_theta": 1e6,
            "rope_local_base_freq": 1e4, "max_position_embeddings": 131072,
        },
    ),
    "phi3": Family(
        qkv_bias=False, o_bias=False, fused_proj=True,
        rope_aliases={"su": "longrope", "yarn": "longrope"},  # transformers' phi3 does this
        defaults={"original_max_position_embeddings": 4096, "rms_norm_eps": 1e-5},
    ),
    "smollm3": Family(
        tie_word_embeddings=True, sliding_window_flag="use_sliding_window",
        layer_rule=_nope_layers_slide, nope="listed", defaults={"rope_theta": 2e6},
    ),
    "olmo2": Family(layer_rule=None, block="post", qk_norm="proj", defaults={"rms_norm_eps": 1e-5}),
    "olmo3": Family(
        layer_rule=_every_nth_global(None, 4), block="post", qk_norm="proj", local_rope=True,
        defaults={"rms_norm_eps": 1e-6, "sliding_window": 4096},
    ),
    "exaone4": Family(
        layer_rule=_pattern_layers, block="post", qk_norm="head", nope="global",
        defaults={"rms_norm_eps": 1e-5, "sliding_window": 4096},
    ),
    "helium": Family(layer_rule=None, o_bias=False, rope_traditional=True,
                     defaults={"rms_norm_eps": 1e-8}),
    "seed_oss": Family(layer_rule=None, o_bias_key="attention_out_bias"),
    "hunyuan_v1_dense": Family(
        layer_rule=None, qk_norm="head_after_rope",
        renames=((".query_layernorm.", ".q_norm."), (".key_layernorm.", ".k_norm.")),
    ),
    "ernie4_5": Family(
        layer_rule=None, bias_key="use_bias", mlp_bias_key="use_bias", rope_traditional=True,
        tie_word_embeddings=True,
    ),
    # EXAONE 3.0/3.5: Llama under GPT-2-style names and keys (transformers runs it as Llama)
    "exaone": Family(
        layer_rule=None,
        key_aliases={"num_layers": "num_hidden_layers", "layer_norm_epsilon": "rms_norm_eps",
                     "activation_function": "hidden_act"},
        renames=(*_GPT_BODY_NAMES, (".attn.attention.", ".self_attn."),
                 (".self_attn.out_proj.", ".self_attn.o_proj."),
                 (".mlp.c_fc_0.", ".mlp.gate_proj."), (".mlp.c_fc_1.", ".mlp.up_proj.")),
        defaults={"rope_theta": 5e5, "rms_norm_eps": 1e-5},
    ),
    # transformers runs internlm3 configs as Llama (qkv_bias and bias name Llama's keys)
    "internlm3": Family(
        layer_rule=None, key_aliases={"qkv_bias": "attention_bias", "bias": "mlp_bias"},
        defaults={"head_dim": 128, "rms_norm_eps": 1e-5},
    ),
    "ministral3": Family(qkv_bias=False, o_bias=False, position_scaled_queries=True),
    # ---- the 2017 parts: LayerNorm, ungated MLPs, parallel blocks
    "phi": Family(
        qkv_bias=True, o_bias=True, layer_rule=None, norm="layer", eps_key="layer_norm_eps",
        mlp="plain", block="parallel", head_bias=True, qk_norm="head",
        qk_norm_flag="qk_layernorm",
        renames=((".self_attn.dense.", ".self_attn.o_proj."), (".mlp.fc1.", ".mlp.up_proj."),
                 (".mlp.fc2.", ".mlp.down_proj."), ("model.final_layernorm.", "model.norm."),
                 (".q_layernorm.", ".q_norm."), (".k_layernorm.", ".k_norm.")),
        defaults={"mlp_bias": True, "hidden_act": "gelu_new", "partial_rotary_factor": 0.5,
                  "layer_norm_eps": 1e-5},
    ),
    "starcoder2": Family(
        bias_key="use_bias", mlp_bias_key="use_bias", tie_word_embeddings=True, norm="layer",
        eps_key="norm_epsilon", mlp="plain",
        renames=((".mlp.c_fc.", ".mlp.up_proj."), (".mlp.c_proj.", ".mlp.down_proj.")),
        defaults={"use_bias": True, "hidden_act": "gelu_pytorch_tanh", "norm_epsilon": 1e-5},
    ),
    "stablelm": Family(
        layer_rule=None, bias_key="use_qkv_bias", o_bias=False, norm="layer",
        eps_key="layer_norm_eps", parallel_flag="use_parallel_residual",
        defaults={"partial_rotary_factor": 0.25, "layer_norm_eps": 1e-5},
    ),
    "nemotron": Family(
        layer_rule=None, norm="layer1p", eps_key="norm_eps", mlp="plain",
        defaults={"hidden_act": "relu2", "partial_rotary_factor": 0.5, "norm_eps": 1e-5},
    ),
    "cohere": Family(
        layer_rule=None, norm="layer_nobias", eps_key="layer_norm_eps", block="parallel",
        rope_traditional=True, logit_scale=True, tie_word_embeddings=True,
        qk_norm="each_head", qk_norm_flag="use_qk_norm",
        defaults={"layer_norm_eps": 1e-5, "logit_scale": 0.0625},
    ),
    # Command R7B: three sliding layers, then a global one without RoPE
    "cohere2": Family(
        layer_rule=_every_nth_global("sliding_window_pattern", 4), nope="global",
        norm="layer_nobias", eps_key="layer_norm_eps", block="parallel",
        rope_traditional=True, logit_scale=True, tie_word_embeddings=True,
        defaults={"layer_norm_eps": 1e-5, "logit_scale": 0.0625, "sliding_window": 4096},
    ),
    "olmo": Family(layer_rule=None, norm="layer_noparam", clip_qkv=True),
    # GLM: interleaved RoPE over half of each head, one gate_up_proj
    "glm": Family(
        layer_rule=None, o_bias=False, mlp="fused", rope_traditional=True,
        defaults={"partial_rotary_factor": 0.5, "head_dim": 128},
    ),
    # GLM-4: and each branch normed on the way out (the sandwich, under GLM's names)
    "glm4": Family(
        layer_rule=None, o_bias=False, mlp="fused", rope_traditional=True, block="sandwich",
        renames=((".post_attention_layernorm.", ".pre_feedforward_layernorm."),
                 (".post_self_attn_layernorm.", ".post_attention_layernorm."),
                 (".post_mlp_layernorm.", ".post_feedforward_layernorm.")),
        defaults={"partial_rotary_factor": 0.5, "head_dim": 128},
    ),
    # GPT-NeoX / Pythia: fused per-head q|k|v (split on load), two norms in parallel
    "gpt_neox": Family(
        layer_rule=None, norm="layer", eps_key="layer_norm_eps", mlp="plain",
        parallel_flag="use_parallel_residual", parallel_block="parallel2",
        renames=(("gpt_neox.embed_in.", "model.embed_tokens."), ("gpt_neox.", "model."),
                 ("embed_out.", "lm_head."), ("model.final_layer_norm.", "model.norm."),
                 (".attention.dense.", ".self_attn.o_proj."), (".attention.", ".self_attn."),
                 (".mlp.dense_h_to_4h.", ".mlp.up_proj."),
                 (".mlp.dense_4h_to_h.", ".mlp.down_proj.")),
        key_aliases={"rotary_pct": "partial_rotary_factor", "rotary_emb_base": "rope_theta"},
        defaults={"attention_bias": True, "mlp_bias": True, "hidden_act": "gelu",
                  "partial_rotary_factor": 0.25, "use_parallel_residual": True},
    ),
    # Granite's multipliers around a mixture stored as one fused input_linear per layer
    "granitemoe": Family(
        layer_rule=None, multipliers=True, moe=MoeFamily(
            expert_size_key="intermediate_size", norm_topk_always=True),
        renames=((".block_sparse_moe.input_linear.", ".mlp.switch_mlp.gate_up_proj."),
                 (".block_sparse_moe.output_linear.", ".mlp.switch_mlp.down_proj."),
                 (".block_sparse_moe.router.layer.", ".mlp.gate."),
                 (".block_sparse_moe.", ".mlp.")),
    ),
    # GLM-4.7-Flash: DeepSeek-V3's latent attention and router; mlp_layer_types says which
    "glm4_moe_lite": Family(
        layer_rule=None, attention="mla", rope_traditional=True,
        moe=MoeFamily(score="sigmoid", group_score="top2", correction_bias=True,
                      shared="plain", sparse_layers="types"),
        defaults={"norm_topk_prob": True, "n_group": 1, "topk_group": 1, "n_shared_experts": 1,
                  "routed_scaling_factor": 1.8},
    ),
    # EXAONE 4's attention (NoPE global layers) with DeepSeek-V3's router
    "exaone_moe": Family(
        layer_rule=_pattern_layers, qk_norm="head", nope="global",
        moe=MoeFamily(score="sigmoid", group_score="top2", correction_bias=True,
                      shared="plain", sparse_layers="types"),
        renames=((".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),),
        defaults={"rms_norm_eps": 1e-5, "sliding_window": 4096, "norm_topk_prob": True,
                  "n_group": 1, "topk_group": 1, "n_shared_experts": 1},
    ),
    "solar_open": Family(
        layer_rule=None, o_bias=False,
        moe=MoeFamily(score="sigmoid", group_score="top2", correction_bias=True,
                      shared="plain"),
        defaults={"norm_topk_prob": True, "n_group": 1, "topk_group": 1, "n_shared_experts": 1},
    ),
    # Gemma-3-style per-kind RoPE (partial), sliding layers, a softmax router
    "mellum": Family(
        qk_norm="head", local_rope=True, moe=MoeFamily(sparse_layers="types"),
    ),
    # MiniCPM3: latent attention (rotate_half RoPE), depth-scaled residuals
    "minicpm3": Family(
        layer_rule=None, attention="mla", depth_scaled=True, tie_word_embeddings=True,
        defaults={"q_lora_rank": 768, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32,
                  "kv_lora_rank": 256, "scale_emb": 12, "scale_depth": 1.4,
                  "dim_model_base": 256},
    ),
    # nanochat: parameter-free norms (one more on the embeddings), q/k normed after RoPE,
    # relu² MLP, soft-capped logits
    "nanochat": Family(
        layer_rule=None, norm="rms_noparam", qk_norm="head_after_rope", mlp="plain",
        embed_norm=True, softcaps=True, rope_negative=True,
        renames=((".mlp.fc1.", ".mlp.up_proj."), (".mlp.fc2.", ".mlp.down_proj.")),
        defaults={"hidden_act": "relu2"},
    ),
    # Apertus: a learned xIELU in an ungated MLP, q/k norms, Apertus' norm names
    "apertus": Family(
        layer_rule=None, qk_norm="head", mlp="plain",
        renames=((".attention_layernorm.", ".input_layernorm."),
                 (".feedforward_layernorm.", ".post_attention_layernorm.")),
        defaults={"hidden_act": "xielu", "rms_norm_eps": 1e-5},
    ),
    # gpt-oss: attention sinks, alternating sliding layers, a biased router, biased experts
    # with a clamped SwiGLU (experts stored fused and interleaved: unfused on load)
    "gpt_oss": Family(
        layer_rule=_every_nth_global(None, 2), attention_sinks=True,
        moe=MoeFamily(expert_size_key="intermediate_size", norm_topk_always=True,
                      router_bias=True, expert_bias=True, clamped_swiglu=True),
        renames=((".mlp.router.", ".mlp.gate."),
                 *((f".mlp.experts.{p}.", f".mlp.switch_mlp.{p}.")
                   for p in ("gate_proj", "up_proj", "down_proj"))),
        defaults={"attention_bias": True, "sliding_window": 128},
    ),
    # Llama 4: chunked attention on RoPE layers, NoPE global layers with temperature
    # tuning, parameter-free q/k norm after RoPE, top-1 sigmoid router scaling the experts'
    # inputs, a shared expert, dense layers between (intermediate_size_mlp)
    "llama4_text": Family(
        layer_rule=_chunked_rope_layers, nope="listed", qk_norm="plain_after_rope",
        qk_norm_flag="use_qk_norm", rope_traditional=True, temperature_tuning=True,
        dense_size_key="intermediate_size_mlp",
        moe=MoeFamily(score="sigmoid", shared="plain", expert_size_key="intermediate_size",
                      scale_inputs=True, fused_experts="halves", sparse_layers="listed"),
        renames=((".feed_forward.router.", ".mlp.gate."),
                 (".feed_forward.shared_expert.", ".mlp.shared_experts."),
                 (".feed_forward.", ".mlp.")),
        defaults={"n_shared_experts": 1, "no_rope_layer_interval": 4, "rope_theta": 5e5},
    ),
    # GPT-2 and StarCoder 1: learned positions, fused c_attn, LayerNorm, GELU MLP, tied
    "gpt2": Family(
        layer_rule=None, qkv_bias=True, o_bias=True, norm="layer", eps_key="layer_norm_eps",
        mlp="plain", tie_word_embeddings=True, positions="learned",
        fused_qkv="conv1d", ffn_mult=4, key_aliases=_GPT2_KEYS, renames=_GPT2_NAMES,
        defaults={"mlp_bias": True, "hidden_act": "gelu_new", "layer_norm_eps": 1e-5,
                  "multi_query": False},  # MHA: one K/V head per query head
    ),
    "gpt_bigcode": Family(
        layer_rule=None, qkv_bias=True, o_bias=True, norm="layer", eps_key="layer_norm_eps",
        mlp="plain", tie_word_embeddings=True, positions="learned",
        fused_qkv="linear", ffn_mult=4, key_aliases=_GPT2_KEYS, renames=_GPT2_NAMES,
        defaults={"mlp_bias": True, "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-5,
                  "multi_query": True},
    ),
    # GPT-J: GPT-2's key names, a parallel block, interleaved partial rotary
    "gptj": Family(
        layer_rule=None, qkv_bias=False, o_bias=False, norm="layer",
        eps_key="layer_norm_eps", mlp="plain", block="parallel", head_bias=True,
        rope_traditional=True, ffn_mult=4, rotary_dim_key="rotary_dim",
        key_aliases={"n_embd": "hidden_size", "n_layer": "num_hidden_layers",
                     "n_head": "num_attention_heads", "n_positions": "max_position_embeddings",
                     "n_inner": "intermediate_size", "layer_norm_epsilon": "layer_norm_eps",
                     "activation_function": "hidden_act"},
        renames=(("transformer.wte.", "model.embed_tokens."), ("transformer.h.", "model.layers."),
                 ("transformer.ln_f.", "model.norm."), (".ln_1.", ".input_layernorm."),
                 (".attn.out_proj.", ".self_attn.o_proj."), (".attn.", ".self_attn."),
                 (".mlp.fc_in.", ".mlp.up_proj."), (".mlp.fc_out.", ".mlp.down_proj."),
                 # mlx-lm's GPT-J: model.wte, model.h, model.ln_f
                 ("model.wte.", "model.embed_tokens."), ("model.h.", "model.layers."),
                 ("model.ln_f.", "model.norm.")),
        defaults={"mlp_bias": True, "hidden_act": "gelu_new", "layer_norm_eps": 1e-5},
    ),
    "ernie4_5_moe": Family(
        layer_rule=None, bias_key="use_bias", mlp_bias_key="use_bias", rope_traditional=True,
        tie_word_embeddings=True,
        moe=MoeFamily(correction_bias=True, shared="plain", norm_topk_always=True,
                      count_key="moe_num_experts", top_k_key="moe_k",
                      shared_count_key="moe_num_shared_experts", sparse_layers="interval"),
        renames=((".mlp.moe_statics.", ".mlp.gate."),),
        defaults={"moe_layer_start_index": 1},
    ),
    "glm4_moe": Family(
        layer_rule=None, o_bias=False, qk_norm="head", qk_norm_flag="use_qk_norm",
        moe=MoeFamily(score="sigmoid", group_score="top2", correction_bias=True,
                      shared="plain", sparse_layers="first_dense"),
        defaults={"partial_rotary_factor": 0.5, "norm_topk_prob": True, "n_group": 1,
                  "topk_group": 1, "n_shared_experts": 1, "first_k_dense_replace": 1,
                  "routed_scaling_factor": 1.0},
    ),
    "dots1": Family(
        layer_rule=_from_max_window_layers, qk_norm="head",
        # mlx-lm stacks dots1's experts as mlp.experts.{proj} (no switch_mlp)
        renames=tuple((f".experts.{p}.", f".switch_mlp.{p}.")
                      for p in ("gate_proj", "up_proj", "down_proj")),
        moe=MoeFamily(score="sigmoid", group_score="top2", correction_bias=True,
                      shared="plain", sparse_layers="first_dense"),
        defaults={"norm_topk_prob": False, "first_k_dense_replace": 0,
                  "routed_scaling_factor": 1.0},
    ),
    "granite": Family(layer_rule=None, multipliers=True),
    # ---- mixtures of experts (moe.py)
    "mixtral": Family(
        qkv_bias=False, o_bias=False,
        moe=MoeFamily(expert_size_key="intermediate_size", norm_topk_always=True),
        renames=_MIXTRAL_NAMES,
        defaults={"rope_theta": 1e6},
    ),
    # Phi-3.5-MoE: Mixtral's layout, LayerNorms, and the sparse mixer's routing
    "phimoe": Family(
        norm="layer", head_bias_key="lm_head_bias",
        moe=MoeFamily(score="sparsemixer", expert_size_key="intermediate_size"),
        renames=_MIXTRAL_NAMES,
        defaults={"rope_theta": 1e6},
    ),
    "qwen2_moe": Family(
        qkv_bias=True, o_bias=False, sliding_window_flag="use_sliding_window",
        layer_rule=_from_max_window_layers,
        moe=MoeFamily(shared="gated", sparse_layers="step"),
    ),
    "qwen3_moe": Family(
        sliding_window_flag="use_sliding_window", layer_rule=_from_max_window_layers,
        qk_norm="head", moe=MoeFamily(sparse_layers="step"),
    ),
    "olmoe": Family(
        layer_rule=None, qk_norm="proj", clip_qkv=True,
        moe=MoeFamily(expert_size_key="intermediate_size"), defaults={"rms_norm_eps": 1e-5},
    ),
    # DBRX: settings nested in attn_config / ffn_config (dotted key_aliases lift them),
    # one Wqkv clamped by clip_qkv, LayerNorms without bias, a softmax router whose top-k
    # weights are divided by their p-norm, experts as one matrix per projection
    "dbrx": Family(
        layer_rule=None, qkv_bias=False, o_bias=False, norm="layer_nobias",
        eps_key="layer_norm_eps", fused_proj=True, clip_qkv=True,
        dense_size_key="ffn_hidden_size",
        moe=MoeFamily(count_key="moe_num_experts", top_k_key="moe_top_k",
                      expert_size_key="ffn_hidden_size",
                      norm_p_key="moe_normalize_expert_weights", fused_experts="rows"),
        key_aliases={
            "d_model": "hidden_size", "n_heads": "num_attention_heads",
            "n_layers": "num_hidden_layers", "max_seq_len": "max_position_embeddings",
            "attn_config.kv_n_heads": "num_key_value_heads",
            "attn_config.clip_qkv": "clip_qkv",
            # classic configs only (transformers 5 reads rope_parameters, which wins)
            "attn_config.rope_theta": "rope_theta",
            "ffn_config.ffn_hidden_size": "ffn_hidden_size",
            "ffn_config.moe_num_experts": "moe_num_experts",
            "ffn_config.moe_top_k": "moe_top_k",
            "ffn_config.moe_normalize_expert_weights": "moe_normalize_expert_weights",
            "ffn_config.ffn_act_fn.name": "hidden_act",
        },
        renames=(("transformer.wte.", "model.embed_tokens."),
                 ("transformer.blocks.", "model.layers."), ("transformer.norm_f.", "model.norm."),
                 (".norm_attn_norm.norm_1.", ".input_layernorm."),
                 (".norm_attn_norm.norm_2.", ".post_attention_layernorm."),
                 (".norm_attn_norm.attn.Wqkv.", ".self_attn.qkv_proj."),
                 (".norm_attn_norm.attn.out_proj.", ".self_attn.o_proj."),
                 (".ffn.router.layer.", ".mlp.gate."),
                 # transformers: experts.mlp.{w1,v1,w2} (no .weight), all experts' rows
                 (".ffn.experts.mlp.w1", ".mlp.experts.gate_proj"),
                 (".ffn.experts.mlp.v1", ".mlp.experts.up_proj"),
                 (".ffn.experts.mlp.w2", ".mlp.experts.down_proj"),
                 # mlx-lm: one Linear per expert, experts.{i}.{w1,v1,w2}
                 (".ffn.", ".mlp."), (".w1.", ".gate_proj."), (".v1.", ".up_proj."),
                 (".w2.", ".down_proj.")),
        defaults={"num_key_value_heads": 1, "ffn_hidden_size": 3584, "moe_num_experts": 4,
                  "moe_top_k": 1, "moe_normalize_expert_weights": 1.0,
                  "layer_norm_eps": 1e-5, "max_position_embeddings": 2048},
    ),
    "deepseek_v2": Family(
        layer_rule=None, attention="mla", rope_traditional=True,
        moe=MoeFamily(group_score="max", group_key="topk_method", shared="plain",
                      sparse_layers="first_dense"),
        defaults={"topk_method": "greedy", "n_shared_experts": 2, "routed_scaling_factor": 1.0},
    ),
    "deepseek_v3": Family(
        layer_rule=None, attention="mla", rope_traditional=True,
        moe=MoeFamily(score="sigmoid", group_score="top2", correction_bias=True,
                      shared="plain", sparse_layers="first_dense"),
        defaults={"norm_topk_prob": True, "n_group": 8, "topk_group": 4, "n_shared_experts": 1,
                  "routed_scaling_factor": 2.5, "first_k_dense_replace": 3},
    ),
    # the 2017 block, for `python -m kvchat.model.training train --block 2017` and
    # explain's comparison: post-LayerNorm, ReLU FFN, sinusoidal positions
    "kvchat2017": Family(
        layer_rule=None, norm="layer", mlp="plain", block="post_ln", positions="sinusoidal",
        defaults={"hidden_act": "relu"},
    ),
}


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


ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")


@dataclass(frozen=True)
class RopeConfig:
    """One RoPE schedule, as transformers' `rope_parameters` describes it."""

    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 2048  # dynamic NTK and longrope read the model's context
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    # longrope (per rotated pair)
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    @classmethod
    def from_params(
        cls,
        params: dict[str, Any],
        cfg: dict[str, Any],
        aliases: dict[str, str] | None = None,
        key: str = "rope_parameters",
    ) -> RopeConfig:
        """`params`: one rope dict (rope_type, rope_theta, factor, ...); `cfg`: the whole
        config for the keys transformers reads beside it."""
        rope_type = params.get("rope_type", params.get("type")) or "default"
        rope_type = (aliases or {}).get(rope_type, rope_type)
        if rope_type not in ROPE_TYPES:
            raise ConfigError(
                f"config.json: {key}.rope_type: unsupported RoPE type {rope_type!r};"
                f" supported: {', '.join(ROPE_TYPES)}"
            )
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        # transformers: a top-level original_max_position_embeddings wins (Phi-3)
        orig = cfg.get("original_max_position_embeddings") or params.get(
            "original_max_position_embeddings"
        ) or max_pos
        factor = params.get("factor")
        if factor is None and rope_type in ("yarn", "longrope"):
            factor = max_pos / orig
        factor = float(1.0 if factor is None else factor)
        if rope_type not in ("default", "longrope") and factor <= 0:
            raise ConfigError(f"config.json: {key}.factor must be > 0, got {factor}")
        partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor")) or 1.0
        short = params.get("short_factor")
        long = params.get("long_factor")
        if rope_type == "longrope" and (short is None or long is None):
            raise ConfigError(
                f"config.json: {key} of type longrope needs short_factor and long_factor"
            )
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        attention_factor = params.get("attention_factor")
        if "short_mscale" in params or "long_mscale" in params:
            # Phi-MoE: cos/sin × short_mscale within the original context, else × long_mscale
            mscales = {params.get("short_mscale"), params.get("long_mscale")}
            if len(mscales) != 1 or not isinstance(m := mscales.pop(), (int, float)):
                raise ConfigError(
                    f"config.json: {key}: short_mscale and long_mscale must be one number"
                    f" (got {params.get('short_mscale')!r}, {params.get('long_mscale')!r})")
            attention_factor = float(m)
        return cls(
            theta=float(theta),
            type=rope_type,
            factor=factor,
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(orig),
            partial_rotary_factor=float(partial),
            max_position_embeddings=max_pos,
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            attention_factor=attention_factor,
            truncate=bool(params.get("truncate", True)),
            short_factor=None if short is None else tuple(float(x) for x in short),
            long_factor=None if long is None else tuple(float(x) for x in long),
        )

    @classmethod
    def from_config(cls, cfg: dict[str, Any], aliases: dict[str, str] | None = None) -> RopeConfig:
        """Both spellings: transformers 5's `rope_parameters` and the classic
        `rope_theta` + `rope_scaling` (mlx-lm 0.32.2 reads only the latter)."""
        params = dict(cfg.get("rope_scaling") or {})
        params.update(cfg.get("rope_parameters") or {})
        return cls.from_params(params, cfg, aliases)

    def rotary_dims(self, head_dim: int) -> int:
        return int(head_dim * self.partial_rotary_factor)

    @property
    def attention_scaling(self) -> float:
        """The factor transformers multiplies cos and sin by (yarn's mscale, longrope's
        attention factor); 1 for the other types."""
        if self.type == "yarn":
            if self.attention_factor is not None:
                return float(self.attention_factor)

            def get_mscale(scale: float, m: float = 1.0) -> float:
                return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

            if self.mscale and self.mscale_all_dim:
                return get_mscale(self.factor, self.mscale) / get_mscale(
                    self.factor, self.mscale_all_dim
                )
            return get_mscale(self.factor)
        if self.type == "longrope":
            if self.attention_factor is not None:
                return float(self.attention_factor)
            f = self.max_position_embeddings / self.original_max_position_embeddings
            if f <= 1.0:
                return 1.0
            return math.sqrt(1 + math.log(f) / math.log(self.original_max_position_embeddings))
        return 1.0


@dataclass(frozen=True)
class LayerSpec:
    """What differs between the layers of one model."""

    kind: str  # FULL or SLIDING
    window: int | None  # keys a query sees (None: all of them)
    rope: RopeConfig | None  # None: a NoPE layer (no rotary embedding)
    moe: bool = False  # the FFN is the model's mixture of experts (ModelConfig.moe)
    chunk: int | None = None  # chunked attention: keys of the query's own chunk only


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
    norm: str = "rms"
    mlp: str = "gated"
    lm_head_bias: bool = False
    activation: str = "silu"
    block: str = "pre"
    qk_norm: str | None = None
    fused_proj: bool = False
    positions: str = "rope"
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
    mla: MlaConfig | None = None  # set: every layer is latent attention (cache kind "latent")
    q_position_scale: tuple[float, int] | None = None  # Ministral 3: (beta, period), see layers
    attention_sinks: bool = False
    temperature: tuple[float, float] | None = None  # Llama 4: (floor_scale, attn_scale)
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
            heads = int(cfg["num_attention_heads"])
            kv_heads = int(cfg.get("num_key_value_heads") or heads)
            head_dim = int(cfg.get("head_dim") or hidden // heads)
            n_layers = int(cfg["num_hidden_layers"])
            inter = int(cfg[fam.dense_size_key])
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
        except (TypeError, ValueError) as e:
            raise ConfigError(f"config.json has a malformed value: {e}") from None
        if mla is not None:
            head_dim = mla.nope_dim + mla.rope_dim
        rope = _global_rope(cfg, fam)
        layers, window = _layer_specs(cfg, fam, n_layers, rope, sparse)
        for r in [rope] + [spec.rope for spec in layers if spec.rope is not None]:
            _check_rotary(r, mla.rope_dim if mla is not None else head_dim)
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
            wrapper=wrapper,
            raw=cfg,
            **quirks,
        )


def _global_rope(cfg: dict[str, Any], fam: Family) -> RopeConfig:
    """The RoPE of full-attention layers (of every layer for most families)."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and FULL in params:  # transformers 5, per layer kind (Gemma 3)
        return RopeConfig.from_params(
            params[FULL] or {}, cfg, fam.rope_aliases, f"rope_parameters.{FULL}"
        )
    return RopeConfig.from_config(cfg, fam.rope_aliases)


def _check_rotary(rope: RopeConfig, head_dim: int) -> None:
    """The RoPE settings that only make sense against the head size."""
    if not 0 < rope.partial_rotary_factor <= 1:
        raise ConfigError(
            "config.json: partial_rotary_factor must be in (0, 1],"
            f" got {rope.partial_rotary_factor}"
        )
    pairs = rope.rotary_dims(head_dim) // 2
    for key, factors in (("short_factor", rope.short_factor), ("long_factor", rope.long_factor)):
        if factors is not None and len(factors) != pairs:
            raise ConfigError(
                f"config.json: rope {key} has {len(factors)} entries; {pairs} rotated pairs"
                " need one each"
            )


def _local_rope(cfg: dict[str, Any], fam: Family) -> RopeConfig:
    """Gemma 3's sliding layers: plain RoPE with `rope_local_base_freq`."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and SLIDING in params:
        return RopeConfig.from_params(
            params[SLIDING] or {}, cfg, fam.rope_aliases, f"rope_parameters.{SLIDING}"
        )
    return RopeConfig.from_params(
        {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq", 1e4)}, cfg
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
    if spec is None:
        return None, [False] * n
    experts = _positive(cfg, spec.count_key or _first_key(
        cfg, ("num_local_experts", "num_experts", "n_routed_experts")))
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
        correction_bias=spec.correction_bias, shared_size=shared_size,
        shared_gate=spec.shared == "gated", router_bias=spec.router_bias,
        expert_bias=spec.expert_bias,
        clamped_swiglu=(float(cfg.get("swiglu_alpha", 1.702)), float(cfg.get("swiglu_limit", 7.0)))
        if spec.clamped_swiglu else None, scale_inputs=spec.scale_inputs,
        jitter_eps=_sparsemixer_eps(cfg) if spec.score == "sparsemixer" else 0.0,
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
    elif spec.sparse_layers == "types":  # GLM-4.7-Flash: mlp_layer_types, else dense first
        types = cfg.get("mlp_layer_types") or ["dense"] + ["sparse"] * (n - 1)
        if not isinstance(types, list) or len(types) != n:
            raise ConfigError(f"config.json: mlp_layer_types must list {n} entries")
        sparse = [t == "sparse" for t in types]
    elif spec.sparse_layers == "interval":
        every = _positive(cfg, "moe_layer_interval", 1)
        start, end = int(cfg.get("moe_layer_start_index") or 0), cfg.get("moe_layer_end_index")
        end = n - 1 if end is None or end < 0 else int(end)
        sparse = [(i + 1) % every == 0 and start <= i <= end for i in range(n)]
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
    if kinds is not None:
        if not isinstance(kinds, list) or len(kinds) != n:
            got = len(kinds) if isinstance(kinds, list) else type(kinds).__name__
            raise ConfigError(
                f"config.json: layer_types has {got} entries for num_hidden_layers {n}"
            )
        bad = [k for k in kinds if k not in LAYER_KINDS]
        if bad:
            raise ConfigError(
                f"config.json: layer_types holds {bad[0]!r}; allowed: {', '.join(LAYER_KINDS)}"
            )
    elif fam.layer_rule is not None:
        kinds = fam.layer_rule(cfg, n)
    else:
        kinds = [FULL] * n
    if window is None:  # no window: a "sliding" layer sees everything (as transformers)
        kinds = [FULL if k == SLIDING else k for k in kinds]
    chunk = cfg.get("attention_chunk_size")
    if chunk is None:
        kinds = [FULL if k == CHUNKED else k for k in kinds]
    local = _local_rope(cfg, fam) if fam.local_rope else rope
    if fam.nope == "listed":
        rope_on = _no_rope_layers(cfg, n)
    elif fam.nope == "global" and window is not None:
        rope_on = [int(k == SLIDING) for k in kinds]
    else:
        rope_on = [int(fam.positions == "rope")] * n
    specs = tuple(
        LayerSpec(
            kind=k,
            window=window if k == SLIDING else None,
            rope=(local if k == SLIDING else rope) if rope_on[i] else None,
            moe=sparse[i],
            chunk=int(chunk) if k == CHUNKED else None,
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
        "positions": fam.positions,
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
        out["embed_scale"] = hidden**0.5
    if fam.query_pre_attn_scalar:
        out["attn_scale"] = float(cfg["query_pre_attn_scalar"]) ** -0.5
    if fam.multipliers:
        out["embed_scale"] = float(cfg.get("embedding_multiplier", 1.0))
        out["attn_scale"] = float(cfg.get("attention_multiplier", 1.0))
        out["residual_scale"] = float(cfg.get("residual_multiplier", 1.0))
        out["logits_divisor"] = float(cfg.get("logits_scaling", 1.0))
        if out["logits_divisor"] == 0:
            raise ConfigError("config.json: logits_scaling must not be 0")
    if fam.softcaps:
        for key, name in (("attn_logit_softcapping", "attn_softcap"),
                          ("final_logit_softcapping", "final_softcap")):
            cap = cfg.get(key)
            if cap is not None and float(cap) <= 0:
                raise ConfigError(f"config.json: {key} must be > 0 (or null), got {cap}")
            out[name] = None if cap is None else float(cap)
    return out


def load_config(path: str | Path) -> ModelConfig:
    """Read `config.json` (a file, or the folder holding it)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ConfigError(f"no config.json in {p.parent}")
    try:
        cfg = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {p}: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{p} is not a JSON object")
    text, _ = unwrap(cfg)
    fam = family_of(text)
    # the family first, then its checks: keys the family ignores are not checked
    text = aliased(text, fam)
    check_config(text if fam.window_used(text) else
                 {k: v for k, v in text.items() if k != "sliding_window"})
    return ModelConfig.from_dict(cfg)


def family_of(cfg: dict[str, Any]) -> Family:
    """The config's family row, or the one-line "unknown architecture" error."""
    model_type = cfg.get("model_type")
    if model_type not in FAMILIES:
        raise ConfigError(
            f"unknown architecture {model_type!r}; supported: {', '.join(sorted(FAMILIES))}"
        )
    return FAMILIES[model_type]
