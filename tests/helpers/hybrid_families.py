"""The families with recurrent layers (Mamba, Mamba-2, gated delta rule, Kimi Delta
Attention, short convolutions, RG-LRU) as tiny random checkpoints: their config
overrides, built like every other family's by `tests.helpers.families.build`."""

from __future__ import annotations

from typing import Any

from tests.helpers.families import FamilySpec

# the keys every tiny checkpoint shares (the config classes here read no _BASE of their own)
_TOKENS: dict[str, Any] = {"vocab_size": 256, "bos_token_id": 1, "eos_token_id": 2,
                           "pad_token_id": 0}
_MAMBA: dict[str, Any] = {**_TOKENS, "hidden_size": 64, "num_hidden_layers": 2,
                          "state_size": 8}
# chunk 16: the 40-token prompt runs three SSD chunks, the last one partial
_MAMBA2: dict[str, Any] = {**_TOKENS, "hidden_size": 64, "num_hidden_layers": 2,
                           "state_size": 16, "num_heads": 8, "head_dim": 16, "n_groups": 2,
                           "chunk_size": 16}

_BAMBA: dict[str, Any] = {"num_hidden_layers": 3, "attn_layer_indices": [1], "mamba_n_heads": 8,
                          "mamba_d_head": 16, "mamba_n_groups": 2, "mamba_d_state": 16,
                          "mamba_chunk_size": 16}
# gated delta rule: 2 key heads of 16 shared by 4 value heads of 16
_DELTA: dict[str, Any] = {"linear_num_key_heads": 2, "linear_num_value_heads": 4,
                          "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                          "num_hidden_layers": 3, "head_dim": 16,
                          "layer_types": ["linear_attention", "full_attention", "linear_attention"]}
_DELTA_MOE: dict[str, Any] = {"num_experts": 4, "num_experts_per_tok": 2,
                              "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}
_QWEN3_NEXT: dict[str, Any] = {**_DELTA, **_DELTA_MOE, "norm_topk_prob": True}
# Granite 4: Bamba's mixers with Granite's multipliers (they bite), 4 experts beside the
# fused shared MLP; NoPE unless position_embedding_type is "rope"
_GRANITE4: dict[str, Any] = {
    **{k: v for k, v in _BAMBA.items() if k != "attn_layer_indices"},
    "layer_types": ["mamba", "attention", "mamba"], "num_local_experts": 4,
    "num_experts_per_tok": 2, "shared_intermediate_size": 48, "embedding_multiplier": 12.0,
    "attention_multiplier": 0.05, "residual_multiplier": 0.22, "logits_scaling": 8.0}
# short convolutions (3 taps) around one attention layer; the MLP size adjusted (⅔ × 1.5,
# rounded to 16: 96)
_LFM2: dict[str, Any] = {"num_hidden_layers": 3, "full_attn_idxs": [1], "head_dim": 16,
                         "block_multiple_of": 16, "block_ffn_dim_multiplier": 1.5}
# Nemotron-H: Mamba-2, attention (no positions), relu² MLP, ungated experts (DeepSeek-V3's
# router, 2 groups, correction bias random) with an ungated shared expert
_NEMOTRON_H: dict[str, Any] = {
    **_TOKENS, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
    "layers_block_type": ["mamba", "attention", "mlp", "moe"], "mamba_num_heads": 8,
    "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 16, "chunk_size": 16,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32, "n_group": 2, "topk_group": 1,
    "routed_scaling_factor": 1.5}
_LFM2_MOE: dict[str, Any] = {
    "num_hidden_layers": 3, "layer_types": ["conv", "full_attention", "conv"], "num_experts": 4,
    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "num_dense_layers": 1,
    "routed_scaling_factor": 1.5}

# Falcon-H1: Mamba-2 (8 heads of 16 through mamba_d_ssm, 2 groups) beside attention in
# every layer; every µP multiplier away from 1 so that each one bites
_FALCON_H1: dict[str, Any] = {
    "mamba_d_ssm": 128, "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 2,
    "mamba_d_state": 16, "mamba_chunk_size": 16, "mamba_rms_norm": True,
    "embedding_multiplier": 1.7, "lm_head_multiplier": 0.6, "key_multiplier": 0.7,
    "attention_in_multiplier": 1.3, "attention_out_multiplier": 0.8, "ssm_in_multiplier": 1.2,
    "ssm_out_multiplier": 0.9, "ssm_multipliers": [1.1, 0.9, 1.2, 0.8, 1.5],
    "mlp_multipliers": [1.3, 0.7]}

# Jamba: Mamba, attention, Mamba, Mamba (attn_layer_period 3, offset 1); experts on
# layers 1 and 3 (expert_layer_period 2, offset 1): attention and Mamba each with both
_JAMBA: dict[str, Any] = {
    "num_hidden_layers": 4, "attn_layer_period": 3, "attn_layer_offset": 1,
    "expert_layer_period": 2, "expert_layer_offset": 1, "num_experts": 4,
    "num_experts_per_tok": 2, "mamba_d_state": 8}

# Zamba2: Mamba-2, hybrid, Mamba-2, hybrid, hybrid; 2 shared blocks taken in turn (the
# third hybrid layer reuses the first's), per-use adapters of rank 8, RoPE; K/V heads =
# heads, as the released models (transformers' k and v adapters are as wide as q's);
# hidden 32: at 64 the random five layers amplify rounding so that transformers' own
# float32 logits are 1.5e-5 off its float64 ones
_ZAMBA2: dict[str, Any] = {
    "num_hidden_layers": 5, "num_key_value_heads": 4, "hidden_size": 32,
    "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid", "hybrid"],
    "n_mamba_heads": 8, "mamba_d_state": 16, "mamba_ngroups": 2, "chunk_size": 16,
    "num_mem_blocks": 2, "use_shared_attention_adapter": True, "adapter_rank": 8,
    "use_mem_rope": True}
