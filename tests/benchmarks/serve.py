"""Benchmark `kvchat serve`: requests/s and tok/s for 1, 2 and 4 concurrent clients,
against the same engine driven directly (what `kvchat generate` runs), in one run.

    python -m tests.benchmarks.serve [--model DIR] [--requests 8] [--max-tokens 64]
                                     [--clients 1,2,4] [--against mlx-lm] [--json]

Every request has its own prompt and generates exactly --max-tokens tokens (ignore_eos),
so each level does the same work; the reference runs the same requests one after another
on an in-process engine. The machine's load average is printed with the numbers: on a
shared machine they are only comparable within one run. Standard library HTTP only.

Every process runs on the BLAS `kvchat` itself would use: kvchat's server and engine
process load it themselves, mlx-lm's server gets it as LD_PRELOAD. Run it as
`KVCHAT_NO_OPENBLAS=1 python -m tests.benchmarks.serve` for MLX's own BLAS everywhere.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kvchat.app.core import blas
from kvchat.app.core.discovery import DEFAULT_MODEL
from tests.helpers.server_process import ServerProcess

SUBJECTS = ("a dragon", "the sea", "a lost cat", "a red kite", "the moon", "a tall tree",
            "a small boat", "the rain", "a baker", "a clock", "a garden", "a train")


def prompts(n: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"Story {i}: about {SUBJECTS[i % len(SUBJECTS)]}."}]
            for i in range(n)]


def tree_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) of `pid` and its children, from /proc (None elsewhere):
    what a request costs, whatever else the machine is doing."""
    tick = os.sysconf("SC_CLK_TCK")
    total, found = 0.0, False
    try:
        names = os.listdir("/proc")
    except OSError:
        return None
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(name) == pid or int(fields[1]) == pid:  # fields[1]: the parent's pid
            total += (int(fields[11]) + int(fields[12])) / tick
            found = True
    return total if found else None


