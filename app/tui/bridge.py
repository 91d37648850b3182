"""Engine thread -> UI thread.

The engine reports through a callback on its own thread; `Bridge` hops to the UI with the
thread-safe `post_message`, which never waits for the UI, so a slow repaint cannot slow
decoding. Text deltas are batched: the first delta of a batch posts one `TextReady`,
later ones only append to a buffer until the UI drains it with `take()`.
"""

from __future__ import annotations

import threading

from textual.message import Message
from textual.message_pump import MessagePump

from kvchat.model.runtime.events import Event, Started, TextDelta


class EngineEvent(Message):
    """An engine event, hopped to the UI thread. `gen` counts turns (Started events)."""

    def __init__(self, event: Event, gen: int) -> None:
        super().__init__()
        self.event = event
        self.gen = gen


class TextReady(Message):
    """Streamed text is waiting in the bridge's buffer."""


class Bridge:
    """Called on the engine thread; never blocks it."""

    def __init__(self, target: MessagePump) -> None:
        self.target = target
        self.closed = False
        self._lock = threading.Lock()
        self._gen = 0
        self._buf: list[tuple[int, str]] = []  # (turn, text) in arrival order
        self._posted = False

    def __call__(self, event: Event) -> None:
        if self.closed:
            return
        if isinstance(event, TextDelta):
            with self._lock:
                self._buf.append((self._gen, event.text))
                post, self._posted = not self._posted, True
            if post:
                self._post(TextReady())
            return
        with self._lock:
            if isinstance(event, Started):
                self._gen += 1
            gen = self._gen
        self._post(EngineEvent(event, gen))

    def _post(self, message: Message) -> None:
        try:
            self.target.post_message(message)
        except RuntimeError:  # the loop closed while the engine was still talking
            self.closed = True

    def take(self, gen: int) -> str:
        """(UI thread) the buffered text of turn `gen`; older leftovers are dropped and a
        newer turn's text stays for that turn (its Started may not be handled yet)."""
        with self._lock:
            out = "".join(t for g, t in self._buf if g == gen)
            self._buf = [(g, t) for g, t in self._buf if g > gen]
            self._posted = False
        return out
