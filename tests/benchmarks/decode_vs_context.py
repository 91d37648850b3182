"""Decode tok/s against context length, as a PNG of two panels.

    python -m tests.benchmarks.decode_vs_context [--model DIR] [--out assets/decode_vs_context.png]

For each context length the prompt is prefilled, then `--gen` tokens are decoded with
the compiled step (`model.generate.generate_step`); the median of `--runs` is plotted.
"full" keeps every token (a cache as large as the context); "rotating" keeps `--window`
tokens (4 sinks), so its per-token cost stops growing once the window is full.
Points run interleaved (full, rotating, full, rotating, …) so machine noise hits both.
Without --model a random model of the shipped model's shape with an 8k context is used.

The second panel: the K/V cache stored in floats, 8 bits and 4 bits (model/decoder/kv_quant.py)
on a random model of a 135M-class shape (SmolLM-135M: 30 layers, hidden 576, 9/3 heads,
head_dim 64), at `--quant-contexts` cached tokens. The caches are filled with random K/V
of that length (what decode reads does not depend on the values), then `--gen` tokens
are decoded with the compiled step; float, 8-bit and 4-bit run interleaved.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from kvchat.model.cache.kv import make_prompt_cache
from kvchat.model.decoder.config import ModelConfig
from kvchat.model.decoder.kv_format import KVQuant
from kvchat.model.decoder.transformer import Transformer
from kvchat.model.runtime.generate import generate_step

ROOT = Path(__file__).resolve().parents[2]
CONTEXTS = (128, 512, 1024, 2048, 4096, 8192)
QUANT_CONTEXTS = (512, 4096, 16384)
# SmolLM-135M's shape (a 135M-class llama with GQA); the weights are random
SHAPE_135M = {
    "model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
    "vocab_size": 49152, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}
KV_KINDS: dict[str, KVQuant | None] = {"float": None, "8-bit": KVQuant(8), "4-bit": KVQuant(4)}


def random_model(context: int) -> Transformer:
    """kvchat-mini's shape (4 layers, hidden 192, 8/2 heads) with a longer context."""
    cfg = json.loads((ROOT / "assets" / "kvchat-mini" / "config.json").read_text())
    for k in ("quantization", "quantization_config"):
        cfg.pop(k, None)
    cfg["max_position_embeddings"] = context
    mx.random.seed(0)
    model = Transformer(ModelConfig.from_dict(cfg))
    mx.eval(model.parameters())
    return model


def decode_tps(model: Any, context: int, window: int | None, gen: int) -> float:
    caches = make_prompt_cache(model, max_kv_size=window or context + gen + 1, keep=4)
    prompt = [(17 + 31 * i) % model.config.vocab_size for i in range(context)]
    t_first = None
    for i, _ in enumerate(generate_step(model, prompt, caches, max_tokens=gen)):
        if i == 0:
            t_first = time.perf_counter()
    assert t_first is not None
    return (gen - 1) / (time.perf_counter() - t_first)


def measure(model: Any, contexts: list[int], window: int, gen: int,
            runs: int) -> dict[str, list[float]]:
    decode_tps(model, 64, window, 8)  # warm-up: trace the compiled step
    out: dict[str, list[float]] = {"full": [], "rotating": []}
    for ctx in contexts:
        rows: dict[str, list[float]] = {"full": [], "rotating": []}
        for _ in range(runs):
            rows["full"].append(decode_tps(model, ctx, None, gen))
            rows["rotating"].append(decode_tps(model, ctx, window, gen))
        for k in out:
            out[k].append(statistics.median(rows[k]))
    return out


def model_135m(context: int) -> Transformer:
    mx.random.seed(0)
    model = Transformer(ModelConfig.from_dict({**SHAPE_135M,
                                               "max_position_embeddings": context}))
    mx.eval(model.parameters())
    return model


def filled_caches(model: Any, tokens: int, room: int, kv: KVQuant | None) -> list[Any]:
    """Caches holding `tokens` random K/V (room for `room` more, so none rotates)."""
    extra = {} if kv is None else {"kv": kv}
    caches = make_prompt_cache(model, max_kv_size=tokens + room, keep=4, **extra)
    cfg = model.config
    key = mx.random.key(1)
    for c in caches:
        for start in range(0, tokens, 4096):  # chunks: bounded temporaries
            n = min(4096, tokens - start)
            key, k1 = mx.random.split(key)
            x = mx.random.normal((1, cfg.num_key_value_heads, n, cfg.head_dim), key=k1)
            c.update_and_fetch(x, x)
        mx.eval([a for a in c.state if isinstance(a, (mx.array, tuple))])
    return caches


