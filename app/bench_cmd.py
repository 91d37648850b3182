"""`kvchat bench`: prefill and decode speed of our engine, optionally beside mlx-lm's
generation loop on the same folder and the same prompt ids, in one process, as ratios.

Definitions (DESIGN.md): prefill_tps = prompt tokens / prefill seconds; decode_tps =
(generated − 1) / (time of last token − time of first token). mlx-lm is timed with the
same definitions around `mlx_lm.generate.generate_step` (its prefill time includes
sampling the first token, which is noise at these sizes).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

from model.client import EngineClient
from model.events import GenParams

from .discovery import DEFAULT_MODEL
from .errors import report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="DIR", help=f"model folder (default: {DEFAULT_MODEL})")
    p.add_argument("--prompt-tokens", type=int, default=128, metavar="N")
    p.add_argument("--gen-tokens", type=int, default=64, metavar="M")
    p.add_argument("--runs", type=int, default=3, metavar="R")
    p.add_argument("--against", choices=["mlx-lm"], help="also time mlx-lm on the same ids")
    p.add_argument("--json", action="store_true")


def prompt_ids(vocab: int, n: int, seed: int = 0) -> list[int]:
    """Deterministic ids away from the low special-token range."""
    rng = random.Random(seed)
    lo = min(16, vocab - 1)
    return [rng.randrange(lo, vocab) for _ in range(n)]


def bench_kvchat(runner: EngineClient, ids: list[int], gen: int, runs: int) -> dict[str, float]:
    params = GenParams(max_tokens=gen, temp=0.0, ignore_eos=True)
    rows = []
    runner.run(ids[: min(8, len(ids))], GenParams(max_tokens=2, ignore_eos=True))  # warm-up
    for _ in range(runs):
        runner.reset()
        done = runner.run(ids, params)
        if done.finish_reason == "error":
            raise RuntimeError(done.error)
        rows.append(done.stats)
    return {
        "prefill_tps": statistics.median(r.prefill_tps or 0.0 for r in rows),
        "decode_tps": statistics.median(r.decode_tps or 0.0 for r in rows),
        "ttft_s": statistics.median(r.ttft_s or 0.0 for r in rows),
        "peak_memory": max(r.peak_memory or 0 for r in rows),
    }


def bench_mlx_lm(path: str, ids: list[int], gen: int, runs: int) -> dict[str, float]:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, _ = load(path)

    def greedy(logits: mx.array) -> mx.array:
        return mx.argmax(logits, axis=-1)

    def once(n_gen: int) -> dict[str, float]:
        prompt = mx.array(ids)
        t0 = time.perf_counter()
        t_first = t_last = t0
        count = 0
        for tok, _ in generate_step(prompt, model, max_tokens=n_gen, sampler=greedy):
            _ = int(tok)
            t_last = time.perf_counter()
            if count == 0:
                t_first = t_last
            count += 1
        span = t_last - t_first
        return {
            "prefill_tps": len(ids) / (t_first - t0),
            "decode_tps": (count - 1) / span if count > 1 and span > 0 else 0.0,
            "ttft_s": t_first - t0,
        }

    once(2)  # warm-up
    mx.reset_peak_memory()
    rows = [once(gen) for _ in range(runs)]
    return {
        "prefill_tps": statistics.median(r["prefill_tps"] for r in rows),
        "decode_tps": statistics.median(r["decode_tps"] for r in rows),
        "ttft_s": statistics.median(r["ttft_s"] for r in rows),
        "peak_memory": mx.get_peak_memory(),
    }


def run(args: argparse.Namespace) -> int:
    if args.prompt_tokens < 1 or args.gen_tokens < 2 or args.runs < 1:
        report("--prompt-tokens must be >= 1, --gen-tokens >= 2 and --runs >= 1")
        return 2
    path = str(args.model or DEFAULT_MODEL)
    runner = EngineClient(path)
    try:
        tokenizer = runner.engine.tokenizer
        vocab = min(runner.info["vocab_size"], tokenizer.vocab_size if tokenizer else 1 << 30)
        ids = prompt_ids(vocab, args.prompt_tokens)
        result: dict[str, Any] = {
            "model": path,
            "prompt_tokens": args.prompt_tokens,
            "gen_tokens": args.gen_tokens,
            "runs": args.runs,
            "kvchat": bench_kvchat(runner, ids, args.gen_tokens, args.runs),
        }
    finally:
        runner.close()
    if args.against == "mlx-lm":
        ref = bench_mlx_lm(path, ids, args.gen_tokens, args.runs)
        result["mlx_lm"] = ref
        result["ratio"] = {
            k: result["kvchat"][k] / ref[k] if ref[k] else None
            for k in ("prefill_tps", "decode_tps")
        }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"model {path}: prompt {args.prompt_tokens} tokens, generate {args.gen_tokens}, "
          f"median of {args.runs} runs")
    cols = ["kvchat"] + (["mlx_lm", "ratio"] if "mlx_lm" in result else [])
    print(f"{'':14}" + "".join(f"{c:>12}" for c in cols))
    for key in ("prefill_tps", "decode_tps", "ttft_s"):
        cells = [result["kvchat"][key]] + (
            [result["mlx_lm"][key], result["ratio"].get(key)] if "mlx_lm" in result else []
        )
        print(f"{key:14}" + "".join(f"{'-':>12}" if c is None else f"{c:12.3f}" for c in cells))
    return 0
