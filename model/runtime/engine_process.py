"""The engine in its own process, behind the same client API as `Engine`.

Why: a Textual UI and the engine in one interpreter share one GIL. While the UI lays out
and renders a streaming reply it holds the GIL for milliseconds at a time, and the
engine thread waits for it several times per token, so decoding slowed to a fraction of
`kvchat generate`'s rate (docs/performance.md). In a child process the
engine has an interpreter of its own; the UI process only unpickles events.

Protocol: two pipes of pickled objects. Parent -> child: (an EngineLike method name,
args) or None to stop. Child -> parent: the engine's events in order, plus `_Snapshot`s
of the cache statistics after every event that changes them (so `layer_stats()` and
`cache_stats()` answer from the last snapshot without a round trip), and None when the
child is done.

SIGINT: the child never acts on it. Ctrl+C at a terminal reaches the whole foreground
process group, the child included; the parent decides what it means (cancel the turn,
shut down) and ends the child through `close`, so a turn never dies half-written. The
child is born with SIGINT blocked and ignores it from its first line on.

Stderr: by default the child shares the parent's. Given `stderr_log`, the child's fd 2 is
that file (opened for appending, set up by the OS before the interpreter starts), so what
any native library prints (a Rust tokenizer's panic, a BLAS warning) lands there and never
on a terminal the parent draws on (the chat's screen); a log that cannot be opened means
fd 2 is /dev/null. When the child dies, the one line the parent reports names the log.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from . import threads
from .events import (
    CacheRestored,
    Done,
    Event,
    GenParams,
    Loaded,
    LoadFailed,
    Stats,
    TurnEvent,
    TurnStats,
)

_SNAPSHOT_AFTER = (Stats, Done, Loaded, CacheRestored)
_END = object()  # the child's event sender stops (after the None that tells the parent)


@dataclass
class _Snapshot:
    layers: list[dict[str, Any]]
    cache: TurnStats


class EngineProcess:
    """`model.events.EngineLike` with the engine running in a child Python process.
    `on_event` is called on a reader thread of this process, as `Engine` calls it on its
    own thread."""

    def __init__(self, on_event: Callable[[Event], None], model_path: str | Path | None = None,
                 nice: int = 0, *, stderr_log: str | Path | None = None, **engine_kw: Any):
        self._on_event = on_event
        self.max_batch: int = engine_kw.get("max_batch", 1)  # see Engine
        self._stderr_log = Path(stderr_log) if stderr_log is not None else None
        self._lock = threading.Lock()
        self._turn = 0
        self._pending = 0  # turns submitted and not yet Done
        self._snapshot = _Snapshot([], TurnStats())
        from kvchat import metal_kernels  # here: the child must not import MLX before its BLAS

        cmd_r, cmd_w = os.pipe()
        evt_r, evt_w = os.pipe()
        # the kernels backend and thread policy this process chose (environment or settings)
        env = {**os.environ, "KVCHAT_KERNELS": metal_kernels.backend(), **threads.child_env()}
        # the child inherits this thread's signal mask across exec: blocked, a SIGINT that
        # comes while the interpreter starts waits until `_child` ignores it (discarded
        # then); a mask, unlike a handler, works from any thread and loses no signal here
        stderr = self._open_stderr()
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", __name__, str(cmd_r), str(evt_w), str(nice)],
                pass_fds=(cmd_r, evt_w), env=env, stdin=subprocess.DEVNULL, stderr=stderr,
            )
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            if stderr is not None and stderr != subprocess.DEVNULL:
                os.close(stderr)  # the child holds its own copy
        os.close(cmd_r)
        os.close(evt_w)
        self._cmd = Connection(cmd_w, readable=False)
        self._evt = Connection(evt_r, writable=False)
        self._send(engine_kw)
        self._reader = threading.Thread(target=self._read, name="kvchat-engine-events",
                                        daemon=True)
        self._reader.start()
        if model_path is not None:
            self.load(model_path)

    # ---- client API -----------------------------------------------------------------
    def load(self, path: str | Path) -> None:
        self._send(("load", (str(path),)))

    def submit(self, prompt: Any, params: GenParams | None = None) -> int:
        with self._lock:
            self._turn += 1  # the child's Engine numbers turns the same way
            self._pending += 1
            turn = self._turn
        self._send(("submit", (prompt, params or GenParams())))
        return turn

    def cancel(self, turn: int | None = None) -> None:
        self._send(("cancel", (turn,)))

    def reset(self) -> None:
        self._snapshot = _Snapshot([], TurnStats())
        self._send(("reset", ()))

    def save_cache(self, path: str | Path, max_bytes: int | None = None) -> None:
        self._send(("save_cache", (str(path), max_bytes)))

    def restore_cache(self, path: str | Path) -> None:
        self._send(("restore_cache", (str(path),)))

    def set_kernels(self, backend: str) -> None:
        self._send(("set_kernels", (backend,)))

    def explain(self, gap: int = 3, block: str = "model") -> None:
        self._send(("explain", (gap, block)))

    def watch_attention(self, layer: int | None, group: int | None = None) -> None:
        self._send(("watch_attention", (layer, group)))

    def cache_stats(self) -> TurnStats:
        return self._snapshot.cache

    @property
    def busy(self) -> bool:
        return self._pending > 0

    @property
    def alive(self) -> bool:
        """Whether the child still runs (a server stops when its engine is gone)."""
        return self._proc.poll() is None

    def layer_stats(self) -> list[dict[str, Any]]:
        return self._snapshot.layers

    def close(self, timeout: float = 10.0) -> None:
        if self._proc.poll() is None:
            self._send(("cancel", ()))
            self._send(None)
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._reader.join(timeout)

    # ---- plumbing ---------------------------------------------------------------------
    def _open_stderr(self) -> int | None:
        """The child's fd 2: the parent's (None), the log, or /dev/null."""
        if self._stderr_log is None:
            return None
        try:
            fd = os.open(self._stderr_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        except OSError:
            self._stderr_log = None
            return subprocess.DEVNULL
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        os.write(fd, f"--- {stamp} engine process of pid {os.getpid()}\n".encode())
        return fd

    def _send(self, msg: Any) -> None:
        with self._lock:
            try:
                self._cmd.send(msg)
            except (BrokenPipeError, OSError):
                pass  # the child is gone; _read reports it

    def _read(self) -> None:
        while True:
            try:
                msg = self._evt.recv()
            except (EOFError, OSError):
                msg = None
            if msg is None:
                break
            for one in msg if isinstance(msg, list) else (msg,):  # a list: a round's events
                self._handle(one)
        code = self._proc.wait()
        if code != 0:  # died: whoever waits for a turn must hear about it
            why = f"the engine process exited with status {code}"
            if self._stderr_log is not None:
                why += f"; its messages are in {self._stderr_log}"
            with self._lock:
                lost, self._pending = self._pending, 0
            if lost:
                self._on_event(Done("error", "", [], [], error=why))
            else:
                self._on_event(LoadFailed("", why))


    def _handle(self, msg: Any) -> None:
        if isinstance(msg, _Snapshot):
            self._snapshot = msg
            return
        if isinstance(msg.event if isinstance(msg, TurnEvent) else msg, Done):
            with self._lock:
                self._pending = max(0, self._pending - 1)
        self._on_event(msg)


def _lower(nice: int) -> None:
    """This process `nice` steps down, every thread of it: Linux keeps a nice value per
    thread, and threads may run before any Python does (an OpenBLAS in LD_PRELOAD starts
    its pool as the process starts)."""
    value = os.nice(nice)
    tasks = Path("/proc/self/task")
    if tasks.is_dir():
        for tid in tasks.iterdir():
            try:
                os.setpriority(os.PRIO_PROCESS, int(tid.name), value)
            except OSError:  # a thread that ended meanwhile
                pass


def _child(cmd_fd: int, evt_fd: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent's (see the module docstring)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    from .engine import Engine

    cmd = Connection(cmd_fd, writable=False)
    evt = Connection(evt_fd, readable=False)
    lock = threading.Lock()
    engine: Engine | None = None

    # pickled and written by a thread of their own, in order: the engine thread queues
    # them and goes on, and the pickling runs while it waits for MLX (which releases the
    # GIL), not before the next step is queued
    outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def send_all() -> None:
        while (msg := outbox.get()) is not _END:
            try:
                evt.send(msg)
            except OSError:  # the parent is gone: the command pipe's EOF ends the child
                return

    sender = threading.Thread(target=send_all, name="kvchat-events", daemon=True)
    sender.start()

    # a batch's turns each emit an event per token: held, they go out once per round
    # (Engine.on_round), one message for all rows instead of one per event
    held: list[Event] = []

    def flush() -> None:  # with `lock` held
        if held:
            outbox.put(held[:])
            held.clear()

    def on_event(ev: Event) -> None:  # on the engine thread
        with lock:  # the snapshot first: a handler of `ev` may read it at once
            inner = ev.event if isinstance(ev, TurnEvent) else ev
            if isinstance(ev, TurnEvent) and not isinstance(inner, _SNAPSHOT_AFTER):
                held.append(ev)
                return
            flush()  # in order: what a turn emitted before this
            if isinstance(inner, _SNAPSHOT_AFTER) and engine is not None:
                # a Stats event already holds the cache's numbers: don't gather them twice
                # between two decode steps
                cache = inner.stats if isinstance(inner, Stats) else engine.cache_stats()
                outbox.put(_Snapshot(engine.layer_stats(), cache))
            outbox.put(ev)

    def on_round() -> None:
        with lock:
            flush()

    engine = Engine(on_event, None, **cmd.recv())
    engine.on_round = on_round
    try:
        while True:
            try:
                msg = cmd.recv()
            except EOFError:
                break
            if msg is None:
                break
            name, args = msg
            getattr(engine, name)(*args)
    finally:
        engine.close()
        with lock:
            flush()
        outbox.put(None)
        outbox.put(_END)
        sender.join()


if __name__ == "__main__":
    # a nice value first: every thread started from here on (OpenBLAS's pool, which starts
    # as it loads; the engine's) inherits it
    if len(sys.argv) > 3 and int(sys.argv[3]):
        _lower(int(sys.argv[3]))
    # the parent's thread policy and OpenBLAS, loaded before anything imports MLX so that
    # MLX's matmuls run in it (app/core/linux_blas.py); nothing above imports MLX
    threads.configure_from_env()
    # through the package module, so pickled classes resolve in the parent (a class of
    # `__main__` would not); the parent passes this module's name, see EngineProcess
    import importlib

    child = importlib.import_module(__spec__.name)._child

    child(int(sys.argv[1]), int(sys.argv[2]))
