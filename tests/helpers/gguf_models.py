"""Tiny models for the GGUF tests: a transformers checkpoint with a real tokenizer of one
of the two kinds a GGUF file holds, a SentencePiece BPE model trained here (with or
without the dummy space prefix) or a byte-level BPE tokenizer.json (Qwen 2's or Llama 3's
pre-tokenizer, as their own files spell it). Trained on a few sentences, deterministic.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.helpers.checkpoints import randomize as _randomize

WINDOW = 16

# text the tokenizers are trained on (and tested with, plus what they never saw)
CORPUS = [
    "Once upon a time, there was a little girl named Lily who loved the big blue sky.",
    "The KV cache holds keys and values of 12345 past tokens: grouped-query attention!",
    "Café, naïve, 中文字符 and emoji 🦙 mix with    spaces\tand tabs.",
    "def f(x):\n    return x * 2  # code\n",
    "I'm sure you'll like it; they've said it's the BEST one we've had.",
] * 40
STRINGS = [
    "Hello world",
    "Once upon a time, there was a little girl named Lily.",
    "  leading spaces and trailing  ",
    "digits 1234567 and 3.14",
    "unseen: Ωμέγα ž ✓ 🦀 and 한국어",
    "line one\nline two\n\n  indented",
    "I'VE said it's fine, we'll see",
]


# --------------------------------------------------------------------- tokenizers


@dataclass(frozen=True)
class TokSpec:
    kind: str  # "spm" or "bpe"
    specials: tuple[str, ...]
    bos: str
    eos: str
    template: str
    space_prefix: bool = True  # SentencePiece's dummy prefix (Gemma has none)
    pre: str | None = None  # llama.cpp's pre-tokenizer name (bpe)
    regex: str | None = None  # the tokenizer.json split expression, as HF files have it
    bos_prefix: bool = False  # a post-processor that adds BOS (Llama 3)


def _turns(start: str, end: str) -> str:
    return ("{% for m in messages %}" + start + "{{ m['role'] }}\n{{ m['content'] }}" + end
            + "\n{% endfor %}{% if add_generation_prompt %}" + start + "assistant\n{% endif %}")


TOKENIZERS = {
    "spm": TokSpec("spm", ("<start_of_turn>", "<end_of_turn>"), "<s>", "</s>",
                   "{{ bos_token }}" + _turns("<start_of_turn>", "<end_of_turn>")),
    "spm_noprefix": TokSpec("spm", ("<start_of_turn>", "<end_of_turn>"), "<s>", "</s>",
                            "{{ bos_token }}" + _turns("<start_of_turn>",
                                                              "<end_of_turn>"),
                            space_prefix=False),
    "qwen2": TokSpec("bpe", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), "<|endoftext|>",
                     "<|im_end|>", _turns("<|im_start|>", "<|im_end|>"), pre="qwen2",
                     regex=r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                     r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
    "llama3": TokSpec("bpe", ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                              "<|end_header_id|>", "<|eot_id|>"), "<|begin_of_text|>",
                      "<|eot_id|>", _turns("<|start_header_id|>", "<|eot_id|>"),
                      pre="llama-bpe", bos_prefix=True,
                      regex=r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+"
                      r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
}


def _write_spm(folder: Path, spec: TokSpec) -> int:
    import sentencepiece as spm

    model = io.BytesIO()
    # Llama's and Gemma's settings: no normalisation, whitespace kept, digits split,
    # byte fallback; the chat markers are control pieces
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=model, model_type="bpe",
        vocab_size=400, byte_fallback=True, character_coverage=1.0,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=spec.space_prefix, split_digits=True,
        allow_whitespace_only_pieces=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        control_symbols=list(spec.specials), num_threads=1, minloglevel=2)
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    # legacy: a "▁" after each special token too, as llama.cpp tokenizes
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": spec.bos, "eos_token": spec.eos, "unk_token": "<unk>", "legacy": True,
        "add_bos_token": True, "chat_template": spec.template}))
    return 400


def _write_bpe(folder: Path, spec: TokSpec) -> int:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(spec.regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=list(spec.specials), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if spec.bos_prefix:
        bos = tok.token_to_id(spec.bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{spec.bos} $A", special_tokens=[(spec.bos, bos)])
    data = json.loads(tok.to_str())
    data["model"]["ignore_merges"] = spec.pre == "llama-bpe"  # as Llama 3's file
    tok = Tokenizer.from_str(json.dumps(data))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=spec.bos,
                                   eos_token=spec.eos)
    fast.chat_template = spec.template
    fast.save_pretrained(str(folder))
    return tok.get_vocab_size()


def write_tokenizer(folder: Path, name: str) -> int:
    """The tokenizer files of kind `name` in `folder`; returns the vocabulary size."""
    spec = TOKENIZERS[name]
    return _write_spm(folder, spec) if spec.kind == "spm" else _write_bpe(folder, spec)


# --------------------------------------------------------------------- checkpoints

_BASE: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5, "pad_token_id": 0,
}
_MOE: dict[str, Any] = {"num_local_experts": 4, "num_experts": 4, "num_experts_per_tok": 2}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0, 1.1, 1.3, 1.7], "long_factor": [1.0, 2.0, 4.0, 9.0],
            "original_max_position_embeddings": 32, "partial_rotary_factor": 0.5}


@dataclass(frozen=True)
class Spec:
    hf_class: str
    tokenizer: str
    overrides: dict[str, Any] = field(default_factory=dict)
    model_type: str | None = None  # what kvchat reads the GGUF file as, if not the same
    seed: int = 0


def build(spec: Spec, folder: Path) -> Path:
    """A tiny transformers checkpoint with the spec's tokenizer (vocabulary its size)."""
    import torch
    import transformers as tf

    vocab = write_tokenizer(folder, spec.tokenizer)
    tok = TOKENIZERS[spec.tokenizer]
    model_cls = getattr(tf, spec.hf_class)
    ids = {"bos_token_id": 1, "eos_token_id": 2} if tok.kind == "spm" else {}
    cfg = model_cls.config_class(**{**_BASE, **ids, "vocab_size": vocab, **spec.overrides})
    torch.manual_seed(spec.seed)
    model = model_cls(cfg).to(torch.float32).eval()
    _randomize(model, spec.seed)
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder




# the store tests' model: a tiny llama with the SentencePiece tokenizer
STORE_SPEC = Spec("LlamaForCausalLM", "spm", {"tie_word_embeddings": False}, seed=31)
