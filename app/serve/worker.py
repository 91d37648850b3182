"""One engine, many requests: a bounded queue served in arrival order.

The engine (in its own process, as the chat runs it; on a thread of this process when a
pipeline's rank 0 must be this process) runs up to its `max_batch` turns side by side,
decoding them in one batched step (docs/serve.md, "Many clients"); an engine without
batching runs one at a time. Its events arrive on a reader thread and hop to the event
loop, each tagged with its turn (TurnEvent) when turns run side by side; each running
job gets its own on its own queue. A client that leaves cancels its turn alone
(`engine.cancel(turn)`).
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvchat.model.runtime.events import (
    Done,
    EngineLike,
    Event,
    GenParams,
    Loaded,
    LoadFailed,
    Prompt,
    Started,
    Stats,
    TurnEvent,
    TurnStats,
)

EngineMaker = Callable[[Callable[[Event], None]], EngineLike]
RETRY_AFTER_S = 1  # what a 429 asks a client to wait
# an engine process that dies (a crash in native code) is started again, this many times
# a minute at most; past that the server stops with the reason
MAX_RESTARTS = 3
RESTART_WINDOW_S = 60.0


class QueueFull(Exception):
    """The waiting line is at its bound (answer 429)."""


class NotReady(Exception):
    """The model is still loading, or the engine has stopped (answer 503)."""


@dataclass
class Job:
    prompt: Prompt
    params: GenParams
    model_path: str | None = None  # load this model first (None: the loaded one)
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    state: str = "waiting"  # waiting | running | done
    started: Started | None = None
    cancelled: bool = False
    t_arrival: float = field(default_factory=time.monotonic)
    t_start: float | None = None
    turn: int | None = None  # the engine's id of its turn, once submitted
    live: TurnStats | None = None  # its latest numbers while it runs
    finished: asyncio.Event = field(default_factory=asyncio.Event)


class EngineWorker:
    """The engine behind the server. Create, then `await start()` on the event loop."""

    def __init__(self, make_engine: EngineMaker, max_queue: int,
                 notice: Callable[[str], None] = print):
        self._make_engine = make_engine
        self._notice = notice
        self._generation = 0  # which engine's events are current (restarts make new ones)
        self._switch: asyncio.Future[str | None] | None = None  # a load a request asked for
        self._deaths: list[float] = []
        self.max_queue = max_queue
        self.waiting: collections.deque[Job] = collections.deque()
        self.running: dict[int, Job] = {}  # by turn id, in submission order
        self._starting: Job | None = None  # popped, loading its model before it runs
        self.info: dict[str, Any] = {}
        self.load_error: str | None = None
        self.ready = asyncio.Event()  # set when the model loaded (or failed to)
        self.failed = asyncio.Event()  # set when it failed to, or the engine stopped
        self.last: TurnStats = TurnStats()  # the last finished turn's numbers
        self.counters = dict.fromkeys(
            ("requests", "completed", "cancelled", "errors", "rejected_busy", "engine_restarts",
             "prompt_tokens", "reused_tokens", "generated_tokens"), 0)
        self._wake = asyncio.Event()
        # events from the engine's thread on their way to the loop (_from_engine)
        self._inbox: list[tuple[Event, int]] = []
        self._inbox_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self.engine: EngineLike | None = None
        self.t_start = time.time()

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._start_engine()
        self._task = asyncio.create_task(self._serve(), name="kvchat-serve-worker")

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self.engine is not None:
            self.engine.close(5.0)

    @property
    def is_ready(self) -> bool:
        return self.ready.is_set() and self.load_error is None

    @property
    def max_running(self) -> int:
        """Turns the engine runs side by side (1: one at a time)."""
        return max(1, int(getattr(self.engine, "max_batch", 1) or 1))

    @property
    def current(self) -> Job | None:
        """The longest-running job (None: the engine is idle)."""
        return next(iter(self.started), None)

    @property
    def started(self) -> list[Job]:
        """The jobs running (or loading their model first), the longest-running first."""
        return ([self._starting] if self._starting is not None else []) + list(
            self.running.values())

    def _n_running(self) -> int:
        return len(self.running) + (self._starting is not None)

    # ---- jobs (event loop) ---------------------------------------------------------
    def submit(self, prompt: Prompt, params: GenParams, model_path: str | None = None) -> Job:
        if not self.is_ready:
            raise NotReady(self.load_error or "the model is still loading")
        # max_queue wait beyond the jobs running (a waiting job is as good as running when
        # the engine has room for it)
        if len(self.waiting) + self._n_running() >= self.max_queue + self.max_running:
            self.counters["rejected_busy"] += 1
            raise QueueFull(f"{len(self.waiting)} requests are already waiting")
        job = Job(prompt, params, model_path)
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
        elif self.engine is not None and job.turn is not None:
            self.engine.cancel(job.turn)

    async def _serve(self) -> None:
        while True:
            while not self.waiting or len(self.running) >= self.max_running:
                self._wake.clear()
                await self._wake.wait()
            job = self.waiting.popleft()
            job.state, job.t_start = "running", time.monotonic()
            assert self.engine is not None
            if job.model_path is not None and job.model_path != self.info.get("path"):
                self._starting = job
                while self.running:  # the turns of the loaded model end first
                    self._wake.clear()
                    await self._wake.wait()
                error = await self._load(job.model_path)
                self._starting = None
                if error is not None:
                    self._finish(job, Done("error", "", [], [], error=error))
                    continue
            job.turn = self.engine.submit(job.prompt, job.params)
            self.running[job.turn] = job

    async def _load(self, path: str) -> str | None:
        """Switch the engine to the model at `path` (its caches go with the old one);
        the reason when it could not load (the old model stays)."""
        assert self._loop is not None and self.engine is not None
        self._switch = self._loop.create_future()
        self.engine.load(path)
        try:
            return await self._switch
        finally:
            self._switch = None

    # ---- the engine -----------------------------------------------------------------
    def _start_engine(self) -> None:
        self._generation += 1
        gen = self._generation
        self.engine = self._make_engine(lambda ev: self._from_engine(ev, gen))

    def _engine_died(self, why: str) -> None:
        """Start a fresh engine (the model loads again; queued jobs wait for it), unless
        it never loaded or keeps dying."""
        now = time.monotonic()
        self._deaths = [t for t in self._deaths if now - t < RESTART_WINDOW_S] + [now]
        if not self.info or len(self._deaths) > MAX_RESTARTS:
            self.load_error = why
            self.ready.set()
            self.failed.set()
            return
        self.counters["engine_restarts"] += 1
        self._notice(f"the engine stopped ({why}); starting it again")
        self.ready.clear()
        if self.engine is not None:
            self.engine.close(1.0)
        self._start_engine()

    def _from_engine(self, ev: Event, gen: int) -> None:  # the engine's thread
        """Hand `ev` to the event loop: a burst (a round's token of every running turn)
        wakes the loop once, not once per event."""
        assert self._loop is not None
        with self._inbox_lock:
            self._inbox.append((ev, gen))
            if len(self._inbox) > 1:
                return  # a drain is already on its way
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop closed while shutting down
            pass

    def _drain(self) -> None:
        with self._inbox_lock:
            events, self._inbox = self._inbox, []
        for ev, gen in events:
            self._on_event(ev, gen)

    def _on_event(self, ev: Event, gen: int) -> None:
        if gen != self._generation:  # a replaced engine's last words
            return
        if isinstance(ev, Loaded):
            first = not self.info
            self.info, self.load_error = ev.info, None
            self.ready.set()
            if self._switch is not None and not self._switch.done():
                self._notice(f"loaded {ev.info.get('name')} for a request")
                self._switch.set_result(None)
            elif not first:
                self._notice("the engine is ready again")
            return
        if isinstance(ev, LoadFailed):
            alive = getattr(self.engine, "alive", True)
            if self._switch is not None and not self._switch.done():
                # the requested model: the old one stays
                self._switch.set_result(f"cannot load {ev.path}: {ev.message}")
            if self._switch is None or not alive:  # at start-up, or the engine died
                self._engine_died(ev.message or "the engine stopped")
            return
        if isinstance(ev, TurnEvent):
            job, ev = self.running.get(ev.turn), ev.event
        elif isinstance(ev, Done) and len(self.running) > 1:  # the engine died mid-turns
            for job in list(self.running.values()):
                self._finish(job, ev)
            return
        else:  # an engine that runs one turn at a time
            job = next(iter(self.running.values()), None)
        if job is None:
            return
        if isinstance(ev, Started):
            job.started = ev
        elif isinstance(ev, Stats):
            job.live = ev.stats
        if isinstance(ev, Done):
            self._finish(job, ev)
        else:
            job.events.put_nowait(ev)

    def _finish(self, job: Job, done: Done) -> None:
        job.state = "done"
        if job.turn is not None:
            self.running.pop(job.turn, None)
        self._wake.set()
        c = self.counters
        if done.finish_reason == "cancelled":
            c["cancelled"] += 1
        elif done.finish_reason == "error":
            c["errors"] += 1
        else:
            c["completed"] += 1
            self.last = done.stats
        c["prompt_tokens"] += len(done.prompt_ids)
        c["reused_tokens"] += done.stats.cached_tokens or 0
        c["generated_tokens"] += len(done.ids)
        job.events.put_nowait(done)
        job.finished.set()
        if done.finish_reason == "error" and not getattr(self.engine, "alive", True):
            self._engine_died(done.error or "the engine stopped")  # it died mid-turn

    # ---- statistics ------------------------------------------------------------------
    def queue_stats(self) -> dict[str, Any]:
        return {"waiting": len(self.waiting), "running": self.current is not None,
                "running_requests": self._n_running(), "max_batch": self.max_running,
                "max_queue": self.max_queue}
