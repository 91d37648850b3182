"""Every family in families.FAMILIES as a tiny random checkpoint built by transformers:
the specs (config overrides, RoPE spelling, what mlx-lm 0.32.2 makes of it), the token ids
they are run on, and `build`, which writes a folder the way the family's checkpoints look
(transformers 5's `rope_parameters`, or the classic keys older checkpoints use)."""

from __future__ import annotations

import functools
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from kvchat.model import load_model
from tests.helpers.checkpoints import classic_rope, randomize, to_classic_rope, write_tokenizer

SEQ = 40
WINDOW = 16
IDS = np.random.default_rng(4321).integers(3, 256, size=(1, SEQ))

_BASE: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}


@dataclass(frozen=True)
class FamilySpec:
    hf_class: str  # transformers' ...ForCausalLM class name
    overrides: dict[str, Any] = field(default_factory=dict)
    rope_form: str = "parameters"  # or "classic" (rope_theta + rope_scaling)
    # RoPE that depends on how far a call reaches (longrope, dynamic): transformers'
    # own token-by-token run is the reference for ours
    incremental_reference: bool = False
    # mlx-lm 0.32.2 on the same fp32 folder: "agrees" (≤ tolerance), "off" (beyond
    # it, documented), "fails" (cannot load or run it)
    mlx_lm: str = "agrees"
    note: str = ""
    convert_classic: bool = False  # mlx_lm.convert needs the classic RoPE spelling
    # its 4-bit folder is made by mlx_lm.convert; where mlx-lm cannot build the family,
    # the test quantizes the transformers checkpoint itself (`_quantize_here`)
    mlx_lm_converts: bool = True
    config_class: str | None = None  # when not the model class's own (InternLM3 runs as Llama)
    seed: int = 0
    own_keys: bool = False  # the config class reads none of _BASE's keys: overrides only
    # the spec (same weights) whose folder transformers reads as the reference, where
    # transformers misreads this one's spelling
    reference: str | None = None


LONGROPE = {
    "rope_type": "longrope", "rope_theta": 10000.0,
    "short_factor": [1.0, 1.1, 1.3, 1.7], "long_factor": [1.0, 2.0, 4.0, 9.0],
    "original_max_position_embeddings": 32, "partial_rotary_factor": 0.5,
}

_MOE: dict[str, Any] = {"num_local_experts": 4, "num_experts": 4, "num_experts_per_tok": 2}
_PHIMOE: dict[str, Any] = {**_MOE, "router_jitter_noise": 0.2, "attention_bias": True,
                           "lm_head_bias": True}
_QWEN2_MOE: dict[str, Any] = {
    **_MOE, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
}
_QWEN3_MOE: dict[str, Any] = {
    **_MOE, "moe_intermediate_size": 32, "norm_topk_prob": True, "head_dim": 32,
}
# mlx-lm 0.32.2 cannot build these from transformers 5's config (no rope_theta): it is
# compared on the classic twin, and converts (4-bit) a classic copy
_NEEDS_THETA: dict[str, Any] = {
    "mlx_lm": "fails", "note": "mlx-lm needs rope_theta", "convert_classic": True,
}
_MLA_ROUTER: dict[str, Any] = {
    "num_hidden_layers": 3, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1,
    "n_group": 2, "topk_group": 1,
}
_ERNIE_MOE: dict[str, Any] = {
    "num_hidden_layers": 3, "moe_num_experts": 4, "moe_k": 2, "moe_intermediate_size": 32,
    "moe_num_shared_experts": 1, "moe_layer_start_index": 1,
}
_GLM4_MOE: dict[str, Any] = {
    **_MLA_ROUTER, "use_qk_norm": True, "head_dim": 32, "attention_bias": True,
}
_DOTS1: dict[str, Any] = {
    **_MLA_ROUTER, "n_group": 1, "topk_group": 1, "sliding_window": WINDOW,
    "max_window_layers": 1, "head_dim": 16,
}
_EXAONE4: dict[str, Any] = {  # mlx-lm reads the pattern as a string ("LG": local, global)
    "num_hidden_layers": 4, "sliding_window": WINDOW, "sliding_window_pattern": "LG",
    "layer_types": ["sliding_attention", "full_attention"] * 2, "head_dim": 16,
}
_COHERE: dict[str, Any] = {"use_qk_norm": True, "logit_scale": 0.5}
_NEOX_4H = "mlx-lm assumes intermediate_size = 4 × hidden_size"
_GRANITEMOE: dict[str, Any] = {
    **_MOE, "embedding_multiplier": 12.0, "attention_multiplier": 0.05,
    "residual_multiplier": 0.22, "logits_scaling": 8.0,
}
_GLM: dict[str, Any] = {"head_dim": 16, "attention_bias": True}
_LLAMA4_MLX = "mlx-lm's llama4_text is not a causal LM of its own"
_LLAMA4: dict[str, Any] = {
    "intermediate_size": 32, "intermediate_size_mlp": 96, "num_hidden_layers": 4,
    "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 1,
    "attention_chunk_size": WINDOW, "interleave_moe_layer_step": 2, "floor_scale": 8,
    "attn_scale": 0.1,
}
_VISION: dict[str, Any] = {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
    "image_size": 28, "patch_size": 14,
}
_MINISTRAL3: dict[str, Any] = {"head_dim": 16, "rope_parameters": {
    "rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0, "original_max_position_embeddings": 16,
    "llama_4_scaling_beta": 0.1, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
    "mscale_all_dim": 1.0,
}}
_MLA: dict[str, Any] = {
    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "num_hidden_layers": 3, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1,
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
    "v_head_dim": 16, "num_key_value_heads": 4,
}
_GLM4_MOE_LITE: dict[str, Any] = {**_MLA, "n_group": 1, "topk_group": 1}
# DBRX spells its own keys and nests most of them; clip_qkv 2 bites (q/k/v std ≈ 1.2)
_DBRX: dict[str, Any] = {
    "d_model": 64, "n_heads": 4, "n_layers": 2, "max_seq_len": 256, "vocab_size": 256,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    "attn_config": {"kv_n_heads": 2, "clip_qkv": 2.0, "rope_theta": 5e5},
    "ffn_config": {"ffn_hidden_size": 96, "moe_num_experts": 4, "moe_top_k": 2,
                   "moe_normalize_expert_weights": 1.0},
    "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
}

