"""How the real chat answers keys while a reply streams, in tmux:
python -m tests.benchmarks.key_latency [MODEL] [--loads idle busy] [--engine-nice N ...]

The reply: stories260K's greedy answer to "One day" without repetition penalty, in a
4096-token window (875 tokens; the window keeps the overflow toast, which would cover the
marks read here, away); Ctrl+R starts it again whenever one is needed.
(a) key → screen: 50 letters typed one at a time, 0.2 s apart, while the reply streams;
    each timed from send-keys until the input box shows it after the ones before; beside
    it, the decode rate (the side panel's average) of each reply that ran to its end.
(b) Esc → "stopped": 20 replies, each stopped by one Esc 0.2-0.5 s after it shows,
    timed from send-keys until the reply is marked "■ stopped"; a reply that ends on its
    own first, or that the screen never showed streaming, is counted apart.

Both run twice: on an idle machine (whatever else it runs: the load average is printed)
and with one core kept busy by a `yes > /dev/null` child this script starts and kills.
Times include tmux's own (send-keys, then the screen read every 5 ms). Keys are sent
and the screen is read through one tmux control-mode client (`tmux -C attach -f
no-output`, commands on its stdin) rather than a `tmux` process per read: 200 processes a
second would take a large share of a core from the chat being measured, which no
person's terminal does.
"""

from __future__ import annotations

import os
import platform
import random
import re
import shlex
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from kvchat.app.core.settings import Settings
from tests.helpers.paths import STORIES260K
from tests.helpers.tmux import Tmux, start_chat

KEYS = "qwertyuiopasdfghjklzxcvbnmmnbvcxzlkjhgfdsapoiuytre"  # 50
TRIALS = 20
PROMPT = "One day"
SETTINGS = {"temp": 0.0, "repetition_penalty": 1.0, "max_tokens": 4000, "max_kv_size": 4096}
POLL_S = 0.005


def machine() -> str:
    model = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{model}; {os.cpu_count()} cores; load average {load};"
            f" {time.strftime('%Y-%m-%d %H:%M:%S %z')}")


