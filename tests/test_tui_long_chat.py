"""A long saved chat opens lazily (app/tui/widgets/transcript.py): of 10,000 messages only
those on screen and about a screen either way are widgets, Home shows the first message
and End the last, the mouse wheel and PageUp move through unmounted ones, "stopped" marks
survive being scrolled away and back, an edit's mark and Ctrl+Y do too, paging through
Markdown replies (measured only as they come on screen) moves the view by exactly a page,
and a reply still streams in at the bottom."""

from __future__ import annotations

from pathlib import Path

from textual import events

from kvchat.app.core.store import Conversation
from kvchat.app.tui.app import KVChatApp
from kvchat.app.tui.widgets import ChatMessage
from tests.helpers.app import SIZE, busy, engine, make_app, ready, send
from tests.helpers.paths import STORIES260K
from tests.helpers.saved_chats import markdown_chat
from tests.helpers.scripted_engine import REPLY, async_test, wait_for

N = 10_000
# the scripted engine reads the whole prompt of a turn, word by word: a shorter chat,
# still many screens long
N_STREAMED = 1_000
MOUNTED_AT_MOST = 100  # a 40-row screen shows ~10 of these messages: a few screens' worth


def _long_chat(n: int = N) -> Conversation:
    conv = Conversation()
    for i in range(n):
        words = " ".join(["word"] * (i % 23))  # a few words: the scripted vocabulary is small
        conv.add_message("user" if i % 2 == 0 else "assistant", f"message {i} {words}".strip(),
                         stopped=i == 1)
    return conv


def _on_screen(app: KVChatApp) -> list[ChatMessage]:
    """The mounted messages that overlap the transcript's visible rows."""
    t = app.chat.transcript
    return [w for w in t.messages if t.region.intersection(w.region).height > 0]


async def _settled(pilot) -> None:  # type: ignore[no-untyped-def]
    for _ in range(6):
        await pilot.pause(0.02)


async def _open(pilot, app: KVChatApp, conv: Conversation) -> None:  # type: ignore[no-untyped-def]
    await ready(pilot)
    await app.chat.show_conversation(conv)
    await _settled(pilot)


def _bounded(app: KVChatApp) -> None:
    mounted = app.chat.transcript.messages
    assert 0 < len(mounted) <= MOUNTED_AT_MOST, len(mounted)


@async_test
async def test_a_long_chat_mounts_only_what_is_on_screen(env: Path) -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await _open(pilot, app, _long_chat())
        t = app.chat.transcript
        assert len(t.entries) == N
        _bounded(app)
        shown = _on_screen(app)
        assert shown[-1].index == N - 1 and shown[-1].content.startswith(f"message {N - 1} ")
        assert t.is_vertical_scroll_end
        # keys reach the transcript from a focused message, as in a short chat
        shown[-1].focus()
        await pilot.press("home")
        await _settled(pilot)
        _bounded(app)
        shown = _on_screen(app)
        assert t.scroll_y == 0 and shown[0].index == 0 and shown[0].content == "message 0"
        assert shown[1].index == 1 and shown[1].has_class("-stopped")
        assert shown[1].border_subtitle == "■ stopped"
        await pilot.press("pagedown")
        await _settled(pilot)
        assert _on_screen(app)[0].index > 0
        await pilot.press("end")
        await _settled(pilot)
        _bounded(app)
        assert _on_screen(app)[-1].index == N - 1 and t.is_vertical_scroll_end
        # the mouse wheel, a long way up: whatever it lands on is mounted and shown
        for _ in range(300):
            t.post_message(events.MouseScrollUp(t, 2, 2, 0, -1, 0, False, False, False))
        await _settled(pilot)
        _bounded(app)
        shown = _on_screen(app)
        assert shown and shown[-1].index < N - 20
        indices = [w.index for w in shown]
        assert indices == list(range(indices[0], indices[0] + len(indices)))  # no gap


@async_test
async def test_a_reply_streams_at_the_bottom_of_a_long_chat(env: Path) -> None:
    app = make_app(pause_after=12)
    async with app.run_test(size=SIZE) as pilot:
        await _open(pilot, app, _long_chat(N_STREAMED))
        t = app.chat.transcript
        await send(pilot, "one more question")
        await wait_for(pilot, lambda: engine(app).paused.is_set())
        await _settled(pilot)
        shown = _on_screen(app)
        reply = app.chat.turns.reply
        assert reply is not None and reply.streaming and reply.content
        assert shown[-1] is reply and shown[-2].content == "one more question"
        assert REPLY.startswith(reply.content)
        # away to the top and back while it streams: the reply stays a widget, at the end
        shown[-2].focus()
        await pilot.press("home")
        await _settled(pilot)
        _bounded(app)
        assert _on_screen(app)[0].index == 0 and reply.is_mounted and reply.streaming
        await pilot.press("end")
        await _settled(pilot)
        assert _on_screen(app)[-1] is reply
        engine(app).resume()
        await wait_for(pilot, lambda: not busy(app))
        await _settled(pilot)
        _bounded(app)
        assert len(t.entries) == len(app.chat.conversation.messages) == N_STREAMED + 2
        last = _on_screen(app)[-1]
        assert last.index == N_STREAMED + 1 and last.content == REPLY and not last.streaming
        assert t.last_reply() == REPLY


@async_test
async def test_edit_mark_and_copy_outlive_scrolling_away(env: Path) -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        conv = _long_chat(N_STREAMED)
        await _open(pilot, app, conv)
        t = app.chat.transcript
        app.chat.action_edit_last()
        edited = N_STREAMED - 2
        assert app.chat.edit_index == edited
        t.messages[-1].focus()
        await pilot.press("home")
        await _settled(pilot)
        assert all(w.index < 100 for w in t.messages)  # the edited message is not mounted
        app.chat.input.focus()
        await pilot.press("ctrl+y")  # the newest reply, although it is not mounted
        assert app.clipboard == conv.messages[-1]["content"]
        t.scroll_end(animate=False)
        await _settled(pilot)
        marked = [w.index for w in t.messages if w.has_class("-editing")]
        assert marked == [edited]


@async_test
async def test_paging_through_markdown_moves_the_view_by_a_page(env: Path) -> None:
    """Markdown replies are far taller than their first estimate: as each comes on
    screen and is measured, what the view shows must not jump."""
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await _open(pilot, app, markdown_chat(200, STORIES260K))
        t = app.chat.transcript
        t.messages[-1].focus()
        await _settled(pilot)
        page = t.scrollable_content_region.height
        for _ in range(6):
            ref = _on_screen(app)[0]
            index, y0 = ref.index, ref.region.y
            await pilot.press("pageup")
            await _settled(pilot)
            same = next(w for w in t.messages if w.index == index)
            assert same.region.y - y0 == page
            _bounded(app)
