"""Does the chat UI slow decoding? The real app against the same engine without a UI
(`kvchat generate`'s EngineClient), interleaved, and the ratio chat ÷ generate.

    python -m tests.benchmarks.chat [--model DIR] [--tokens 1600] [--runs 2]
        [--tmux] [--json]

--tmux drives the real app in a real terminal: a private tmux server runs `kvchat`'s
App (the default engine process, full rendering at --size), the
prompt is typed with send-keys, and the app writes its reply's Done stats to a file.
Without --tmux the app runs headless under Textual's Pilot (layout and Markdown work,
no terminal output). Both sides get the same conversation and GenParams (greedy, EOS
ignored so the reply has exactly --tokens tokens). Reported per run: decode tok/s as the
engine measured it, the rate over each quarter of the reply (flat means render work
does not grow with the reply's length) and, with --tmux, the CPU time the UI process
used while the reply streamed (what it took from the engine's cores, a number the
machine's load moves far less than tok/s).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from kvchat.app.core.discovery import DEFAULT_MODEL
from kvchat.model.runtime.events import Done, Event, GenParams, Loaded, TextDelta

PROMPT = "Once upon a time"
RATIO = "chat ÷ generate"


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
    from kvchat.model.runtime.client import EngineClient

    stamps: list[float] = []
    with EngineClient(model, on_delta=lambda _t: stamps.append(time.perf_counter())) as runner:
        done = runner.run([{"role": "user", "content": PROMPT}], _params(tokens))
    return {"decode_tps": done.stats.decode_tps, "tokens": len(done.ids),
            "quarters": _quarters(stamps)}


def _factory(tokens: int, in_process: bool, stamps: list[float], finished: list[Done],
             on_loaded: Any = None) -> Any:
    """The app's engine factory (the engine service's: an engine process, or the engine
    on a thread of this process) with every turn's GenParams forced to the benchmark's,
    and the events watched."""
    from kvchat.app.core.engine_service import EngineService

    service = EngineService("thread" if in_process else "process")

    def factory(on_event: Any, path: str | None) -> Any:
        def spy(ev: Event) -> None:
            if isinstance(ev, TextDelta):
                stamps.append(time.perf_counter())
            elif isinstance(ev, Done):
                finished.append(ev)
            elif isinstance(ev, Loaded) and on_loaded is not None:
                on_loaded()
            on_event(ev)

        engine = service.build(spy, path)
        submit = engine.submit
        engine.submit = lambda prompt, params=None: submit(  # type: ignore[method-assign]
            prompt, dataclasses.replace(params or GenParams(), **dataclasses.asdict(
                _params(tokens)) | {"stop": ()}))
        return engine

    return factory


def run_chat(model: str, tokens: int, size: tuple[int, int] = (120, 40),
             in_process: bool = False) -> dict[str, Any]:
    from kvchat.app.core.settings import Settings
    from kvchat.app.tui.app import KVChatApp

    stamps: list[float] = []
    finished: list[Done] = []
    factory = _factory(tokens, in_process, stamps, finished)

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


def serve_app(model: str, tokens: int, result: str) -> int:
    """(inside tmux) The real app on this terminal; `result`.ready appears when the
    model is loaded, `result` holds the reply's numbers when it is done."""
    from kvchat.app.core.settings import Settings
    from kvchat.app.tui.app import KVChatApp

    out = Path(result)

    class Stamps(list):  # token arrival times, and this process's CPU time at the first
        cpu0 = 0.0

        def append(self, t: float) -> None:
            if not self:
                self.cpu0 = time.process_time()
            super().append(t)

    stamps = Stamps()

    def on_loaded() -> None:
        Path(f"{result}.ready").write_text("1")

    class Watch(list):  # Done arrives on the engine's reader thread: write the file there
        def append(self, done: Done) -> None:
            super().append(done)
            # the UI process's CPU seconds (all its threads) while the reply streamed:
            # what it took from the cores the engine needs, whatever the machine's load
            ui_cpu = time.process_time() - stamps.cpu0
            out.write_text(json.dumps({"decode_tps": done.stats.decode_tps,
                                       "tokens": len(done.ids),
                                       "quarters": _quarters(stamps),
                                       "ui_cpu_s": ui_cpu,
                                       "reply_s": stamps[-1] - stamps[0] if stamps else 0.0}))

    factory = _factory(tokens, False, stamps, Watch(), on_loaded)
    app = KVChatApp(model, Settings(restore_session=False), engine_factory=factory)
    profile = os.environ.get("KVCHAT_BENCH_PROFILE")
    if profile:  # where the UI's thread spends its time (cProfile stats to that file)
        import cProfile

        cProfile.runctx("app.run()", globals(), {"app": app}, profile)
    else:
        app.run()
    return 0


