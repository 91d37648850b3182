"""A reply cut short by a dead pipeline rank: the engine keeps the text
the user saw and its ids (--json reports them), and the chat saves it, marked stopped."""

from __future__ import annotations

from pathlib import Path

from kvchat.app.core.store import ConversationStore
from tests.helpers.app import ready, turn
from tests.helpers.scripted_engine import async_test


def test_engine_keeps_the_partial_reply_and_its_ids() -> None:
    from kvchat.model.runtime.client import EngineClient
    from kvchat.model.runtime.events import GenParams, TextDelta
    from tests.helpers.scripted_engine import ScriptedEngine

    with EngineClient("/models/a", timeout=30,
                      engine=lambda cb, p: ScriptedEngine(cb, p, fail_after=5)) as c:
        done = c.run([{"role": "user", "content": "hi"}], GenParams(max_tokens=40))
        shown = "".join(e.text for e in c.events if isinstance(e, TextDelta))
    assert done.finish_reason == "error"
    assert done.error == "rank 1 (127.0.0.1) stopped responding"
    assert done.text and done.text == shown  # what the user saw, no more, no less
    assert 4 <= len(done.ids) <= 6


@async_test
async def test_partial_reply_from_a_dead_rank_is_saved_marked(env: Path) -> None:
    from kvchat.app.core.settings import Settings
    from kvchat.app.tui.app import KVChatApp
    from tests.helpers.scripted_engine import ScriptedEngine

    app = KVChatApp("/models/m", Settings(),
                    engine_factory=lambda cb, p: ScriptedEngine(cb, p, fail_after=5))
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await turn(pilot, "tell me")
        conv_id = app.chat.conversation.id
        shown = [w for w in app.chat.transcript.messages if w.role == "assistant"]
        assert shown and shown[-1].content and shown[-1].stopped
    saved = ConversationStore().load(conv_id)
    last = saved.messages[-1]
    assert last["role"] == "assistant" and last["content"] == shown[-1].content
    assert last.get("stopped") is True
