"""With the real engine: stories260K's BOS never reaches the transcript, the
saved chat, the export or the clipboard; after a swap the panel shows the new model's
GQA factor and weights as loaded (the same number `kvchat models` prints)."""

from __future__ import annotations

import pytest
from textual.widgets import Static

from kvchat.app.core.discovery import model_rows
from kvchat.model.runtime.events import Done
from tests.helpers.app import SIZE, ready, turn
from tests.helpers.paths import MINI
from tests.helpers.real_app import last, real_app, settings
from tests.helpers.scripted_engine import async_test, wait_for

# hermetic: config, data, HF cache, HOME in tmp_path
pytestmark = [pytest.mark.usefixtures("hermetic_env")]


@async_test
async def test_real_bos_never_becomes_text() -> None:
    app, seen = real_app(settings(max_tokens=400))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await turn(pilot, "Once upon a time")
        done = last(seen, Done)
        assert done.finish_reason == "eos" and done.ids[-1] == 1
        reply = app.chat.conversation.messages[-1]["content"]
        assert reply.strip() and "<s>" not in reply
        saved = app.chat.store.path_for(app.chat.conversation.id).read_text()
        assert "<s>" not in saved
        export = app.chat.action_export()
        assert export is not None and "<s>" not in export.read_text()
        copied: list[str] = []
        app.copy_to_clipboard = copied.append  # type: ignore[method-assign]
        app.chat.action_copy_reply()
        assert copied == [reply]


@pytest.mark.slow
@async_test
async def test_real_swap_panel_numbers_are_the_new_models() -> None:
    app, _seen = real_app(settings(max_tokens=8))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await turn(pilot, "Once")
        assert "2× smaller" in str(app.chat.panel.query_one("#cache", Static).render())  # 8/4
        app.chat.load_model(str(MINI.resolve()))
        await wait_for(pilot, lambda: app.chat.model_path == str(MINI.resolve()), timeout=120)
        await pilot.pause(0.2)
        cache = str(app.chat.panel.query_one("#cache", Static).render())
        assert "4× smaller" in cache  # kvchat-mini: 8 query heads over 2 KV heads
        row = next(r for r in model_rows([], include_defaults=True) if r.entry.source == "assets")
        assert row.facts is not None
        assert app.chat.model_info["weight_bytes"] == row.facts.weight_bytes
