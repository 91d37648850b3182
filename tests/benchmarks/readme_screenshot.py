"""Writes the README's screenshot: the real app (real engine, in its own process) on the
shipped model, as the Quickstart opens it, mid-reply at 120x36.

    python -m tests.benchmarks.readme_screenshot assets/screenshot.svg

Config and data go to a temporary folder, so no settings or chats of yours show up.
(A script, not a test: a test that only runs when an environment variable is set shows
up as a skip in every run.)
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from pathlib import Path

from kvchat.app.core.engine_service import EngineService
from kvchat.app.core.settings import Settings
from kvchat.app.tui.app import KVChatApp
from tests.helpers.app import busy, press_now, replies, turn
from tests.helpers.paths import MINI
from tests.helpers.scripted_engine import wait_for

MODEL = MINI


async def screenshot() -> str:
    s = Settings(temp=0.0, top_p=1.0, min_p=0.0, max_tokens=60, max_kv_size=256)
    app = KVChatApp(str(MODEL), s, engine_factory=EngineService().build)
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_for(pilot, lambda: bool(app.chat.model_info), timeout=120)
        await turn(pilot, "Tell me a story about a robot.")
        app.chat.settings.max_tokens = 400
        app.chat.input.load_text("Tell me another story.")
        press_now(app, "enter", "\r")
        await wait_for(pilot, lambda: busy(app))
        while busy(app) and len(replies(app)[-1].content) < 120:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.5)  # the streamed text and the panel on screen
        # the footer recomposes for the new phase's keys: caught laid out, not half-way
        await wait_for(pilot, lambda: len(keys := app.chat.query("FooterKey")) > 5
                       and all(k.region.width for k in keys))
        if not busy(app):
            raise SystemExit("the reply ended before the screenshot; run it again")
        svg = app.export_screenshot(title="kvchat")
        await pilot.press("escape")
        await wait_for(pilot, lambda: not busy(app))
    return svg


def main() -> None:
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "assets/screenshot.svg")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["KVCHAT_CONFIG_DIR"] = f"{tmp}/config"
        os.environ["KVCHAT_DATA_DIR"] = f"{tmp}/data"
        svg = asyncio.run(screenshot())
    target.write_text(svg)
    print(target)


if __name__ == "__main__":
    main()
