"""The batched decode step alone: ms per step and tok/s at 1, 2, 4 and 8 rows, in one
process, no server (model/runtime/batch.py's `Batch.step`, greedy, the rows' samplers in
the step as the engine runs them).

    python -m tests.benchmarks.batch_step [--models mini 135m] [--rows 1 2 4 8]
        [--steps 30] [--rounds 5]

Each row holds its own prompt (20 + 3·i tokens, so lengths differ) in its own cache, as a
server's requests do. Every width runs twice: its rows' K/V in shared buffers (`shared`:
model/runtime/slab.py, what a server does with float caches) and each row's in its own
cache (`own`: rows_step.py, what quantized or recurrent caches get).

Each round times --steps steps at every width in turn; the best round
is printed (the machine's load moves every width alike), with the ratio of tok/s to one
row's: what batching can give before any per-token host work (serve_concurrency.py
measures the server). Models as in threads.py: `mini` the shipped kvchat-mini
(dequantized to float32), `135m` a random float32 model of SmolLM-135M's shape.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time
from typing import Any

from kvchat.app.core import blas
from tests.benchmarks.serve_concurrency import cpu_name
from tests.benchmarks.threads import STORIES, bench_model


def rows_of(model: Any, n: int, prompt: int = 20) -> list[Any]:
    import mlx.core as mx

    from kvchat.model.cache.kv import make_prompt_cache
    from kvchat.model.runtime.batch import BatchRow
    from kvchat.model.runtime.generate import Progress, prefill
    from kvchat.model.runtime.sampling import Argmax

    out = []
    for i in range(n):
        caches = make_prompt_cache(model)
        ids = [1 + t % (model.config.vocab_size - 1) for t in range(prompt + 3 * i)]
        for _ in prefill(model, ids, caches, progress=Progress()):
            pass
        mx.eval([c.state for c in caches])
        out.append(BatchRow(caches, True, Argmax(model.config.vocab_size)))
    return out


def step(batch: Any, rows: list[Any]) -> None:
    for r in rows:
        batch.park(r, 5)
    batch.step()


def done(rows: list[Any]) -> None:
    """Wait for the queued steps (Batch.step does not)."""
    import mlx.core as mx

    mx.eval([r.logits for r in rows])


def per_step(batch: Any, rows: list[Any], steps: int) -> float:
    """Seconds per step over `steps` steps of `rows`, the queued ones waited for."""
    t0 = time.perf_counter()
    for _ in range(steps):
        step(batch, rows)
    done(rows)
    return (time.perf_counter() - t0) / steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.benchmarks.batch_step",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=["mini", "135m"], default=["mini"])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    from kvchat.model.runtime.batch import Batch

    print(f"{datetime.datetime.now().isoformat(timespec='minutes')} · {cpu_name()},"
          f" {os.cpu_count()} cores · load average {os.getloadavg()[0]:.1f} · {blas.describe()}")
    for name in args.models:
        model = bench_model(name, STORIES)
        kinds = [(b, shared) for b in args.rows for shared in (True, False)
                 if shared or b > 1]  # one row steps alone either way
        batches = {k: (Batch(model, shared=k[1]), rows_of(model, k[0])) for k in kinds}

        for k in kinds:  # traces and first allocations
            for _ in range(3):
                step(*batches[k])
            done(batches[k][1])
        best = dict.fromkeys(kinds, float("inf"))
        for _ in range(args.rounds):
            for k in kinds:
                best[k] = min(best[k], per_step(*batches[k], args.steps))
        one = min(args.rows)
        print(f"{name}: rows | K/V | ms/step | tok/s | × {one} row(s)")
        for b, shared in kinds:
            t = best[b, shared]
            kv = "alone" if b == 1 else "shared" if shared else "own"
            print(f"  {b} | {kv} | {t * 1e3:.2f} | {b / t:.0f} |"
                  f" {b / t / (one / best[one, True]):.2f}")
        print(f"  (load average {os.getloadavg()[0]:.1f} after)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
