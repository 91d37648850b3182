"""`kvchat pull REPO_ID [--revision R]`: fetch a model from the Hugging Face Hub.

Into the Hugging Face cache (so `kvchat models`, the picker, mlx-lm and transformers all
find it), with a progress bar per file and in total (speed, ETA), resuming partial files,
then the loader's checks before it is offered. HF_ENDPOINT, HF_HUB_CACHE / HF_HOME and
HF_HUB_OFFLINE are honoured.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from typing import TextIO

from kvchat.model.errors import KVChatError

from .discovery import human_bytes
from .errors import report
from .hub_download import PullProgress, pull, verify_pulled
from .text import visible

BAR_W = 24
REDRAW_S = 0.1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("repo_id", metavar="REPO_ID", help="a Hugging Face model repo, e.g. org/name")
    p.add_argument("--revision", default=None, metavar="R",
                   help="branch, tag or commit (default: main)")


def fmt_eta(seconds: float | None) -> str:
    if seconds is None:
        return "--:--"
    s = int(seconds + 0.5)
    if s >= 3600:
        return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
    return f"{s // 60}:{s % 60:02d}"


def short_bytes(n: float) -> str:
    """1.3 MiB: a progress line changes ten times a second, so one decimal is plenty."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def bar(done: int, total: int, width: int = BAR_W) -> str:
    frac = min(1.0, done / total) if total > 0 else 1.0
    full = int(frac * width)
    return "█" * full + "░" * (width - full) + f" {frac * 100:3.0f}%"


def progress_lines(p: PullProgress, bar_width: int = BAR_W) -> tuple[str, str]:
    """(the current file's line, the total line): what the terminal and the picker show."""
    name = p.file if len(p.file) <= 28 else "…" + p.file[-27:]
    file_line = (f"{name:<28} {bar(p.file_done, p.file_total, bar_width)}"
                 f"  {short_bytes(p.file_done)} / {short_bytes(p.file_total)}")
    total_line = (
        f"{'total ' + str(p.files_done) + '/' + str(p.files_total) + ' files':<28}"
        f" {bar(p.bytes_done, p.bytes_total, bar_width)}  {short_bytes(p.bytes_done)} /"
        f" {short_bytes(p.bytes_total)} · {short_bytes(p.speed)}/s · ETA {fmt_eta(p.eta)}"
    )
    return file_line, total_line


class TerminalProgress:
    """Two lines redrawn in place on a terminal (≤ 10 a second); on a pipe, one line per
    finished file, so logs stay readable."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.tty = out.isatty()
        self.drawn = False
        self.last = 0.0
        self.files_reported = 0
        self.lock = threading.Lock()

    def __call__(self, p: PullProgress, force: bool = False) -> None:
        with self.lock:
            if not self.tty:
                while self.files_reported < p.files_done:
                    self.files_reported += 1
                    print(progress_lines(p)[1], file=self.out, flush=True)
                return
            now = time.monotonic()
            if not force and now - self.last < REDRAW_S and p.files_done < p.files_total:
                return
            self.last = now
            # our own cursor moves pass a VisibleWriter (app/cli.py) as they are; the lines
            # hold names from the Hub, so they are shown, never obeyed
            control = getattr(self.out, "write_control", self.out.write)
            if self.drawn:
                control("\x1b[2F")  # back to the first of the two lines
            for line in progress_lines(p):
                control("\x1b[2K")  # clear it
                self.out.write(visible(line) + "\n")
            self.out.flush()
            self.drawn = True


def run(args: argparse.Namespace) -> int:
    show = TerminalProgress(sys.stderr)
    last: list[PullProgress] = []

    def on_progress(p: PullProgress) -> None:
        last[:] = [p]
        show(p)

    try:
        folder = pull(args.repo_id, args.revision, on_progress=on_progress)
    except KeyboardInterrupt:
        report("pull interrupted; partial files are kept, run the same command to resume")
        return 130
    except KVChatError as e:
        report(str(e))
        return 1
    if last:
        show(last[0], force=True)
        p = last[0]
        if p.resumed_bytes:
            print(f"resumed {human_bytes(p.resumed_bytes)} from partial files", file=sys.stderr)
    try:
        facts = verify_pulled(folder)
    except KVChatError as e:
        report(f"downloaded, but kvchat cannot load it: {e}")
        return 1
    print(f"{args.repo_id}: ready · {human_bytes(facts['weight_bytes'])} of weights in"
          f" {facts['compute_dtype']}")
    print(folder)
    print(f"chat with it: kvchat --model {folder}")
    return 0