# ---- the RG-LRU, OLMo-hybrid and Kimi-Linear fixtures
# RecurrentGemma: hidden 80 (√80 rounds to 8.9375 in bfloat16: the embedding scale bites),
# RG-LRU 64 wide in 4 gate blocks, block_types cycled (R, A, R), local attention over 16
# with 1 K/V head (head_dim 20, 10 rotated), the MLP 128 // 2 wide, soft cap 8
_RECURRENT_GEMMA: dict[str, Any] = {
    **_TOKENS, "hidden_size": 80, "intermediate_size": 128, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 1, "lru_width": 64,
    "attention_window_size": 16, "block_types": ["recurrent", "attention"],
    "logits_soft_cap": 8.0, "tie_word_embeddings": True}

# OLMo-hybrid: gated delta (4 heads of 16, β up to 2), post-norm attention, gated delta
_OLMO_HYBRID: dict[str, Any] = {
    "num_hidden_layers": 3, "layer_types": ["linear_attention", "full_attention",
                                            "linear_attention"],
    "linear_num_key_heads": 4, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16}

# Kimi Linear: KDA (4 heads of 16, so o_proj's input is 64 wide and quantizes), latent
# attention without rotary (rank 16, 8 unrotated "rope" features, MHA: 4 K/V heads), KDA;
# layer 0 dense (first_k_dense_replace's default), then DeepSeek-V3's router over 4
# experts in 2 groups with a shared expert
_KIMI_LINEAR: dict[str, Any] = {
    "num_hidden_layers": 3, "num_key_value_heads": 4,
    "layer_types": ["linear_attention", "full_attention", "linear_attention"],
    "linear_num_heads": 4, "linear_head_dim": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16, "v_head_dim": 16, "num_local_experts": 4,
    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_group": 2, "topk_group": 1}

HYBRID_SPECS: dict[str, FamilySpec] = {
    # the selective scan (time_step_rank "auto": 4), tied head
    "mamba": FamilySpec("MambaForCausalLM", _MAMBA, own_keys=True, seed=90),
    # B, C and Δ RMS-normed; untied head
    "falcon_mamba": FamilySpec("FalconMambaForCausalLM", {
        **_MAMBA, "tie_word_embeddings": False}, own_keys=True, seed=91),
    # SSD: 8 heads of 16 in 2 groups, the gated norm per group
    "mamba2": FamilySpec("Mamba2ForCausalLM", _MAMBA2, own_keys=True, seed=92),
    # Mamba-2, attention (partial rotary ½), Mamba-2; in both RoPE spellings
    "bamba": FamilySpec("BambaForCausalLM", _BAMBA, seed=93),
    "bamba_classic": FamilySpec("BambaForCausalLM", _BAMBA, rope_form="classic", seed=93),
    # delta rule, gated attention (offset q/k norms, partial rotary ¼), delta rule; MoE
    # with a gated shared expert on every layer
    "qwen3_next": FamilySpec("Qwen3NextForCausalLM", _QWEN3_NEXT, seed=94),
    "qwen3_next_classic": FamilySpec("Qwen3NextForCausalLM", _QWEN3_NEXT, rope_form="classic",
                                     seed=94),
    # Qwen3.5's language model: four input projections; dense, MoE, and inside the
    # multimodal checkpoint (the vision tower is left out)
    "qwen3_5_text": FamilySpec("Qwen3_5ForCausalLM", _DELTA, config_class="Qwen3_5TextConfig",
                               seed=95),
    "qwen3_5_moe_text": FamilySpec("Qwen3_5MoeForCausalLM", {**_DELTA, **_DELTA_MOE},
                                   config_class="Qwen3_5MoeTextConfig", seed=96),
    "qwen3_5": FamilySpec("Qwen3_5ForConditionalGeneration", {
        "text_config": _DELTA, "vision_config": {
            "depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
            "out_hidden_size": 64, "patch_size": 14, "spatial_merge_size": 2,
            "temporal_patch_size": 2}}, seed=97),
    "granitemoehybrid": FamilySpec("GraniteMoeHybridForCausalLM", _GRANITE4, seed=100),
    "granitemoehybrid_rope": FamilySpec("GraniteMoeHybridForCausalLM", {
        **_GRANITE4, "position_embedding_type": "rope"}, seed=101),
    "granitemoehybrid_rope_classic": FamilySpec("GraniteMoeHybridForCausalLM", {
        **_GRANITE4, "position_embedding_type": "rope"}, rope_form="classic", seed=101),
    # 0 experts: the shared MLP alone is each layer's MLP (Granite-4.0-H-Micro)
    "granitemoehybrid_dense": FamilySpec("GraniteMoeHybridForCausalLM", {
        **_GRANITE4, "num_local_experts": 0}, seed=102),
    "nemotron_h": FamilySpec("NemotronHForCausalLM", _NEMOTRON_H, own_keys=True, seed=103),
    # the classic config: hybrid_override_pattern "M*-E" and num_hidden_layers
    "nemotron_h_classic": FamilySpec("NemotronHForCausalLM", _NEMOTRON_H, own_keys=True,
                                     seed=103),
    # the experts read a 32-wide projection of the hidden state (moe_latent_size)
    "nemotron_h_latent": FamilySpec("NemotronHForCausalLM", {
        **_NEMOTRON_H, "moe_latent_size": 32}, own_keys=True, seed=104),
    "lfm2": FamilySpec("Lfm2ForCausalLM", _LFM2, seed=98),
    "lfm2_classic": FamilySpec("Lfm2ForCausalLM", _LFM2, rope_form="classic", seed=98),
    # a sigmoid router whose expert_bias (set by the test: transformers' init is 0) picks
    # experts without weighing them; layer 0 dense
    "lfm2_moe": FamilySpec("Lfm2MoeForCausalLM", _LFM2_MOE, seed=99),
    # ---- attention beside a recurrent mixer in one layer, and their hybrids
    # Falcon-H1: the gated norm normalising before the gate; in both RoPE spellings; and
    # without the gated norm (y · silu(z), the released checkpoints' mamba_rms_norm false)
    "falcon_h1": FamilySpec("FalconH1ForCausalLM", _FALCON_H1, seed=110),
    "falcon_h1_classic": FamilySpec("FalconH1ForCausalLM", _FALCON_H1, rope_form="classic",
                                    seed=110),
    "falcon_h1_plain_gate": FamilySpec("FalconH1ForCausalLM", {
        **_FALCON_H1, "mamba_rms_norm": False}, seed=111),
    # Jamba (no positions; Δ, B, C norms with weights; softmax top-2 not renormalised), and
    # its twin with mamba_dt_rank "auto" as configs may say (transformers 5 writes the number)
    "jamba": FamilySpec("JambaForCausalLM", _JAMBA, seed=112),
    "jamba_auto_rank": FamilySpec("JambaForCausalLM", _JAMBA, seed=112),
    # Zamba2, in both spellings (the classic: rope_theta, layers_block_type "mamba"), and
    # with one shared block, no attention adapters and no RoPE
    "zamba2": FamilySpec("Zamba2ForCausalLM", _ZAMBA2, seed=113),
    "zamba2_classic": FamilySpec("Zamba2ForCausalLM", _ZAMBA2, rope_form="classic", seed=113),
    "zamba2_plain": FamilySpec("Zamba2ForCausalLM", {
        **_ZAMBA2, "num_mem_blocks": 1, "use_shared_attention_adapter": False,
        "use_mem_rope": False}, seed=114),
    # Δ clamped at time_step_min 0.3 (it bites; transformers' one-token step skips that
    # clamp, so its greedy decode is not its own forward pass: logits only)
    "zamba2_dt_floor": FamilySpec("Zamba2ForCausalLM", {**_ZAMBA2, "time_step_min": 0.3},
                                  seed=115),
    # ---- the RG-LRU, OLMo-hybrid and Kimi-Linear families
    "recurrent_gemma": FamilySpec("RecurrentGemmaForCausalLM", _RECURRENT_GEMMA, own_keys=True,
                                  seed=110),
    "recurrent_gemma_classic": FamilySpec("RecurrentGemmaForCausalLM", _RECURRENT_GEMMA,
                                          own_keys=True, rope_form="classic", seed=110),
    "olmo_hybrid": FamilySpec("OlmoHybridForCausalLM", _OLMO_HYBRID, seed=111),
    "olmo_hybrid_classic": FamilySpec("OlmoHybridForCausalLM", _OLMO_HYBRID,
                                      rope_form="classic", seed=111),
    "kimi_linear": FamilySpec("KimiLinearForCausalLM", _KIMI_LINEAR, seed=112),
    # Moonshot's own spelling: linear_attn_config (1-indexed kda_layers and
    # full_attn_layers, num_heads, head_dim), first_k_dense_replace for the dense layers
    "kimi_linear_classic": FamilySpec("KimiLinearForCausalLM", _KIMI_LINEAR, seed=112),
}
