"""The generation engine: one long-lived thread that owns every MLX call.

MLX streams are thread-local (mlx >= 0.31.2): an array built in one thread and evaluated
in another fails, so load, prefill, decode and clear_cache all happen on this thread
(docs/design.md, "Data flow of one chat turn"). Clients talk to it through a queue and
hear back through `on_event` (called on this thread; a Textual client hops with
`call_from_thread`).

The engine holds the queue, the thread, the model and the conversation's cache, and
dispatches jobs. A turn is `turn.run_turn`'s generator, driven here; its pieces live
beside it: the cache and its reuse (chat_cache.py), stop strings (stops.py), statistics
(turn_stats.py), the attention view (attention_watch.py).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import gc
import os
import queue
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from kvchat import metal_kernels
from kvchat.model.cache.integrity import warm_fingerprint
from kvchat.model.cache.kv import layer_stats
from kvchat.model.cache.kv_math import (
    attention_name,
    cached_widths,
    gqa_heads,
    kv_saving,
    state_bytes,
)
from kvchat.model.cache.misses import MODEL_CHANGED
from kvchat.model.decoder.transformer import Transformer
from kvchat.model.decoder.weights import load_model, parameter_count, weight_bytes
from kvchat.model.distributed import pipeline
from kvchat.model.errors import NEVER_CAUGHT, KVChatError, error_line
from kvchat.model.files import model_name
from kvchat.model.text.tokenizer import Tokenizer, load_tokenizer

from .attention_watch import AttentionWatch
from .batch import Batch, Waiting
from .chat_cache import ChatCache
from .events import (
    AttentionView,
    CacheRestored,
    CacheSaved,
    Done,
    Event,
    Explained,
    GenParams,
    KernelsSwitched,
    Loaded,
    LoadFailed,
    Loading,
    PrefillProgress,
    Prompt,
    TurnEvent,
    TurnStats,
)
from .generate import PREFILL_CHUNK
from .speculative import DraftModel, tokenizer_mismatch
from .turn import TurnContext, run_turn
from .turn_stats import STATS_INTERVAL_S, current_stats, runtime_stats

_NO_JOB = object()  # _next_job: nothing new while turns run


@dataclasses.dataclass
class _Held:
    """A job that waited for running turns (_next_job)."""

    job: tuple[str, Any]


@dataclasses.dataclass
class _Row:
    """A turn running beside others: its events (run_turn's generator) and its cache."""

    turn: int
    events: Iterator[Event | Waiting]
    chat: ChatCache


def _float_dtype(model: Transformer) -> mx.Dtype:
    """The compute dtype: that of the first floating parameter (norms stay float when
    the rest is quantized; a pipeline rank may lack the final norm)."""
    return next(a.dtype for _, a in tree_flatten(model.parameters())
                if mx.issubdtype(a.dtype, mx.floating))


@dataclasses.dataclass(frozen=True)
class Views:
    """What explains the model, computed on the engine thread where the model and its
    cache live, handed in by whoever builds the engine (`kvchat.model.explain.views.VIEWS`)
    so the runtime never imports the views. Module-level functions: they pickle by name
    into an engine process."""

    # (model, caches, model_info, gap, block) -> anatomy.explain's dict
    explain: Callable[..., dict[str, Any]] | None = None
    # (model, caches, layer, group, token id) -> AttentionView
    attention: Callable[..., AttentionView] | None = None


def model_info(model: Transformer, tokenizer: Tokenizer) -> dict[str, Any]:
    cfg = model.config
    dtype = _float_dtype(model)
    quant = getattr(model, "quantization", None)
    path = Path(getattr(model, "path", ""))
    return {
        "name": model_name(path),
        "path": str(path),
        "architecture": cfg.model_type,
        "parameters": parameter_count(model),
        "bits": quant["bits"] if quant else None,
        # quantized checkpoints are dequantized on load on the CPU (model/decoder/weights.py)
        "dequantized": bool(getattr(model, "dequantized", False)),
        "dtype": str(dtype).removeprefix("mlx.core."),
        "weight_bytes": weight_bytes(model),
        "n_layers": cfg.num_hidden_layers,
        "n_heads": cfg.num_attention_heads,
        "n_kv_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        # "GQA"/"MHA"/"MQA"/"MLA" and its saving over MHA (docs/design.md's gqa_saving, as
        # the cache's stats give it); latent attention also: its bytes as GQA ÷ its own
        "attention": attention_name(cfg),
        "gqa_saving": kv_saving(cfg),
        "as_gqa_factor": cached_widths(cfg, gqa_heads(cfg)).bytes_per_token(1, 1)
        / cached_widths(cfg).bytes_per_token(1, 1) if cfg.mla is not None else None,
        "context": cfg.max_position_embeddings,
        # recurrent layers: their states' bytes (kv_math's formula, the same at every
        # token) before a turn has built the caches, and the layers that attend beside them
        "attention_layers": cfg.attention_layers,
        "state_layers": cfg.recurrent_layers,
        "state_bytes": state_bytes(cfg, dtype.size),
        "mixer": next((s.mixer for s in cfg.layers if s.mixer is not None), None),
        "note": cfg.note,  # a multimodal checkpoint: what is not loaded
        "vocab_size": cfg.vocab_size,
        "tokenizer": tokenizer.kind,
        "chat_template": tokenizer.chat_template is not None,
        # a model split across hosts: whole-model totals and each rank's share
        **(model.pipeline_info() if hasattr(model, "pipeline_info") else {}),
    }


_live_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


@atexit.register
def _close_live_engines() -> None:
    # a client that forgot close() must not make the interpreter abort at exit
    for engine in list(_live_engines):
        engine.close()


class Engine:
    """Implements model.events.EngineLike. Subclasses may replace model execution only:
    `_open` (what a path loads), `clock` and `_runtime_stats` (tests/helpers/scripted_engine.py)."""

    clock = staticmethod(time.perf_counter)
    stats_interval_s = STATS_INTERVAL_S

    def __init__(
        self,
        on_event: Callable[[Event], None],
        model_path: str | Path | None = None,
        *,
        prefill_chunk: int = PREFILL_CHUNK,
        reuse_prefix: bool = True,
        tokenizer: str = "auto",
        compiled: bool = True,
        prefix_pool_bytes: int = 0,
        views: Views | None = None,
        warm_fingerprint: bool = False,
        max_batch: int = 1,
    ):
        self._on_event = on_event
        # called on the engine thread after each round's events, before its batched step
        # (engine_process.py sends a round's events to the parent in one message)
        self.on_round: Callable[[], None] | None = None
        self._views = views or Views()
        self._jobs: queue.Queue[tuple[str, Any] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._last_turn = 0
        self._cancel_upto = 0  # turns with id <= this are cancelled
        self._cancelled: set[int] = set()  # and these, one by one (a server's clients)
        self._busy = threading.Event()
        self.prefill_chunk = prefill_chunk
        self.reuse_prefix = reuse_prefix  # off: every turn prefills its whole prompt
        self.tokenizer_kind = tokenizer  # "auto" | "sentencepiece" | "hf"
        self.compiled = compiled  # off: the plain step (same ids; for comparison)
        # a client that saves and restores caches: hash a loaded model's files at once
        self.warm_fingerprint = warm_fingerprint
        # turns that run side by side, decoding in one batched step (a server's); 1: one
        # turn at a time, its events as they are; more: each wrapped in a TurnEvent
        self.max_batch = max_batch
        self._rows: dict[int, _Row] = {}  # the turns running now (max_batch > 1)
        self._held: collections.deque[tuple[str, Any]] = collections.deque()
        # engine-thread state
        self.model: Transformer | None = None
        self.tokenizer: Tokenizer | None = None
        self.model_info: dict[str, Any] = {}
        self._draft: tuple[str, DraftModel] | None = None  # the last draft model loaded
        # the conversation's K/V cache, and a server's pool of idle caches of other
        # conversations (the chat has one conversation and no pool)
        self._chat = ChatCache(prefix_pool_bytes)
        self._batch: Batch | None = None  # the decode steps parked by running turns
        # the attention view a client watches; closed (nothing computed) until asked
        self._watch = AttentionWatch(self._views.attention)
        self._thread = threading.Thread(target=self._run, name="kvchat-engine", daemon=True)
        self._thread.start()
        _live_engines.add(self)
        if model_path is not None:
            self.load(model_path)

    # ---- client API (any thread) -------------------------------------------------
    def load(self, path: str | Path) -> None:
        self._jobs.put(("load", str(path)))

    def submit(self, prompt: Prompt, params: GenParams | None = None) -> int:
        """Queue a turn: a conversation (list of {role, content}), raw text, or ids."""
        with self._lock:
            self._last_turn += 1
            turn = self._last_turn
        self._jobs.put(("turn", (turn, prompt, params or GenParams(), self.clock())))
        return turn

    def cancel(self, turn: int | None = None) -> None:
        """Stop the running turn (and any queued) within one decode step or prefill chunk;
        `turn` (an id `submit` returned): that turn only."""
        with self._lock:
            if turn is None:
                self._cancel_upto = self._last_turn
            else:
                self._cancelled.add(turn)

    def _stopped(self, turn: int) -> bool:
        return turn <= self._cancel_upto or turn in self._cancelled

    def reset(self) -> None:
        """New chat: drop the cache (on the engine thread, after queued work)."""
        self._jobs.put(("reset", None))

    def save_cache(self, path: str | Path, max_bytes: int | None = None) -> None:
        """Write the K/V cache beside a saved chat (after queued turns); skipped when it
        would exceed `max_bytes`. Reports CacheSaved."""
        self._jobs.put(("save", (Path(path), max_bytes)))

    def restore_cache(self, path: str | Path) -> None:
        """Load a cache save_cache wrote for the loaded model; the next turn reuses its
        prefix as if the chat had never closed. Reports CacheRestored."""
        self._jobs.put(("restore", Path(path)))

    def set_kernels(self, backend: str) -> None:
        """Run RMSNorm and RoPE on `backend` from the next step on (after queued turns);
        reports KernelsSwitched. The switch happens where the model runs: on this
        engine's thread, in this engine's process."""
        self._jobs.put(("kernels", backend))

    def explain(self, gap: int = 3, block: str = "model") -> None:
        """The loaded model's anatomy at the cache's current context (RoPE dials at this
        token gap), computed where the model runs (after queued work); reports Explained.
        block "2017": the same model as a 2017 block (config.as_2017_block)."""
        self._jobs.put(("explain", (gap, block)))

    def watch_attention(self, layer: int | None, group: int | None = None) -> None:
        """Start (a layer, and a KV group or None for all heads) or stop (None) the
        attention view: while set, AttentionView events follow the newest token, a few
        a second during a reply, and one now (after queued work)."""
        self._watch.watch(layer, group)
        if layer is not None:
            self._jobs.put(("attention", None))

    def close(self, timeout: float = 10.0) -> None:
        """Stop the engine thread (idempotent); its MLX state is released there."""
        if not self._thread.is_alive():
            return
        self.cancel()
        self._jobs.put(None)
        self._thread.join(timeout)

    @property
    def busy(self) -> bool:
        return self._busy.is_set()

    def layer_stats(self) -> list[dict[str, Any]]:
        """Per-layer cache view (metadata only, safe from any thread)."""
        caches, model = self._chat.caches, self.model
        if caches is None or model is None:
            return []
        return layer_stats(caches, model.config)

    def cache_stats(self) -> TurnStats:
        if self.model is None:
            return TurnStats()
        return self._stats_now()

    # ---- engine thread -------------------------------------------------------------
    def _emit(self, event: Event | TurnEvent) -> None:
        try:
            self._on_event(event)
        except Exception:  # a broken client must not kill the engine
            traceback.print_exc()

    def _run(self) -> None:
        try:
            while (job := self._next_job()) is not None:
                if job is _NO_JOB:  # turns are running: step them
                    self._round()
                    if not self._rows:
                        self._busy.clear()
                    continue
                kind, arg = job.job if isinstance(job, _Held) else job  # type: ignore[union-attr]
                self._busy.set()
                try:
                    if self.max_batch > 1 and kind == "turn":
                        self._join(*arg)
                    else:
                        self._do(kind, arg)
                except NEVER_CAUGHT:
                    raise
                except BaseException as e:  # no job may end the engine thread
                    self._job_failed(kind, arg, e)
                finally:
                    if not self._rows:
                        self._busy.clear()
        finally:
            for row in list(self._rows.values()):  # closing: the running turns end here
                row.events.close()
            self._rows.clear()
            # MLX's thread-local streams must be destroyed by their own thread before it
            # exits, else the process aborts at exit ("terminate called ...").
            self.model = self.tokenizer = None
            self._chat.drop(pool=True)
            gc.collect()
            mx.clear_streams()

    # ---- turns side by side (max_batch > 1: docs/design.md, "Continuous batching") ----
    def _next_job(self) -> tuple[str, Any] | None | object:
        """The next job: a held one once it may run, else a new one (waited for while
        nothing runs); _NO_JOB when turns are running and nothing can start."""
        if self._held:
            kind = self._held[0][0]
            if (kind == "turn" and len(self._rows) < self.max_batch) or not self._rows:
                return _Held(self._held.popleft())
        if not self._rows and not self._held:
            return self._jobs.get()
        try:
            job = self._jobs.get_nowait()
        except queue.Empty:
            return _NO_JOB
        if job is not None and self._must_wait(job[0]):
            self._held.append(job)  # after the jobs held before it, in order
            return _NO_JOB
        return job

    def _must_wait(self, kind: str) -> bool:
        """Whether a new job waits: behind held ones; a turn while max_batch run; anything
        else until the running turns have ended (a load, a reset, a save...)."""
        if self.max_batch <= 1:
            return False
        if kind == "turn":
            return bool(self._held) or len(self._rows) >= self.max_batch
        return bool(self._held) or bool(self._rows)

    def _join(self, turn: int, prompt: Prompt, params: GenParams, t_submit: float) -> None:
        """Start turn `turn` beside the running ones: it prefills at its first rounds,
        then its decode steps join the batch."""
        if self.model is None or self.tokenizer is None:
            self._emit(TurnEvent(turn, Done("error", "", [], [], error="no model loaded")))
            return
        if self._batch is None or self._batch.model is not self.model:
            self._batch = Batch(self.model)
        chat = self._chat.row()
        model = self.model
        ctx = TurnContext(
            model, self.tokenizer, chat, stop=lambda: self._stopped(turn), clock=self.clock,
            stats=lambda s=None: current_stats(model, chat.caches, self._chat.pool_stats(),
                                               self._runtime_stats(), s),
            watch=self._watch, prefill_chunk=self.prefill_chunk, compiled=self.compiled,
            reuse_prefix=self.reuse_prefix, stats_interval_s=self.stats_interval_s,
            draft=self._draft_model, batch=self._batch,
        )
        self._rows[turn] = _Row(turn, run_turn(ctx, prompt, params, t_submit), chat)

    def _round(self) -> None:
        """Advance every running turn to its next step (a prefill chunk is one), then run
        the decode steps parked meanwhile in one batched forward."""
        for row in list(self._rows.values()):
            self._advance(row)
        if self.on_round is not None:  # this round's events go out before its step runs
            self.on_round()
        if self._batch is not None:
            self._batch.step()

    def _advance(self, row: _Row) -> None:
        """Emit `row`'s events up to its next yield point: parked (WAIT), a prefill
        chunk done (but the last, after which its first token follows at once), or its
        Done (it leaves, its cache back in the pool)."""
        done: Done | None = None
        try:
            for event in row.events:
                if isinstance(event, Waiting):
                    return
                if isinstance(event, Done):
                    done = event
                    break
                self._emit(TurnEvent(row.turn, event))
                if isinstance(event, PrefillProgress) and event.done < event.total:
                    return  # one chunk per round: a long prompt never stalls the others
        except NEVER_CAUGHT:
            raise
        except BaseException as e:  # run_turn reports its own failures: this is a bug
            row.chat.drop()
            done = Done("error", "", [], [], error=error_line(e))
        row.events.close()
        row.chat.release()  # before its Done: the cache as the client will see it
        del self._rows[row.turn]
        self._cancelled.discard(row.turn)
        if done is not None:
            self._emit(TurnEvent(row.turn, done))

    def _do(self, kind: str, arg: Any) -> None:
        """One job; each reports its own outcome (a turn its Done, a load Loaded or
        LoadFailed, ...)."""
        if kind == "load":
            self._load(arg)
        elif kind == "turn":
            self._turn(*arg)
        elif kind == "reset":
            self._chat.drop(pool=True)
        elif kind == "save":
            if (saved := self._chat.save(*arg, self.model_info)) is not None:
                self._emit(saved)
        elif kind == "restore":
            self._emit(self._chat.restore(arg, self.model, self.model_info))
        elif kind == "kernels":
            message = metal_kernels.switch_backend(arg)
            self._emit(KernelsSwitched(metal_kernels.backend(), message))
        elif kind == "explain":
            self._explain(*arg)
        elif kind == "attention":
            view = self._watch.view(self.model, self._chat.caches, self._chat.last_id)
            if view is not None:
                self._emit(view)

    def _job_failed(self, kind: str, arg: Any, error: BaseException) -> None:
        """A job raised past its own reporting: the cache may be half-written, so the next
        turn starts clean, and a client waiting for the job's answer gets it, one line."""
        if os.environ.get("KVCHAT_DEBUG") == "1":
            traceback.print_exception(error)
        self._chat.drop()
        line = error_line(error)
        answer: Event | TurnEvent | None = None
        if kind == "turn":
            answer = Done("error", "", [], [], error=line)
            if self.max_batch > 1:
                answer = TurnEvent(arg[0], answer)
        elif kind == "load":
            answer = LoadFailed(arg, line)
        elif kind == "save":
            answer = CacheSaved(str(arg[0]), error=f"K/V cache not saved: {line}")
        elif kind == "restore":
            answer = CacheRestored(str(arg), 0, f"K/V cache not restored: {line}")
        if answer is not None:
            self._emit(answer)

    def _open(self, path: str) -> tuple[Any, Tokenizer, dict[str, Any]]:
        """Model, tokenizer and model info of a folder or GGUF file (engine thread)."""
        model = pipeline.load(path)  # load_model, or this rank's slice of a pipeline
        tokenizer = load_tokenizer(path, prefer=self.tokenizer_kind)  # type: ignore[arg-type]
        # a GGUF file's name and type ("gguf": "Q4_K_M") complete the info
        return model, tokenizer, {**model_info(model, tokenizer),
                                  **getattr(model, "source_info", {})}

    def _load(self, path: str) -> None:
        self._emit(Loading(path))
        try:
            model, tokenizer, info = self._open(path)
        except KVChatError as e:
            self._emit(LoadFailed(path, str(e)))
            return
        except NEVER_CAUGHT:
            raise
        except BaseException as e:  # keep the old model whatever went wrong
            self._emit(LoadFailed(path, error_line(e)))
            return
        before = mx.get_active_memory()
        self.model, self.tokenizer = model, tokenizer
        self._draft = None  # checked against the old tokenizer
        self._chat.drop(pool=True, why=MODEL_CHANGED)  # remembered: a later miss says so
        del model
        gc.collect()
        mx.clear_cache()
        freed = max(0, before - mx.get_active_memory())
        self.model_info = info
        if self.warm_fingerprint:
            warm_fingerprint(path)
        self._emit(Loaded(dict(self.model_info), freed))

    def _turn(self, turn: int, prompt: Prompt, params: GenParams, t_submit: float) -> None:
        if self.model is None or self.tokenizer is None:
            self._emit(Done("error", "", [], [], error="no model loaded"))
            return
        ctx = TurnContext(
            self.model, self.tokenizer, self._chat,
            stop=lambda: self._stopped(turn), clock=self.clock, stats=self._stats_now,
            watch=self._watch, prefill_chunk=self.prefill_chunk, compiled=self.compiled,
            reuse_prefix=self.reuse_prefix, stats_interval_s=self.stats_interval_s,
            draft=self._draft_model,
        )
        # closed whatever happens here: its in-flight step ends before the cache is touched
        with contextlib.closing(run_turn(ctx, prompt, params, t_submit)) as events:
            for event in events:
                assert not isinstance(event, Waiting)  # no batch: no step is parked
                self._emit(event)
        self._cancelled.discard(turn)

    def _draft_model(self, path: str) -> DraftModel:
        """The draft model in `path`, loaded on first use and kept (one at a time);
        KVChatError (one line) when it does not load or its tokenizer is not the model's."""
        if self._draft is not None and self._draft[0] == path:
            return self._draft[1]
        assert self.tokenizer is not None
        self._draft = None
        try:
            model = load_model(path)
            tokenizer = load_tokenizer(path, prefer=self.tokenizer_kind)  # type: ignore[arg-type]
        except KVChatError as e:
            raise KVChatError(f"draft model: {e}") from None
        if (why := tokenizer_mismatch(self.tokenizer, tokenizer)) is not None:
            raise KVChatError(f"draft model {model_name(Path(path))}: {why}; it must share"
                              " the model's tokenizer")
        draft = DraftModel(model, model_name(Path(path)))
        self._draft = (path, draft)
        return draft

    def _explain(self, gap: int, block: str) -> None:
        if self.model is None:
            return
        if self._views.explain is None:
            raise KVChatError("this engine was built without the explain views")
        self._emit(Explained(self._views.explain(self.model, self._chat.caches,
                                                 self.model_info, gap, block)))

    def _runtime_stats(self) -> TurnStats:
        """Allocator counters and where the model runs (a scripted engine pins them)."""
        return runtime_stats()

    def _stats_now(self, turn: TurnStats | None = None) -> TurnStats:
        """`turn`'s numbers with the cache's and the runtime's as they are now."""
        assert self.model is not None
        return current_stats(self.model, self._chat.caches, self._chat.pool_stats(),
                             self._runtime_stats(), turn, self._chat.checkpoints)
