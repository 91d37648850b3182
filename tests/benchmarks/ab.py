"""Decode speed with and without one of the CPU path's changes, in one process:

    python -m tests.benchmarks.ab [--what rope] [--models mini stories 135m]
        [--runs 5] [--prompt-tokens 128] [--gen-tokens 64] [--json]

- `rope`: the `fast` kernels backend's CPU rotation (metal_kernels/fast.py) / the same
  backend with `mx.fast.rope`, registered as a backend for the run.

Both sides run in this process through kvchat's decode loop (`generate_step`, compiled
step, `auto` threads), alternating, after one warm-up each, so a machine that gets busier
moves both alike; the median of --runs is printed with `with ÷ without`. The fast BLAS
is loaded as `kvchat` loads it (tests/benchmarks/__init__.py). Models as in
`bench_threads`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from typing import Any

from kvchat.app.core import blas
from tests.benchmarks.threads import STORIES, bench_model, once, use_setting

WHAT = {"rope": ("kvchat's", "mx.fast.rope")}


def switch(what: str) -> Callable[[bool], object]:
    """`set(with_it)` for one change (`what`: a key of WHAT)."""
    from kvchat import metal_kernels
    from kvchat.metal_kernels import fast

    metal_kernels.register_backend("mx-fast-rope", fast.WithMlxRope())

    def use_ours(on: bool) -> str:
        return metal_kernels.set_backend("fast" if on else "mx-fast-rope")

    return use_ours


def measure(model: Any, set_on: Callable[[bool], object], runs: int, prompt_tokens: int,
            gen: int) -> dict[str, Any]:
    vocab = model.config.vocab_size
    prompt = [16 + (31 * i) % (vocab - 16) for i in range(prompt_tokens)]
    use_setting("auto")
    got: dict[str, list[float]] = {"with": [], "without": []}
    for r in range(runs + 1):  # the first pass warms both up (traces, buffers)
        for side in ("with", "without") if r % 2 else ("without", "with"):
            set_on(side == "with")
            tps = once(model, prompt, gen)[1]
            if r:
                got[side].append(tps)
    set_on(True)
    med = {k: statistics.median(v) for k, v in got.items()}
    return {"median": med, "runs": got, "ratio": med["with"] / med["without"]}


def render(what: str, rows: dict[str, dict[str, Any]]) -> str:
    on, off = WHAT[what]
    lines = [f"{what}: decode tok/s, {on} / {off} (median; with ÷ without)"]
    for name, r in rows.items():
        lines.append(f"  {name:<9}{r['median']['with']:>10,.1f}{r['median']['without']:>10,.1f}"
                     f"{r['ratio']:>8.2f}   with: "
                     + ", ".join(f"{x:.1f}" for x in r["runs"]["with"])
                     + "; without: " + ", ".join(f"{x:.1f}" for x in r["runs"]["without"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.benchmarks.ab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--what", nargs="+", choices=list(WHAT), default=list(WHAT))
    p.add_argument("--models", nargs="+", choices=["mini", "stories", "135m"],
                   default=["mini", "stories", "135m"])
    p.add_argument("--stories", default=STORIES, metavar="DIR")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    result: dict[str, Any] = {"blas": blas.describe(), "runs": a.runs,
                              "prompt_tokens": a.prompt_tokens, "gen_tokens": a.gen_tokens}
    texts = [f"BLAS {result['blas']}; prompt {a.prompt_tokens}, decode {a.gen_tokens};"
             f" median of {a.runs} alternating pairs"]
    for what in a.what:
        set_on = switch(what)
        rows = {name: measure(bench_model(name, a.stories), set_on, a.runs, a.prompt_tokens,
                              a.gen_tokens) for name in a.models}
        result[what] = rows
        texts.append(render(what, rows))
        print(texts[-1], file=sys.stderr, flush=True)
    print(json.dumps(result) if a.json else "\n".join(texts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
