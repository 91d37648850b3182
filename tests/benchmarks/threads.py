"""The thread-policy table: prefill and decode tok/s per model at 1, 2 and all OpenBLAS
threads, under the automatic policy (`auto`: by shape and by the machine's load) and under
the same table blind to the load (`shape`), on the machine as it is and with one core kept
busy by `yes > /dev/null` beside it.

    python -m tests.benchmarks.threads [--models mini stories 135m] [--runs 3]
        [--prompt-tokens 256] [--gen-tokens 48] [--loads none busy] [--matmuls] [--json]

Runs through kvchat's own decode loop (`model.generate.generate_step`) with OpenBLAS
loaded the way `kvchat` loads it (tests/benchmarks/__init__.py). Each round times every
setting once, in turn, so a machine that gets busier or quieter moves all columns alike;
the median of --runs rounds is printed, with `auto` and `shape` each ÷ the best fixed
count in that row. The last line is the verdict (`verdict`): the baseline is the best
fixed setting (one count for every call: the fewest threads within LOSS of each row's best,
else the count whose worst row is best); `shape`, then `auto`, replaces the simpler choice
only if it beats it by GAIN in some row and falls below LOSS of it in none. The machine's load
average is printed beside each row: measure on a quiet machine, and say the load.

Models: `mini` the shipped kvchat-mini (4-bit, dequantized to float32 as the engine
does), `stories` stories260K (the checkout's tests/models copy, or --stories DIR), `135m`
a random float32 model of SmolLM-135M's shape (speed only; the weights do not matter).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvchat.app.core import blas
from kvchat.app.core.discovery import DEFAULT_MODEL
from kvchat.model.cache.kv import make_prompt_cache

# the checkout's copy (tests/models, MIT, with provenance); --stories for another
STORIES = str(Path(__file__).resolve().parents[2] / "tests" / "models" / "stories260K")
SMOL_135M = {  # HuggingFaceTB/SmolLM-135M's config.json, the parts that shape the model
    "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "vocab_size": 49152, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "tie_word_embeddings": True, "hidden_act": "silu",
}
LOADS = {"none": "nothing added", "busy": "one core busy (yes > /dev/null)"}
RULES = ("shape", "auto")  # the columns that are rules, not fixed counts (simplest first)
GAIN = 1.10  # a rule earns its place by beating the simpler choice by this much somewhere
LOSS = 0.95  # and by not falling below this fraction of it anywhere (medians; noise)


def bench_model(name: str, stories: str) -> Any:
    """`mini`, `stories` or `135m` (the module's docstring says which is what)."""
    import mlx.core as mx

    from kvchat.model.decoder.config import ModelConfig
    from kvchat.model.decoder.transformer import Transformer
    from kvchat.model.decoder.weights import load_model

    if name == "mini":
        return load_model(DEFAULT_MODEL)
    if name == "stories":
        return load_model(stories)
    mx.random.seed(0)
    model = Transformer(ModelConfig.from_dict(SMOL_135M))
    mx.eval(model.parameters())
    return model


def once(model: Any, prompt: list[int], gen: int) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of one reply, kvchat's definitions (docs/design.md)."""
    from kvchat.model.runtime.generate import generate_step

    caches = make_prompt_cache(model, max_kv_size=len(prompt) + gen + 1, keep=4)
    t0 = time.perf_counter()
    t_first = t_last = t0
    for i, _ in enumerate(generate_step(model, prompt, caches, max_tokens=gen)):
        t_last = time.perf_counter()
        if i == 0:
            t_first = t_last
    return len(prompt) / (t_first - t0), (gen - 1) / (t_last - t_first)


@contextmanager
def load(kind: str) -> Iterator[None]:
    """`busy`: a `yes > /dev/null` beside the measurement, as another program would."""
    proc = None
    if kind == "busy":
        proc = subprocess.Popen(["yes"], stdout=subprocess.DEVNULL)
        time.sleep(0.2)
    try:
        yield
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()


def cpu_model() -> str:
    """The CPU's name as /proc/cpuinfo gives it (with its family/model numbers)."""
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/cpuinfo").read_text()
                    .split("\n\n")[0].splitlines() if ":" in line)
    except OSError:
        return "unknown CPU"
    info = {k.strip(): v.strip() for k, v in info.items()}
    return (f"{info.get('model name', 'unknown CPU')} (family {info.get('cpu family', '?')},"
            f" model {info.get('model', '?')})")


