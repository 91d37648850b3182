"""The families table: one `Family` row per `model_type` naming its building blocks (norm,
MLP, block layout, attention extras, mixture of experts) and the defaults transformers
assumes when a config key is absent.

Every difference between the supported families lives in `FAMILIES`; `config.py` resolves
a row plus a config.json into plain numbers, and the rest of the code reads those and
never branches on `model_type`. A row's choices are `Literal` types whose values are the
ones the consuming code dispatches on (layers.py, moe.py, transformer.py, weights.py,
config.py), so a misspelt choice is a type error and fails tests/test_config_families.py
rather than falling through to some default branch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from kvchat.model.errors import ConfigError

# ---- the choices a row makes, each spelled once (the consumer that reads it in brackets)
# "rms": x̂·w | "rms_noparam": x̂ (nanochat) | "offset": x̂·(1 + w) (Gemma) | "layer":
# LayerNorm (mean removed), w and b | "layer_nobias" (Cohere) | "layer1p": w stored as
# w − 1 (Nemotron) | "layer_noparam" (OLMo)  [layers.NORMS]
NormKind = Literal["rms", "rms_noparam", "offset", "layer", "layer_nobias", "layer1p",
                   "layer_noparam"]
# "gated": down(act(gate)·up) | "fused": the same from one gate_up_proj (GLM) |
# "plain": down(act(up))  [layers.Block: MLP, FusedMLP, PlainMLP]
MlpKind = Literal["gated", "fused", "plain"]
# "pre" | "sandwich" (4 norms) | "post" (norms after each branch) | "parallel" (attention
# and MLP read the same normed input) | "parallel2" (each its own norm) | "post_ln"
# (2017: LayerNorm of the residual sum after each branch) | "mixer_only" (Mamba: one
# branch, x + mixer(norm(x)), no MLP) | "parallel_mixer" (Falcon-H1: attention and the
# recurrent mixer side by side on one normed input, then a pre-norm MLP) | "shared_block"
# (Zamba2: a mixer-only layer, or one whose mixer input also gets a shared transformer
# block's output over [x, embeddings])  [layers.BLOCKS]
BlockKind = Literal["pre", "sandwich", "post", "parallel", "parallel2", "post_ln", "mixer_only",
                    "parallel_mixer", "shared_block"]
# "rope" | "sinusoidal" (2017: added to the embeddings) | "learned" (GPT-2: a table) |
# "none" (Nemotron-H: its few attention layers have no positions at all)
# [transformer.py, config.py]
PositionKind = Literal["rope", "sinusoidal", "learned", "none"]
# "head" (per head) | "each_head" (Cohere: a weight row per head) | "proj" (over the
# projection) | "head_after_rope" (Hunyuan) | "plain_after_rope" (Llama 4: parameter-free,
# RoPE layers only)  [layers.Attention]
QkNormKind = Literal["head", "each_head", "proj", "head_after_rope", "plain_after_rope"]
# layers without RoPE: "listed" (SmolLM3's `no_rope_layers`) | "global" (the
# full-attention layers of a model with sliding ones: EXAONE 4, Command R7B)  [config.py]
NopeKind = Literal["listed", "global"]
# "gqa" (MHA/GQA/MQA) | "mla" (latent, DeepSeek-V2/V3; mla.LatentAttention) | "none" (no
# attention layer at all: Mamba)  [config.py]
AttentionKind = Literal["gqa", "mla", "none"]
# the token mixer of a family's recurrent layers, each over a fixed-size state per layer
# (model/cache/state.py) instead of a K/V cache: "mamba" (Mamba's selective scan,
# ssm.MambaMixer) | "mamba2" (Mamba-2's SSD, ssm.Mamba2Mixer) | "gated_delta" (Qwen3-Next's
# gated delta rule, delta.GatedDeltaNet) | "short_conv" (LFM2's gated short convolution,
# conv.ShortConv) | "rglru" (Griffin's RG-LRU, rglru.RecurrentBlock) | "kda" (Kimi Delta
# Attention: the gated delta rule with one decay per key channel, delta.KimiDeltaAttention)
# [layers.MIXERS]
MixerKind = Literal["mamba", "mamba2", "gated_delta", "short_conv", "rglru", "kda"]
# the gated delta rule's input projections: "fused" (Qwen3-Next: in_proj_qkvz + in_proj_ba,
# grouped per key head) | "split" (Qwen3.5: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a) |
# "separate" (OLMo-hybrid: q_proj, k_proj, v_proj of their own, then z, b, a as
# "split")  [delta.GatedDeltaNet]
DeltaProjKind = Literal["fused", "split", "separate"]
# one fused c_attn holding q, k, v one after the other, split on load: "linear" stored
# (out, in) (StarCoder 1) | "conv1d" stored (in, out) as GPT-2's Conv1D  [weights.py]
FusedQkvKind = Literal["linear", "conv1d"]
# router scores: "softmax" | "sigmoid" (DeepSeek-V3) | "sparsemixer" (Phi-MoE: each pick a
# softmax over the experts still within router_jitter_noise of the best)  [moe.route]
RouterScore = Literal["softmax", "sigmoid", "sparsemixer"]
# a group's score in grouped top-k: its best expert ("max", V2) or its best two ("top2",
# V3)  [moe.route]
GroupScore = Literal["max", "top2"]
# "gated" (Qwen2-MoE: behind a sigmoid gate) | "plain" (DeepSeek)  [config.py, moe.MoE]
SharedKind = Literal["gated", "plain"]
# how transformers stores fused experts (`experts.gate_up_proj`): gate and up
# "interleaved" column by column (gpt-oss) or as two "halves" (Llama 4); or "rows" (DBRX):
# one (experts × size, hidden) matrix per projection  [moe.unfuse_experts]
ExpertLayout = Literal["interleaved", "halves", "rows"]
# which layers are sparse: "all" | "step" (decoder_sparse_step, mlp_only_layers) |
# "first_dense" (first_k_dense_replace dense layers, then MoE) | "listed" (Llama 4:
# moe_layers, else every interleave_moe_layer_step-th) | "types" (mlp_layer_types, else
# the first first_k_dense_replace layers dense) |
# "interval" (ERNIE: every moe_layer_interval-th from moe_layer_start_index to
# moe_layer_end_index) | "kinds" (Nemotron-H: the layers whose kind is FFN_MOE) | "period"
# (Jamba: every expert_layer_period-th from expert_layer_offset)  [config.py]
SparseLayers = Literal["all", "step", "first_dense", "listed", "types", "interval", "kinds",
                       "period"]

FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"
LAYER_KINDS = (FULL, SLIDING, CHUNKED)
# a layer whose token mixer is its family's recurrent one (transformers' name for them)
RECURRENT = "linear_attention"
# a layer that attends and runs the recurrent mixer too (Falcon-H1: side by side; Zamba2:
# a shared attention block feeding the mixer): K/V and a state in one layer,
# model/cache/hybrid.py
HYBRID = "hybrid"
# other layer_types values that mean the same two kinds (Granite 4: "mamba" and
# "attention", LFM2: "conv")
LAYER_KIND_ALIASES = {"mamba": RECURRENT, "conv": RECURRENT, "attention": FULL}
# Nemotron-H: layers that are only an MLP, or only the mixture of experts (no token mixer)
FFN, FFN_MOE = "mlp", "moe"
FFN_KINDS = (FFN, FFN_MOE)

# activation names in config.json -> the function mlx computes (activations.ACTIVATIONS)
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
    rope_on = no_rope_layers(cfg, n)
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
    rope_on = no_rope_layers(cfg, n)
    return [FULL if r else SLIDING for r in rope_on]


def _all_recurrent(cfg: dict[str, Any], n: int) -> list[str]:
    """Mamba, Mamba-2: every layer is the recurrent mixer."""
    return [RECURRENT] * n


def _attention_listed(key: str, default: list[int] | None = None) -> LayerRule:
    """Bamba (`attn_layer_indices`), LFM2 (`full_attn_idxs`): the listed layers attend,
    the others are recurrent."""

    def rule(cfg: dict[str, Any], n: int) -> list[str]:
        listed = cfg.get(key)
        listed = (list(range(n)) if default is None else default) if listed is None else listed
        if not isinstance(listed, list) or not all(isinstance(i, int) for i in listed):
            raise ConfigError(f"config.json: {key} must list layer indices, got {listed!r:.60}")
        return [FULL if i in listed else RECURRENT for i in range(n)]

    return rule


def _pattern_kinds(key: str) -> LayerRule:
    """Nemotron-H's classic `hybrid_override_pattern`, one character per layer: M (Mamba-2),
    * (attention), - (MLP), E (mixture of experts)."""
    kinds = {"M": RECURRENT, "*": FULL, "-": FFN, "E": FFN_MOE}

    def rule(cfg: dict[str, Any], n: int) -> list[str]:
        pattern = cfg.get(key)
        if not isinstance(pattern, str) or len(pattern) != n or set(pattern) - set(kinds):
            raise ConfigError(f"config.json: {key} must be {n} characters of M, *, - and E,"
                              f" got {pattern!r:.60}")
        return [kinds[c] for c in pattern]

    return rule


def _all_hybrid(cfg: dict[str, Any], n: int) -> list[str]:
    """Falcon-H1: every layer attends and runs Mamba-2 beside it."""
    return [HYBRID] * n


def _attention_period(cfg: dict[str, Any], n: int) -> list[str]:
    """Jamba: layer i attends when i % attn_layer_period == attn_layer_offset, the others
    are recurrent."""
    period, offset = int(cfg.get("attn_layer_period", 8)), int(cfg.get("attn_layer_offset", 4))
    if period < 1 or not 0 <= offset < period:
        raise ConfigError(f"config.json: attn_layer_offset ({offset}) must lie in"
                          f" [0, attn_layer_period ({period}))")
    return [FULL if i % period == offset else RECURRENT for i in range(n)]


def _every_nth_attention(key: str, default: int) -> LayerRule:
    """Qwen3-Next: every `full_attention_interval`-th layer attends, the others are recurrent."""

    def rule(cfg: dict[str, Any], n: int) -> list[str]:
        every = int(cfg.get(key) or default)
        return [FULL if (i + 1) % every == 0 else RECURRENT for i in range(n)]

    return rule


def _block_types(key: str, default: tuple[str, ...]) -> LayerRule:
    """RecurrentGemma: `block_types` ("recurrent", "attention") repeated over the layers;
    its attention layers are local (they slide)."""
    kinds = {"recurrent": RECURRENT, "attention": SLIDING}

    def rule(cfg: dict[str, Any], n: int) -> list[str]:
        types = cfg.get(key) or list(default)
        if not isinstance(types, list) or not all(t in kinds for t in types):
            raise ConfigError(f"config.json: {key} must list \"recurrent\" and \"attention\","
                              f" got {types!r:.60}")
        return [kinds[types[i % len(types)]] for i in range(n)]

    return rule


def _every_4th_attention_or_last(cfg: dict[str, Any], n: int) -> list[str]:
    """OLMo-hybrid without layer_types: every 4th layer attends, the last one if none
    would (transformers' default)."""
    kinds = [FULL if i % 4 == 3 else RECURRENT for i in range(n)]
    return kinds if FULL in kinds or not kinds else [*kinds[:-1], FULL]


def _listed_from_one(attend_key: str, mixer_key: str) -> LayerRule:
    """Kimi Linear's checkpoints: the attention layers and the recurrent ones each listed,
    counted from 1 (linear_attn_config's full_attn_layers and kda_layers); without the
    lists, every 4th layer from layer 4 attends (transformers' default)."""

    def rule(cfg: dict[str, Any], n: int) -> list[str]:
        attend, mix = cfg.get(attend_key), cfg.get(mixer_key)
        if attend is None and mix is None:
            return [FULL if i and i % 4 == 0 else RECURRENT for i in range(n)]
        kinds: list[str | None] = [None] * n
        for key, listed, kind in ((attend_key, attend, FULL), (mixer_key, mix, RECURRENT)):
            if not isinstance(listed, list) or not all(
                    isinstance(i, int) and not isinstance(i, bool) and 1 <= i <= n
                    for i in listed):
                raise ConfigError(f"config.json: {key} must list layer numbers 1 to {n},"
                                  f" got {listed!r:.60}")
            for i in listed:
                kinds[i - 1] = kind
        if None in kinds:
            raise ConfigError(f"config.json: layer {kinds.index(None) + 1} is in neither"
                              f" {attend_key} nor {mixer_key}")
        return [k for k in kinds if k is not None]

    return rule


def no_rope_layers(cfg: dict[str, Any], n: int) -> list[int]:
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

    score: RouterScore = "softmax"
    # grouped top-k: experts split in n_group groups, only the topk_group best groups
    # compete, each scored by `group_score` (None: no grouping)
    group_score: GroupScore | None = None
    group_key: str | None = None  # config key that switches grouping on (V2: topk_method)
    correction_bias: bool = False  # V3: e_score_correction_bias picks experts, never weighs
    correction_bias_flag: str | None = None  # LFM2-MoE: only when this config flag is true
    shared: SharedKind | None = None  # None: no shared expert
    count_key: str | None = None  # None: num_local_experts / num_experts / n_routed_experts
    top_k_key: str = "num_experts_per_tok"
    shared_count_key: str = "n_shared_experts"  # "plain": shared size = count × expert size
    shared_size_key: str | None = None  # "plain": or the size this key gives (Granite 4)
    dense_when_none: bool = False  # Granite 4: 0 experts (the count key) is a dense model
    gated: bool = True  # False: each expert is down(act(up(x))) (Nemotron-H), no gate_proj
    # Nemotron-H: the experts read a projection of this config key's size (moe_latent_size;
    # null: the hidden state itself)
    latent_key: str | None = None
    expert_size_key: str = "moe_intermediate_size"
    norm_topk_always: bool = False  # Mixtral renormalises the top-k weights unconditionally
    # DBRX: the top-k weights ÷ their p-norm, p from this config key (null: no division)
    norm_p_key: str | None = None
    router_bias: bool = False  # gpt-oss: the router Linear has a bias
    expert_bias: bool = False  # gpt-oss: every expert projection has a bias
    clamped_swiglu: bool = False  # gpt-oss: swiglu_alpha / swiglu_limit (moe.clamped_swiglu)
    scale_inputs: bool = False  # Llama 4: each expert's input × its weight (not its output)
    fused_experts: ExpertLayout = "interleaved"
    sparse_layers: SparseLayers = "all"


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
    norm: NormKind = "rms"
    eps_key: str = "rms_norm_eps"  # the config key of the norms' epsilon
    mlp: MlpKind = "gated"
    head_bias: bool = False  # the LM head has a bias (Phi-2)
    head_bias_key: str | None = None  # or when this config flag is true (Phi-MoE)
    logit_scale: bool = False  # Cohere: logits × logit_scale
    embed_norm: bool = False  # nanochat: the embeddings pass through the final norm first
    # MiniCPM3: embeddings × scale_emb, each branch × scale_depth / √layers
    depth_scaled: bool = False
    activation_key: str = "hidden_act"  # config key naming the MLP's gate activation
    activation_aliases: dict[str, str] = field(default_factory=dict)
    block: BlockKind = "pre"
    positions: PositionKind = "rope"
    qk_norm: QkNormKind | None = None  # None: q and k are not normed
    qk_norm_flag: str | None = None  # qk_norm applies only when this config flag is true
    # Ministral 3: queries × 1 + β·log(1 + ⌊position / original context⌋), β from the rope
    # parameters' llama_4_scaling_beta
    position_scaled_queries: bool = False
    attention_sinks: bool = False  # gpt-oss: a learned sink logit per head (self_attn.sinks)
    # Llama 4: the dense layers' intermediate_size_mlp; None: no MLP (Mamba)
    dense_size_key: str | None = "intermediate_size"
    # Llama 4: NoPE layers' queries × 1 + attn_scale·log(1 + ⌊(pos + 1) / floor_scale⌋)
    temperature_tuning: bool = False
    # StableLM, GPT-NeoX: this config flag makes the block `parallel_block`
    parallel_flag: str | None = None
    parallel_block: BlockKind = "parallel"
    fused_proj: bool = False  # one qkv_proj and one gate_up_proj (Phi-3)
    embed_scale_sqrt_hidden: bool = False  # Gemma: embeddings × √hidden_size
    # RecurrentGemma: that √hidden_size rounded to bfloat16 first (transformers' buffer)
    embed_scale_bf16: bool = False
    ffn_half: bool = False  # RecurrentGemma: the MLP is intermediate_size // 2 wide
    multipliers: bool = False  # Granite: embedding/attention/residual multipliers, logits_scaling
    # Falcon-H1's µP multipliers: embedding, lm_head, key, attention in/out, SSM in/out and
    # per-part of in_proj, MLP gate/down (config._quirks, state_config._ssm)
    mup_multipliers: bool = False
    query_pre_attn_scalar: bool = False  # Gemma 2/3: attention scale = scalar^-0.5
    softcaps: bool = False  # Gemma 2/3: attn/final logit soft-capping keys are honoured
    local_rope: bool = False  # Gemma 3: sliding layers have their own RoPE base
    # layers without RoPE (None: every layer has RoPE when positions is "rope")
    nope: NopeKind | None = None
    rope_aliases: dict[str, str] = field(default_factory=dict)  # Phi-3: "su" -> "longrope"
    moe: MoeFamily | None = None  # the FFN of (some) layers is a mixture of experts
    attention: AttentionKind = "gqa"
    # the recurrent mixer of the layers that do not attend (None: every layer attends), and
    # which layers those are when config.json has no layer_types (None: layer_types only)
    mixer: MixerKind | None = None
    mixer_rule: LayerRule | None = None
    attention_gate: bool = False  # Qwen3-Next: attention output × sigmoid(a gate from q_proj)
    ssm_bcdt_norm: bool = False  # Falcon-Mamba: B, C and Δ RMS-normed before the scan
    ssm_bcdt_weights: bool = False  # Jamba: the same norms with weights (rms_norm_eps)
    # Zamba2: Mamba-2's Δ clamped to [config[key], ∞) (its time_step_limit)
    ssm_dt_min_key: str | None = None
    # LFM2: with block_auto_adjust_ff_dim the MLP is ⅔ of intermediate_size, × the
    # block_ffn_dim_multiplier, rounded up to block_multiple_of (config._derived_keys)
    ffn_auto_adjust: bool = False
    # RoPE only when config[key] == value (Granite 4: position_embedding_type "rope")
    rope_flag: tuple[str, Any] | None = None
    ffn_layers: bool = False  # Nemotron-H: layer kinds FFN / FFN_MOE (no token mixer)
    # renames applied first when the model has no experts (Granite 4's dense variant: its
    # shared_mlp is the layer's MLP, not a shared expert)
    dense_renames: tuple[tuple[str, str], ...] = ()
    delta_proj: DeltaProjKind = "fused"  # how the gated delta rule projects its inputs
    # renames applied after `renames` to the tensors of the recurrent layers only (Kimi
    # Linear keeps both kinds of token mixer under `self_attn`, with names that collide)
    recurrent_renames: tuple[tuple[str, str], ...] = ()
    # the block layout of the recurrent layers where it is not the attention layers'
    # (OLMo-hybrid: pre-norm linear-attention layers beside post-norm attention ones)
    recurrent_block: BlockKind | None = None
    rope_traditional: bool = False  # RoPE rotates adjacent pairs (DeepSeek's interleave)
    rope_negative: bool = False  # nanochat: its rotate_half turns the other way
    clip_qkv: bool = False  # OLMoE: config's clip_qkv clamps q, k and v
    # classic config keys -> the names transformers 5 (and kvchat) reads; a dotted key
    # reads a nested object (DBRX: "attn_config.kv_n_heads"), and wins over a top-level one
    key_aliases: dict[str, str] = field(default_factory=dict)
    ffn_mult: int | None = None  # GPT-J: intermediate_size absent (null) means ffn_mult × hidden
    # one fused c_attn holding q, k, v one after the other (GPT-2, StarCoder 1)
    fused_qkv: FusedQkvKind | None = None
    rotary_dim_key: str | None = None  # GPT-J: rotated features per head, as a count
    # checkpoint tensor names -> ours (substring replacements, applied in order)
    renames: tuple[tuple[str, str], ...] = ()
    # tensors stored in parts that one of our modules holds whole, after the renames: (the
    # parts' name pieces in order, the whole's), concatenated along the first axis
    # (OLMo-hybrid's q_conv1d, k_conv1d, v_conv1d -> conv1d)  [weights.py]
    concat_on_load: tuple[tuple[tuple[str, ...], str], ...] = ()
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

# Mamba's config keys (transformers' and the original state-spaces ones, as mlx-lm reads
# them) -> the ssm_* keys state_config.py reads; its checkpoint's `backbone.*` names
_MAMBA_KEYS = {
    "d_model": "hidden_size", "n_layer": "num_hidden_layers", "n_layers": "num_hidden_layers",
    "state_size": "ssm_state_size", "d_state": "ssm_state_size",
    "conv_kernel": "ssm_conv_kernel", "d_conv": "ssm_conv_kernel", "expand": "ssm_expand",
    "intermediate_size": "ssm_inner", "d_inner": "ssm_inner", "use_bias": "ssm_proj_bias",
    "bias": "ssm_proj_bias", "use_conv_bias": "ssm_conv_bias", "conv_bias": "ssm_conv_bias",
    "time_step_rank": "ssm_dt_rank", "layer_norm_epsilon": "rms_norm_eps",
}
_MAMBA2_KEYS = {**_MAMBA_KEYS, "num_heads": "ssm_heads", "head_dim": "ssm_head_dim",
                "n_groups": "ssm_groups", "chunk_size": "ssm_chunk_size",
                "time_step_limit": "ssm_dt_limit"}
_BACKBONE_NAMES = (("backbone.embeddings.", "model.embed_tokens."),
                   ("backbone.embedding.", "model.embed_tokens."),
                   ("backbone.norm_f.", "model.norm."), ("backbone.", "model."))
_MAMBA_DEFAULTS: dict[str, Any] = {"rms_norm_eps": 1e-5, "ssm_conv_bias": True}
# the hybrids' Mamba-2 keys (Bamba, Granite 4)
_HYBRID_MAMBA_KEYS = {
    "mamba_d_state": "ssm_state_size", "mamba_d_conv": "ssm_conv_kernel",
    "mamba_expand": "ssm_expand", "mamba_n_heads": "ssm_heads", "mamba_d_head": "ssm_head_dim",
    "mamba_n_groups": "ssm_groups", "mamba_chunk_size": "ssm_chunk_size",
    "mamba_conv_bias": "ssm_conv_bias", "mamba_proj_bias": "ssm_proj_bias",
    "time_step_limit": "ssm_dt_limit",
}

# LFM2's names: operator_norm / ffn_norm around conv or self_attn and feed_forward (w1 gate,
# w3 up, w2 down, per expert too), the final norm called embedding_norm
_LFM2_NAMES = (("model.embedding_norm.", "model.norm."), (".operator_norm.", ".input_layernorm."),
               (".ffn_norm.", ".post_attention_layernorm."), (".feed_forward.", ".mlp."),
               (".mlp.expert_bias", ".mlp.gate.e_score_correction_bias"),
               (".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj."),
               (".self_attn.out_proj.", ".self_attn.o_proj."), (".q_layernorm.", ".q_norm."),
               (".k_layernorm.", ".k_norm."), (".conv.conv.", ".mixer.conv."),
               (".conv.in_proj.", ".mixer.in_proj."), (".conv.out_proj.", ".mixer.out_proj."))
_LFM2: dict[str, Any] = dict(
    layer_rule=None, qk_norm="head", mixer="short_conv", tie_word_embeddings=True,
    eps_key="norm_eps", key_aliases={"tie_embedding": "tie_word_embeddings"},
    renames=_LFM2_NAMES,
    defaults={"rope_theta": 1e6, "norm_eps": 1e-5, "conv_L_cache": 3, "conv_bias": False},
)

_QWEN3_5: dict[str, Any] = dict(
    layer_rule=None, norm="offset", qk_norm="head", attention_gate=True, mixer="gated_delta",
    mixer_rule=_every_nth_attention("full_attention_interval", 4), delta_proj="split",
    renames=((".linear_attn.", ".mixer."),),
    defaults={"partial_rotary_factor": 0.25, "linear_conv_kernel_dim": 4},
)

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
    # ---- recurrent layers (model/cache/state.py): state-space models and hybrids
    # Mamba: every layer one selective-scan mixer behind one norm, tied head
    "mamba": Family(
        layer_rule=None, attention="none", mixer="mamba", mixer_rule=_all_recurrent,
        block="mixer_only", dense_size_key=None, tie_word_embeddings=True,
        key_aliases=_MAMBA_KEYS, renames=_BACKBONE_NAMES, defaults=_MAMBA_DEFAULTS,
    ),
    # Falcon-Mamba: Mamba with B, C and Δ RMS-normed (mixer_rms_eps) before the scan
    "falcon_mamba": Family(
        layer_rule=None, attention="none", mixer="mamba", mixer_rule=_all_recurrent,
        block="mixer_only", dense_size_key=None, tie_word_embeddings=True,
        ssm_bcdt_norm=True, key_aliases=_MAMBA_KEYS, renames=_BACKBONE_NAMES,
        defaults=_MAMBA_DEFAULTS,
    ),
    # Mamba-2: the SSD mixer (scalar decay per head, B and C per group, a gated norm)
    "mamba2": Family(
        layer_rule=None, attention="none", mixer="mamba2", mixer_rule=_all_recurrent,
        block="mixer_only", dense_size_key=None, key_aliases=_MAMBA2_KEYS,
        renames=_BACKBONE_NAMES,
        defaults={**_MAMBA_DEFAULTS, "ssm_proj_bias": False, "ssm_heads": 128, "ssm_head_dim": 64,
                  "ssm_state_size": 128, "ssm_groups": 8, "ssm_chunk_size": 256},
    ),
    # Bamba: Llama's pre-norm layers, each attending (attn_layer_indices) or Mamba-2;
    # partial rotary ½ (transformers hard-codes it)
    "bamba": Family(
        layer_rule=None, mixer="mamba2", mixer_rule=_attention_listed("attn_layer_indices", []),
        key_aliases=_HYBRID_MAMBA_KEYS,
        renames=(("model.final_layernorm.", "model.norm."), (".mamba.", ".mixer."),
                 (".feed_forward.", ".mlp."), (".pre_ff_layernorm.", ".post_attention_layernorm.")),
        defaults={"partial_rotary_factor": 0.5, "rms_norm_eps": 1e-5, "ssm_head_dim": "auto",
                  "ssm_heads": 128, "ssm_state_size": 256, "ssm_chunk_size": 256},
    ),
    # Granite 4 (-H): Bamba's layers with Granite's multipliers, a fused shared MLP beside
    # the GraniteMoE experts (or alone: 0 experts), RoPE only with position_embedding_type
    # "rope" (else NoPE)
    "granitemoehybrid": Family(
        layer_rule=None, multipliers=True, mlp="fused", mixer="mamba2",
        rope_flag=("position_embedding_type", "rope"), dense_size_key="shared_intermediate_size",
        moe=MoeFamily(expert_size_key="intermediate_size", norm_topk_always=True,
                      shared="plain", shared_size_key="shared_intermediate_size",
                      dense_when_none=True),
        key_aliases=_HYBRID_MAMBA_KEYS,
        dense_renames=((".shared_mlp.", ".mlp."),),
        renames=((".block_sparse_moe.router.layer.", ".mlp.gate."),
                 (".block_sparse_moe.", ".mlp.switch_mlp."),
                 (".shared_mlp.", ".mlp.shared_experts."), (".input_linear.", ".gate_up_proj."),
                 (".output_linear.", ".down_proj."), (".mamba.", ".mixer.")),
        defaults={"ssm_head_dim": "auto", "ssm_heads": 128, "ssm_state_size": 256,
                  "ssm_chunk_size": 256, "shared_intermediate_size": 1024},
    ),
    # Nemotron-H: one branch per layer behind one norm, the branch Mamba-2, attention without
    # positions, a relu² MLP, or ungated relu² experts routed as DeepSeek-V3 with ungated
    # shared experts (layers_block_type, or the classic hybrid_override_pattern)
    "nemotron_h": Family(
        layer_rule=None, block="mixer_only", mixer="mamba2", ffn_layers=True,
        mixer_rule=_pattern_kinds("hybrid_override_pattern"), positions="none", mlp="plain",
        activation_key="mlp_hidden_act", eps_key="rms_norm_eps",
        moe=MoeFamily(score="sigmoid", group_score="top2", correction_bias=True,
                      shared="plain", shared_size_key="moe_shared_expert_intermediate_size",
                      gated=False, latent_key="moe_latent_size", sparse_layers="kinds"),
        key_aliases={
            "layers_block_type": "layer_types", "layer_norm_epsilon": "rms_norm_eps",
            "mamba_num_heads": "ssm_heads", "mamba_head_dim": "ssm_head_dim",
            "n_groups": "ssm_groups", "conv_kernel": "ssm_conv_kernel", "expand": "ssm_expand",
            "chunk_size": "ssm_chunk_size", "use_conv_bias": "ssm_conv_bias",
            "mamba_proj_bias": "ssm_proj_bias", "time_step_limit": "ssm_dt_limit"},
        renames=(("backbone.", "model."), ("model.embeddings.", "model.embed_tokens."),
                 ("model.norm_f.", "model.norm.")),
        # transformers' defaults, so a config without experts (Nemotron-H 8B) resolves
        defaults={"mlp_hidden_act": "relu2", "rms_norm_eps": 1e-5, "n_group": 1,
                  "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0,
                  "n_routed_experts": 8, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 7688, "moe_shared_expert_intermediate_size": 7688,
                  "ssm_heads": 128, "ssm_head_dim": 64, "ssm_state_size": 128, "ssm_groups": 8,
                  "ssm_chunk_size": 128},
    ),
    # Qwen3-Next: gated delta rule layers, every full_attention_interval-th layer gated
    # attention (q_proj also yields a sigmoid gate on the output) with offset q/k norms and
    # partial rotary; Qwen2-MoE's router and gated shared expert; offset norms throughout
    "qwen3_next": Family(
        layer_rule=None, norm="offset", qk_norm="head", attention_gate=True,
        mixer="gated_delta", mixer_rule=_every_nth_attention("full_attention_interval", 4),
        moe=MoeFamily(shared="gated", sparse_layers="step"),
        renames=((".linear_attn.", ".mixer."),),
        defaults={"partial_rotary_factor": 0.25, "linear_conv_kernel_dim": 4},
    ),
    # Qwen3.5 (the language model of the `qwen3_5` checkpoints, config.WRAPPERS): Qwen3-Next's
    # layers with the delta rule's q|k|v, z, b, a from four projections; dense or MoE
    "qwen3_5_text": Family(**_QWEN3_5),
    "qwen3_5_moe_text": Family(**_QWEN3_5, moe=MoeFamily(shared="gated", norm_topk_always=True)),
    # LFM2: gated short-convolution layers (conv_L_cache taps) and attention layers
    # (full_attn_idxs; per-head q/k norms), a SwiGLU MLP whose size is adjusted
    "lfm2": Family(**_LFM2, mixer_rule=_attention_listed("full_attn_idxs"),
                   ffn_auto_adjust=True),
    # LFM2-MoE: LFM2's layers, the first num_dense_layers dense, then a sigmoid router
    # whose expert_bias picks experts (DeepSeek-V3's correction bias, no groups)
    "lfm2_moe": Family(
        **{**_LFM2, "key_aliases": {"tie_embedding": "tie_word_embeddings",
                                    "num_dense_layers": "first_k_dense_replace"}},
        mixer_rule=_attention_listed("full_attn_idxs"),
        moe=MoeFamily(score="sigmoid", correction_bias=True,
                      correction_bias_flag="use_expert_bias", sparse_layers="first_dense"),
    ),
    # Falcon-H1: in every layer attention and Mamba-2 read the same normed input side by
    # side (µP multipliers on each branch, on in_proj's parts, on the MLP's gate and down),
    # then a pre-norm SwiGLU MLP; the mixer's gated norm is optional (mamba_rms_norm)
    "falcon_h1": Family(
        layer_rule=None, block="parallel_mixer", mixer="mamba2", mixer_rule=_all_hybrid,
        mup_multipliers=True,
        key_aliases={**_HYBRID_MAMBA_KEYS, "mamba_d_ssm": "ssm_inner",
                     "mamba_rms_norm": "ssm_gated_norm",
                     "mamba_norm_before_gate": "ssm_norm_first",
                     "projectors_bias": "ssm_out_bias"},
        renames=(("model.final_layernorm.", "model.norm."), (".mamba.", ".mixer."),
                 (".feed_forward.", ".mlp."), (".pre_ff_layernorm.", ".post_attention_layernorm.")),
        defaults={"rms_norm_eps": 1e-5, "ssm_inner": 1024, "ssm_head_dim": "auto",
                  "ssm_heads": 128, "ssm_state_size": 256, "ssm_chunk_size": 256,
                  "ssm_gated_norm": False, "ssm_norm_first": True, "max_position_embeddings": 8192},
    ),
    # Jamba: Llama's pre-norm layers, attention (no positions at all) every
    # attn_layer_period-th layer, Mamba's selective scan (Δ, B and C RMS-normed with weights)
    # in the others; every expert_layer_period-th layer a Mixtral-style mixture (softmax
    # top-k, weights not renormalised), the others a SwiGLU MLP
    "jamba": Family(
        layer_rule=None, mixer="mamba", mixer_rule=_attention_period, ssm_bcdt_weights=True,
        positions="none", qkv_bias=False, o_bias=False,
        moe=MoeFamily(expert_size_key="intermediate_size", sparse_layers="period"),
        key_aliases={**_HYBRID_MAMBA_KEYS, "mamba_dt_rank": "ssm_dt_rank"},
        renames=(("model.final_layernorm.", "model.norm."), (".mamba.", ".mixer."),
                 (".feed_forward.router.", ".mlp.gate."), (".feed_forward.", ".mlp."),
                 (".pre_ff_layernorm.", ".post_attention_layernorm.")),
        defaults={"rms_norm_eps": 1e-6, "num_experts": 16, "num_experts_per_tok": 2,
                  "expert_layer_period": 2, "expert_layer_offset": 1, "ssm_state_size": 16,
                  "ssm_conv_kernel": 4, "ssm_expand": 2, "ssm_conv_bias": True,
                  "max_position_embeddings": 262144},
    ),
    # Zamba2: Mamba-2 layers; the "hybrid" ones first run one of num_mem_blocks shared
    # transformer blocks (taken in turn) on [x, the embeddings], with per-use LoRA adapters,
    # and add its output through their own linear to the mixer's input (layers.SharedBlock,
    # weights.share_blocks)
    "zamba2": Family(
        layer_rule=None, block="shared_block", mixer="mamba2", qkv_bias=False, o_bias=False,
        mlp="fused", mlp_bias_key="add_bias_linear", tie_word_embeddings=True, ffn_mult=4,
        rope_flag=("use_mem_rope", True), ssm_dt_min_key="time_step_min",
        key_aliases={"layers_block_type": "layer_types", "attention_head_dim": "head_dim",
                     "n_mamba_heads": "ssm_heads", "mamba_headdim": "ssm_head_dim",
                     "mamba_ngroups": "ssm_groups", "mamba_d_state": "ssm_state_size",
                     "mamba_d_conv": "ssm_conv_kernel", "mamba_expand": "ssm_expand",
                     "chunk_size": "ssm_chunk_size", "add_bias_linear": "ssm_proj_bias"},
        renames=(("model.final_layernorm.", "model.norm."), (".mamba_decoder.mamba.", ".mixer."),
                 (".mamba_decoder.", "."), (".mamba.", ".mixer.")),
        # the mixer's conv always has a bias (transformers ignores use_conv_bias there)
        defaults={"hidden_act": "gelu", "rms_norm_eps": 1e-5, "ssm_conv_bias": True,
                  "ssm_heads": 8, "ssm_state_size": 64, "ssm_groups": 1, "ssm_chunk_size": 256,
                  "ssm_head_dim": "auto", "time_step_min": 0.001, "num_mem_blocks": 1,
                  "adapter_rank": 128, "max_position_embeddings": 4096},
    ),
    # ---- hybrid families added with the RG-LRU, OLMo-hybrid and Kimi-Linear rows
    # RecurrentGemma (Griffin): pre-norm layers (temporal_pre_norm, channel_pre_norm) whose
    # temporal block is the RG-LRU or local attention (block_types repeated), offset norms,
    # embeddings × √hidden in bfloat16, an MLP of intermediate_size // 2 with biases,
    # o_proj with a bias, partial rotary ½, soft-capped logits, tied head
    "recurrent_gemma": Family(
        norm="offset", activation_key="hidden_activation", mixer="rglru",
        mixer_rule=_block_types("block_types", ("recurrent", "recurrent", "attention")),
        o_bias=True, tie_word_embeddings=True, embed_scale_sqrt_hidden=True,
        embed_scale_bf16=True, softcaps=True, ffn_half=True,
        key_aliases={"attention_window_size": "sliding_window",
                     "logits_soft_cap": "final_logit_softcapping"},
        renames=((".temporal_pre_norm.", ".input_layernorm."),
                 (".channel_pre_norm.", ".post_attention_layernorm."),
                 (".mlp_block.", ".mlp."), ("model.final_norm.", "model.norm."),
                 *((f".temporal_block.{p}.", f".self_attn.{p}.")
                   for p in ("q_proj", "k_proj", "v_proj", "o_proj")),
                 (".temporal_block.conv_1d.", ".mixer.conv1d."),
                 (".temporal_block.", ".mixer.")),
        defaults={"partial_rotary_factor": 0.5, "mlp_bias": True, "rms_norm_eps": 1e-6,
                  "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 2048,
                  "final_logit_softcapping": 30.0, "conv1d_width": 4},
    ),
    # OLMo-hybrid: OLMo 3's post-norm attention layers (q/k norm over the projection, RoPE
    # always: transformers 5 fills in theta 1e4 when the config has none) beside pre-norm
    # gated-delta layers (q, k, v, a, b, g projections of their own, β up to 2, the gated
    # norm's epsilon 1e-5)
    "olmo_hybrid": Family(
        layer_rule=None, block="post", recurrent_block="pre", qk_norm="proj",
        mixer="gated_delta", mixer_rule=_every_4th_attention_or_last, delta_proj="separate",
        renames=((".linear_attn.g_proj.", ".mixer.in_proj_z."),
                 (".linear_attn.a_proj.", ".mixer.in_proj_a."),
                 (".linear_attn.b_proj.", ".mixer.in_proj_b."),
                 (".linear_attn.o_proj.", ".mixer.out_proj."),
                 (".linear_attn.o_norm.", ".mixer.norm."), (".linear_attn.", ".mixer."),
                 # the names transformers saves (its conversion mapping's), as the
                 # released checkpoints have them
                 (".attention_layer_norm.", ".input_layernorm."),
                 (".feedforward_layer_norm.", ".post_attention_layernorm.")),
        concat_on_load=(((".mixer.q_conv1d.", ".mixer.k_conv1d.", ".mixer.v_conv1d."),
                         ".mixer.conv1d."),),
        defaults={"rms_norm_eps": 1e-6, "linear_norm_eps": 1e-5,
                  "linear_allow_neg_eigval": True, "linear_conv_kernel_dim": 4},
    ),
    # Kimi Linear: pre-norm layers whose mixer is Kimi Delta Attention (q, k, v each
    # through its own short convolution, a low-rank forget gate per key channel, a
    # low-rank output gate through a sigmoid-gated norm) or latent attention without any
    # rotary (MLA's rope part unrotated); DeepSeek-V3's router with shared experts, the
    # first first_k_dense_replace layers dense; both token mixers saved under self_attn
    "kimi_linear": Family(
        layer_rule=None, attention="mla", positions="none", mixer="kda",
        mixer_rule=_listed_from_one("full_attn_layers", "kda_layers"), delta_proj="separate",
        moe=MoeFamily(score="sigmoid", group_score="top2", correction_bias=True,
                      shared="plain", sparse_layers="types"),
        key_aliases={
            "num_experts_per_token": "num_experts_per_tok", "moe_renormalize": "norm_topk_prob",
            "num_expert_group": "n_group", "num_shared_experts": "n_shared_experts",
            "model_max_length": "max_position_embeddings",
            "linear_attn_config.num_heads": "linear_num_heads",
            "linear_attn_config.head_dim": "linear_head_dim",
            "linear_attn_config.short_conv_kernel_size": "linear_conv_kernel_dim",
            "linear_attn_config.full_attn_layers": "full_attn_layers",
            "linear_attn_config.kda_layers": "kda_layers"},
        renames=_MIXTRAL_NAMES, recurrent_renames=((".self_attn.", ".mixer."),),
        concat_on_load=(((".mixer.q_conv1d.", ".mixer.k_conv1d.", ".mixer.v_conv1d."),
                         ".mixer.conv1d."),),
        defaults={"rms_norm_eps": 1e-5, "norm_topk_prob": True, "n_group": 1, "topk_group": 1,
                  "n_shared_experts": 1, "routed_scaling_factor": 2.446,
                  "first_k_dense_replace": 1, "linear_num_heads": 32, "linear_head_dim": 128,
                  "linear_conv_kernel_dim": 4, "max_position_embeddings": 1048576,
                  "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
                  "qk_nope_head_dim": 128, "v_head_dim": 128},
    ),
    # the 2017 block, for `python -m kvchat.model.training train --block 2017` and
    # explain's comparison: post-LayerNorm, ReLU FFN, sinusoidal positions
    "kvchat2017": Family(
        layer_rule=None, norm="layer", mlp="plain", block="post_ln", positions="sinusoidal",
        defaults={"hidden_act": "relu"},
    ),
}


def family_of(cfg: dict[str, Any]) -> Family:
    """The config's family row, or the one-line "unknown architecture" error."""
    model_type = cfg.get("model_type")
    if model_type not in FAMILIES:
        raise ConfigError(
            f"unknown architecture {model_type!r}; supported: {', '.join(sorted(FAMILIES))}"
        )
    return FAMILIES[model_type]
