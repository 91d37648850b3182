"""OpenBLAS's kernel sets under MLX: GFLOP/s of an N×N float32 matmul on one thread with
each set this CPU runs, its generic set (Prescott: what an OpenBLAS older than the CPU
falls back to), the set kvchat ends up with, and MLX's reference BLAS.

    python -m tests.benchmarks.blas_kernels [--size 1024] [--runs 3] [--reps 5] [--json]

Each column is a fresh process (OpenBLAS picks its kernels once, as it loads) that loads
the BLAS as `kvchat` does (tests/benchmarks/__init__.py): `kvchat` with nothing set,
a named set with OPENBLAS_CORETYPE (the user's choice, which kvchat keeps), `reference`
with KVCHAT_NO_OPENBLAS=1. Each round runs every column once, in turn, so a machine that
gets busier or quieter moves all alike; the median of --runs rounds is printed, each
column's value the best of --reps products. The CPU, the load average and the date are
printed with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_CHILD = """
import json, sys, time
import tests.benchmarks  # loads the BLAS as kvchat does, before MLX
import mlx.core as mx
from kvchat.app.core import blas
from kvchat.model.runtime import threads
threads.configure(1)
threads.set_threads(1)  # OpenBLAS's own count (none under the reference BLAS)
n, reps = int(sys.argv[1]), int(sys.argv[2])
a, b = mx.random.normal((n, n)), mx.random.normal((n, n))
mx.eval(a, b, a @ b)  # warm-up
best = float("inf")
for _ in range(reps):
    t = time.perf_counter()
    mx.eval(a @ b)
    best = min(best, time.perf_counter() - t)
print(json.dumps({"gflops": 2 * n**3 / best / 1e9, "core": blas.active_blas()["core"],
                  "name": blas.active_blas()["name"]}))
"""


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return "CPU not recorded"


def columns() -> dict[str, dict[str, str]]:
    """Column name -> environment changes for its process."""
    from kvchat.app.core import linux_blas  # Linux's layer (main checks the platform)

    sets = list(linux_blas.fitting_cores(linux_blas.cpu_flags())) + ["Prescott"]
    cols = {"kvchat": {}}
    cols |= {s: {linux_blas.CORETYPE_ENV: s} for s in sets}
    cols["reference"] = {linux_blas.OFF_ENV: "1"}
    return cols


def run(extra: dict[str, str], size: int, reps: int) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", "OPENBLAS_CORETYPE", "KVCHAT_NO_OPENBLAS")}
    out = subprocess.run([sys.executable, "-c", _CHILD, str(size), str(reps)], cwd=REPO,
                         env={**env, **extra}, capture_output=True, text=True, timeout=600,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.benchmarks.blas_kernels",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--runs", type=int, default=3, help="rounds (each runs every column)")
    p.add_argument("--reps", type=int, default=5, help="products per column per round")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if sys.platform != "linux":
        print("OpenBLAS's kernel sets are Linux's (macOS: Accelerate)", file=sys.stderr)
        return 1
    cols = columns()
    load_before = os.getloadavg()
    seen: dict[str, list[dict]] = {c: [] for c in cols}
    for _ in range(args.runs):
        for name, extra in cols.items():
            seen[name].append(run(extra, args.size, args.reps))
    load_after = os.getloadavg()
    rows = {name: {"gflops": statistics.median(r["gflops"] for r in rs),
                   "core": rs[-1]["core"], "blas": rs[-1]["name"]} for name, rs in seen.items()}
    head = {"cpu": cpu_model(), "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
            "load_before": load_before, "load_after": load_after, "size": args.size}
    if args.json:
        print(json.dumps({**head, "columns": rows}))
        return 0
    print(f"{head['cpu']}, {head['cores']} cores, {head['date']}, load average"
          f" {load_before[0]:.2f} -> {load_after[0]:.2f}")
    print(f"{args.size}x{args.size} float32 matmul, 1 thread, median of {args.runs} rounds"
          f" (best of {args.reps} each)")
    for name, r in rows.items():
        runs = f"{r['blas']}, {r['core']} kernels" if r["core"] else r["blas"]
        print(f"  {name:<12} {r['gflops']:7.1f} GFLOP/s  ({runs})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