@dataclass
class Level:
    name: str
    clients: int
    requests: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    cpu_s: float | None = None  # CPU the engine (and server) spent on this level

    def row(self) -> dict[str, Any]:
        lat = sorted(self.latencies)
        return {
            "mode": self.name, "clients": self.clients, "requests": self.requests,
            "tokens": self.tokens, "wall_s": round(self.wall_s, 3),
            "requests_per_s": round(self.requests / self.wall_s, 3) if self.wall_s else 0.0,
            "tok_per_s": round(self.tokens / self.wall_s, 1) if self.wall_s else 0.0,
            "latency_p50_s": round(lat[len(lat) // 2], 3) if lat else None,
            "ttft_mean_s": round(sum(self.ttfts) / len(self.ttfts), 3) if self.ttfts else None,
            "cpu_ms_per_token": round(1000 * self.cpu_s / self.tokens, 2)
            if self.cpu_s is not None and self.tokens else None,
        }


def bench_engine(model: str, requests: list[Any], max_tokens: int) -> Level:
    """The same turns on the engine directly, one after another: in its own process, as
    the server runs it (and with the same BLAS), without the HTTP layer."""
    from kvchat.app.core.engine_service import EngineService
    from kvchat.model.runtime.events import GenParams

    params = GenParams(max_tokens=max_tokens, ignore_eos=True)
    level = Level("generate (engine)", 1)
    with EngineService("process").client(model) as engine:
        engine.run(requests[0], params)  # warm-up: compile the step, as the server's is
        child = engine.engine._proc.pid  # type: ignore[attr-defined]
        t0, cpu0 = time.perf_counter(), tree_cpu_s(child)
        for msgs in requests:
            t = time.perf_counter()
            done = engine.run(msgs, params)
            level.latencies.append(time.perf_counter() - t)
            level.ttfts.append(done.stats.ttft_s or 0.0)
            level.tokens += len(done.ids)
            level.requests += 1
        level.wall_s = time.perf_counter() - t0
        cpu1 = tree_cpu_s(child)
        level.cpu_s = None if cpu0 is None or cpu1 is None else cpu1 - cpu0
    return level


def stream(server: ServerProcess, messages: Any, max_tokens: int,
           temperature: float | None = None) -> tuple[int, float]:
    """One streamed chat completion: (completion tokens, seconds to the first text);
    `temperature` None: the server's default."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=600)
    body = json.dumps({"messages": messages, "max_tokens": max_tokens, "ignore_eos": True,
                       "stream": True, "stream_options": {"include_usage": True},
                       **({"temperature": temperature} if temperature is not None else {})})
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body,
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise SystemExit(f"HTTP {resp.status}: {resp.read()[:200]!r}")
    ttft, tokens = None, 0
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        obj = json.loads(line[6:])
        if ttft is None and obj.get("choices") and obj["choices"][0]["delta"].get("content"):
            ttft = time.perf_counter() - t0
        if obj.get("usage"):  # the last chunk (mlx-lm may put it on the finish chunk)
            tokens = obj["usage"]["completion_tokens"]
    conn.close()
    return tokens, ttft or 0.0


def bench_server(server: ServerProcess, requests: list[Any], max_tokens: int,
                 clients: int) -> Level:
    level = Level(server.name, clients)
    todo = list(requests)
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                if not todo:
                    return
                msgs = todo.pop(0)
            t = time.perf_counter()
            tokens, ttft = stream(server, msgs, max_tokens)
            with lock:
                level.latencies.append(time.perf_counter() - t)
                level.ttfts.append(ttft)
                level.tokens += tokens
                level.requests += 1

    threads = [threading.Thread(target=client) for _ in range(clients)]
    cpu0 = tree_cpu_s(server.proc.pid)
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    level.wall_s = time.perf_counter() - t0
    cpu1 = tree_cpu_s(server.proc.pid)
    level.cpu_s = None if cpu0 is None or cpu1 is None else cpu1 - cpu0
    return level


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.benchmarks.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL), metavar="DIR")
    p.add_argument("--requests", type=int, default=8, help="requests per level")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--clients", default="1,2,4", help="concurrency levels (comma-separated)")
    p.add_argument("--against", choices=["mlx-lm"], default=None,
                   help="run the same levels against mlx-lm's server too (it knows no"
                   " ignore_eos: its replies may end early; tok/s counts what it generated)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    b = blas.active_blas()  # this process's, loaded as `kvchat` loads it
    # mlx-lm's server on the same library and kernels (the set kvchat chose, if it did)
    preload = {"LD_PRELOAD": b["path"]} if b["fast"] and b["path"] else {}
    if preload and b.get("core_chosen"):
        preload["OPENBLAS_CORETYPE"] = b["core_chosen"]
    levels = [int(x) for x in args.clients.split(",")]
    load_before = os.getloadavg()
    reqs = prompts(args.requests)
    rows = [bench_engine(args.model, reqs, args.max_tokens).row()]
    for mlx_lm in (False, True) if args.against else (False,):
        extra = () if mlx_lm else ("--max-queue", "64")
        server = ServerProcess(args.model, *extra, mlx_lm=mlx_lm,
                               env=preload if mlx_lm else None)
        try:
            stream(server, reqs[0], args.max_tokens)  # warm-up
            for c in levels:
                # fresh prompts per level: nothing served from an earlier level's cache
                level_reqs = [[{"role": "user", "content": f"(level {c}) {m[0]['content']}"}]
                              for m in reqs]
                rows.append(bench_server(server, level_reqs, args.max_tokens, c).row())
        finally:
            server.stop()
    ref = rows[0]["tok_per_s"] or 1.0
    for r in rows:
        r["vs_generate"] = round(r["tok_per_s"] / ref, 3)
    meta = {"model": args.model, "cpus": os.cpu_count(), "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(), "max_tokens": args.max_tokens,
            "blas": blas.describe()}
    if args.json:
        print(json.dumps({**meta, "levels": rows}))
        return 0
    print(f"model {args.model}; {args.requests} requests x {args.max_tokens} tokens per level;"
          f" {meta['cpus']} CPUs, load average {load_before[0]:.1f} before,"
          f" {meta['loadavg_after'][0]:.1f} after; "
          f"BLAS {meta['blas']}")
    cols = ("mode", "clients", "requests", "wall_s", "requests_per_s", "tok_per_s",
            "vs_generate", "latency_p50_s", "ttft_mean_s", "cpu_ms_per_token")
    print("  ".join(f"{c:>17}" if i == 0 else f"{c:>8}" for i, c in enumerate(
        ("mode", "clients", "reqs", "wall_s", "req/s", "tok/s", "vs_gen", "p50_s", "ttft_s",
         "cpu_ms/tok"))))
    for r in rows:
        print("  ".join(f"{r[c]!s:>17}" if i == 0 else f"{r[c]!s:>8}"
                        for i, c in enumerate(cols)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
