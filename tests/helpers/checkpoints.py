"""Tiny random Hugging Face checkpoints built offline by transformers + torch on the CPU
(float32, fixed seeds, `save_pretrained(safe_serialization=True)`). Sizes are tiny (hidden
64, 2 layers, vocab 256) to keep the suite fast on a couple of cores; conftest's
`tiny_checkpoint` fixture builds each once per session."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# llama3 RoPE scaling with a short original context, so scaling changes logits at
# 48 tokens. head_dim 32 with theta 5e5 gives wavelengths 6.3, 14.3, 32.5, 74, ...:
# with original_max_position_embeddings 32 (high 32/4 = 8, low 32/1 = 32) that puts
# pairs in all three bands (kept, smoothly blended, divided by `factor`).
LLAMA3_ROPE: dict[str, Any] = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

_BASE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


@dataclass(frozen=True)
class TinySpec:
    """One tiny checkpoint: HF class, config overrides, and how config.json is written."""

    arch: str  # "llama" | "mistral" | "qwen2"
    overrides: dict[str, Any] = field(default_factory=dict)
    # "parameters": as transformers 5 writes it (rope_parameters);
    # "classic": rewritten to rope_theta + rope_scaling (older transformers, mlx-lm reads this)
    rope_form: str = "parameters"
    # does mlx-lm 0.32.2 build the same function as transformers from this config.json?
    mlx_lm_agrees: bool = True
    note: str = ""
    seed: int = 0  # weights' seed; llama3 and llama3_classic share one on purpose


TINY_SPECS: dict[str, TinySpec] = {
    "llama": TinySpec("llama", {"tie_word_embeddings": False}),
    "llama_tied": TinySpec("llama", {"tie_word_embeddings": True}, seed=1),
    "llama3": TinySpec(
        "llama",
        {"num_attention_heads": 2, "num_key_value_heads": 1, "rope_parameters": LLAMA3_ROPE},
        mlx_lm_agrees=False,
        note="mlx-lm 0.32.2 ignores rope_parameters (uses theta 1e4, no scaling)",
        seed=2,
    ),
    "llama3_classic": TinySpec(
        "llama",
        {"num_attention_heads": 2, "num_key_value_heads": 1, "rope_parameters": LLAMA3_ROPE},
        rope_form="classic",
        seed=2,
    ),
    # linear scaling (positions / factor), transformers 5 form: mlx-lm misses it too
    "llama_linear": TinySpec(
        "llama",
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}},
        mlx_lm_agrees=False,
        note="mlx-lm 0.32.2 ignores rope_parameters (no linear scaling)",
        seed=3,
    ),
    # head_dim 32 while hidden / heads = 16: q_proj is 64 -> 128, o_proj 128 -> 64
    "head_dim": TinySpec("llama", {"head_dim": 32}, seed=4),
    # 4 query heads share 1 KV head
    "mistral": TinySpec("mistral", {"sliding_window": None, "num_key_value_heads": 1}, seed=5),
    "mistral_swa": TinySpec(
        "mistral",
        {"sliding_window": 16},
        mlx_lm_agrees=False,
        note="mlx-lm 0.32.2 maps mistral to llama and ignores sliding_window",
        seed=6,
    ),
    # Qwen2 always has q/k/v biases; theta 1e6 as real Qwen2 (mlx-lm's qwen2 default)
    "qwen2": TinySpec(
        "qwen2", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, seed=7
    ),
}


def _hf_classes(arch: str) -> tuple[type, type]:
    import transformers as tf

    return {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
    }[arch]


def randomize(model: Any, seed: int) -> None:
    """Non-trivial weights: HF's init (std 0.02, norms 1, biases 0) would give almost
    uniform logits and hide bugs in norm weights, biases and attention patterns."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=p.dtype)
            if "norm" in ("." + name).rsplit(".", 2)[-2]:  # a norm's own (not DBRX's Wqkv)
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.2 * noise)
            else:
                p.copy_(0.15 * noise)


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer so mlx_lm.load / mlx_lm.convert accept the folder offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(str(folder))


def classic_rope(cfg: dict[str, Any]) -> None:
    """A config dict's `rope_parameters` as `rope_theta` + `rope_scaling`, in place."""
    params = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = None if params.get("rope_type", "default") == "default" else params


def to_classic_rope(folder: Path) -> None:
    """Rewrite config.json from `rope_parameters` to `rope_theta` + `rope_scaling`."""
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    classic_rope(cfg)
    cfg_path.write_text(json.dumps(cfg, indent=2))


def build_tiny_checkpoint(spec: TinySpec, folder: Path) -> Path:
    import torch

    seed = spec.seed
    config_cls, model_cls = _hf_classes(spec.arch)
    cfg = config_cls(**{**_BASE, **spec.overrides})
    torch.manual_seed(seed)
    model = model_cls(cfg).to(torch.float32).eval()
    randomize(model, seed)
    model.save_pretrained(str(folder), safe_serialization=True)
    write_tokenizer(folder, cfg.vocab_size)
    if spec.rope_form == "classic":
        to_classic_rope(folder)
    return folder