FAMILY_SPECS: dict[str, FamilySpec] = {
    # head_dim 32 while hidden / heads = 16; layer 1 slides (max_window_layers 1)
    "qwen3": FamilySpec("Qwen3ForCausalLM", {
        "head_dim": 32, "use_sliding_window": True, "sliding_window": WINDOW,
        "max_window_layers": 1, "tie_word_embeddings": False,
    }, mlx_lm="off", note="mlx-lm ignores Qwen3's sliding layers", seed=10),
    "qwen3_dense": FamilySpec("Qwen3ForCausalLM", {"head_dim": 32}, seed=11),
    "gemma": FamilySpec("GemmaForCausalLM", {"head_dim": 16}, mlx_lm="off",
                        note="mlx-lm uses the exact GELU, the config asks for tanh", seed=12),
    # sliding, global, sliding; scale from query_pre_attn_scalar; caps small enough to bite
    "gemma2": FamilySpec("Gemma2ForCausalLM", {
        "num_hidden_layers": 3, "head_dim": 16, "sliding_window": WINDOW,
        "query_pre_attn_scalar": 24, "attn_logit_softcapping": 5.0,
        "final_logit_softcapping": 8.0,
    }, mlx_lm="off", note="mlx-lm ignores Gemma 2's sliding window", seed=13),
    # sliding ×2, global, sliding; local base 1e4, global linear ×8 on base 1e6
    "gemma3_text": FamilySpec("Gemma3ForCausalLM", {
        "num_hidden_layers": 4, "head_dim": 16, "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                        "sliding_attention"],
        "query_pre_attn_scalar": 16,
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    }, mlx_lm="fails", note="mlx-lm reads sliding_window_pattern, not layer_types",
        seed=14),
    # the same as older configs spell it (rope_theta, rope_local_base_freq, rope_scaling,
    # sliding_window_pattern): sliding, global, sliding, global
    "gemma3_text_classic": FamilySpec("Gemma3ForCausalLM", {
        "num_hidden_layers": 4, "head_dim": 16, "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "query_pre_attn_scalar": 16,
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    }, rope_form="gemma3_classic", seed=14),
    "phi3": FamilySpec("Phi3ForCausalLM", {"sliding_window": WINDOW}, mlx_lm="off",
                       note="mlx-lm ignores Phi-3's sliding_window", seed=15),
    # partial rotary (half of head_dim) and longrope, short factors up to 32 tokens
    "phi3_longrope": FamilySpec("Phi3ForCausalLM", {
        "max_position_embeddings": 128, "original_max_position_embeddings": 32,
        "rope_parameters": LONGROPE,
    }, incremental_reference=True, mlx_lm="off",
        note="mlx-lm always uses the long factors", seed=16),
    # layers 1 and 3 NoPE (interval 2), and those slide
    "smollm3": FamilySpec("SmolLM3ForCausalLM", {
        "num_hidden_layers": 4, "no_rope_layer_interval": 2,
        "use_sliding_window": True, "sliding_window": WINDOW,
    }, mlx_lm="off", note="mlx-lm ignores SmolLM3's sliding layers", seed=17),
    "smollm3_dense": FamilySpec("SmolLM3ForCausalLM", {
        "num_hidden_layers": 4, "no_rope_layer_interval": 2,
    }, mlx_lm="off", note="mlx-lm ignores rope_parameters (theta 2e6)", seed=17),
    "smollm3_classic": FamilySpec("SmolLM3ForCausalLM", {
        "num_hidden_layers": 4, "no_rope_layer_interval": 2,
    }, rope_form="classic", seed=17),
    "olmo2": FamilySpec("Olmo2ForCausalLM", seed=18),
    "granite": FamilySpec("GraniteForCausalLM", {
        "embedding_multiplier": 12.0, "attention_multiplier": 0.05,
        "residual_multiplier": 0.22, "logits_scaling": 8.0,
    }, mlx_lm="fails", note="mlx-lm cannot read a transformers 5 granite config",
        convert_classic=True, seed=19),
    "granite_classic": FamilySpec("GraniteForCausalLM", {
        "embedding_multiplier": 12.0, "attention_multiplier": 0.05,
        "residual_multiplier": 0.22, "logits_scaling": 8.0,
    }, rope_form="classic", seed=19),
    # RoPE types on a llama body: yarn (with its attention factor), dynamic NTK past 32
    "llama_yarn": FamilySpec("LlamaForCausalLM", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 16,
    }}, mlx_lm="off", note="mlx-lm ignores rope_parameters", seed=20),
    "llama_yarn_classic": FamilySpec("LlamaForCausalLM", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 16,
    }}, rope_form="classic", seed=20),
    "llama_dynamic": FamilySpec("LlamaForCausalLM", {
        "max_position_embeddings": 32,
        "rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    }, rope_form="classic", incremental_reference=True, seed=21),
    # ---- mixtures of experts: 4 experts, top 2
    "mixtral": FamilySpec("MixtralForCausalLM", _MOE, seed=30),
    "mixtral_classic": FamilySpec("MixtralForCausalLM", _MOE, rope_form="classic", seed=30),
    # Phi-3.5-MoE: the sparse mixer (a jitter of 0.2 keeps several experts in each
    # softmax), LayerNorms, biased attention and LM head
    "phimoe": FamilySpec("PhimoeForCausalLM", _PHIMOE, mlx_lm="off",
                         note="mlx-lm ignores rope_parameters", seed=35),
    "phimoe_classic": FamilySpec("PhimoeForCausalLM", _PHIMOE, rope_form="classic", seed=35),
    # longrope with Phi-3.5-MoE's short/long mscale, within the original context
    "phimoe_longrope": FamilySpec("PhimoeForCausalLM", {**_PHIMOE, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.1, 1.3] * 4,
        "long_factor": [2.0, 4.0] * 4, "short_mscale": 1.25, "long_mscale": 1.25,
        "original_max_position_embeddings": 128}}, mlx_lm="off",
        note="mlx-lm ignores rope_parameters", seed=36),
    # a shared expert behind its sigmoid gate
    "qwen2_moe": FamilySpec("Qwen2MoeForCausalLM", _QWEN2_MOE, mlx_lm="off",
                            note="mlx-lm ignores rope_parameters (theta 1e4 read as 1e6)",
                            seed=31),
    "qwen2_moe_classic": FamilySpec("Qwen2MoeForCausalLM", _QWEN2_MOE, rope_form="classic",
                                    seed=31),
    # layer 1 dense (mlp_only_layers)
    "qwen2_moe_dense_layer": FamilySpec("Qwen2MoeForCausalLM", {
        **_QWEN2_MOE, "num_hidden_layers": 3, "mlp_only_layers": [1],
    }, mlx_lm="fails", note="mlx-lm ignores mlp_only_layers", mlx_lm_converts=False, seed=31),
    # transformers 5 writes num_local_experts and rope_parameters; the classic config
    # (Qwen3-30B-A3B's) num_experts and rope_theta
    "qwen3_moe": FamilySpec("Qwen3MoeForCausalLM", _QWEN3_MOE, mlx_lm="fails",
                            note="mlx-lm needs num_experts and rope_theta",
                            convert_classic=True, seed=32),
    "qwen3_moe_classic": FamilySpec("Qwen3MoeForCausalLM", _QWEN3_MOE, rope_form="classic",
                                    seed=32),
    "olmoe": FamilySpec("OlmoeForCausalLM", _MOE, seed=33),
    "olmoe_clip": FamilySpec("OlmoeForCausalLM", {**_MOE, "clip_qkv": 2.0}, mlx_lm="off",
                             note="mlx-lm ignores clip_qkv", mlx_lm_converts=False, seed=33),
    # latent attention; V2: queries from one q_proj, softmax router limited to the best
    # group; V3: low-rank queries, sigmoid router with its correction bias, grouped top-2
    # yarn as DeepSeek-V2-Lite's config has it (mscale = mscale_all_dim)
    "deepseek_v2": FamilySpec("DeepseekV2ForCausalLM", {
        **_MLA, "q_lora_rank": None, "topk_method": "group_limited_greedy",
        "routed_scaling_factor": 1.5, "rope_parameters": {
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.707,
            "mscale_all_dim": 0.707, "original_max_position_embeddings": 16,
            "beta_fast": 32, "beta_slow": 1},
    }, mlx_lm="fails", note="mlx-lm needs rope_scaling", convert_classic=True, seed=34),
    "deepseek_v2_classic": FamilySpec("DeepseekV2ForCausalLM", {
        **_MLA, "q_lora_rank": None, "topk_method": "group_limited_greedy",
        "routed_scaling_factor": 1.5, "rope_parameters": {
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.707,
            "mscale_all_dim": 0.707, "original_max_position_embeddings": 16,
            "beta_fast": 32, "beta_slow": 1},
    }, rope_form="classic", seed=34),
    "deepseek_v3": FamilySpec("DeepseekV3ForCausalLM", _MLA, seed=35),
    # yarn as DeepSeek-V3's config spells it (mscale and mscale_all_dim), classic keys
    "deepseek_v3_yarn": FamilySpec("DeepseekV3ForCausalLM", {**_MLA, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
        "mscale_all_dim": 0.8, "original_max_position_embeddings": 16, "beta_fast": 32,
        "beta_slow": 1,
    }}, rope_form="classic", seed=36),
    # more MoE routers: ERNIE's softmax with a correction bias, GLM-4.5's and dots.llm1's
    # DeepSeek-V3 router over GLM / Qwen3 attention
    # mlx-lm drops the router's correction bias (so its 4-bit folders lack it: the test
    # quantizes ERNIE itself)
    "ernie4_5_moe": FamilySpec("Ernie4_5_MoeForCausalLM", _ERNIE_MOE, **_NEEDS_THETA,
                               mlx_lm_converts=False, seed=46),
    "ernie4_5_moe_classic": FamilySpec("Ernie4_5_MoeForCausalLM", _ERNIE_MOE, mlx_lm="off",
                                       note="mlx-lm drops ERNIE's router correction bias",
                                       rope_form="classic", seed=46),
    "glm4_moe": FamilySpec("Glm4MoeForCausalLM", _GLM4_MOE, **_NEEDS_THETA, seed=47),
    "glm4_moe_classic": FamilySpec("Glm4MoeForCausalLM", _GLM4_MOE, rope_form="classic", seed=47),
    "dots1": FamilySpec("Dots1ForCausalLM", _DOTS1, **_NEEDS_THETA, seed=48),
    "dots1_classic": FamilySpec("Dots1ForCausalLM", _DOTS1, rope_form="classic", mlx_lm="off",
                                note="mlx-lm ignores dots1's sliding layers", seed=48),
    # ---- dense rows: OLMo 3 (post-norm, sliding layers with their own RoPE), EXAONE 4
    # (post-norm, per-head q/k norm, NoPE global layers), Helium and ERNIE 4.5
    # (interleaved RoPE), Seed-OSS (biased q/k/v), Hunyuan (q/k norm after RoPE)
    "olmo3": FamilySpec("Olmo3ForCausalLM", {
        "num_hidden_layers": 4, "sliding_window": WINDOW, "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
    }, **_NEEDS_THETA, seed=40),
    "exaone4": FamilySpec("Exaone4ForCausalLM", _EXAONE4, **_NEEDS_THETA, seed=41),
    "exaone4_classic": FamilySpec("Exaone4ForCausalLM", _EXAONE4, rope_form="classic", seed=41),
    "helium": FamilySpec("HeliumForCausalLM", {"head_dim": 16}, **_NEEDS_THETA, seed=42),
    "helium_classic": FamilySpec("HeliumForCausalLM", {"head_dim": 16}, rope_form="classic",
                                 seed=42),
    "seed_oss": FamilySpec("SeedOssForCausalLM", {
        "attention_bias": True, "attention_out_bias": False}, seed=43),
    "hunyuan_v1_dense": FamilySpec("HunYuanDenseV1ForCausalLM", {"head_dim": 16}, seed=44),
    "ernie4_5": FamilySpec("Ernie4_5ForCausalLM", {"use_bias": True}, **_NEEDS_THETA, seed=45),
    "ernie4_5_classic": FamilySpec("Ernie4_5ForCausalLM", {"use_bias": True},
                                   rope_form="classic", seed=45),
    # ---- the 2017 parts: LayerNorm (with and without bias, 1+w, none), ungated MLPs,
    # parallel blocks, partial rotary, Cohere's per-head q/k norm and logit scale
    "phi": FamilySpec("PhiForCausalLM", {"num_key_value_heads": 4}, mlx_lm="off",
                      note="mlx-lm ignores rope_parameters", seed=50),
    "phi_classic": FamilySpec("PhiForCausalLM", {"num_key_value_heads": 4},
                              rope_form="classic", seed=50),
    "phi_qk_norm": FamilySpec("PhiForCausalLM", {"num_key_value_heads": 4, "qk_layernorm": True},
                              mlx_lm="fails", note="mlx-lm has no Phi q/k layernorm",
                              mlx_lm_converts=False, seed=50),
    "starcoder2": FamilySpec("Starcoder2ForCausalLM", {"sliding_window": WINDOW}, mlx_lm="off",
                             note="mlx-lm ignores StarCoder2's sliding_window", seed=51),
    "stablelm": FamilySpec("StableLmForCausalLM", {"use_qkv_bias": True}, **_NEEDS_THETA,
                           seed=52),
    "stablelm_classic": FamilySpec("StableLmForCausalLM", {"use_qkv_bias": True},
                                   rope_form="classic", seed=52),
    "stablelm_parallel": FamilySpec("StableLmForCausalLM", {"use_parallel_residual": True},
                                    **_NEEDS_THETA, seed=52),
    "nemotron": FamilySpec("NemotronForCausalLM", {
        "attention_bias": True, "mlp_bias": True, "head_dim": 16}, seed=53),
    "cohere": FamilySpec("CohereForCausalLM", _COHERE, mlx_lm="off",
                         note="mlx-lm ignores rope_parameters (theta 1e4 read as 8e6)", seed=54),
    "cohere_classic": FamilySpec("CohereForCausalLM", _COHERE, rope_form="classic", seed=54),
    "cohere2": FamilySpec("Cohere2ForCausalLM", {
        "num_hidden_layers": 4, "sliding_window": WINDOW, "sliding_window_pattern": 2,
        "logit_scale": 0.5}, mlx_lm="off",
        note="mlx-lm reads neither rope_parameters nor layer_types", seed=55),
    "olmo": FamilySpec("OlmoForCausalLM", {"clip_qkv": 2.0}, mlx_lm="fails",
                       note="mlx-lm needs the hf_olmo package", mlx_lm_converts=False, seed=56),
    "glm": FamilySpec("GlmForCausalLM", _GLM, mlx_lm="off",
                      note="mlx-lm rotates whole heads (GLM rotates half)", seed=57),
    "glm_classic": FamilySpec("GlmForCausalLM", _GLM, rope_form="classic", mlx_lm="off",
                              note="mlx-lm rotates whole heads (GLM rotates half)", seed=57),
    "glm4": FamilySpec("Glm4ForCausalLM", _GLM, **_NEEDS_THETA, seed=58),
    "glm4_classic": FamilySpec("Glm4ForCausalLM", _GLM, rope_form="classic", seed=58),
    # multimodal checkpoints: the language model runs, the vision tower is left out
    "gemma3": FamilySpec("Gemma3ForConditionalGeneration", {
        "text_config": {"head_dim": 16, "sliding_window": WINDOW, "query_pre_attn_scalar": 16,
                        "layer_types": ["sliding_attention", "full_attention"]},
        "vision_config": _VISION, "mm_tokens_per_image": 4}, mlx_lm="fails",
        note="mlx-lm's gemma3 assumes the 262k vocabulary", mlx_lm_converts=False, seed=60),
    "mistral3": FamilySpec("Mistral3ForConditionalGeneration", {
        "text_config": {**_MINISTRAL3, "model_type": "ministral3"},
        "vision_config": {**_VISION, "head_dim": 16}}, mlx_lm="fails",
        note="mlx-lm expects an lm_head the tied wrapper does not have", mlx_lm_converts=False,
        seed=61),
    # yarn and Llama-4-style query scaling by position (period 16: it bites at 40 tokens)
    "ministral3": FamilySpec("Ministral3ForCausalLM", _MINISTRAL3, seed=62),
    "ministral3_classic": FamilySpec("Ministral3ForCausalLM", _MINISTRAL3, rope_form="classic",
                                     mlx_lm="fails", note="mlx-lm reads only rope_parameters",
                                     seed=62),
    # classic GPT-NeoX configs say rotary_pct and rotary_emb_base
    # (mlx-lm fails on all three: it assumes intermediate_size = 4 × hidden_size)
    "gpt_neox": FamilySpec("GPTNeoXForCausalLM", {"num_key_value_heads": 4}, mlx_lm="fails",
                           note="mlx-lm needs rotary_pct and rotary_emb_base",
                           mlx_lm_converts=False, seed=63),
    "gpt_neox_classic": FamilySpec("GPTNeoXForCausalLM", {"num_key_value_heads": 4},
                                   rope_form="classic", mlx_lm="fails", note=_NEOX_4H, seed=63),
    "gpt_neox_sequential": FamilySpec("GPTNeoXForCausalLM", {
        "num_key_value_heads": 4, "use_parallel_residual": False}, rope_form="classic",
        mlx_lm="fails", note=_NEOX_4H, seed=63),
    "granitemoe": FamilySpec("GraniteMoeForCausalLM", _GRANITEMOE, **_NEEDS_THETA, seed=64),
    "granitemoe_classic": FamilySpec("GraniteMoeForCausalLM", _GRANITEMOE, rope_form="classic",
                                     seed=64),
    "glm4_moe_lite": FamilySpec("Glm4MoeLiteForCausalLM", _GLM4_MOE_LITE, mlx_lm="off",
                                note="mlx-lm ignores rope_parameters (theta 1e4 read as 1e6)",
                                seed=65),
    "glm4_moe_lite_classic": FamilySpec("Glm4MoeLiteForCausalLM", _GLM4_MOE_LITE,
                                        rope_form="classic", seed=65),
    "exaone_moe": FamilySpec("ExaoneMoeForCausalLM", {
        **_EXAONE4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "n_group": 2, "topk_group": 1}, mlx_lm="fails", note="mlx-lm needs is_moe_layer",
        mlx_lm_converts=False, seed=66),
    "solar_open": FamilySpec("SolarOpenForCausalLM", {
        **_MLA_ROUTER, "num_hidden_layers": 2, "head_dim": 16}, **_NEEDS_THETA,
        mlx_lm_converts=False, seed=67),
    # (transformers' own Mellum cannot run partial rotary: full heads here)
    "mellum": FamilySpec("MellumForCausalLM", {
        **_MOE, "num_hidden_layers": 4, "moe_intermediate_size": 32, "head_dim": 16,
        "sliding_window": WINDOW, "norm_topk_prob": True,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
        "rope_parameters": {"full_attention": {"rope_theta": 5e5, "rope_type": "default"},
                            "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}},
    }, mlx_lm="fails", note="mlx-lm needs num_experts", mlx_lm_converts=False, seed=68),
    "minicpm3": FamilySpec("MiniCPM3ForCausalLM", {
        **{k: _MLA[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
                                "qk_nope_head_dim", "v_head_dim", "num_key_value_heads")},
        "scale_emb": 12.0, "scale_depth": 1.4}, mlx_lm="fails",
        note="mlx-lm needs rope_scaling", mlx_lm_converts=False, seed=69),
    "nanochat": FamilySpec("NanoChatForCausalLM", {"final_logit_softcapping": 8.0},
                           mlx_lm="fails", note="mlx-lm expects another nanochat layout",
                           mlx_lm_converts=False, seed=70),
    # sinks, sliding / global, yarn without truncation, the SwiGLU clamp at 1 (it bites)
    "gpt_oss": FamilySpec("GptOssForCausalLM", {
        **_MOE, "swiglu_limit": 1.0, "intermediate_size": 32, "head_dim": 16,
        "sliding_window": WINDOW, "rope_parameters": {
            "rope_type": "yarn", "rope_theta": 1.5e5, "factor": 16.0, "beta_fast": 32.0,
            "original_max_position_embeddings": 16, "beta_slow": 1.0, "truncate": False}},
        # 4-bit: its fused experts (experts.gate_up_proj, down_proj: no `.weight`, no
        # quantized form under transformers' names) stay float, as Llama 4's
        mlx_lm="fails", note="mlx-lm cannot read transformers 5's stacked gpt-oss experts",
        mlx_lm_converts=False, seed=73),
    # GPT-2 key names (n_embd, n_inner null: 4 × hidden), interleaved rotary over 8 of 16
    "gptj": FamilySpec("GPTJForCausalLM", {"num_key_value_heads": 4, "rotary_dim": 8,
                                            "n_inner": None}, seed=74),
    # learned positions, fused c_attn (GPT-2: Conv1D, (in, out)); StarCoder 1: one K/V head
    "gpt2": FamilySpec("GPT2LMHeadModel", {"n_inner": 96}, mlx_lm="fails",
                       note="mlx-lm needs n_ctx", mlx_lm_converts=False, seed=75),
    "gpt_bigcode": FamilySpec("GPTBigCodeForCausalLM", {"n_inner": 96}, seed=76),
    # chunks of 16 on the RoPE layers, layer 3 NoPE + global + temperature tuning (floor
    # 8: it bites), layers 1 and 3 MoE (top-1 sigmoid, scaled inputs, shared expert)
    # (mlx-lm builds llama4_text only inside its multimodal llama4: it fails on both)
    "llama4_text": FamilySpec("Llama4ForCausalLM", _LLAMA4, **_NEEDS_THETA, mlx_lm_converts=False,
                              seed=77),
    # the multimodal Llama 4 checkpoint (Llama-4-Scout/Maverick's model_type): its text model
    "llama4": FamilySpec("Llama4ForConditionalGeneration", {
        "text_config": {**_LLAMA4, "rope_parameters": {"rope_type": "default",
                                                       "rope_theta": 5e5}},
        "vision_config": {**_VISION, "vision_output_dim": 32, "projector_input_dim": 32,
                          "projector_output_dim": 64}}, mlx_lm="fails",
        note="mlx-lm needs rope_theta and rope_scaling", mlx_lm_converts=False, seed=58),
    "llama4_classic": FamilySpec("Llama4ForConditionalGeneration", {
        "text_config": _LLAMA4, "vision_config": {
            **_VISION, "vision_output_dim": 32, "projector_input_dim": 32,
            "projector_output_dim": 64}}, rope_form="classic", seed=58),
    "llama4_text_classic": FamilySpec("Llama4ForCausalLM", _LLAMA4, rope_form="classic",
                                      mlx_lm="fails", note=_LLAMA4_MLX, seed=77),
    # llama3-scaled RoPE (original context 32: the blend bites)
    "apertus": FamilySpec("ApertusForCausalLM", {"head_dim": 16, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}, mlx_lm="fails",
        note="mlx-lm needs rope_theta, post_norm, qk_norm", mlx_lm_converts=False, seed=72),
    # DBRX: transformers 5 writes rope_parameters beside attn_config.rope_theta; classic
    # configs (databricks') only the latter, which transformers 5 ignores (it runs theta
    # 1e4): the classic twin is checked against transformers on the first folder
    "dbrx": FamilySpec("DbrxForCausalLM", _DBRX, own_keys=True, seed=78),
    "dbrx_classic": FamilySpec("DbrxForCausalLM", _DBRX, own_keys=True, rope_form="classic",
                               reference="dbrx", seed=78),
    # top-k weights ÷ their 2-norm (mlx-lm always divides by the 1-norm)
    "dbrx_norm_p2": FamilySpec("DbrxForCausalLM", {**_DBRX, "ffn_config": {
        **_DBRX["ffn_config"], "moe_normalize_expert_weights": 2.0}}, own_keys=True,
        mlx_lm="off", note="mlx-lm ignores moe_normalize_expert_weights", seed=79),
    # EXAONE 3.x: Llama with GPT-2-style tensor names; classic configs say num_layers,
    # layer_norm_epsilon and activation_function
    "exaone": FamilySpec("LlamaForCausalLM", {}, config_class="ExaoneConfig", mlx_lm="fails",
                         note="mlx-lm needs num_layers and rope_theta", convert_classic=True,
                         seed=80),
    "exaone_classic": FamilySpec("LlamaForCausalLM", {}, config_class="ExaoneConfig",
                                 rope_form="classic", seed=80),
    "internlm3": FamilySpec("LlamaForCausalLM", {"head_dim": 16, "qkv_bias": True, "bias": True},
                            config_class="InternLM3Config", mlx_lm="fails",
                            note="mlx-lm's internlm3 has no q/k/v/o or MLP biases",
                            mlx_lm_converts=False, seed=71),
}
NAMES = list(FAMILY_SPECS)


