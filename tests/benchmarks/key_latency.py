"""Key latency of the real chat while a reply streams (the UI process at normal priority,
the engine in its child process):

    python -m tests.benchmarks.key_latency [MODEL]            key → screen, in tmux
    python -m tests.benchmarks.key_latency --inside [--out F]  key event → app state

In tmux: a private tmux server runs `kvchat` on MODEL (default stories260K, whose greedy
reply to "One day" runs for seconds) with a 256-token window; once the reply streams,
each of 15 letters is typed with send-keys and timed until the input box shows it after
the ones before.

--inside: the app runs headless under Textual's Pilot on stories260K with an engine that
decodes past EOS, so the reply streams for seconds; each key event is queued as the
terminal driver delivers it and timed until its effect shows in the app's state (Ctrl+S
opens the settings, a letter reaches the input box, Esc stops the reply). Prints one JSON
object (and writes it to --out); tests/test_tui_real.py checks the same keys work, without
timing them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.helpers.paths import REPO_ROOT, STORIES260K
from tests.helpers.tmux import Tmux

KEYS = "qwertyuiopasdfg"


def in_tmux(model: str) -> None:
    """Key → screen timings of `kvchat` in tmux while a reply streams (module docstring)."""
    root = Path(tempfile.mkdtemp())
    (root / "config").mkdir()
    (root / "config" / "settings.json").write_text(
        json.dumps({"temp": 0.0, "max_tokens": 20000, "max_kv_size": 256}))
    tmux = Tmux(f"kvchat-keys-{os.getpid()}")
    cmd = (f"cd {shlex.quote(str(REPO_ROOT))} && env KVCHAT_CONFIG_DIR={root / 'config'}"
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


async def inside(out: Path | None) -> dict[str, Any]:
    """Pilot-driven key timings while the real engine decodes (module docstring)."""
    from kvchat.app.tui.screens.settings_form import SettingsScreen
    from kvchat.model.runtime.events import Done
    from tests.helpers.app import busy, press_now, press_until, ready, replies
    from tests.helpers.real_app import EndlessEngine, last, real_app, settings
    from tests.helpers.scripted_engine import wait_for

    app, seen = real_app(settings(max_tokens=20000, max_kv_size=256), EndlessEngine)
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        app.chat.input.load_text("Once upon a time")
        press_now(app, "enter", "\r")
        await wait_for(pilot, lambda: bool(replies(app)) and bool(replies(app)[-1].content))
        settings_open = await press_until(
            pilot, "ctrl+s", None, lambda: isinstance(app.screen, SettingsScreen))
        settings_while_decoding = busy(app)
        await press_until(pilot, "escape", None,
                          lambda: not isinstance(app.screen, SettingsScreen))
        typing: list[float] = []
        while busy(app) and len(typing) < 30:
            want = app.chat.input.text + "x"
            typing.append(
                await press_until(pilot, "x", "x", lambda w=want: app.chat.input.text == w))
            await asyncio.sleep(0.03)
        samples_while_decoding = len(typing) - (not busy(app))
        stop_while_decoding = busy(app)
        stop = await press_until(pilot, "escape", None, lambda: not busy(app))
        done = last(seen, Done)
    ms = sorted(x * 1000 for x in typing)
    report = {
        "typing_ms_median": round(statistics.median(ms), 1),
        "typing_ms_p90": round(ms[int(0.9 * (len(ms) - 1))], 1),
        "typing_ms_max": round(ms[-1], 1),
        "typing_samples_while_decoding": samples_while_decoding,
        "ctrl_s_to_settings_open_ms": round(settings_open * 1000, 1),
        "settings_opened_while_decoding": settings_while_decoding,
        "esc_to_reply_stopped_ms": round(stop * 1000, 1),
        "esc_while_decoding": stop_while_decoding,
        "decode_tps": round(done.stats.decode_tps or 0.0, 1),
        "generated_tokens": done.stats.generated_tokens,
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }
    if out is not None:
        out.write_text(json.dumps(report, indent=2) + "\n")
    return report


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m tests.benchmarks.key_latency",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=str(STORIES260K),
                   help="model folder for the tmux run (default stories260K)")
    p.add_argument("--inside", action="store_true",
                   help="time key events inside the app under Pilot (stories260K)")
    p.add_argument("--out", type=Path, help="with --inside: also write the JSON here")
    args = p.parse_args()
    if not args.inside:
        in_tmux(args.model)
        return
    with tempfile.TemporaryDirectory() as tmp:  # no settings or chats of yours
        os.environ["KVCHAT_CONFIG_DIR"] = f"{tmp}/config"
        os.environ["KVCHAT_DATA_DIR"] = f"{tmp}/data"
        report = asyncio.run(inside(args.out))
    print(f"key latency while decoding (stories260K): {json.dumps(report)}")


if __name__ == "__main__":
    main()
