"""Write a GGUF file from a Hugging Face checkpoint folder the way llama.cpp's
convert_hf_to_gguf.py does, for the tests (kvchat's reader must undo each step).

Followed here from the converter: the tensor names from `gguf.get_tensor_name_map` (the
converter's own table), `LlamaModel.permute` on the Llama architecture's q/k rows, Gemma's
norms written as 1 + w and its lm_head dropped, experts stacked per layer, 1-D tensors in
F32, the metadata keys each model class writes (Llama 3's schedule as the `rope_freqs`
tensor, Phi-3's long/short factors as tensors), the SentencePiece vocabulary as
`_create_vocab_sentencepiece` reads it, the byte-level one as `get_vocab_base` does, and
`gguf.SpecialVocab` for the special ids, add_bos and the chat template. Quantized files
quantize every matrix but the routers with `gguf.quants.quantize`, as llama-quantize
leaves `ffn_gate_inp` alone.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

# HF model_type -> llama.cpp architecture
ARCH = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2",
        "qwen3": "qwen3", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "gemma": "gemma",
        "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3"}
_GEMMA = ("gemma", "gemma2", "gemma3")
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)"
                     r"\.weight$")
_EXPERT_KIND = {"w1": "gate", "w2": "down", "w3": "up", "gate_proj": "gate",
                "up_proj": "up", "down_proj": "down"}


def permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, as published."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


def _rope(cfg: dict[str, Any]) -> dict[str, Any]:
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope = dict(rope)
    if "rope_theta" not in rope and "full_attention" not in rope and "rope_theta" in cfg:
        rope["rope_theta"] = cfg["rope_theta"]
    return rope


def llama3_factors(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """LlamaModel.generate_extra_tensors: Llama 3's divisor per rotated pair."""
    base = rope.get("rope_theta", 10000.0)
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old / low, old / high
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _metadata(w: Any, cfg: dict[str, Any], arch: str) -> dict[str, np.ndarray]:
    """The metadata each model class writes; returns extra tensors (RoPE factors)."""
    import gguf

    extra: dict[str, np.ndarray] = {}
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = _rope(cfg)
    full = rope.get("full_attention", rope)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg.get("num_key_value_heads", heads))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if arch not in ("gemma", "gemma2"):  # GemmaModel writes no RoPE base
        rope_type = full.get("rope_type", "default")
        if rope_type == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
        elif rope_type == "yarn":
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(full["factor"])
            w.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
        if "rope_theta" in full:
            w.add_rope_freq_base(full["rope_theta"])
        if "sliding_attention" in rope:
            w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    if "num_local_experts" in cfg or "num_experts" in cfg:
        w.add_expert_count(cfg.get("num_local_experts") or cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("head_dim") is not None and arch not in _GEMMA:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if arch == "llama":
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(head_dim)
        if full.get("rope_type") == "llama3":
            extra["rope_freqs.weight"] = llama3_factors(full, head_dim)
    if arch in ("qwen2moe", "qwen3moe"):
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if arch in _GEMMA:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        w.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma3":
        if cfg.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        w.add_sliding_window(cfg["sliding_window"])
    if arch == "phi3":
        partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        orig = cfg.get("original_max_position_embeddings") or full.get(
            "original_max_position_embeddings") or cfg["max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_rope_dimension_count(int(partial * cfg["hidden_size"]) // heads)
        w.add_sliding_window(cfg.get("sliding_window") or 0)
        if full.get("rope_type") in ("longrope", "su"):
            scale = cfg["max_position_embeddings"] / orig
            w.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0)
            extra["rope_factors_long.weight"] = np.array(full["long_factor"], np.float32)
            extra["rope_factors_short.weight"] = np.array(full["short_factor"], np.float32)
    return extra


def _special(folder: Path, template: bool, **kw: Any) -> Any:
    import gguf

    special = gguf.SpecialVocab(folder, **kw)
    if not template:  # a file converted without a chat template
        special.chat_template = None
    return special


def _spm_vocab(w: Any, folder: Path, vocab_size: int, space_prefix: bool,
               template: bool) -> None:
    """_set_vocab_sentencepiece: pieces, scores and types from tokenizer.model."""
    import gguf
    from sentencepiece import SentencePieceProcessor

    sp = SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    tokens = [f"[PAD{i}]".encode() for i in range(vocab_size)]
    scores = [-10000.0] * vocab_size
    types = [gguf.TokenType.UNUSED] * vocab_size
    for i in range(sp.vocab_size()):
        tokens[i] = sp.IdToPiece(i).encode("utf-8")
        scores[i] = sp.GetScore(i)
        types[i] = (gguf.TokenType.UNKNOWN if sp.IsUnknown(i) else gguf.TokenType.CONTROL
                    if sp.IsControl(i) else gguf.TokenType.UNUSED if sp.IsUnused(i)
                    else gguf.TokenType.BYTE if sp.IsByte(i) else gguf.TokenType.NORMAL)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    if not space_prefix:  # GemmaModel.set_vocab
        w.add_add_space_prefix(False)
    _special(folder, template, n_vocab=len(tokens)).add_to_gguf(w)


def _bpe_vocab(w: Any, folder: Path, vocab_size: int, pre: str, template: bool) -> None:
    """_set_vocab_gpt2 with get_vocab_base (the pre-tokenizer named, not hashed)."""
    import gguf
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    reverse = {i: t for t, i in tok.vocab.items()}
    added = tok.get_added_vocab()
    decoder = tok.added_tokens_decoder
    tokens: list[str] = []
    types: list[int] = []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        token = reverse[i]
        if token in added:
            types.append(gguf.TokenType.CONTROL if decoder[i].special
                         else gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    _special(folder, template, load_merges=True).add_to_gguf(w)


def _tensors(folder: Path, cfg: dict[str, Any], arch: str) -> dict[str, np.ndarray]:
    """The checkpoint's tensors under llama.cpp's names, modified as the converter does."""
    import gguf
    from safetensors.numpy import load_file

    raw: dict[str, np.ndarray] = {}
    for f in sorted(folder.glob("*.safetensors")):
        raw.update(load_file(f))
    n_layers = cfg["num_hidden_layers"]
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), n_layers)
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, data in raw.items():
        data = data.astype(np.float32)
        if arch in _GEMMA and name == "lm_head.weight":
            continue  # GemmaModel: "lm_head is not used in llama.cpp"
        m = _EXPERT.match(name)
        if m:
            layer, e, proj = m.groups()
            experts.setdefault((int(layer), _EXPERT_KIND[proj]), {})[int(e)] = data
            continue
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            data = permute(data, heads, heads)
        if arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            data = permute(data, heads, kv_heads)
        if arch in _GEMMA and name.endswith("norm.weight"):
            data = data + 1  # the converter: "norm_shift", Gemma's (1 + w)
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise ValueError(f"the converter's map has no name for {name}")
        out[new] = data
    for (layer, kind), parts in experts.items():
        out[f"blk.{layer}.ffn_{kind}_exps.weight"] = np.stack(
            [parts[i] for i in range(len(parts))])
    return out


