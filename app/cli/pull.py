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

from kvchat.app.core.discovery import human_bytes
from kvchat.app.core.errors import report
from kvchat.app.core.hub_download import PullProgress, pull, verify_pulled
from kvchat.app.core.pull_progress import progress_lines
from kvchat.app.core.text import visible_name
from kvchat.model.errors import KVChatError

REDRAW_S = 0.1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("repo_id", metavar="REPO_ID", help="a Hugging Face model repo, e.g. org/name")
    p.add_argument("--revision", default=None, metavar="R",
                   help="branch, tag or commit (default: main)")


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
            # our own cursor moves pass a VisibleWriter (app/main.py) as they are; the lines
            # hold names from the Hub, so they are shown, never obeyed
            control = getattr(self.out, "write_control", self.out.write)
            if self.drawn:
                control("\x1b[2F")  # back to the first of the two lines
            for line in progress_lines(p):
                control("\x1b[2K")  # clear it
                self.out.write(visible_name(line) + "\n")
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
