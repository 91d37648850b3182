"""One engine, many requests: a bounded queue served in arrival order.

The engine (in its own process, as the chat runs it; on a thread of this process when a
pipeline's rank 0 must be this process) runs one turn at a time. Its events arrive on a
reader thread and hop to the event loop; the running job gets them on its own queue.
Turns are submitted one by one, only after the previous Done, so `engine.cancel()`
(which cancels every turn submitted so far) only ever reaches the job it is meant for.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvchat.model.events import (
    Done,
    EngineLike,
    Event,
    GenParams,
    Loaded,
    LoadFailed,
    Prompt,
    Started,
    Stats,
    TurnStats,
)

EngineMaker = Callable[[Callable[[Event], None]], EngineLike]
RETRY_AFTER_S = 1  # what a 429 asks a client to wait


class QueueFull(Exception):
    """The waiting line is at its bound (answer 429)."""


class NotReady(Exception):
    """The model is still loading, or the engine has stopped (answer 503)."""


@dataclass
class Job:
    prompt: Prompt
    params: GenParams
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    state: str = "waiting"  # waiting | running | done
    started: Started | None = None
    cancelled: bool = False
    t_arrival: float = field(default_factory=time.monotonic)
    t_start: float | None = None
    finished: asyncio.Event = field(default_factory=asyncio.Event)


class EngineWorker:
    """The engine behind the server. Create, then `await start()` on the event loop."""

    def __init__(self, make_engine: EngineMaker, max_queue: int):
        self._make_engine = make_engine
        self.max_queue = max_queue
        self.waiting: collections.deque[Job] = collections.deque()
        self.current: Job | None = None
        self.info: dict[str, Any] = {}
        self.load_error: str | None = None
        self.ready = asyncio.Event()  # set when the model loaded (or failed to)
        self.failed = asyncio.Event()  # set when it failed to, or the engine stopped
        self.live: TurnStats = TurnStats()  # the running turn's latest numbers
        self.last: TurnStats = TurnStats()  # the last finished turn's numbers
        self.counters = dict.fromkeys(
            ("requests", "completed", "cancelled", "errors", "rejected_busy",
             "prompt_tokens", "reused_tokens", "generated_tokens"), 0)
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self.engine: EngineLike | None = None
        self.t_start = time.time()

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.engine = self._make_engine(self._from_engine)
        self._task = asyncio.create_task(self._serve(), name="kvchat-serve-worker")

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self.engine is not None:
            self.engine.close(5.0)

    @property
    def is_ready(self) -> bool:
        return self.ready.is_set() and self.load_error is None

    # ---- jobs (event loop) ---------------------------------------------------------
    def submit(self, prompt: Prompt, params: GenParams) -> Job:
        if not self.is_ready:
            raise NotReady(self.load_error or "the model is still loading")
        # the first waiting job is as good as running when the engine is idle
        if len(self.waiting) + (self.current is not None) > self.max_queue:
            self.counters["rejected_busy"] += 1
            raise QueueFull(f"{len(self.waiting)} requests are already waiting")
        job = Job(prompt, params)
        self.counters["requests"] += 1
        self.waiting.append(job)
        self._wake.set()
        return job

    def cancel(self, job: Job) -> None:
        """The client left: drop a waiting job at once, stop a running one within one
        decode step (its Done comes back as usual)."""
        if job.state == "done" or job.cancelled:
            return
        job.cancelled = True
        if job.state == "waiting":
            self.waiting.remove(job)
            self._finish(job, Done("cancelled", "", [], []))
        elif self.engine is not None:
            self.engine.cancel()

    async def _serve(self) -> None:
        while True:
            while not self.waiting:
                self._wake.clear()
                await self._wake.wait()
            job = self.waiting.popleft()
            job.state, job.t_start = "running", time.monotonic()
            self.current = job
            assert self.engine is not None
            self.engine.submit(job.prompt, job.params)
            await job.finished.wait()
            self.current = None

    # ---- engine events -------------------------------------------------------------
    def _from_engine(self, ev: Event) -> None:  # the engine's thread
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._on_event, ev)
        except RuntimeError:  # the loop closed while shutting down
            pass

    def _on_event(self, ev: Event) -> None:
        if isinstance(ev, Loaded):
            self.info, self.load_error = ev.info, None
            self.ready.set()
            return
        if isinstance(ev, LoadFailed):  # at start-up, or the engine process died
            self.load_error = ev.message or "the engine stopped"
            self.ready.set()
            self.failed.set()
            return
        job = self.current
        if job is None:
            return
        if isinstance(ev, Started):
            job.started = ev
        elif isinstance(ev, Stats):
            self.live = ev.stats
        if isinstance(ev, Done):
            self._finish(job, ev)
        else:
            job.events.put_nowait(ev)

    def _finish(self, job: Job, done: Done) -> None:
        job.state = "done"
        c = self.counters
        if done.finish_reason == "cancelled":
            c["cancelled"] += 1
        elif done.finish_reason == "error":
            c["errors"] += 1
            if not getattr(self.engine, "alive", True):  # the engine process died
                self.load_error = done.error or "the engine stopped"
                self.failed.set()
        else:
            c["completed"] += 1
            self.last = done.stats
        c["prompt_tokens"] += len(done.prompt_ids)
        c["reused_tokens"] += done.stats.cached_tokens or 0
        c["generated_tokens"] += len(done.ids)
        job.events.put_nowait(done)
        job.finished.set()

    # ---- statistics ------------------------------------------------------------------
    def queue_stats(self) -> dict[str, Any]:
        return {"waiting": len(self.waiting), "running": self.current is not None,
                "max_queue": self.max_queue}