def run_chat_tmux(model: str, tokens: int, size: tuple[int, int] = (120, 40),
                  timeout: float = 600.0) -> dict[str, Any]:
    """The real app in a real terminal (tmux), the prompt typed as a user would."""
    import shlex
    import subprocess
    import sys
    import tempfile

    sock = f"kvchat-bench-{os.getpid()}"

    def tmux(*args: str) -> str:
        return subprocess.run(["tmux", "-L", sock, "-f", "/dev/null", *args], check=True,
                              capture_output=True, text=True, timeout=30).stdout

    with tempfile.TemporaryDirectory(prefix="kvchat-bench-chat-") as tmp:
        result = Path(tmp) / "done.json"
        cmd = shlex.join([sys.executable, "-m", "tests.benchmarks.chat", "--serve-app",
                          str(result), "--model", model, "--tokens", str(tokens)])
        # settings and saved chats in the temporary folder: the user's stay untouched
        env = (f"KVCHAT_CONFIG_DIR={shlex.quote(tmp)} KVCHAT_DATA_DIR={shlex.quote(tmp)}"
               " TERM=xterm-256color")
        tmux("new-session", "-d", "-s", "bench", "-x", str(size[0]), "-y", str(size[1]),
             f"env {env} {cmd} 2>{shlex.quote(tmp)}/stderr")
        try:
            deadline = time.monotonic() + timeout
            while not Path(f"{result}.ready").exists():
                if time.monotonic() > deadline:
                    raise RuntimeError("the app did not load the model: "
                                       + tmux("capture-pane", "-p", "-t", "bench"))
                time.sleep(0.1)
            time.sleep(0.5)  # the Loaded event reaches the screen
            tmux("send-keys", "-t", "bench", "-l", PROMPT)
            tmux("send-keys", "-t", "bench", "Enter")
            while not result.exists() or not result.read_text():
                if time.monotonic() > deadline:
                    raise RuntimeError("no reply: " + tmux("capture-pane", "-p", "-t", "bench"))
                time.sleep(0.1)
            time.sleep(0.1)
            row = json.loads(result.read_text())
            tmux("send-keys", "-t", "bench", "C-q")
            quit_by = time.monotonic() + 15
            while time.monotonic() < quit_by and subprocess.run(
                    ["tmux", "-L", sock, "has-session", "-t", "bench"],
                    capture_output=True).returncode == 0:
                time.sleep(0.1)  # the app closes its engine and exits
        finally:
            subprocess.run(["tmux", "-L", sock, "kill-server"], capture_output=True)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.benchmarks.chat", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--tokens", type=int, default=1600)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--tmux", action="store_true",
                   help="drive the real app in a real terminal (tmux) instead of headless")
    p.add_argument("--in-process", action="store_true",
                   help="the engine thread in the UI's process (as before the split)")
    p.add_argument("--serve-app", metavar="RESULT", help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    from kvchat.model.runtime import threads

    threads.configure(None)
    if a.serve_app:
        return serve_app(a.model, a.tokens, a.serve_app)
    import shutil
    import tempfile

    scratch = tempfile.mkdtemp(prefix="kvchat-bench-chat-")
    saved = {k: os.environ.get(k) for k in ("KVCHAT_CONFIG_DIR", "KVCHAT_DATA_DIR")}
    os.environ.update(dict.fromkeys(saved, scratch))  # the benchmark's chats: not the user's
    try:
        return _compare(a)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(scratch, ignore_errors=True)


def _compare(a: argparse.Namespace) -> int:
    from kvchat.model.runtime import threads

    run_generate(a.model, 16)  # warm-up (page cache, imports)
    rows: dict[str, list[dict[str, Any]]] = {"generate": [], "chat": []}
    for _ in range(a.runs):  # interleaved: generate, chat, generate, chat, …
        rows["generate"].append(run_generate(a.model, a.tokens))
        rows["chat"].append(run_chat_tmux(a.model, a.tokens) if a.tmux else
                            run_chat(a.model, a.tokens, in_process=a.in_process))
    ratios = [c["decode_tps"] / g["decode_tps"]
              for g, c in zip(rows["generate"], rows["chat"], strict=True)]
    result = {"model": a.model, "tokens": a.tokens,
              "chat_mode": "real app in tmux" if a.tmux else "headless app (Pilot)",
              "threads": threads.describe(), "loadavg": os.getloadavg(), **rows,
              "ratio_of": RATIO, "ratio_runs": ratios,
              "ratio_median": statistics.median(ratios)}
    if a.json:
        print(json.dumps(result))
        return 0
    print(f"model {a.model}, {a.tokens} tokens, chat = {result['chat_mode']}, threads:"
          f" {result['threads']}, load average {result['loadavg'][0]:.1f}")
    for side in ("generate", "chat"):
        for r in rows[side]:
            qs = " ".join(f"{q:.0f}" for q in r["quarters"])
            ui = (f"  UI process CPU {r['ui_cpu_s']:.2f} s over {r['reply_s']:.2f} s"
                  f" ({r['ui_cpu_s'] / r['reply_s']:.0%} of a core)"
                  if r.get("reply_s") else "")
            print(f"{side:9} {r['tokens']} tokens  decode {r['decode_tps']:.1f} tok/s"
                  f"  by quarter: {qs}{ui}")
    print(f"{RATIO} decode tok/s per pair: " + ", ".join(f"{x:.2f}" for x in ratios)
          + f"  (median {result['ratio_median']:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