class Reader:
    """Reads pane `c`'s screen through one control-mode client: each read is one
    `capture-pane` command on its stdin and the block tmux answers with (%begin … %end)."""

    def __init__(self, tmux: Tmux) -> None:
        self.proc = subprocess.Popen(
            ["tmux", "-L", tmux.socket, "-f", "/dev/null", "-C", "attach", "-t", "c",
             "-f", "no-output,ignore-size"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.reply()  # the block answering `attach` itself

    def reply(self) -> str:
        """The next %begin … %end block's lines (notifications between blocks skipped)."""
        assert self.proc.stdout
        lines: list[str] = []
        inside = False
        for line in self.proc.stdout:
            if line.startswith("%begin"):
                inside, lines = True, []
            elif line.startswith(("%end", "%error")) and inside:
                return "".join(lines)
            elif inside:
                lines.append(line)
        raise RuntimeError("the tmux control client ended")

    def screen(self) -> str:
        return self.command("capture-pane -p -t c")

    def command(self, line: str) -> str:
        """Runs one tmux command line through the client; its output."""
        assert self.proc.stdin
        self.proc.stdin.write(line + "\n")
        return self.reply()

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


READER: Reader | None = None


def read(tmux: Tmux) -> str:
    return READER.screen() if READER is not None else tmux.screen("c")


def send(tmux: Tmux, *keys: str) -> None:
    """send-keys to pane `c` (through the control client once it runs: no process each)."""
    if READER is None:
        tmux("send-keys", "-t", "c", *keys)
    else:
        READER.command(" ".join(["send-keys", "-t", "c", *(shlex.quote(k) for k in keys)]))


def until(tmux: Tmux, pred: Callable[[str], bool], timeout: float) -> tuple[bool, str]:
    """(whether pred(screen) held within timeout, the last screen read)"""
    deadline = time.monotonic() + timeout
    screen = ""
    while time.monotonic() < deadline:
        screen = read(tmux)
        if pred(screen):
            return True, screen
        time.sleep(POLL_S)
    return False, screen


def input_box(screen: str) -> str:
    return "".join(screen.splitlines()[-6:])


@contextmanager
def chat(model: Path, nice: int = Settings().engine_nice) -> Iterator[Tmux]:
    global READER
    tmux = Tmux(f"kvchat-keys-{os.getpid()}-{time.monotonic_ns()}")
    try:
        start_chat(tmux, "c", Path(tempfile.mkdtemp()), {**SETTINGS, "engine_nice": nice},
                   model=model)
        time.sleep(1)
        READER = Reader(tmux)
        send(tmux, "-l", PROMPT)
        send(tmux, "Enter")
        streaming(tmux)
        yield tmux
    finally:
        if READER is not None:
            READER.close()
            READER = None
        tmux.kill_server()


def streaming(tmux: Tmux) -> bool:
    """Whether a new reply shows (it says "generating…" from the moment it is sent)."""
    ok, _ = until(tmux, lambda s: "generating…" in s and "■ stopped" not in s, 30)
    return ok


AVERAGE = re.compile(r"average\s+([\d,.]+) tok/s")
RATES: list[float] = []  # the side panel's decode rate of each reply that ran to its end


def restart(tmux: Tmux) -> bool:
    """Ctrl+R once the last reply has ended; whether the new one was seen streaming."""
    _, screen = until(tmux, lambda s: "generating…" not in s and "stopping…" not in s, 30)
    m = AVERAGE.search(screen)
    if m and "■ stopped" not in screen:
        RATES.append(float(m.group(1).replace(",", "")))
    send(tmux, "C-r")
    return streaming(tmux)


def typing(tmux: Tmux) -> tuple[list[float], int]:
    """(ms per key, keys typed while the reply streamed)"""
    ms, during = [], 0
    for i, key in enumerate(KEYS):
        if "generating…" not in read(tmux):
            restart(tmux)
        t0 = time.monotonic()
        send(tmux, "-l", key)
        typed = KEYS[: i + 1]
        ok, screen = until(tmux, lambda s, t=typed: t in input_box(s), 10)
        ms.append((time.monotonic() - t0) * 1000 if ok else float("inf"))
        during += "generating…" in screen
        time.sleep(0.2)
    return ms, during


def stopping(tmux: Tmux) -> tuple[list[float], int, int]:
    """(ms per stop that was marked, replies that ended before the stop, replies never
    seen streaming: a UI too far behind to show one)"""
    ms, ended, unseen = [], 0, 0
    rng = random.Random(0)
    for _ in range(TRIALS):
        if not restart(tmux):
            unseen += 1
            continue
        time.sleep(rng.uniform(0.2, 0.5))
        t0 = time.monotonic()
        send(tmux, "Escape")
        ok, screen = until(tmux, lambda s: "■ stopped" in s or not (
            "generating…" in s or "stopping…" in s), 15)
        if ok and "■ stopped" in screen:
            ms.append((time.monotonic() - t0) * 1000)
        else:
            ended += 1
    return ms, ended, unseen


def summary(ms: list[float]) -> str:
    if not ms:
        return "none"
    return f"median {statistics.median(ms):.0f} ms, worst {max(ms):.0f} ms"


@contextmanager
def busy_core() -> Iterator[None]:
    proc = subprocess.Popen("yes > /dev/null", shell=True, start_new_session=True)
    try:
        yield
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run(model: Path, label: str, nice: int) -> None:
    RATES.clear()
    with chat(model, nice) as tmux:
        keys, during = typing(tmux)
        rate = f"{statistics.median(RATES):,.0f} tok/s" if RATES else "no reply ended"
        print(f"{label}: key → screen over {len(keys)} keys ({during} while the reply"
              f" streamed): {summary(keys)}; decode meanwhile {rate} (median of"
              f" {len(RATES)} replies)", flush=True)
        stops, ended, unseen = stopping(tmux)
        print(f"{label}: Esc → \"■ stopped\" over {TRIALS} replies ({ended} ended before the"
              f" stop, {unseen} never seen streaming): {summary(stops)}", flush=True)


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=str(STORIES260K))
    ap.add_argument("--loads", nargs="+", choices=("idle", "busy"), default=["idle", "busy"])
    ap.add_argument("--engine-nice", nargs="+", type=int, default=[Settings().engine_nice],
                    metavar="N", help="the chat's engine_nice setting (default: the"
                    " settings' default); several: each in turn, per load")
    a = ap.parse_args()
    model = Path(a.model)
    print(f"machine: {machine()}", flush=True)
    for load in a.loads:
        for nice in a.engine_nice:
            label = ("idle" if load == "idle" else "one busy core") + f", engine nice {nice}"
            if load == "idle":
                run(model, label, nice)
            else:
                with busy_core():
                    run(model, label, nice)
    print(f"after: load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
