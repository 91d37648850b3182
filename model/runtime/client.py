"""The engine driven synchronously: one client for `kvchat generate`, `kvchat bench`,
the training sampler and the tests.

The engine still runs on its own thread (it owns every MLX call); the client waits on its
events in a queue. Ctrl+C during a turn cancels it and returns the partial reply.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvchat.model.errors import KVChatError

from .events import Done, EngineLike, Event, GenParams, Loaded, LoadFailed, Prompt, TextDelta

EngineMaker = Callable[..., EngineLike]


class EngineClient:
    """Load a model, then `run(prompt, params) -> Done`. Use as a context manager or
    call close(). Every event a run produced is in `events` until the next run."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        on_delta: Callable[[str], None] | None = None,
        engine: EngineMaker | None = None,
        timeout: float | None = None,
        **engine_kw: Any,
    ) -> None:
        if engine is None:
            from .engine import Engine  # imports MLX

            engine = Engine
        self._queue: queue.Queue[Event] = queue.Queue()
        self.on_delta = on_delta
        self.timeout = timeout
        self.events: list[Event] = []
        self.engine = engine(self._queue.put, str(model_path), **engine_kw)
        try:
            ev = self.wait(Loaded, LoadFailed)
        except BaseException:  # Ctrl+C while loading: don't leave the thread running
            self.engine.close(timeout=1.0)
            raise
        if isinstance(ev, LoadFailed):
            self.engine.close()
            raise KVChatError(ev.message)
        assert isinstance(ev, Loaded)
        self.info: dict[str, Any] = ev.info

    def wait(self, *kinds: type) -> Event:
        """The next event of one of `kinds` (others are kept in `events`)."""
        while True:
            ev = self._queue.get(timeout=self.timeout)
            self.events.append(ev)
            if isinstance(ev, kinds):
                return ev

    def queued(self) -> int:
        """Events the engine has sent that no wait() has taken yet."""
        return self._queue.qsize()

    def run(self, prompt: Prompt, params: GenParams | None = None) -> Done:
        """One turn, to its Done; text deltas go to `on_delta` as they come."""
        self.events = []
        self.engine.submit(prompt, params or GenParams())
        try:
            while True:
                ev = self.wait(TextDelta, Done)
                if isinstance(ev, Done):
                    return ev
                if self.on_delta is not None:
                    self.on_delta(ev.text)
        except KeyboardInterrupt:  # once: cancel and wait for the turn's Done
            self.engine.cancel()
            try:
                done = self.wait(Done)
            except KeyboardInterrupt:  # twice: give up now with what arrived
                text = "".join(e.text for e in self.events if isinstance(e, TextDelta))
                ids = [e.token for e in self.events if isinstance(e, TextDelta)]
                return Done("cancelled", text, ids, [])
            assert isinstance(done, Done)
            return done

    def reset(self) -> None:
        self.engine.reset()

    def close(self, timeout: float = 10.0) -> None:
        self.engine.close(timeout)

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
