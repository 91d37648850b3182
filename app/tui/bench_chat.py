"""Does the chat UI slow decoding? The real app (headless, Textual's Pilot) against the
same engine without a UI (`kvchat generate`'s EngineClient), interleaved.

    python -m kvchat.app.tui.bench_chat [--model DIR] [--tokens 1600] [--runs 2] [--json]

Both sides get the same conversation and GenParams (greedy, EOS ignored so the reply
has exactly --tokens tokens). Reported per run: decode tok/s as the engine measured it,
and the rate over each quarter of the reply (flat means render work does not grow with
the reply's length).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import time
from typing import Any

from kvchat.app.core.discovery import DEFAULT_MODEL
from kvchat.model.events import Done, Event, GenParams, TextDelta

PROMPT = "Once upon a time"


def _quarters(stamps: list[float]) -> list[float]:
    """tok/s over each quarter of the reply, from per-token arrival times."""
    n = len(stamps)
    out = []
    for q in range(4):
        a, b = q * n // 4, (q + 1) * n // 4 - 1
        if b > a and stamps[b] > stamps[a]:
            out.append((b - a) / (stamps[b] - stamps[a]))
    return out


def _params(tokens: int) -> GenParams:
    return GenParams(max_tokens=tokens, temp=0.0, ignore_eos=True)


def run_generate(model: str, tokens: int) -> dict[str, Any]:
    from kvchat.model.client import EngineClient

    stamps: list[float] = []
    with EngineClient(model, on_delta=lambda _t: stamps.append(time.perf_counter())) as runner:
        done = runner.run([{"role": "user", "content": PROMPT}], _params(tokens))
    return {"decode_tps": done.stats.decode_tps, "tokens": len(done.ids),
            "quarters": _quarters(stamps)}


def run_chat(model: str, tokens: int, size: tuple[int, int] = (120, 40),
             in_process: bool = False) -> dict[str, Any]:
    from kvchat.app.core.settings import Settings
    from kvchat.app.tui.app import KVChatApp
    from kvchat.model.engine import Engine
    from kvchat.model.engine_process import EngineProcess

    stamps: list[float] = []
    finished: list[Done] = []

    def factory(on_event: Any, path: str | None) -> Engine | EngineProcess:
        def spy(ev: Event) -> None:
            if isinstance(ev, TextDelta):
                stamps.append(time.perf_counter())
            elif isinstance(ev, Done):
                finished.append(ev)
            on_event(ev)

        engine = (Engine if in_process else EngineProcess)(spy, path)
        submit = engine.submit
        engine.submit = lambda prompt, params=None: submit(  # type: ignore[method-assign]
            prompt, dataclasses.replace(params or GenParams(), **dataclasses.asdict(
                _params(tokens)) | {"stop": ()}))
        return engine

    async def drive() -> Done:
        app = KVChatApp(model, Settings(), engine_factory=factory)
        async with app.run_test(size=size) as pilot:
            while not app.chat.model_info:
                await pilot.pause(0.05)
            await app.chat.send(PROMPT)
            while not finished:
                await pilot.pause(0.05)
            return finished[-1]

    done = asyncio.run(drive())
    return {"decode_tps": done.stats.decode_tps, "tokens": len(done.ids),
            "quarters": _quarters(stamps)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvchat.app.tui.bench_chat", description=__doc__)
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--tokens", type=int, default=1600)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--in-process", action="store_true",
                   help="the engine thread in the UI's process (as before the split)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    run_generate(a.model, 16)  # warm-up (page cache, imports)
    rows: dict[str, list[dict[str, Any]]] = {"generate": [], "chat": []}
    for _ in range(a.runs):  # interleaved: generate, chat, generate, chat, …
        rows["generate"].append(run_generate(a.model, a.tokens))
        rows["chat"].append(run_chat(a.model, a.tokens, in_process=a.in_process))
    ratios = [c["decode_tps"] / g["decode_tps"]
              for g, c in zip(rows["generate"], rows["chat"], strict=True)]
    result = {"model": a.model, "tokens": a.tokens, **rows, "ratio_runs": ratios,
              "ratio_median": statistics.median(ratios)}
    if a.json:
        print(json.dumps(result))
        return 0
    for side in ("generate", "chat"):
        for r in rows[side]:
            qs = " ".join(f"{q:.0f}" for q in r["quarters"])
            print(f"{side:9} {r['tokens']} tokens  decode {r['decode_tps']:.1f} tok/s"
                  f"  by quarter: {qs}")
    print("chat / generate per pair: " + ", ".join(f"{x:.2f}" for x in ratios)
          + f"  (median {result['ratio_median']:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
