"""Export a checkpoint as the shipped model folder: 4-bit weights in mlx-lm's layout,
the tokenizer files, the config and the model card."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from . import corpus
from .data import BOS_ID, EOS_TEXT, load_sp, log
from .loop import build_model, load_checkpoint_meta

GROUP_SIZE, BITS = 32, 4


def tokenizer_files(sp: Any, max_len: int) -> dict[str, Any]:
    """tokenizer_config.json, special_tokens_map.json (HF/mlx-lm conventions)."""
    added = {}
    for i in range(sp.get_piece_size()):
        if sp.is_control(i) or sp.is_unknown(i) or sp.id_to_piece(i) in (
                corpus.IM_START, corpus.IM_END):
            added[str(i)] = {"content": sp.id_to_piece(i), "lstrip": False, "normalized": False,
                             "rstrip": False, "single_word": False, "special": True}
    tok_cfg = {
        "tokenizer_class": "LlamaTokenizer",
        "add_bos_token": False,  # the chat template writes <s> itself
        "add_eos_token": False,
        "add_prefix_space": False,
        "legacy": False,
        "bos_token": "<s>",
        "eos_token": EOS_TEXT,
        "unk_token": "<unk>",
        "pad_token": "<unk>",
        "additional_special_tokens": [corpus.IM_START, corpus.IM_END],
        "added_tokens_decoder": added,
        "chat_template": corpus.CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "spaces_between_special_tokens": False,
        "model_max_length": max_len,
        "sp_model_kwargs": {},
    }
    special = {"bos_token": "<s>", "eos_token": EOS_TEXT, "unk_token": "<unk>",
               "pad_token": "<unk>",
               "additional_special_tokens": [corpus.IM_START, corpus.IM_END]}
    return {"tokenizer_config.json": tok_cfg, "special_tokens_map.json": special}


def export(run: Path, data: Path, out: Path, group_size: int = GROUP_SIZE,
           bits: int = BITS) -> dict[str, Any]:
    """Quantize the checkpoint to 4 bits the mlx-lm way and write a model folder."""
    meta = load_checkpoint_meta(run)
    cfg = dict(meta["config"])
    sp = load_sp(data / "tokenizer.model")
    model = build_model(cfg, 0)
    model.load_weights(str(run / "ckpt" / "model.safetensors"))
    # float16 like mlx-community checkpoints (scales/biases inherit it); CPU loaders
    # upcast to float32 for speed
    model.set_dtype(mx.float16)

    # mlx-lm's rule (utils.quantize_model): every Linear/Embedding whose input dim
    # divides the group size
    def predicate(_: str, m: nn.Module) -> bool:
        return hasattr(m, "to_quantized") and m.weight.shape[-1] % group_size == 0

    nn.quantize(model, group_size=group_size, bits=bits, class_predicate=predicate)
    q = {"group_size": group_size, "bits": bits, "mode": "affine"}
    cfg["quantization"] = q
    cfg["quantization_config"] = q  # mlx-lm writes both (HF tree support)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    index = {"metadata": {"total_size": sum(v.nbytes for v in weights.values()),
                          "total_parameters": meta["params"]},
             "weight_map": {k: "model.safetensors" for k in sorted(weights)}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))
    (out / "config.json").write_text(json.dumps(dict(sorted(cfg.items())), indent=4))
    shutil.copyfile(data / "tokenizer.model", out / "tokenizer.model")
    for name, obj in tokenizer_files(sp, cfg["max_position_embeddings"]).items():
        (out / name).write_text(json.dumps(obj, indent=2))
    gen = {"bos_token_id": BOS_ID, "eos_token_id": [cfg["eos_token_id"]],
           "pad_token_id": 0, "do_sample": True, "temperature": 0.8}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    readme = MODEL_CARD.format(params=meta["params"], layers=cfg["num_hidden_layers"],
                               hidden=cfg["hidden_size"], heads=cfg["num_attention_heads"],
                               kv=cfg["num_key_value_heads"], ff=cfg["intermediate_size"],
                               vocab=cfg["vocab_size"], gs=group_size, bits=bits,
                               val=meta.get("val_loss", float("nan")),
                               ppl=meta.get("val_ppl", float("nan")), steps=meta["step"])
    (out / "README.md").write_text(readme)
    size = sum(f.stat().st_size for f in out.iterdir())
    log(f"exported {out}: {size / 1e6:.2f} MB")
    return {"bytes": size, **meta}


MODEL_CARD = """# kvchat-mini

kvchat's default model: a {params:,}-parameter Llama-style chat model trained from scratch
by `python -m kvchat.model.training` on the project's own synthetic conversations (see ../DATA.md).
It greets, tells short simple stories, and explains kvchat, KV caches, GQA, RoPE, RMSNorm
and SwiGLU in a sentence or two. It knows nothing else.

- {layers} layers, hidden {hidden}, SwiGLU {ff}, {heads} query heads over {kv} KV heads
  (GQA), RoPE, pre-norm RMSNorm, tied embeddings, vocabulary {vocab} (SentencePiece BPE,
  byte fallback)
- {bits}-bit affine quantization, group size {gs} (mlx-lm format)
- ChatML-style template: `<|im_start|>role\\n...<|im_end|>`; EOS is `<|im_end|>`
- {steps} training steps; validation loss {val:.4f} (perplexity {ppl:.3f}) on held-out
  assistant tokens

Licence: MIT (weights, tokenizer and data are the project's own).
"""

