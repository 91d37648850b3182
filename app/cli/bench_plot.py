"""Decode tok/s against context length, full cache vs rotating cache, as a PNG.

    python -m kvchat.app.cli.bench_plot [--model DIR] [--out assets/decode_vs_context.png]

For each context length the prompt is prefilled, then `--gen` tokens are decoded with
the compiled step (`model.generate.generate_step`); the median of `--runs` is plotted.
"full" keeps every token (a cache as large as the context); "rotating" keeps `--window`
tokens (4 sinks), so its per-token cost stops growing once the window is full.
Points run interleaved (full, rotating, full, rotating, …) so machine noise hits both.
Without --model a random model of the shipped model's shape with an 8k context is used.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from kvchat.model.config import ModelConfig
from kvchat.model.generate import generate_step
from kvchat.model.transformer import Transformer

ROOT = Path(__file__).resolve().parents[2]
CONTEXTS = (128, 512, 1024, 2048, 4096, 8192)


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
    caches = model.make_cache(max_kv_size=window or context + gen + 1, keep=4)
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


def plot(contexts: list[int], res: dict[str, list[float]], window: int, title: str,
         path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(contexts, res["full"], "o-", label="full cache (every token kept)")
    ax.plot(contexts, res["rotating"], "s-", label=f"rotating cache ({window} tokens, 4 sinks)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(contexts, [f"{c:,}" for c in contexts])
    ax.set_xlabel("context length (tokens in the prompt)")
    ax.set_ylabel("decode tokens / s")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvchat.app.cli.bench_plot", description=__doc__)
    p.add_argument("--model", metavar="DIR", help="a model folder (default: random, see above)")
    p.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "assets" / "decode_vs_context.png"))
    a = p.parse_args(argv)
    if a.model:
        from kvchat.model.weights import load_model

        model, name = load_model(a.model), Path(a.model).name
    else:
        model, name = random_model(max(a.contexts) + a.gen + 1), "random kvchat-mini shape"
    res = measure(model, a.contexts, a.window, a.gen, a.runs)
    from kvchat.app.core import blas

    title = (f"{name}, float32, {mx.default_device()}, BLAS {blas.active_blas()['name']}\n"
             f"median of {a.runs} runs × {a.gen} decoded tokens per point")
    plot(a.contexts, res, a.window, title, Path(a.out))
    print(json.dumps({"model": name, "contexts": a.contexts, "window": a.window, **res}))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
