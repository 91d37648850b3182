"""Time the kernel entry points per backend: `python -m tests.benchmarks.kernels [--json]`.

Shapes: decode (1 row) and prefill (512 rows) of a hidden size (default 4096, a 7-8B
model's), and RoPE on Q/K with 32 query and 8 KV heads of 128 at 1 and 512 positions.
Backends: `metal` (where Metal exists), `fast`, `ops`, and, when the repository's tests
are importable and a C++ compiler exists, `emulated` (the CPU Metal emulator running the
same .metal sources; its cost is per call, not a speed anyone would run at). Rounds are
interleaved across backends so a slow spell of a shared machine hits them all alike;
the median of the rounds is reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from kvchat import metal_kernels

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def _emulated_backend() -> str | None:
    """Register the emulator as a backend when the tests package is importable."""
    try:
        from tests import metal_emulator  # only in a source checkout, with PYTHONPATH=.
    except ImportError:
        return None
    if not metal_emulator.available():
        return None
    from .metal import MetalBackend

    backend = MetalBackend(metal_emulator.metal_kernel, "emulated")
    metal_kernels.register_backend("emulated", backend)
    return "emulated"


def _cases(hidden: int, rows: int, dtype: mx.Dtype) -> dict[str, Callable[[], Any]]:
    x = mx.random.normal((rows, hidden)).astype(dtype)
    r = mx.random.normal((rows, hidden)).astype(dtype)
    w = mx.ones((hidden,), dtype=dtype)
    q = mx.random.normal((1, rows, 32, 128)).astype(dtype).transpose(0, 2, 1, 3)
    k = mx.random.normal((1, rows, 8, 128)).astype(dtype).transpose(0, 2, 1, 3)
    mx.eval(x, r, w, q, k)
    rope_kw = dict(traditional=False, base=500000.0, scale=1.0, offset=1000)
    return {
        "rms_norm": lambda: metal_kernels.rms_norm(x, w, 1e-5),
        "add_rms_norm": lambda: metal_kernels.add_rms_norm(x, r, w, 1e-5),
        "rope_qk": lambda: metal_kernels.rope_qk(q, k, 128, **rope_kw),
    }


def _time(backend: str, fn: Callable[[], Any]) -> float:
    with metal_kernels.using(backend):
        t0 = time.perf_counter()
        mx.eval(fn())
        return time.perf_counter() - t0


def run(hidden: int, dtype: mx.Dtype, rounds: int, emulator_rounds: int,
        shapes: dict[str, int]) -> list[dict[str, Any]]:
    backends = metal_kernels.available_backends()
    emulated = _emulated_backend() if emulator_rounds > 0 else None
    if emulated and emulated not in backends:
        backends.append(emulated)
    results = []
    for shape, rows in shapes.items():
        for kernel, fn in _cases(hidden, rows, dtype).items():
            times: dict[str, list[float]] = {b: [] for b in backends}
            for b in backends:
                _time(b, fn)  # warm-up: kernel builds, compiles, allocations
            for i in range(rounds):
                for b in backends:
                    if b == emulated and i >= emulator_rounds:
                        continue
                    times[b].append(_time(b, fn))
            for b in backends:
                results.append({
                    "kernel": kernel, "shape": shape, "rows": rows, "hidden": hidden,
                    "dtype": str(dtype).removeprefix("mlx.core."), "backend": b,
                    "median_us": round(statistics.median(times[b]) * 1e6, 1),
                    "rounds": len(times[b]), "device": str(mx.default_device()),
                })
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.benchmarks.kernels", description=__doc__)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="default: float16 on a GPU, float32 on the CPU")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--emulator-rounds", type=int, default=3, help="0: leave the emulator out")
    p.add_argument("--prefill-rows", type=int, default=512)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    dtype = DTYPES[args.dtype] if args.dtype else (
        mx.float16 if mx.metal.is_available() else mx.float32)
    res = run(args.hidden, dtype, args.rounds, args.emulator_rounds,
              {"decode": 1, "prefill": args.prefill_rows})
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    print(f"device {res[0]['device']}, dtype {res[0]['dtype']}, hidden {args.hidden}; "
          "median microseconds per call (RoPE: Q 32x128 + K 8x128 heads)")
    print(f"{'kernel':<14}{'shape':<9}{'rows':>5}  {'backend':<10}{'us':>12}{'rounds':>8}")
    for r in res:
        print(f"{r['kernel']:<14}{r['shape']:<9}{r['rows']:>5}  {r['backend']:<10}"
              f"{r['median_us']:>12.1f}{r['rounds']:>8}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
