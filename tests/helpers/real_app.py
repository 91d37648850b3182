"""The chat app on the real engine (its own process, real MLX) and stories260K, for UI
tests and benchmarks that need real decoding; every event the app was sent is recorded."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvchat.app.core.settings import Settings
from kvchat.app.tui.app import KVChatApp
from kvchat.model.runtime.engine_process import EngineProcess
from kvchat.model.runtime.events import Event, GenParams
from tests.helpers.paths import STORIES260K


def settings(**kw: Any) -> Settings:
    """Greedy settings (reproducible replies) with a short reply unless `kw` says so."""
    base = {"temp": 0.0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0,
            "max_tokens": 48}
    return Settings(**{**base, **kw})


class EndlessEngine(EngineProcess):
    """Decodes on past EOS and BOS (stories260K ends a story with BOS) up to max_tokens:
    for tests that need a reply still streaming after a few seconds."""

    def submit(self, prompt: Any, params: GenParams | None = None) -> int:
        return super().submit(prompt, dataclasses.replace(params or GenParams(), ignore_eos=True))


def real_app(
    s: Settings, engine: type[EngineProcess] = EngineProcess
) -> tuple[KVChatApp, list[Event]]:
    """The app on the real engine and stories260K; every event it was sent is recorded."""
    seen: list[Event] = []

    def factory(on_event: Any, path: str | None) -> EngineProcess:
        def recording(ev: Event) -> None:
            seen.append(ev)
            on_event(ev)

        return engine(recording, path)  # as the app runs it: in its own process

    return KVChatApp(str(STORIES260K), s, engine_factory=factory), seen


def last(seen: list[Event], kind: type) -> Any:
    """The last recorded event of `kind`."""
    found = [e for e in seen if isinstance(e, kind)]
    assert found, f"no {kind.__name__} event yet"
    return found[-1]