# keys transformers 5 writes under a new name -> the one classic configs (and mlx-lm) use
_CLASSIC_KEYS = {
    "exaone": {"num_hidden_layers": "num_layers", "rms_norm_eps": "layer_norm_epsilon",
               "hidden_act": "activation_function"},
    "qwen3_moe": {"num_local_experts": "num_experts"},
    "gpt_neox": {"partial_rotary_factor": "rotary_pct", "rope_theta": "rotary_emb_base"},
    "dbrx": {"rope_theta": "attn_config.rope_theta",
             "num_key_value_heads": "attn_config.kv_n_heads"},
}


def to_classic(folder: Path) -> None:
    """config.json as pre-transformers-5 checkpoints spell it (RoPE and renamed keys);
    per-layer-kind RoPE (OLMo 3) as the global one plus rope_local_base_freq."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    text = cfg.get("text_config")
    if isinstance(text, dict) and "rope_parameters" in text:  # a multimodal wrapper's
        classic_rope(text)
    rope = cfg.get("rope_parameters") or {}
    if "full_attention" in rope:
        cfg["rope_parameters"] = rope = rope["full_attention"]
        cfg["rope_local_base_freq"] = cfg["rope_parameters"]["rope_theta"]
    if "partial_rotary_factor" in rope:  # a top-level key in classic configs
        cfg["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
    path.write_text(json.dumps(cfg))
    if "rope_parameters" in cfg:
        to_classic_rope(folder)
    cfg = json.loads(path.read_text())
    for new, old in _CLASSIC_KEYS.get(cfg["model_type"], {}).items():
        *outer, key = old.split(".")  # a dotted name: inside a nested object
        functools.reduce(lambda d, k: d[k], outer, cfg)[key] = cfg.pop(new)
    path.write_text(json.dumps(cfg, indent=2))


def build(spec: FamilySpec, folder: Path) -> Path:
    import torch
    import transformers as tf

    model_cls = getattr(tf, spec.hf_class)
    config_cls = getattr(tf, spec.config_class) if spec.config_class else model_cls.config_class
    overrides = json.loads(json.dumps(spec.overrides))
    if "text_config" in overrides:  # a multimodal wrapper around a tiny text model
        overrides["text_config"] = {**_BASE, **overrides["text_config"]}
        cfg = config_cls(**overrides)
    elif spec.own_keys:
        cfg = config_cls(**overrides)
    else:
        cfg = config_cls(**{**_BASE, **overrides})
    torch.manual_seed(spec.seed)
    model = model_cls(cfg).to(torch.float32).eval()
    randomize(model, spec.seed)
    model.save_pretrained(str(folder), safe_serialization=True)
    write_tokenizer(folder, cfg.get_text_config().vocab_size)
    if spec.rope_form == "classic":
        to_classic(folder)
    elif spec.rope_form == "gemma3_classic":
        path = folder / "config.json"
        c = json.loads(path.read_text())
        rope = c.pop("rope_parameters")
        c["rope_theta"] = rope["full_attention"]["rope_theta"]
        c["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
        c["rope_scaling"] = {"rope_type": "linear", "factor": rope["full_attention"]["factor"]}
        c["sliding_window_pattern"] = 2
        path.write_text(json.dumps(c, indent=2))
    return folder


def rel_err(a: np.ndarray, ref: np.ndarray) -> float:
    assert a.shape == ref.shape, (a.shape, ref.shape)
    return float(np.abs(a - ref).max()) / max(1.0, float(np.abs(ref).max()))


# wrappers whose own forward fails on text alone in transformers 5.24 (Llama 4's packs
# its output with an `image_outputs` its language model does not return): the reference
# is the wrapper's `language_model`, the Llama4ForCausalLM its forward would call
_TEXT_ALONE_FAILS = {"Llama4ForConditionalGeneration"}


@functools.cache
def hf_logits(folder: Path, incremental: bool = False) -> np.ndarray:
    """transformers' logits (eager attention), whole or token by token; computed once."""
    import torch
    import transformers as tf

    arch = json.loads((folder / "config.json").read_text()).get("architectures") or [""]
    # multimodal checkpoints: their own class, run on text alone
    auto = getattr(tf, arch[0], None) if "ForConditionalGeneration" in arch[0] else None
    model = (auto or tf.AutoModelForCausalLM).from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    if arch[0] in _TEXT_ALONE_FAILS:  # its own language model, with the wrapper's weights
        model = model.language_model
    ids = torch.tensor(IDS)
    with torch.no_grad():
        if not incremental:
            return model(ids).logits.float().numpy()
        out, past = [], None
        for t in range(SEQ):
            r = model(ids[:, t : t + 1], past_key_values=past, use_cache=True)
            past = r.past_key_values
            out.append(r.logits)
        return torch.cat(out, dim=1).float().numpy()


