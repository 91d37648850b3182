"""A GGUF file's tokenizer (`tokenizer.ggml.*` metadata) as a Hugging Face tokenizer.json,
built to tokenize as llama.cpp does; `tokenizer.load_tokenizer` runs it.

Two vocabulary kinds:

- "llama" (SentencePiece BPE: tokens, scores, token types): a BPE model whose merges are
  the vocabulary's pieces ranked by score (a piece splits into two pieces it can be made
  of), byte fallback to the `<0xNN>` pieces, spaces as "▁", and a "▁" in front of every
  stretch of text, as llama.cpp puts one at the start and after each special token (its
  `add_space_prefix`; Gemma has none);
- "gpt2" (byte-level BPE: tokens, merges, and `tokenizer.ggml.pre` naming the
  pre-tokenizer): llama.cpp's split expressions for that name, then the byte-level
  mapping.

Control and unknown tokens become special added tokens (split out of text, skipped by
`skip_special_tokens`), user-defined ones plain added tokens. EOS ids: the file's EOS,
EOT and EOM, and the end-of-turn tokens llama.cpp recognises by their text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvchat.model.errors import ModelLoadError
from kvchat.model.files import shown_path
from kvchat.model.gguf_file import GGUFFile

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
           r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> llama.cpp's split expressions (applied in turn), for the
# pre-tokenizers of the families kvchat reads from GGUF files
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "smaug-bpe"),
                    (_LLAMA3,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), (_QWEN2,)),
    **dict.fromkeys(("gpt-2", "gpt2", "phi-2", "roberta-bpe"), (_GPT2,)),
    **dict.fromkeys(("smollm", "starcoder", "refact", "codeshell"), (r"\p{N}", _GPT2)),
    "tekken": (_TEKKEN,),
}
# llama.cpp: a whole word in the vocabulary is one token without merging (Llama 3)
_IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "pixtral"}
# end-of-turn tokens llama.cpp adds to the end-of-generation set by their text
EOG_TEXTS = frozenset({"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                       "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>",
                       "<end_of_utterance>"})


class GGUFTokenizerError(ModelLoadError):
    """A GGUF file whose tokenizer metadata kvchat cannot build; one line."""


@dataclass(frozen=True)
class GGUFVocab:
    """What `load_tokenizer` needs from the file."""

    tokenizer_json: str
    tokens: list[str]
    bos_id: int | None
    eos_ids: list[int]  # the EOS token first
    add_bos: bool
    chat_template: str | None
    named: dict[str, str] = field(default_factory=dict)  # bos_token, eos_token, … texts


def _ids(gf: GGUFFile, n: int) -> dict[str, int]:
    out = {}
    for kind in ("bos", "eos", "unknown", "padding", "eot", "eom"):
        v = gf.get(f"tokenizer.ggml.{kind}_token_id")
        if isinstance(v, (int, np.integer)) and not isinstance(v, bool) and 0 <= v < n:
            out[kind] = int(v)
    return out


def _types(gf: GGUFFile, n: int) -> np.ndarray:
    types = gf.get("tokenizer.ggml.token_type")
    if types is None:
        return np.full(n, NORMAL, dtype=np.int32)
    if not isinstance(types, np.ndarray) or len(types) != n:
        raise GGUFTokenizerError(f"{shown_path(gf.path.name)}: tokenizer.ggml.token_type does"
                                 f" not give one type per token ({n} tokens)")
    return types.astype(np.int32)


def _added(tokens: list[str], types: np.ndarray) -> list[dict[str, Any]]:
    return [{"id": i, "content": tokens[i], "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": int(t) != USER_DEFINED}
            for i, t in enumerate(types.tolist()) if t in (UNKNOWN, CONTROL, USER_DEFINED)]


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # a repeated token keeps its first id
    return vocab


def spm_merges(tokens: list[str], scores: np.ndarray, types: np.ndarray) -> list[list[str]]:
    """SentencePiece BPE as ranked merges: every normal piece that splits into two normal
    pieces, the higher the piece's score the earlier (SentencePiece merges the pair whose
    result scores highest), ties in vocabulary order, as transformers converts them."""
    normal = {t: i for i, t in enumerate(tokens) if types[i] == NORMAL}
    found: list[tuple[float, int, int, int, str, str]] = []
    for piece, i in normal.items():
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in normal and right in normal:
                found.append((-float(scores[i]), i, normal[left], normal[right], left, right))
    found.sort()
    return [[left, right] for *_, left, right in found]


def _llama_json(gf: GGUFFile, tokens: list[str], types: np.ndarray, ids: dict[str, int]
                ) -> dict[str, Any]:
    scores = gf.get("tokenizer.ggml.scores")
    if not isinstance(scores, np.ndarray) or len(scores) != len(tokens):
        raise GGUFTokenizerError(f"{shown_path(gf.path.name)}: a SentencePiece vocabulary"
                                 " needs tokenizer.ggml.scores, one per token")
    prefix = gf.get("tokenizer.ggml.add_space_prefix", True) is not False
    normalizers: list[dict[str, Any]] = [{"type": "Prepend", "prepend": "▁"}] if prefix else []
    normalizers.append({"type": "Replace", "pattern": {"String": " "}, "content": "▁"})
    decoders: list[dict[str, Any]] = [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"}]
    if prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    unk = ids.get("unknown")
    return {
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": None,
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {"type": "BPE", "dropout": None,
                  "unk_token": tokens[unk] if unk is not None else None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": True, "byte_fallback": bool((types == BYTE).any()),
                  "ignore_merges": False, "vocab": _vocab(tokens),
                  "merges": spm_merges(tokens, scores, types)},
    }


def _gpt2_json(gf: GGUFFile, tokens: list[str]) -> tuple[dict[str, Any], str]:
    name = shown_path(gf.path.name)
    pre = gf.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise GGUFTokenizerError(
            f"{name}: the GGUF pre-tokenizer {pre!r:.40} is not supported; kvchat knows:"
            f" {', '.join(sorted(PRE_TOKENIZERS))}")
    merges = gf.get("tokenizer.ggml.merges")
    if not isinstance(merges, list) or not all(isinstance(m, str) for m in merges):
        raise GGUFTokenizerError(f"{name}: a byte-level BPE vocabulary needs"
                                 " tokenizer.ggml.merges")
    pairs = []
    for m in merges:
        left, sep, right = m.partition(" ")
        if not sep or not left or not right:
            raise GGUFTokenizerError(f"{name}: merge {m!r:.40} is not two tokens")
        pairs.append([left, right])
    splits = [{"type": "Split", "pattern": {"Regex": rx}, "behavior": "Isolated",
               "invert": False} for rx in PRE_TOKENIZERS[pre]]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                  "use_regex": False}
    return {
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [*splits, byte_level]},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": pre in _IGNORE_MERGES, "vocab": _vocab(tokens),
                  "merges": pairs},
    }, pre


def has_tokenizer(gf: GGUFFile) -> bool:
    return gf.get("tokenizer.ggml.model") in ("llama", "gpt2") and isinstance(
        gf.get("tokenizer.ggml.tokens"), list)


def gguf_vocab(gf: GGUFFile) -> GGUFVocab:
    """The tokenizer the file describes (GGUFTokenizerError, one line, when it cannot
    be built)."""
    name = shown_path(gf.path.name)
    model = gf.get("tokenizer.ggml.model")
    tokens = gf.get("tokenizer.ggml.tokens")
    if model is None or tokens is None:
        raise GGUFTokenizerError(f"{name}: the GGUF file holds no tokenizer"
                                 " (tokenizer.ggml.model and .tokens)")
    if model not in ("llama", "gpt2"):
        raise GGUFTokenizerError(f"{name}: GGUF tokenizer model {model!r:.40} is not supported"
                                 " (llama and gpt2 are)")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise GGUFTokenizerError(f"{name}: tokenizer.ggml.tokens is not a list of strings")
    types = _types(gf, len(tokens))
    ids = _ids(gf, len(tokens))
    if model == "llama":
        spec, pre = _llama_json(gf, tokens, types, ids), None
    else:
        spec, pre = _gpt2_json(gf, tokens)
    spec = {"version": "1.0", "truncation": None, "padding": None,
            "added_tokens": _added(tokens, types), "post_processor": None, **spec}

    add_bos = gf.get("tokenizer.ggml.add_bos_token")
    if not isinstance(add_bos, (bool, np.bool_)):  # llama.cpp's defaults
        add_bos = model == "llama" or pre in _IGNORE_MERGES
    bos = ids.get("bos")
    eos_ids = [ids[k] for k in ("eos", "eot", "eom") if k in ids]
    eos_ids += [i for i, t in enumerate(tokens)
                if t in EOG_TEXTS and types[i] in (CONTROL, USER_DEFINED)]
    template = gf.get("tokenizer.chat_template")
    named = {f"{k}_token": tokens[ids[g]] for k, g in (("bos", "bos"), ("eos", "eos"),
                                                      ("unk", "unknown"), ("pad", "padding"))
             if g in ids}
    return GGUFVocab(
        tokenizer_json=json.dumps(spec, ensure_ascii=False),
        tokens=tokens,
        bos_id=bos,
        eos_ids=list(dict.fromkeys(eos_ids)),
        add_bos=bool(add_bos) and bos is not None,
        chat_template=template if isinstance(template, str) and template.strip() else None,
        named=named,
    )


__all__ = ["EOG_TEXTS", "GGUFTokenizerError", "GGUFVocab", "PRE_TOKENIZERS", "gguf_vocab",
           "has_tokenizer", "spm_merges"]
