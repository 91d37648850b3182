"""Benchmark continuous batching: `kvchat serve` against `mlx_lm.server` on the same model,
1, 4 and 8 concurrent streaming clients, in one run.

    python -m tests.benchmarks.serve_concurrency [--clients 1 4 8] [--model DIR|135m]
        [--requests 2] [--max-tokens 64] [--mlx-lm-max-tokens 32] [--runs 3]
        [--temperature T] [--json]

`--model 135m`: a random float32 model of SmolLM-135M's shape (threads.SMOL_135M), written
to a temporary folder both servers load (its weights, a word-level tokenizer over its
vocabulary and a plain chat template): a model whose step is mostly arithmetic, where a
batch shares the weights' reads; kvchat-mini's is mostly per-operation and per-token work.

Both servers start first and stay up; each level runs on kvchat, then on mlx-lm, so the
two see the same load as it drifts. Every client sends --requests requests one after
another, each with its own prompt (fresh per level and server: nothing is served from an
earlier level's cache), streaming. kvchat generates exactly --max-tokens (ignore_eos);
mlx-lm knows no ignore_eos, so its replies may end early and its tok/s counts what it
generated. Printed per level: aggregate tok/s (every client's tokens ÷ the level's wall
time), per-client tok/s (mean of each client's tokens ÷ its own wall time), median time
to first token, and the ratio to the same server's one-client level; with the machine,
its load before and after, the share of CPU time the host took (a virtual machine's
steal, Linux only), and the date. With --runs N every level runs N times (all
levels in turn, N rounds) and each figure is the median of its N, the aggregate's range
beside it: a level lasts about a second on a small model, so one run is at the mercy of
whatever else the machine does in that second. The goal (docs/serve.md, Many clients):
aggregate tok/s at 8 clients ≥ 3 × one client's, and ≥ mlx_lm.server's.

Every process runs on the BLAS `kvchat` itself uses (mlx-lm's server gets it as
LD_PRELOAD), as in tests/benchmarks/serve.py.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kvchat.app.core import blas
from kvchat.app.core.discovery import DEFAULT_MODEL
from tests.benchmarks.serve import stream
from tests.benchmarks.threads import SMOL_135M
from tests.helpers.checkpoints import write_tokenizer
from tests.helpers.server_process import ServerProcess

SUBJECTS = ("a dragon", "the sea", "a lost cat", "a red kite", "the moon", "a tall tree",
            "a small boat", "the rain", "a baker", "a clock", "a garden", "a train")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_times() -> tuple[int, int] | None:
    """(stolen, total) CPU ticks so far (Linux's /proc/stat; None elsewhere): on a virtual
    machine the host may take the CPU from it at any moment, which no load average shows."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (fields[7] if len(fields) > 7 else 0), sum(fields)


def steal_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of CPU time the host took between two `cpu_times()`."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def smol_folder(folder: Path) -> Path:
    """`--model 135m`'s folder: SmolLM-135M's shape, random float32 weights (seed 0)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from kvchat.model.decoder.config import ModelConfig
    from kvchat.model.decoder.transformer import Transformer

    mx.random.seed(0)
    model = Transformer(ModelConfig.from_dict(SMOL_135M))
    mx.save_safetensors(str(folder / "model.safetensors"),
                        dict(tree_flatten(model.parameters())), metadata={"format": "mlx"})
    config = {**SMOL_135M, "architectures": ["LlamaForCausalLM"], "torch_dtype": "float32",
              "bos_token_id": 1, "eos_token_id": 2}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(folder, SMOL_135M["vocab_size"])
    tok_config = folder / "tokenizer_config.json"
    tok_config.write_text(json.dumps({**json.loads(tok_config.read_text()),
                                      "chat_template": CHAT_TEMPLATE}))
    return folder


def level(server: ServerProcess, clients: int, requests: int, max_tokens: int,
          tag: str, temperature: float | None = None) -> dict[str, Any]:
    """`clients` threads, each streaming `requests` requests in turn."""
    per_client: list[tuple[int, float]] = []
    ttfts: list[float] = []
    lock = threading.Lock()
    start = threading.Barrier(clients)
    errors: list[BaseException] = []

    def client(c: int) -> None:
        start.wait()
        t0, tokens = time.perf_counter(), 0
        try:
            for r in range(requests):
                i = c * requests + r
                msgs = [{"role": "user", "content":
                         f"({tag}) Story {i}: about {SUBJECTS[i % len(SUBJECTS)]}."}]
                n, ttft = stream(server, msgs, max_tokens, temperature)
                tokens += n
                with lock:
                    ttfts.append(ttft)
        except BaseException as e:
            errors.append(e)
        with lock:
            per_client.append((tokens, time.perf_counter() - t0))

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise SystemExit(f"{server.name}: {errors[0]}")
    total = sum(n for n, _ in per_client)
    return {"server": server.name, "clients": clients, "tokens": total,
            "wall_s": round(wall, 3), "aggregate_tps": round(total / wall, 1),
            "per_client_tps": round(statistics.mean(n / s for n, s in per_client), 1),
            "ttft_median_s": round(statistics.median(ttfts), 3),
            "ttft_max_s": round(max(ttfts), 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.benchmarks.serve_concurrency",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL), metavar="DIR",
                   help="a model folder, or 135m (see above)")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--requests", type=int, default=2, help="requests per client")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--mlx-lm-max-tokens", type=int, default=None,
                   help="max_tokens for mlx-lm (default: --max-tokens)")
    p.add_argument("--runs", type=int, default=3, help="rounds of every level (medians)")
    p.add_argument("--temperature", type=float, default=None,
                   help="every request's temperature (default: the servers' own, greedy)")
    p.add_argument("--no-mlx-lm", action="store_true", help="kvchat serve only")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if args.model == "135m":
        with tempfile.TemporaryDirectory(prefix="kvchat-135m-") as tmp:
            return run(args, argv, str(smol_folder(Path(tmp))), "135m (random, float32)")
    return run(args, argv, args.model, args.model)


def run(args: argparse.Namespace, argv: list[str] | None, path: str, name: str) -> int:
    b = blas.active_blas()
    preload = {"LD_PRELOAD": b["path"]} if b["fast"] and b["path"] else {}
    if preload and b.get("core_chosen"):
        preload["OPENBLAS_CORETYPE"] = b["core_chosen"]
    meta: dict[str, Any] = {
        "command": "python -m tests.benchmarks.serve_concurrency " + " ".join(
            argv if argv is not None else sys.argv[1:]),
        "model": name, "cpu": cpu_name(), "cores": os.cpu_count(),
        "date": datetime.datetime.now().isoformat(timespec="minutes"),
        "loadavg_before": os.getloadavg(), "blas": blas.describe(),
        "cpu_times_before": cpu_times(),
        "requests_per_client": args.requests, "max_tokens": args.max_tokens,
        "runs": args.runs, "temperature": args.temperature}
    servers = [ServerProcess(path, "--max-queue", "64", "--max-batch",
                             str(max(args.clients)))]
    if not args.no_mlx_lm:
        servers.append(ServerProcess(path, mlx_lm=True, env=preload))
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    try:
        for s in servers:  # warm-up: traces, first allocations
            stream(s, [{"role": "user", "content": "Hello."}], 8)
        for r in range(args.runs):
            for c in args.clients:
                for s in servers:
                    mt = args.max_tokens if s.name == "serve" else (
                        args.mlx_lm_max_tokens or args.max_tokens)
                    got = level(s, c, args.requests, mt, f"{s.name} {c} {r}",
                                args.temperature)
                    runs.setdefault((s.name, c), []).append(got)
                    print(f"  {got}", file=sys.stderr, flush=True)
    finally:
        for s in servers:
            s.stop()
    rows = [median_row(v) for v in runs.values()]
    meta["loadavg_after"] = os.getloadavg()
    meta["steal"] = steal_share(meta.pop("cpu_times_before"), cpu_times())
    one = {r["server"]: r["aggregate_tps"] for r in rows if r["clients"] == min(args.clients)}
    for r in rows:
        r["vs_one_client"] = round(r["aggregate_tps"] / (one.get(r["server"]) or 1.0), 2)
    if args.json:
        print(json.dumps({**meta, "levels": rows}))
        return 0
    print(f"{meta['date']} · {meta['cpu']}, {meta['cores']} cores · load average"
          f" {meta['loadavg_before'][0]:.1f} before, {meta['loadavg_after'][0]:.1f} after"
          + (f" · CPU stolen by the host {meta['steal']:.0%}" if meta["steal"] is not None
             else "") + f" · {meta['blas']}")
    print(f"{meta['command']} · model {name} · {args.requests} requests per client")
    print(f"each figure the median of {args.runs} run(s); the aggregate's range beside it")
    print("| server | clients | aggregate tok/s | range | × 1 client | per-client tok/s |"
          " TTFT median s | TTFT max s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        name = "kvchat serve" if r["server"] == "serve" else "mlx_lm.server"
        lo, hi = r["aggregate_range"]
        print(f"| {name} | {r['clients']} | {r['aggregate_tps']} | {lo}–{hi} |"
              f" {r['vs_one_client']} | {r['per_client_tps']} | {r['ttft_median_s']} |"
              f" {r['ttft_max_s']} |")
    return 0


def median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One level's runs as one row: each figure's median, and the aggregate's range."""
    out = dict(runs[0])
    for k in ("tokens", "wall_s", "aggregate_tps", "per_client_tps", "ttft_median_s",
              "ttft_max_s"):
        out[k] = round(statistics.median(r[k] for r in runs), 3)
    agg = [r["aggregate_tps"] for r in runs]
    out["aggregate_range"] = (min(agg), max(agg))
    return out


if __name__ == "__main__":
    raise SystemExit(main())
