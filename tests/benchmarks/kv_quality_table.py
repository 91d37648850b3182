"""The quality cost of 8- and 4-bit K/V caches, measured: the README's table.

    python -m tests.benchmarks.kv_quality_table [--stories DIR] [--hf DIR] [--json FILE]
                                              [--record]

For stories260K, the shipped model (assets/kvchat-mini) and a transformers checkpoint
(--hf DIR; default: one built here with transformers' LlamaForCausalLM, random weights,
head_dim 64, stories260K's tokenizer), at 8 and 4 bits, without rotation (a cache larger
than the run) and rotating past a 128-token window (4 sinks): greedy agreement with the
float cache over --tokens tokens, mean KL, perplexity on held-out text
(model/explain/kv_quality.py). Prints a Markdown table (and the JSON rows to --json); --record
keeps each model's no-rotation figures for the settings screen.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from kvchat.model.cache.kv import make_prompt_cache

ROOT = Path(__file__).resolve().parents[2]
STORIES = ROOT / "tests" / "models" / "stories260K"  # the checkout's copy
MINI = ROOT / "assets" / "kvchat-mini"
WINDOW = 128
HELD_OUT_SEED = 20261201  # corpus stories from a seed the shipped model never trained on


def build_hf_checkpoint(folder: Path, tokenizer_from: Path) -> Path:
    """A transformers LlamaForCausalLM (random weights, seed 0, head_dim 64, GQA 2:1)
    saved with save_pretrained, with `tokenizer_from`'s tokenizer files."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, initializer_range=0.1,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.float32).eval().save_pretrained(
        str(folder), safe_serialization=True)
    for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json"):
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, folder / name)
    return folder


def _texts(name: str, tokenizer: Any) -> tuple[list[int], list[int]]:
    from kvchat.model.explain.kv_quality import texts

    prompt, held_out = texts(tokenizer)
    if name == "kvchat-mini":  # its own kind of text: held-out stories from its generator
        from kvchat.model.training.corpus import story

        rng = random.Random(HELD_OUT_SEED)
        held_out = tokenizer.encode(" ".join(story(rng) for _ in range(3)))
    return prompt, held_out


def measure_model(name: str, folder: Path, n: int) -> list[dict[str, Any]]:
    import mlx.core as mx

    from kvchat.model.cache.kv_math import kv_bytes_per_token
    from kvchat.model.decoder.kv_format import KVQuant
    from kvchat.model.decoder.weights import load_model
    from kvchat.model.explain.kv_quality import measure
    from kvchat.model.runtime.generate import generate_step
    from kvchat.model.text.tokenizer import load_tokenizer

    model = load_model(folder)
    cfg = model.config
    prompt, held_out = _texts(name, load_tokenizer(folder))
    dtype_bytes = mx.zeros((1,), model.model.embed_tokens.weight.dtype).dtype.size
    rows = []
    for window in (len(prompt) + n + 1, WINDOW):
        float_ids = list(generate_step(model, prompt, make_prompt_cache(model, max_kv_size=window),
                                       max_tokens=n))
        for bits in (8, 4):
            q = KVQuant(bits)
            t0 = time.perf_counter()
            a = measure(model, prompt, q, n=n, max_kv_size=window, held_out=held_out,
                        float_ids=float_ids)
            args = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, dtype_bytes)
            rows.append({
                "model": name, "path": str(folder), "head_dim": cfg.head_dim,
                "stored_head_dim": q.padded_dim(cfg.head_dim),
                "rotating": window == WINDOW, "window": window,
                "float_bytes_per_token": kv_bytes_per_token(*args),
                "bytes_per_token": kv_bytes_per_token(*args, q=q),
                "seconds": round(time.perf_counter() - t0, 1),
                **a.to_dict(),
            })
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model (head_dim) | bits | window | same next token | first divergence (free run)"
        " | equal ids (free run) | mean KL (nats) | perplexity float → quantized"
        " | K/V bytes/token float → quantized |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        hd = (f"{r['head_dim']}" if r["stored_head_dim"] == r["head_dim"]
              else f"{r['head_dim']} → {r['stored_head_dim']}")
        first = "none" if r["first_divergence"] is None else f"token {r['first_divergence']}"
        window = f"{WINDOW}, rotating" if r["rotating"] else "none (no rotation)"
        lines.append(
            f"| {r['model']} ({hd}) | {r['bits']} (g{r['group_size']}) | {window}"
            f" | {r['forced_match']:.1%} of {r['tokens']} | {first} | {r['free_match']:.1%}"
            f" | {r['mean_kl']:.2g} | {r['ppl_float']:.3f} → {r['ppl_quant']:.3f}"
            f" | {r['float_bytes_per_token']:,} → {r['bytes_per_token']:,} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.benchmarks.kv_quality_table",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stories", default=str(STORIES), metavar="DIR")
    p.add_argument("--hf", default=None, metavar="DIR",
                   help="a transformers checkpoint (default: build one, see above)")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--json", default=None, metavar="FILE")
    p.add_argument("--record", action="store_true",
                   help="keep the no-rotation figures for the settings screen")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(a.hf) if a.hf else build_hf_checkpoint(Path(tmp), Path(a.stories))
        models = [("stories260K", Path(a.stories)), ("kvchat-mini", MINI),
                  ("transformers llama" + ("" if a.hf else ", random weights"), hf)]
        rows = []
        for name, folder in models:
            rows += measure_model(name, folder, a.tokens)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    if a.record:
        from kvchat.app.core import kv_quality

        for r in rows:
            if not r["rotating"] and not r["path"].startswith(tmp):
                kv_quality.record(r["path"], r, how="kv_quality_table")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
