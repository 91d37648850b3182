"""exp on MLX's CPU: MLX's own against 2^(x·log2 e) through `mx.power`
(model/decoder/fast_exp.py), per element and in kvchat-mini's decode step, in one process.

    python -m tests.benchmarks.fast_exp [--rounds 3] [--steps 30] [--warm 100]
        [--prompt 512]

Per element: ns for exp, sigmoid and softmax over a (8, 8, 1, 3000) array, MLX's op
against fast_exp's with `mx.power`. In the step: ms per batched decode step
(model/runtime/batch.py, shared K/V) at 1 and 8 rows after --warm steps (the rows' K/V
then hold 120-160 slots), and ms to prefill one --prompt-token prompt (one chunk),
fast_exp with `mx.power` and with MLX's ops, in alternating rounds (each figure is the
best of its rounds). Where MLX vectorizes exp (an ARM CPU) or
runs on a GPU, fast_exp uses MLX's ops anyway; this measures what it would change.
"""

from __future__ import annotations

import argparse
import datetime
import os
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
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warm", type=int, default=100)
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens to prefill")
    args = p.parse_args(argv)
    import mlx.core as mx

    from kvchat.model.decoder import fast_exp
    from kvchat.model.runtime.batch import Batch
    from tests.benchmarks.batch_step import per_step, rows_of
    from tests.benchmarks.threads import STORIES, bench_model

    print(f"{datetime.datetime.now().isoformat(timespec='minutes')} · {cpu_name()},"
          f" {os.cpu_count()} cores · load average {os.getloadavg()[0]:.1f} · {blas.describe()}")
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
    best: dict[tuple[bool, int], float] = {}
    for _ in range(args.rounds):
        for power in (False, True):
            fast_exp._X86 = power
            model.__dict__.pop("_kvchat_slab_traces", None)  # traced again with this exp
            for n in (1, 8):
                batch, rows = Batch(model), rows_of(model, n)
                per_step(batch, rows, args.warm)
                t = per_step(batch, rows, args.steps)
                best[power, n] = min(best.get((power, n), t), t)
            fast_exp._X86 = power
            t0 = time.perf_counter()
            rows_of(model, 1, args.prompt)  # one prompt, prefilled and evaluated
            t = time.perf_counter() - t0
            best[power, 0] = min(best.get((power, 0), t), t)
    print(f"| kvchat-mini | 1 row step ms | 8 rows step ms | 8 rows' tok/s ÷ 1 row's |"
          f" prefill {args.prompt} tokens ms |\n|---|---:|---:|---:|---:|")
    for power, name in ((False, "MLX exp"), (True, "mx.power")):
        cells = (best[power, 1] * 1e3, best[power, 8] * 1e3,
                 8 * best[power, 1] / best[power, 8], best[power, 0] * 1e3)
        print(f"| {name} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    print(f"(load average {os.getloadavg()[0]:.1f} after)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
