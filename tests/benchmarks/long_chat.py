"""How fast a long saved chat reopens in the real app, in tmux:
python -m tests.benchmarks.long_chat [--messages 1000 3000 10000] [--markdown 200]

For each size a chat is saved the way the app saves chats (ConversationStore into
<data dir>/chats, session.json naming it as the chat open last), under a temporary HOME,
config, data and log folder, and `kvchat --model stories260K` is started in a 120×36 tmux
pane; the app reopens the chat once the model is in. Measured from the launch:

- loaded: until the header names the model (the chat reopens right after that);
- open: until the chat's last message is on the screen;
- key: keys typed the moment the header names the model, until the input box shows
  them (a UI busy mounting the chat shows them only when it is free again), from the
  launch and from the keys' sending;
- quit: from Ctrl+Q until the process has exited (its exit status is written).

`--messages`: short chats ("question N" / "answer N …", alternating); `--markdown`: that
many realistic Markdown replies (headings, lists, a table, a code fence) after as many
questions. A 2-message chat comes first: the start and the model's load alone. Times
include tmux's own (capture-pane polled every 20 ms).
"""

from __future__ import annotations

import argparse
import os
import shlex
import tempfile
import time
from pathlib import Path

from kvchat.app.core.store import Conversation
from tests.benchmarks.key_latency import machine
from tests.helpers.paths import STORIES260K
from tests.helpers.saved_chats import (
    MARKDOWN_LAST_LINE,
    markdown_chat,
    save_as_last_open,
    short_chat,
)
from tests.helpers.tmux import Tmux, chat_env, command, session

SIZE = (120, 36)
POLL_S = 0.02
TYPED = "x7q7x"
TIMEOUT_S = 300.0

def until(tmux: Tmux, pred, timeout: float = TIMEOUT_S) -> float | None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred(tmux.screen("c")):
            return time.monotonic()
        time.sleep(POLL_S)
    return None


def measure(conv: Conversation, last_text: str) -> tuple[float | None, ...]:
    """(loaded, open, key, key after sending, quit) in seconds; None: not within
    TIMEOUT_S."""
    root = Path(tempfile.mkdtemp(prefix="kvchat-long-chat-"))
    env, status = chat_env(root, {"temp": 0.0})
    env["HOME"] = str(root / "home")
    save_as_last_open(conv, Path(env["KVCHAT_DATA_DIR"]))
    tmux = Tmux(f"kvchat-long-{os.getpid()}-{time.monotonic_ns()}")
    try:
        t0 = time.monotonic()
        session(tmux, "c", SIZE, command(f"--model {shlex.quote(str(STORIES260K))}", env,
                                         status))
        t_loaded = until(tmux, lambda s: "stories260K" in s.splitlines()[0] if s else False)
        t_sent = time.monotonic()
        tmux("send-keys", "-t", "c", "-l", TYPED)
        t_open = until(tmux, lambda s: last_text in s)
        t_key = until(tmux, lambda s: TYPED in "".join(s.splitlines()[-6:]))
        t1 = time.monotonic()
        tmux("send-keys", "-t", "c", "C-q")
        while not status.exists() and time.monotonic() - t1 < TIMEOUT_S:
            time.sleep(POLL_S)
        t_quit = time.monotonic() if status.exists() else None
        return (t_loaded and t_loaded - t0, t_open and t_open - t0, t_key and t_key - t0,
                t_key and t_key - t_sent, t_quit and t_quit - t1)
    finally:
        tmux.kill_server()


def row(label: str, times: tuple[float | None, ...]) -> str:
    cells = [f"{t:.1f} s" if t is not None else f"> {TIMEOUT_S:.0f} s" for t in times]
    return f"| {label} | " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.long_chat")
    parser.add_argument("--messages", type=int, nargs="*", default=[1000, 3000, 10000])
    parser.add_argument("--markdown", type=int, default=200)
    args = parser.parse_args()
    print(f"machine: {machine()}", flush=True)
    print("| chat | loaded | open: last message shown | key shown | key shown, from sending |"
          " Ctrl+Q → exit |")
    print("|---|---:|---:|---:|---:|---:|")
    for n in [2, *args.messages]:  # 2: the app's start and model load, for reference
        conv = short_chat(n, STORIES260K)
        print(row(f"{n:,} short messages", measure(conv, conv.messages[-1]["content"][:40])),
              flush=True)
    if args.markdown:
        conv = markdown_chat(args.markdown, STORIES260K)
        print(row(f"{args.markdown} Markdown replies", measure(conv, MARKDOWN_LAST_LINE)),
              flush=True)
    print(f"after: load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
