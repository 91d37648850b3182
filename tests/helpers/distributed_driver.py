"""Rank 0 for the distributed tests, as `kvchat --hosts` runs it: the engine service
(app/core/engine_service.py) starts the other ranks, joins them and builds the engine;
drive it, print one JSON line per event of interest.

    python -m tests.helpers.distributed_driver HOSTFILE MODEL [--turns N] [--pause] ...

--pause: on the first streamed token (--pause-at prefill: before the prefill), print
{"paused": [rank pids]} and block the engine thread until a line arrives on stdin (the
test kills a rank meanwhile), so the fault always lands mid-turn whatever the machine's
speed.
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("hostfile")
    ap.add_argument("model")
    ap.add_argument("--prompt", default="Once upon a time")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--max-kv-size", type=int, default=None)
    ap.add_argument("--turns", type=int, default=1)
    ap.add_argument("--pause", action="store_true")
    ap.add_argument("--pause-at", choices=["token", "prefill"], default="token",
                    help="pause on the first streamed token, or before the prefill")
    ap.add_argument("--exit-wait", type=float, default=10.0,
                    help="with --pause: how long to wait for the other ranks to exit")
    args = ap.parse_args()

    from kvchat.app.core.engine_service import EngineService

    service = EngineService()
    service.split_across(args.hostfile, args.model)
    procs = service.ranks

    from kvchat.model.runtime.events import (
        Done,
        GenParams,
        Loaded,
        LoadFailed,
        Started,
        TextDelta,
        stats_json,
    )

    def say(obj: dict) -> None:
        print(json.dumps(obj), flush=True)

    events: queue.Queue = queue.Queue()
    paused = False

    def on_event(ev: object) -> None:
        nonlocal paused
        at = TextDelta if args.pause_at == "token" else Started
        if args.pause and not paused and isinstance(ev, at):
            paused = True
            say({"paused": [p.pid for p in procs]})
            sys.stdin.readline()
        events.put(ev)

    engine = service.build(on_event, args.model)  # rank 0: on a thread of this process
    while not isinstance(ev := events.get(), Loaded | LoadFailed):
        pass
    if isinstance(ev, LoadFailed):
        say({"load_failed": ev.message})
        service.close()
        return 1
    say({"loaded": ev.info})
    params = GenParams(max_tokens=args.max_tokens, max_kv_size=args.max_kv_size)
    for _ in range(args.turns):
        t0 = time.monotonic()
        engine.submit(args.prompt, params)
        while not isinstance(ev := events.get(), Done):
            pass
        say({"finish_reason": ev.finish_reason, "ids": ev.ids, "error": ev.error,
             "stats": stats_json(ev.stats), "seconds": time.monotonic() - t0,
             "layers": engine.layer_stats()})
    if args.pause:  # after a fault the other ranks must leave by themselves
        deadline = time.monotonic() + args.exit_wait
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.1)
        say({"rank_exit": [p.poll() for p in procs]})
    service.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