def convert(folder: Path, out: Path, *, tokenizer: str, pre: str | None = None,
            outtype: str = "F32", space_prefix: bool = True, roundtrip: bool = False,
            template: bool = True,
            types: Callable[[str, np.ndarray], tuple[np.ndarray, Any] | None] | None = None,
            ) -> Path:
    """`folder` (config.json, safetensors, tokenizer files) as the GGUF file `out`.

    tokenizer: "spm" (tokenizer.model) or "bpe" (tokenizer.json, pre-tokenizer `pre`).
    outtype: the matrices' type: F32, F16, Q8_0, Q4_0 or Q4_1 (1-D tensors stay F32).
    roundtrip: store a quantized type's values dequantized, as F32 (the reference).
    template: write the folder's chat template (False: a file without one).
    types: a hook (gguf name, F32 data) -> (raw data, GGML type) to store one tensor
    otherwise, or None to leave it.
    """
    import gguf
    from gguf import quants

    cfg = json.loads((folder / "config.json").read_text())
    arch = ARCH[cfg["model_type"]]
    w = gguf.GGUFWriter(out, arch)
    w.add_name(folder.name)
    ftype = {"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
             "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
             "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
             "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1}[outtype]
    extra = _metadata(w, cfg, arch)
    w.add_file_type(ftype)
    if tokenizer == "spm":
        _spm_vocab(w, folder, cfg["vocab_size"], space_prefix, template)
    else:
        assert pre is not None
        _bpe_vocab(w, folder, cfg["vocab_size"], pre, template)
    tensors = {**_tensors(folder, cfg, arch), **extra}
    for name, data in tensors.items():
        hooked = types(name, data) if types else None
        if hooked is not None:
            raw, qtype = hooked
            w.add_tensor(name, raw, raw_dtype=qtype)
        elif data.ndim <= 1 or name.endswith("_norm.weight") or outtype == "F32":
            w.add_tensor(name, data.astype(np.float32))
        elif outtype == "F16":
            w.add_tensor(name, data.astype(np.float16))
        elif "ffn_gate_inp" in name:  # llama-quantize keeps the routers
            w.add_tensor(name, data.astype(np.float32))
        elif data.shape[-1] % 32:  # rows of whole blocks only: llama-quantize falls back
            w.add_tensor(name, data.astype(np.float16))
        else:
            qtype = getattr(gguf.GGMLQuantizationType, outtype)
            packed = quants.quantize(data, qtype)
            if roundtrip:
                w.add_tensor(name, quants.dequantize(packed, qtype).astype(np.float32))
            else:
                w.add_tensor(name, packed, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
