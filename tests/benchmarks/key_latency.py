"""Key → screen latency of the real chat in tmux while a reply streams (the UI process at
normal priority, the engine in its child process):
python -m tests.benchmarks.key_latency [MODEL]

A private tmux server runs `kvchat` on MODEL (default stories260K, whose greedy reply to
"One day" runs for seconds) with a 256-token window; once the reply streams, each of 15
letters is typed with send-keys and timed until the input box shows it after the
ones before."""

from __future__ import annotations

import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tests.test_tmux_chat import REPO, STORIES, Tmux

KEYS = "qwertyuiopasdfg"


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else str(STORIES)
    root = Path(tempfile.mkdtemp())
    (root / "config").mkdir()
    (root / "config" / "settings.json").write_text(
        json.dumps({"temp": 0.0, "max_tokens": 20000, "max_kv_size": 256}))
    tmux = Tmux(f"kvchat-keys-{os.getpid()}")
    cmd = (f"cd {shlex.quote(str(REPO))} && env KVCHAT_CONFIG_DIR={root / 'config'}"
           f" KVCHAT_DATA_DIR={root / 'data'} TERM=xterm-256color"
           f" {shlex.quote(sys.executable)} -m kvchat.app --model {shlex.quote(model)}")
    try:
        tmux("new-session", "-d", "-s", "c", "-x", "100", "-y", "30", cmd)
        tmux.wait_screen("c", lambda s: "Message" in s and "palette" in s, timeout=90)
        time.sleep(2)
        tmux("send-keys", "-t", "c", "-l", "One day")
        tmux("send-keys", "-t", "c", "Enter")
        tmux.wait_screen("c", lambda s: "generating…" in s, timeout=60)
        ms, streaming = [], 0
        for i, key in enumerate(KEYS):
            t0 = time.monotonic()
            tmux("send-keys", "-t", "c", "-l", key)
            # the input box (near the bottom) shows every letter typed so far
            typed = KEYS[: i + 1]
            screen = tmux.wait_screen(
                "c", lambda s, t=typed: t in "".join(s.splitlines()[-6:]), timeout=10)
            ms.append((time.monotonic() - t0) * 1000)
            streaming += "generating…" in screen
            time.sleep(0.2)
    finally:
        tmux.kill_server()
    ms.sort()
    print(f"key → screen ms over {len(ms)} keys ({streaming} while the reply streamed):"
          f" median {statistics.median(ms):.0f}, p90 {ms[int(0.9 * (len(ms) - 1))]:.0f},"
          f" worst {ms[-1]:.0f}")


if __name__ == "__main__":
    main()