def cached_decode_tps(model: Any, tokens: int, kv: KVQuant | None, gen: int) -> float:
    caches = filled_caches(model, tokens, gen + 8, kv)
    t_first = None
    for i, _ in enumerate(generate_step(model, [1], caches, max_tokens=gen)):
        if i == 0:
            t_first = time.perf_counter()
    assert t_first is not None
    return (gen - 1) / (time.perf_counter() - t_first)


def measure_quantized(contexts: list[int], gen: int, runs: int) -> dict[str, list[float]]:
    model = model_135m(max(contexts) + gen + 16)
    for kv in KV_KINDS.values():
        cached_decode_tps(model, 64, kv, 4)  # warm-up: trace each kind's step
    out: dict[str, list[float]] = {k: [] for k in KV_KINDS}
    for ctx in contexts:
        rows: dict[str, list[float]] = {k: [] for k in KV_KINDS}
        for _ in range(runs):
            for name, kv in KV_KINDS.items():
                rows[name].append(cached_decode_tps(model, ctx, kv, gen))
        for k in out:
            out[k].append(statistics.median(rows[k]))
    return out


def _panel(ax: Any, xs: list[int], series: list[tuple[str, list[float], str]],
           xlabel: str, title: str) -> None:
    for label, values, style in series:
        ax.plot(xs, values, style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [f"{c:,}" for c in xs])
    ax.set_xlabel(xlabel)
    ax.set_ylabel("decode tokens / s")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()


def plot(contexts: list[int], res: dict[str, list[float]], window: int, title: str,
         path: Path, quant: tuple[list[int], dict[str, list[float]], str] | None = None,
         ) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if quant is None:
        fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    else:
        fig, (ax, qax) = plt.subplots(1, 2, figsize=(13, 4.4), dpi=110)
        qctx, qres, qtitle = quant
        _panel(qax, qctx, [(f"{name} K/V cache", values, f"{mark}-")
                           for (name, values), mark in zip(qres.items(), "o^v", strict=False)],
               "cached tokens", qtitle)
    _panel(ax, contexts, [("full cache (every token kept)", res["full"], "o-"),
                          (f"rotating cache ({window} tokens, 4 sinks)", res["rotating"], "s-")],
           "context length (tokens in the prompt)", title)
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.benchmarks.decode_vs_context",
                                description=__doc__)
    p.add_argument("--model", metavar="DIR", help="a model folder (default: random, see above)")
    p.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--quant-contexts", type=int, nargs="*", default=list(QUANT_CONTEXTS),
                   help="cached tokens for the float / 8-bit / 4-bit panel (none: no panel)")
    p.add_argument("--quant-gen", type=int, default=16)
    p.add_argument("--out", default=str(ROOT / "assets" / "decode_vs_context.png"))
    a = p.parse_args(argv)
    if a.model:
        from kvchat.model.decoder.weights import load_model

        model, name = load_model(a.model), Path(a.model).name
    else:
        model, name = random_model(max(a.contexts) + a.gen + 1), "random kvchat-mini shape"
    res = measure(model, a.contexts, a.window, a.gen, a.runs)
    from kvchat.app.core import blas

    title = (f"{name}, float32, {mx.default_device()}, BLAS {blas.active_blas()['name']}\n"
             f"median of {a.runs} runs × {a.gen} decoded tokens per point")
    quant = None
    if a.quant_contexts:
        qres = measure_quantized(a.quant_contexts, a.quant_gen, a.runs)
        qtitle = (f"random 135M-class llama (SmolLM-135M shape), float32\n"
                  f"median of {a.runs} runs × {a.quant_gen} decoded tokens per point")
        quant = (a.quant_contexts, qres, qtitle)
        print(json.dumps({"model": "random 135M-class", "cached_tokens": a.quant_contexts,
                          **qres}))
    plot(a.contexts, res, a.window, title, Path(a.out), quant)
    print(json.dumps({"model": name, "contexts": a.contexts, "window": a.window, **res}))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
