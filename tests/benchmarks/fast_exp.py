"""exp on MLX's CPU: MLX's own against 2^(x·log2 e) through `mx.power`
(model/decoder/fast_exp.py), per element and in kvchat-mini's decode step, in one process.

    python -m tests.benchmarks.fast_exp [--rounds 10] [--steps 30] [--warm 100]
        [--prompt 512]

Per element: ns for exp, sigmoid and softmax over a (8, 8, 1, 3000) array, MLX's op
against fast_exp's with `mx.power`. In the step: ms per batched decode step
(model/runtime/batch.py, shared K/V) at 1 and 8 rows after --warm steps (the rows' K/V
then hold 120-160 slots), and ms to prefill one --prompt-token prompt (one chunk),
fast_exp with `mx.power` and with MLX's ops in each round (their order alternating):
the median of the rounds, and the median of each round's ratio with its range (a
virtual machine's speed moves from one minute to the next; a round's two sides share
their minute). Where MLX vectorizes exp (an ARM CPU) or
runs on a GPU, fast_exp uses MLX's ops anyway; this measures what it would change.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from kvchat.app.core import blas
from tests.benchmarks.serve_concurrency import cpu_name


def per_element(f: Callable[[Any], Any], x: Any, n: int = 200) -> float:
    import mlx.core as mx

    for _ in range(10):
        mx.eval(f(x))
    t0 = time.perf_counter()
    for _ in range(n):
        mx.eval(f(x))
    return (time.perf_counter() - t0) / n / x.size * 1e9


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.benchmarks.fast_exp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warm", type=int, default=100)
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens to prefill")
    args = p.parse_args(argv)
    from kvchat.model.decoder import fast_exp

    print(f"{datetime.datetime.now().isoformat(timespec='minutes')} · {cpu_name()},"
          f" {os.cpu_count()} cores · load average {os.getloadavg()[0]:.1f} · {blas.describe()}")
    x86 = fast_exp._X86
    try:
        return _measure(args)
    finally:
        fast_exp._X86 = x86


def _measure(args: argparse.Namespace) -> int:
    import mlx.core as mx

    from kvchat.model.decoder import fast_exp
    from kvchat.model.runtime.batch import Batch
    from tests.benchmarks.batch_step import per_step, rows_of
    from tests.benchmarks.threads import STORIES, bench_model

    x = mx.random.normal((8, 8, 1, 3000))
    mlx_ops = {"exp": mx.exp, "sigmoid": mx.sigmoid,
               "softmax": lambda a: mx.softmax(a, axis=-1, precise=True)}
    print("| op | MLX ns/element | mx.power ns/element |")
    print("|---|---:|---:|")
    fast_exp._X86 = True  # what an x86 CPU gets (fast_exp.power_exp)
    for name, op in mlx_ops.items():
        print(f"| {name} | {per_element(op, x):.2f} |"
              f" {per_element(getattr(fast_exp, name), x):.2f} |")

    model = bench_model("mini", STORIES)
    times: dict[tuple[bool, int], list[float]] = {}  # (power, rows; 0: the prefill) -> s
    for r in range(args.rounds):
        for power in (False, True) if r % 2 == 0 else (True, False):
            fast_exp._X86 = power
            for name in [k for k in model.__dict__ if k.endswith("_traces")]:
                del model.__dict__[name]  # every compiled step traced again with this exp
            for n in (1, 8):
                batch, rows = Batch(model), rows_of(model, n)
                per_step(batch, rows, args.warm)
                times.setdefault((power, n), []).append(per_step(batch, rows, args.steps))
            t0 = time.perf_counter()
            rows_of(model, 1, args.prompt)  # one prompt, prefilled and evaluated
            times.setdefault((power, 0), []).append(time.perf_counter() - t0)
    print(f"| kvchat-mini, median ms | 1 row step | 8 rows step | prefill {args.prompt} tokens |"
          "\n|---|---:|---:|---:|")
    for power, name in ((False, "MLX exp"), (True, "mx.power")):
        print(f"| {name} | " + " | ".join(
            f"{statistics.median(times[power, n]) * 1e3:.2f}" for n in (1, 8, 0)) + " |")
    print("| mx.power ÷ MLX exp, median of the rounds' ratios (range) | " + " | ".join(
        _ratio(times[True, n], times[False, n]) for n in (1, 8, 0)) + " |")
    print(f"(load average {os.getloadavg()[0]:.1f} after)")
    return 0


def _ratio(a: list[float], b: list[float]) -> str:
    r = [x / y for x, y in zip(a, b, strict=True)]
    return f"{statistics.median(r):.2f} ({min(r):.2f}–{max(r):.2f})"


if __name__ == "__main__":
    raise SystemExit(main())