GROUP = 64  # the 4-bit check's group size


def _checkpoint(folder: Path) -> dict[str, mx.array]:
    weights: dict[str, mx.array] = {}
    for f in sorted(folder.glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    return weights


def _quantizable(src: Path, weights: dict[str, mx.array]) -> dict[str, bool]:
    """The checkpoint's tensors that kvchat holds in a module it quantizes, each with
    whether it is quantized transposed (GPT-2's Conv1D stores (in, out); a quantized
    weight is packed along the input axis, so it is stored (out, in)).

    A floating `.weight` of 2 or more dims qualifies when its input axis divides by
    GROUP and every tensor the loader makes of it (followed through `our_names`: renamed,
    split, stacked, transposed; marked by its float64 dtype) is the `.weight` of a
    module with `to_quantized` (not DeepSeek-V3's biased router). Tensors the loader
    drops (a vision tower) reach nothing and stay as they are. Fused experts stored
    without `.weight` (gpt-oss's and Llama 4's `experts.gate_up_proj`, `down_proj`,
    (experts, in, out)) have no quantized form under transformers' names: left float."""
    from kvchat.model.decoder.config import load_config
    from kvchat.model.decoder.weights import conv1d_weight, our_names, rename

    cfg = load_config(src)
    modules = dict(load_model(src).named_modules())
    out: dict[str, bool] = {}
    for name, w in weights.items():
        if not (name.endswith(".weight") and w.ndim >= 2
                and mx.issubdtype(w.dtype, mx.floating)):
            continue
        transposed = conv1d_weight(cfg, rename(cfg, name))
        if (w.shape[0] if transposed else w.shape[-1]) % GROUP:
            continue
        marked = our_names(cfg, {**weights, name: w.astype(mx.float64)})
        reached = [k for k, v in marked.items() if v.dtype == mx.float64]
        if reached and all(k.endswith(".weight") and hasattr(modules.get(k[:-7]), "to_quantized")
                           for k in reached):
            out[name] = transposed
    return out


def _quantize_here(src: Path, q4: Path, deq: Path) -> None:
    """4-bit (group GROUP) in mlx-community's layout under transformers' own tensor names,
    without mlx-lm: each tensor of `_quantizable` as `name.weight` (packed uint32),
    `name.scales`, `name.biases`, and "quantization" (and "quantization_config", as
    mlx-lm writes) in config.json; every other tensor as it is. `deq` is the float
    reference for transformers: the same folder with each quantized tensor replaced by
    its dequantized value, in its own layout and dtype."""
    weights = _checkpoint(src)
    chosen = _quantizable(src, weights)
    packed: dict[str, mx.array] = {}
    floats: dict[str, mx.array] = {}
    for name, w in weights.items():
        if name not in chosen:
            packed[name] = floats[name] = w
            continue
        linear = w.T if chosen[name] else w
        wq, scales, biases = mx.quantize(linear, group_size=GROUP, bits=4)
        base = name[: -len(".weight")]
        packed.update({f"{base}.weight": wq, f"{base}.scales": scales, f"{base}.biases": biases})
        back = mx.dequantize(wq, scales, biases, group_size=GROUP, bits=4).astype(w.dtype)
        floats[name] = back.T if chosen[name] else back
    shutil.copytree(src, deq)
    q4.mkdir()
    for f in src.iterdir():
        if not f.name.endswith((".safetensors", ".safetensors.index.json")):
            shutil.copy(f, q4 / f.name)
    for folder, tensors in ((q4, packed), (deq, floats)):
        for f in folder.glob("*.safetensors*"):
            f.unlink()
        mx.save_safetensors(str(folder / "model.safetensors"), tensors,
                            metadata={"format": "pt"})
    cfg = json.loads((q4 / "config.json").read_text())
    cfg["quantization"] = {"group_size": GROUP, "bits": 4}
    cfg["quantization_config"] = {"group_size": GROUP, "bits": 4}
    (q4 / "config.json").write_text(json.dumps(cfg, indent=2))
