"""One chat turn in the UI: it submits the turn to the engine, streams its text into the
reply, follows its Started / Stats / Done events and its notices, and stops it.

A stop (Esc, Ctrl+C) asks the engine to cancel at its next token: the reply says
"stopping…" at once and ends marked stopped with the text the engine had produced, however
the engine ends the turn: a busy UI can handle the key only after the engine has already
finished on its own (docs/design.md, Data flow of one chat turn). What the turn leaves
behind (the message in the conversation, the saved chat) is the conversation's business:
`keep` gets it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from kvchat.app.tui.bridge import Bridge
from kvchat.app.tui.turn import FINISH_PHASE, Phase
from kvchat.app.tui.turn_notices import on_turn_event
from kvchat.app.tui.widgets import ChatMessage, StatsPanel, Transcript
from kvchat.model.runtime.events import (
    Done,
    EngineLike,
    GenParams,
    Overflow,
    PrefillProgress,
    Started,
    Stats,
)

TEXT_FLUSH_HZ = 15  # streamed text reaches the transcript at most this often
FINISH_NOTES = {"length": "max tokens reached", "stop": "stop string", "eos": ""}


class TurnView(Protocol):
    """What the controller uses of the chat screen."""

    engine: EngineLike | None
    bridge: Bridge
    phase: Phase

    @property
    def transcript(self) -> Transcript: ...

    @property
    def panel(self) -> StatsPanel: ...

    def go(self, new: Phase) -> None: ...

    def notify(self, message: str, *, title: str = "", severity: Any = "information",
               timeout: float | None = None) -> None: ...

    def set_timer(self, delay: float, callback: Callable[[], Any]) -> Any: ...


class TurnController:
    """The running turn of one chat screen. `keep(text, stopped)` is called once per
    reply that stays in the conversation."""

    def __init__(self, view: TurnView, keep: Callable[[str, bool], None]) -> None:
        self.view = view
        self._keep = keep
        self.reply: ChatMessage | None = None  # the reply streaming now
        self.restored_tokens = 0  # tokens of a reopened chat's cache, until its next turn
        self._gen = 0  # the turn whose text the transcript shows (the bridge's count)
        self._stop_asked = False  # a stop reached this turn before its Done did
        self._last_flush = 0.0
        self._flush_armed = False

    # ---- starting and stopping -------------------------------------------------------------
    async def start(self, messages: list[dict[str, str]], params: GenParams, index: int) -> None:
        """Show an empty reply at conversation position `index` and submit the turn."""
        view = self.view
        assert view.engine is not None
        self.reply = ChatMessage("assistant", "", index=index, streaming=True)
        self._stop_asked = False
        await view.transcript.add(self.reply)
        view.transcript.follow()
        view.go(Phase.PREFILLING)
        view.engine.submit(messages, params)

    def stop(self) -> bool:
        """Stop the running turn at its next token (the partial text stays, marked
        stopped); False when no turn runs."""
        view = self.view
        if not view.phase.generating or view.engine is None:
            return False
        self._stop_asked = True
        view.engine.cancel()
        if self.reply is not None:
            self.reply.mark_stopping()
        return True

    # ---- streamed text ---------------------------------------------------------------------
    def follow(self, gen: int) -> None:
        """A turn started (the bridge's count of Started events): its text is the one shown."""
        self._gen = gen

    async def text_ready(self) -> None:
        # At most TEXT_FLUSH_HZ transcript updates a second, however fast tokens come:
        # each update re-lays out the screen, and keys must stay snappy while decoding.
        wait = self._last_flush + 1 / TEXT_FLUSH_HZ - time.monotonic()
        if wait <= 0:
            await self.flush()
        elif not self._flush_armed:
            self._flush_armed = True
            self.view.set_timer(wait, self._timed_flush)

    async def _timed_flush(self) -> None:
        self._flush_armed = False
        await self.flush()

    async def flush(self) -> None:
        """Move the streamed text of this turn into the reply."""
        self._last_flush = time.monotonic()
        text = self.view.bridge.take(self._gen)
        if text and self.reply is not None:
            if self.view.phase is Phase.PREFILLING:
                self.view.go(Phase.DECODING)
            await self.reply.append(text)

    # ---- engine events ---------------------------------------------------------------------
    async def on_started(self, ev: Started) -> None:
        view = self.view
        view.panel.start_turn(ev.prompt_tokens, ev.cached_tokens)
        if ev.reprefill_reason:
            view.notify(ev.reprefill_reason, title="Cache")
        if self.restored_tokens:  # the first turn of a chat reopened with its cache
            view.notify(
                f"{view.panel.held(ev.cached_tokens):,} tokens from the saved cache;"
                f" {ev.reprefilled_tokens:,} re-prefilled.",
                title="Reopened warm",
            )
            self.restored_tokens = 0
        await self.flush()

    def on_stats(self, ev: Stats) -> None:
        self.view.panel.update_stats(ev.stats)
        if self.view.phase is Phase.PREFILLING and ev.stats.generated_tokens:
            self.view.go(Phase.DECODING)

    def on_notice(self, ev: PrefillProgress | Overflow) -> None:
        on_turn_event(ev, self.view.panel, self.reply, self.view.notify)

    async def on_done(self, ev: Done) -> None:
        await self.flush()
        reply, self.reply = self.reply, None
        # asked to stop: the engine may have ended the turn on its own before the cancel
        # reached it; the user stopped it all the same
        stopped = ev.finish_reason == "cancelled" or (
            self._stop_asked and ev.finish_reason != "error")
        self._stop_asked = False
        view = self.view
        try:
            view.panel.end_turn(ev.stats)
            if reply is not None:
                await self._finish_reply(reply, ev, stopped)
        finally:
            # only now: the conversation and the file are up to date when keys are
            # accepted again
            if view.phase.generating:
                view.go(Phase.STOPPED if stopped
                        else FINISH_PHASE.get(ev.finish_reason, Phase.ERROR))

    async def _finish_reply(self, reply: ChatMessage, ev: Done, stopped: bool) -> None:
        if ev.finish_reason == "error":
            self.view.notify(ev.error or "generation failed", severity="error", title="Error")
            if ev.text:  # the reply so far (a rank died mid-reply): kept, marked, saved
                await reply.finish(ev.text, stopped=True, note="error")
                self._keep(ev.text, True)
            else:
                await self.view.transcript.remove_message(reply)
            return
        await reply.finish(ev.text, stopped=stopped, note=FINISH_NOTES.get(ev.finish_reason, ""))
        self._keep(ev.text, stopped)