def settings(cores: int) -> list[str]:
    fixed = sorted({1, 2, cores})
    return [str(n) for n in fixed] + list(RULES)


def use_setting(setting: str) -> None:
    """A fixed count, `auto`, or `shape` (the automatic table with the load not read)."""
    from kvchat.model.runtime import threads

    os.environ[threads.ENV] = "auto" if setting == "shape" else setting
    p = threads.configure(None)
    if setting == "shape":
        threads.set_policy(replace(p, reads_load=False))


def measure(model: Any, cores: int, kinds: list[str], runs: int, prompt_tokens: int,
            gen: int) -> list[dict[str, Any]]:
    vocab = model.config.vocab_size
    prompt = [16 + (31 * i) % (vocab - 16) for i in range(prompt_tokens)]
    cols = settings(cores)
    rows = []
    for kind in kinds:
        with load(kind):
            for s in cols:  # warm-up: compile traces, allocator caches, OpenBLAS threads
                use_setting(s)
                once(model, prompt, 4)  # the measured prompt: its shapes traced too
            got: dict[str, list[tuple[float, float]]] = {s: [] for s in cols}
            la0 = os.getloadavg()[0]
            for r in range(runs):  # rounds; the order rotates so no setting always goes first
                for s in cols[r % len(cols):] + cols[:r % len(cols)]:
                    use_setting(s)
                    got[s].append(once(model, prompt, gen))
            la1 = os.getloadavg()[0]
        for i, metric in enumerate(("prefill_tps", "decode_tps")):
            med = {s: statistics.median(v[i] for v in got[s]) for s in cols}
            best = max(med[s] for s in cols if s not in RULES)
            rows.append({"load": kind, "metric": metric, "median": med,
                         "runs": {s: [v[i] for v in got[s]] for s in cols},
                         "vs_best": {s: med[s] / best for s in cols},
                         "loadavg": [la0, la1]})
    return rows


def verdict(models: dict[str, list[dict[str, Any]]]) -> str:
    """Which rule the medians support (the module's docstring says how).

    The baseline is the best fixed setting: one thread count used for every call, the
    fewest threads within LOSS of each row's best everywhere, else the count whose worst
    row is best. A rule replaces the simpler choice before it (the fixed count, then
    `shape`) only if it beats that choice by GAIN in some row and falls below LOSS of it
    in none."""
    rows = [r["vs_best"] for rs in models.values() for r in rs]
    if not rows:
        return "verdict: nothing measured"
    fixed = [c for c in rows[0] if c not in RULES]
    worst = {c: min(r[c] for r in rows) for c in fixed}
    base = next((c for c in fixed if worst[c] >= LOSS), max(fixed, key=lambda c: worst[c]))

    def against(rule: str, other: str) -> tuple[float, float]:
        ratios = [r[rule] / r[other] for r in rows]
        return max(ratios), min(ratios)

    choice = base
    for rule in RULES:  # simplest first: the load-blind table, then the load-reading one
        top, low = against(rule, choice)
        if top >= GAIN and low >= LOSS:
            choice = rule
    fixed_name = f"{base} thread(s) fixed"
    top, low = against("auto", base)
    if choice == "auto":
        return (f"verdict: keep auto (against {fixed_name}, the best fixed setting: up to"
                f" {top:.2f}x, never below {low:.2f})")
    name = "the load-blind table" if choice == "shape" else fixed_name
    return (f"verdict: replace auto with {name} (auto against {fixed_name}: up to {top:.2f}x,"
            f" down to {low:.2f})")


MATMULS = ((1, 192, 512), (1, 576, 1536), (128, 576, 1536), (256, 576, 1536),
           (512, 192, 512), (512, 576, 1536))  # (tokens, rows, cols): the models' shapes


