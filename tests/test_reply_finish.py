"""A streamed reply, once it ends, looks exactly as the same text rendered from scratch,
and keeps the blocks it streamed when they already are what a full parse gives (a long
reply's re-mount held the UI, and the keys typed meanwhile, for a fifth of a second)."""

from __future__ import annotations

import re

import pytest
from textual.app import App, ComposeResult
from textual.widgets import Markdown

from kvchat.app.tui.widgets.chat import ChatMessage, Transcript
from tests.helpers.scripted_engine import async_test

TEXTS = {
    "blocks": "# Title\n\nSome *text* and `code`.\n\n- one\n- two\n  more\n\n1. a\n2. b\n\n"
              "```python\nprint(1)\n\nx = 2\n```\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n"
              "> quote\n> more\n\nEnd **bold**.",
    "paragraphs": "\n\n".join(f"Paragraph {i}: Lily and Ben went to the park." for i in range(9)),
    # a fence left open until the end, then closed: every block before it must stay
    "late fence": "Before.\n\n```\ncode\n\nmore code\n```\nAfter the fence.",
    # a link definition at the end changes how an earlier paragraph reads
    "link definition": "See [the docs][d] first.\n\nThen more.\n\n[d]: https://example.com",
}


class _One(App[None]):
    def compose(self) -> ComposeResult:
        yield Transcript()


async def _screen(text: str, stream: bool) -> tuple[str, bool]:
    """(the screenshot of one reply holding `text`, whether its streamed blocks stayed)"""
    app = _One()
    async with app.run_test(size=(80, 60)) as pilot:
        transcript = app.query_one(Transcript)
        kept = False
        if stream:
            msg = ChatMessage("assistant", "", index=0, streaming=True)
            await transcript.add(msg)
            for i in range(0, len(text), 3):  # fragments split words, marks and fences
                await msg.append(text[i:i + 3])
            await pilot.pause()
            before = list(msg.query_one(Markdown).children)
            await msg.finish(text)
            kept = list(msg.query_one(Markdown).children) == before
        else:
            msg = ChatMessage("assistant", text, index=0)
            await transcript.add(msg)
        await pilot.pause()
        return re.sub(r"terminal-\d+", "terminal", app.export_screenshot()), kept


@pytest.mark.parametrize("name", list(TEXTS))
@async_test
async def test_a_finished_stream_renders_as_the_text_from_scratch(name: str) -> None:
    text = TEXTS[name]
    streamed, kept = await _screen(text, stream=True)
    fresh, _ = await _screen(text, stream=False)
    assert streamed == fresh
    # the streamed blocks stay unless a full parse differs (the link definition)
    assert kept is (name != "link definition")
