"""Does the attention view cost decode speed? The engine's decode tok/s with the view
closed and open, against mlx-lm's on the same model in the same run (interleaved).

    python -m tests.benchmarks.attention [--model DIR] [--tokens 256] [--runs 3] [--json]

With the view closed the decode loop only checks one attribute per token, so "closed"
must match what the engine did before the view existed: compare its ratio to mlx-lm with
the same script run on an older checkout (an engine without `watch_attention` reports
only "closed"). "open" recomputes the newest token's attention a few times a second.
Each turn starts from an empty cache (greedy, EOS ignored: exactly --tokens tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
from typing import Any

from kvchat.app.core.discovery import DEFAULT_MODEL
from kvchat.model.runtime.events import Done, Event, GenParams, Loaded, LoadFailed

PROMPT = "Once upon a time"


class _Turns:
    """An in-process Engine driven one turn at a time."""

    def __init__(self, model: str):
        from kvchat.model.runtime.engine import Engine

        self._done = threading.Event()
        self._last: Event | None = None
        self.engine = Engine(self._on_event, model)
        self._wait()
        if isinstance(self._last, LoadFailed):
            raise SystemExit(f"kvchat: error: {self._last.message}")

    def _on_event(self, ev: Event) -> None:
        if isinstance(ev, (Done, Loaded, LoadFailed)):
            self._last = ev
            self._done.set()

    def _wait(self) -> None:
        if not self._done.wait(600):
            raise SystemExit("kvchat: error: the engine did not answer within 10 minutes")
        self._done.clear()

    def decode_tps(self, tokens: int) -> float:
        self.engine.reset()
        self.engine.submit(PROMPT, GenParams(max_tokens=tokens, ignore_eos=True))
        self._wait()
        assert isinstance(self._last, Done), self._last
        if self._last.finish_reason != "length":
            raise SystemExit(f"kvchat: error: turn ended with {self._last.finish_reason}:"
                             f" {self._last.error}")
        return float(self._last.stats.decode_tps or 0.0)


def _mlx_lm_tps(model: Any, tokenizer: Any, tokens: int) -> float:
    import mlx_lm

    tps = 0.0
    for response in mlx_lm.stream_generate(model, tokenizer, PROMPT, max_tokens=tokens):
        tps = float(response.generation_tps)  # the last response carries the whole rate
    return tps


def run(model: str, tokens: int, runs: int) -> dict[str, Any]:
    import mlx_lm

    turns = _Turns(model)
    can_watch = hasattr(turns.engine, "watch_attention")
    lm_model, lm_tok = mlx_lm.load(model)
    _mlx_lm_tps(lm_model, lm_tok, 16)  # warm-up: both sides compile and allocate once
    turns.decode_tps(16)
    sides: dict[str, list[float]] = {"closed": [], "mlx_lm": []}
    if can_watch:
        sides["open"] = []
    for _ in range(runs):  # interleaved, so a change in the machine's load hits every side
        sides["closed"].append(turns.decode_tps(tokens))
        if can_watch:
            turns.engine.watch_attention(0, None)
            sides["open"].append(turns.decode_tps(tokens))
            turns.engine.watch_attention(None)
        sides["mlx_lm"].append(_mlx_lm_tps(lm_model, lm_tok, tokens))
    turns.engine.close()
    med = {k: statistics.median(v) for k, v in sides.items()}
    out: dict[str, Any] = {
        "model": model, "tokens": tokens, "runs": runs, "loadavg": list(os.getloadavg()),
        "decode_tps": sides, "median_tps": med,
        "closed_vs_mlx_lm": med["closed"] / med["mlx_lm"] if med["mlx_lm"] else None,
    }
    if can_watch:
        out["open_vs_closed"] = med["open"] / med["closed"] if med["closed"] else None
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.benchmarks.attention",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    out = run(args.model, args.tokens, args.runs)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{args.model}: {args.tokens} tokens × {args.runs} runs,"
          f" load average {out['loadavg'][0]:.2f}")
    for side, values in out["decode_tps"].items():
        print(f"  {side:7} median {out['median_tps'][side]:8.1f} tok/s   runs "
              + " ".join(f"{v:.1f}" for v in values))
    print(f"  closed / mlx-lm: {out['closed_vs_mlx_lm']:.3f}")
    if "open_vs_closed" in out:
        print(f"  open / closed:   {out['open_vs_closed']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