def matmuls(cores: int, rounds: int = 3) -> list[dict[str, Any]]:
    """Microseconds per fp32 matmul of each shape at each fixed thread count (best of
    `rounds`): where a second thread starts to pay (model/runtime/threads.py's threshold)."""
    import mlx.core as mx

    from kvchat.model.runtime import threads

    out = []
    for m, k, n in MATMULS:
        a, b = mx.random.normal((m, k)), mx.random.normal((k, n))
        mx.eval(a, b)
        reps = max(5, int(2e9 / (m * k * n)))
        best: dict[int, float] = {}
        for _ in range(rounds):
            for t in sorted({1, 2, cores}):
                threads.set_threads(t)
                mx.eval(a @ b)
                t0 = time.perf_counter()
                for _ in range(reps):
                    mx.eval(a @ b)
                best[t] = min(best.get(t, 1e9), (time.perf_counter() - t0) / reps * 1e6)
        out.append({"shape": [m, k, n], "work": m * k * n, "us": best,
                    "auto": threads.policy().threads_for(m, k, n)})
    return out


def render_matmuls(rows: list[dict[str, Any]], load: str) -> str:
    cols = sorted(rows[0]["us"])
    lines = [f"matmul µs ({LOADS[load]}):  tokens × rows × cols" + "".join(
        f"{str(c) + ' thr':>10}" for c in cols) + f"{'auto (free cores)':>19}"]
    for r in rows:
        m, k, n = r["shape"]
        lines.append(f"{m:>6} × {k:>4} × {n:>4} ({r['work']:.1e})" + "".join(
            f"{r['us'][c]:>10,.0f}" for c in cols) + f"{r['auto']:>19}")
    return "\n".join(lines)


def render(result: dict[str, Any]) -> str:
    cols = result["settings"]
    head = (f"{'model':<9}{'load':<6}{'metric':<13}" + "".join(f"{c + ' thr':>11}" for c in cols)
            + "".join(f"{r + '÷best':>12}" for r in RULES) + "  loadavg")
    lines = [f"thread policy: {result['policy']}; {result['cores']} cores of"
             f" {result.get('cpu', 'a CPU')}, {result.get('date', '')};"
             f" BLAS {result['blas']}; prompt {result['prompt_tokens']} tokens, decode"
             f" {result['gen_tokens']}; median of {result['runs']} rounds", head]
    for m, rows in result["models"].items():
        for row in rows:
            lines.append(f"{m:<9}{row['load']:<6}{row['metric']:<13}"
                         + "".join(f"{row['median'][c]:>11,.1f}" for c in cols)
                         + "".join(f"{row['vs_best'][r]:>12.2f}" for r in RULES)
                         + "  {:.1f}→{:.1f}".format(*row["loadavg"]))
    lines.append("load: " + "; ".join(f"{k} = {v}" for k, v in LOADS.items()))
    lines.append(verdict(result["models"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.benchmarks.threads",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="*", choices=["mini", "stories", "135m"],
                   default=["mini", "stories", "135m"])
    p.add_argument("--stories", default=STORIES, metavar="DIR")
    p.add_argument("--loads", nargs="+", choices=list(LOADS), default=list(LOADS))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--gen-tokens", type=int, default=48)
    p.add_argument("--matmuls", action="store_true",
                   help="also time single matmuls of the models' shapes per thread count")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    from kvchat.model.runtime import threads

    cores = threads.available_cores()
    policy = threads.configure(None).label()
    result: dict[str, Any] = {
        "cores": cores, "cpu": cpu_model(), "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "blas": blas.describe(), "policy": policy,
        "settings": settings(cores), "prompt_tokens": a.prompt_tokens,
        "gen_tokens": a.gen_tokens, "runs": a.runs, "loads": LOADS, "models": {}}
    if a.matmuls:
        result["matmuls"] = {}
        for kind in a.loads:
            with load(kind):
                result["matmuls"][kind] = matmuls(cores)
            print(render_matmuls(result["matmuls"][kind], kind), file=sys.stderr, flush=True)
    for name in a.models:
        model = bench_model(name, a.stories)
        result["models"][name] = measure(model, cores, a.loads, a.runs, a.prompt_tokens,
                                         a.gen_tokens)
        del model
        one = {**result, "models": {name: result["models"][name]}}
        print("\n".join(render(one).splitlines()[2:-2]), file=sys.stderr, flush=True)
    text = render(result) if a.models else ""
    for kind, rows in result.get("matmuls", {}).items():
        text += "\n" + render_matmuls(rows, kind)
    result["verdict"] = verdict(result["models"])
    print(json.dumps(result) if a.json else text.strip())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
