"""The chat app under Pilot: apps over the scripted engine (tests/helpers/scripted_engine.py)
or the real one, and the steps every UI test takes (wait until loaded, send a turn, read
the replies). The folders the app reads and writes come from conftest's `env` fixtures."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from textual import events

from kvchat.app.core.settings import Settings
from kvchat.app.tui.app import KVChatApp
from kvchat.app.tui.screens import ModelPickerScreen
from kvchat.app.tui.widgets import ChatMessage
from kvchat.model.runtime.events import Done
from tests.helpers.scripted_engine import ScriptedEngine, wait_for

MODEL = "/models/stories260K"  # the scripted engine's model: a path nothing reads
SIZE = (120, 40)
# the real engine loads its model in a child process: on a loaded 2-core machine that
# can take tens of seconds, so the waits below allow it
LOAD_TIMEOUT = 120.0


def make_app(settings: Settings | None = None, **engine_kw: Any) -> KVChatApp:
    """The app on the scripted engine (`engine_kw` are its knobs) and MODEL."""

    def factory(on_event: Any, path: str | None) -> ScriptedEngine:
        return ScriptedEngine(on_event, path, **engine_kw)

    return KVChatApp(MODEL, settings or Settings(), engine_factory=factory)


def folder_app(env: Path, model: str | None = None, **settings: Any) -> KVChatApp:
    """The app on the scripted engine with `models_env`'s model folders (it opens
    models/mini unless `model` says otherwise); `settings` are Settings fields."""
    s = Settings(model_dirs=[str(env / "models")], **settings)
    path = model or str((env / "models" / "mini").resolve())
    return KVChatApp(path, s, engine_factory=lambda cb, p: ScriptedEngine(cb, p, token_delay=0.001))


def engine(app: KVChatApp) -> ScriptedEngine:
    assert isinstance(app.chat.engine, ScriptedEngine)
    return app.chat.engine


def busy(app: KVChatApp) -> bool:
    return app.chat.phase.generating


def replies(app: KVChatApp) -> list[ChatMessage]:
    return [w for w in app.chat.transcript.messages if w.role == "assistant"]


def last_done(app: KVChatApp) -> Done:
    done = [e for e in engine(app).events if isinstance(e, Done)]
    assert done, "no turn has ended"
    return done[-1]


async def ready(pilot: Any, timeout: float = LOAD_TIMEOUT) -> None:
    """Until the model is loaded (its info reached the chat)."""
    await wait_for(pilot, lambda: bool(pilot.app.chat.model_info), timeout=timeout)


@contextlib.asynccontextmanager
async def loaded(app: KVChatApp, size: tuple[int, int] = SIZE,
                 timeout: float = LOAD_TIMEOUT) -> AsyncIterator[Any]:
    """`app` running under Pilot in a `size` terminal, its model loaded: the pilot."""
    async with app.run_test(size=size) as pilot:
        await ready(pilot, timeout)
        yield pilot


async def send(pilot: Any, text: str) -> None:
    pilot.app.chat.input.load_text(text)
    await pilot.press("enter")


async def turn(pilot: Any, text: str, timeout: float = LOAD_TIMEOUT) -> None:
    """Send `text` and wait until the reply has ended."""
    await send(pilot, text)
    await wait_for(pilot, lambda: not busy(pilot.app), timeout=timeout)


def press_now(app: KVChatApp, key: str, char: str | None = None) -> None:
    """Queue a key as the terminal driver does. pilot.press would also wait for the
    screen to settle, which while a reply streams means until the reply ends."""
    app.post_message(events.Key(key, char))


async def press_until(pilot: Any, key: str, char: str | None, done: Callable[[], bool],
                      timeout: float = 30.0) -> float:
    """Queue a key as the terminal driver does and poll until `done()` holds; the seconds
    from the key entering the app's queue to its effect on the app's state."""
    t0 = time.perf_counter()
    pilot.app.post_message(events.Key(key, char))
    while not done():
        if time.perf_counter() - t0 > timeout:
            raise AssertionError(f"{key!r} had no effect within {timeout:.0f}s")
        await asyncio.sleep(0.0005)  # not pilot.pause: that forces a repaint per poll
    return time.perf_counter() - t0


async def open_picker(pilot: Any) -> ModelPickerScreen:
    """Ctrl+O, until the picker has scanned the model folders."""
    await pilot.press("ctrl+o")
    picker = pilot.app.screen
    assert isinstance(picker, ModelPickerScreen)
    await wait_for(pilot, lambda: picker.scanned)
    return picker
