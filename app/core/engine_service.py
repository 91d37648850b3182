"""The engine behind every face, built, swapped and shut down in one place.

Where it runs (`EngineService.kind`):
- "process" (the chat, `kvchat serve`): `EngineProcess`, the engine in a child Python
  process, so rendering or an event loop never holds the GIL the engine needs between
  tokens (docs/performance.md, "kvchat against mlx-lm").
- "thread" (`kvchat generate`, `kvchat bench`): `Engine` on a thread of this process; one
  turn and nothing to render, so a child would only add its start-up, and `bench` reads
  the engine's tokenizer.
- A pipeline's rank 0 is always "thread": its link to the other ranks lives in this
  process. `split_across` starts the ranks of a `--hosts` file and joins them; under
  `mlx.launch`, app/main.py joined before the command ran (app/core/hosts.py).

Every engine gets `kvchat.model.explain.views.VIEWS` (the runtime never imports the
explain package; this service may), and the face's `EngineOptions`.

Swapping. A model swap is the engine's own `load`: when the new model fails to load the
engine says so (`LoadFailed`) and keeps the old one. A fresh engine in place of the
current one (`kvchat serve` after its engine died) is `build` again: the old engine is
closed only once the new one exists, so a build that fails leaves the old one current.

SIGINT belongs to the face. The engine's child process ignores it (from birth:
model/runtime/engine_process.py); at a terminal Ctrl+C reaches the whole foreground
process group, and only the face acts on it: `generate` and `bench` cancel the turn and
exit 130 (model/runtime/client.py), the chat reads it as a key (stop the reply; twice
quits), `serve` shuts down. Shutting down ends the engine through `close` (cancel, stop,
kill after the timeout), never by the signal, so no turn dies half-written. An engine on
a thread never sees a signal (Python runs handlers on the main thread). The ranks
`split_across` starts run in sessions of their own and end with `close`.

Priorities are left alone: the UI process keeps normal priority, so a person's keys and
Esc never wait behind other programs, and the engine's child inherits the same.
"""

from __future__ import annotations

import dataclasses
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from kvchat.model.runtime.events import EngineLike, Event

if TYPE_CHECKING:
    from kvchat.model.runtime.client import EngineClient

Kind = Literal["process", "thread"]


@dataclass(frozen=True)
class EngineOptions:
    """The engine settings a face chooses (`Engine`'s keyword arguments)."""

    tokenizer: str = "auto"  # "auto" | "sentencepiece" | "hf"
    compiled: bool = True  # off: the plain decode step (bench --no-compile)
    prefix_pool_bytes: int = 0  # idle caches of other conversations (kvchat serve)
    # turns decoded side by side in one batched step (kvchat serve; 1: one at a time)
    max_batch: int = 1
    # hash the loaded model's files in the background (the chat, which saves and restores
    # K/V caches and needs the model's fingerprint for each: model/cache/integrity.py)
    warm_fingerprint: bool = False


CHAT_OPTIONS = EngineOptions(warm_fingerprint=True)


class EngineService:
    """One face's engine: `build` it (an `EngineFactory`), or a synchronous `client`;
    `close` ends it and any ranks `split_across` started. Also a context manager."""

    def __init__(self, kind: Kind = "process", options: EngineOptions | None = None) -> None:
        self._kind: Kind = kind
        self.options = options or EngineOptions()
        self.engine: EngineLike | None = None  # the current engine (the last built)
        self.ranks: list[subprocess.Popen[bytes]] = []  # the pipeline's other ranks

    @property
    def kind(self) -> Kind:
        """Where the next engine runs: as asked, except that a pipeline's rank 0 keeps it in
        this process, beside its link to the other ranks."""
        from kvchat.model.distributed import link

        return "thread" if link.launched() else self._kind

    def split_across(self, hostfile: str | Path, model: str) -> None:
        """Start ranks 1..N-1 of `hostfile` serving `model` and join them as rank 0: the
        engine built next runs the pipeline. HostsError (one line) when the hosts cannot
        take it; a failure leaves no rank running."""
        from kvchat.app.core import hosts

        log_dir = Path(tempfile.mkdtemp(prefix="kvchat-ranks-"))
        self.ranks = hosts.start_ranks(hostfile, model, log_dir)
        try:
            hosts.join_if_launched(model)
        except BaseException:
            self._stop_ranks()
            raise

    def build(self, on_event: Callable[[Event], None], model_path: str | None = None
              ) -> EngineLike:
        """A new engine, reporting to `on_event`, loading `model_path` (None: no model
        yet). It replaces the current engine, which is closed once the new one exists."""
        kw: dict[str, Any] = {**dataclasses.asdict(self.options), "views": _views()}
        if self.kind == "process":
            from kvchat.model.runtime.engine_process import EngineProcess

            engine: EngineLike = EngineProcess(on_event, model_path, **kw)
        else:
            from kvchat.model.runtime.engine import Engine  # imports MLX

            engine = Engine(on_event, model_path, **kw)
        old, self.engine = self.engine, engine
        if old is not None:
            old.close(1.0)
        return engine

    def client(self, model_path: str | Path, *, on_delta: Callable[[str], None] | None = None,
               timeout: float | None = None) -> EngineClient:
        """The engine driven synchronously (the command line): it loads `model_path` and
        raises KVChatError (one line) when that fails."""
        from kvchat.model.runtime.client import EngineClient

        return EngineClient(model_path, on_delta=on_delta, timeout=timeout, engine=self.build)

    def close(self, timeout: float = 10.0) -> None:
        """End the engine (a child process too) and the ranks; idempotent."""
        engine, self.engine = self.engine, None
        try:
            if engine is not None:
                engine.close(timeout)
        finally:
            self._stop_ranks()

    def _stop_ranks(self) -> None:
        ranks, self.ranks = self.ranks, []
        if ranks:
            from kvchat.app.core import hosts

            hosts.stop_ranks(ranks)

    def __enter__(self) -> EngineService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _views() -> Any:
    from kvchat.model.explain.views import VIEWS  # imports MLX

    return VIEWS
