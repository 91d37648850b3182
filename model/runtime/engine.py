"""The generation engine: one long-lived thread that owns every MLX call.

MLX streams are thread-local (mlx >= 0.31.2): an array built in one thread and evaluated
in another fails, so load, prefill, decode and clear_cache all happen on this thread.
Clients talk to it through a queue and hear back through `on_event` (called on this
thread; a Textual client hops with `call_from_thread`).

A turn: render the conversation -> ids -> longest common prefix with the ids the cache
holds -> trim the cache back -> prefill the new suffix in chunks -> decode, pipelined
with `mx.async_eval` -> stream text deltas, periodic stats and one `Done`.
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import json
import os
import queue
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from kvchat import metal_kernels
from kvchat.model.cache.file import load_cache, savable, save_cache
from kvchat.model.cache.integrity import check_layers, model_fingerprint
from kvchat.model.cache.kv import (
    cache_stats,
    can_trim_to,
    layer_stats,
    make_prompt_cache,
    plan_quantization,
    trim_to,
    why_not_trimmable,
)
from kvchat.model.cache.kv_math import (
    attention_name,
    cached_widths,
    gqa_heads,
    kv_saving,
)
from kvchat.model.cache.prefix_pool import PrefixPool, common_prefix_len
from kvchat.model.decoder.transformer import Transformer
from kvchat.model.decoder.weights import parameter_count, weight_bytes
from kvchat.model.distributed import pipeline
from kvchat.model.errors import KVChatError, error_line
from kvchat.model.files import model_name
from kvchat.model.text.chat_template import TemplateCancelled
from kvchat.model.text.tokenizer import Tokenizer, load_tokenizer

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
    Overflow,
    PrefillProgress,
    Prompt,
    Started,
    Stats,
    TextDelta,
    TurnStats,
)
from .generate import PREFILL_CHUNK, Progress, generate_step
from .sampling import Sampler

STATS_INTERVAL_S = 0.1  # ~10 stats events a second, never one per token
ATTENTION_INTERVAL_S = 0.25  # the attention view's refresh while a reply streams


def _float_dtype(model: Transformer) -> mx.Dtype:
    """The compute dtype: that of the first floating parameter (norms stay float when
    the rest is quantized; a pipeline rank may lack the final norm)."""
    return next(a.dtype for _, a in tree_flatten(model.parameters())
                if mx.issubdtype(a.dtype, mx.floating))


def _cache_key(params: GenParams) -> tuple[Any, ...]:
    """What makes a cache: a change of any of these starts a new one."""
    return (params.max_kv_size, params.keep, params.kv_bits, params.kv_group_size,
            params.quantized_kv_start)


def _bound_params(bound: list[Any]) -> GenParams:
    """The cache settings a saved bound (`_cache_key`'s values) stands for."""
    return GenParams(max_kv_size=bound[0], keep=bound[1], kv_bits=bound[2],
                     kv_group_size=bound[3], quantized_kv_start=bound[4])


def _make_cache(model: Any, params: GenParams) -> list[Any]:
    kv = params.kv_quant()
    extra = {} if kv is None else {"kv": kv}  # a float cache asks nothing new of the model
    return make_prompt_cache(model, max_kv_size=params.max_kv_size, keep=params.keep, **extra)


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


class PartialReply(Exception):
    """A turn that failed after some of its reply was shown: that text and its ids."""

    def __init__(self, error: BaseException, text: str, ids: list[int]) -> None:
        super().__init__(str(error))
        self.error, self.text, self.ids = error, text, list(ids)


def model_info(model: Transformer, tokenizer: Tokenizer) -> dict[str, Any]:
    cfg = model.config
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
        "dtype": str(_float_dtype(model)).removeprefix("mlx.core."),
        "weight_bytes": weight_bytes(model),
        "n_layers": cfg.num_hidden_layers,
        "n_heads": cfg.num_attention_heads,
        "n_kv_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        # "GQA"/"MHA"/"MQA"/"MLA", its saving over MHA, and (MLA) the GQA figure's share
        "attention": attention_name(cfg),
        "kv_saving": kv_saving(cfg),
        "gqa_factor": cached_widths(cfg, gqa_heads(cfg)).bytes_per_token(1, 1)
        / cached_widths(cfg).bytes_per_token(1, 1),
        "context": cfg.max_position_embeddings,
        "note": cfg.note,  # a multimodal checkpoint: what is not loaded
        "vocab_size": cfg.vocab_size,
        "tokenizer": tokenizer.kind,
        "chat_template": tokenizer.chat_template is not None,
        # a model split across hosts: whole-model totals and each rank's share
        **(model.pipeline_info() if hasattr(model, "pipeline_info") else {}),
    }


def is_blank(prompt: Prompt) -> bool:
    """Nothing to reply to: blank text, no ids, or a conversation whose last message is blank."""
    if isinstance(prompt, str):
        return not prompt.strip()
    if not prompt:
        return True
    last = prompt[-1]
    return isinstance(last, dict) and not str(last.get("content") or "").strip()


class _StopMatcher:
    """Cuts the text at the first stop string and holds back a tail that could still
    become one, so a stop string never reaches the client."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.emitted = 0

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit now, whether a stop string was hit)."""
        self.text += delta
        for s in self.stops:
            i = self.text.find(s, max(0, self.emitted - len(s)))
            if i >= 0:
                self.text = self.text[:i]
                return self._take(len(self.text)), True
        return self._take(len(self.text) - self.hold), False

    def flush(self) -> str:
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        out = self.text[self.emitted : upto]
        self.emitted = upto
        return out


_live_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


@atexit.register
def _close_live_engines() -> None:
    # a client that forgot close() must not make the interpreter abort at exit
    for engine in list(_live_engines):
        engine.close()


class Engine:
    """Implements model.events.EngineLike. Subclasses may replace model execution only:
    `_open` (what a path loads), `clock` and `_runtime_stats` (tests/scripted_engine.py)."""

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
    ):
        self._on_event = on_event
        self._views = views or Views()
        self._jobs: queue.Queue[tuple[str, Any] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._last_turn = 0
        self._cancel_upto = 0  # turns with id <= this are cancelled
        self._busy = threading.Event()
        self.prefill_chunk = prefill_chunk
        self.reuse_prefix = reuse_prefix  # off: every turn prefills its whole prompt
        self.tokenizer_kind = tokenizer  # "auto" | "sentencepiece" | "hf"
        self.compiled = compiled  # off: the plain step (same ids; for comparison)
        # engine-thread state
        self.model: Transformer | None = None
        self.tokenizer: Tokenizer | None = None
        self.model_info: dict[str, Any] = {}
        self._cache: list[Any] | None = None
        self._cache_key: tuple[Any, ...] | None = None
        self._cache_ids: list[int] = []  # ids whose K/V the cache holds, in order
        # (layer, KV group) the attention view watches; None: closed, nothing computed
        self._watch: tuple[int, int | None] | None = None
        # a server's idle caches of other conversations (model/cache/prefix_pool.py); the chat has
        # one conversation and no pool
        self._pool = PrefixPool(prefix_pool_bytes) if prefix_pool_bytes > 0 else None
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

    def cancel(self) -> None:
        """Stop the running turn (and any queued) within one decode step or prefill chunk."""
        with self._lock:
            self._cancel_upto = self._last_turn

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
        with self._lock:
            self._watch = None if layer is None else (layer, group)
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
        if self._cache is None or self.model is None:
            return []
        return layer_stats(self._cache, self.model.config)

    def cache_stats(self) -> TurnStats:
        if self.model is None:
            return TurnStats()
        return self._stats_now()

    # ---- engine thread -------------------------------------------------------------
    def _emit(self, event: Event) -> None:
        try:
            self._on_event(event)
        except Exception:  # a broken client must not kill the engine
            traceback.print_exc()

    def _run(self) -> None:
        try:
            while (job := self._jobs.get()) is not None:
                kind, arg = job
                self._busy.set()
                try:
                    if kind == "load":
                        self._load(arg)
                    elif kind == "turn":
                        self._turn(*arg)
                    elif kind == "reset":
                        self._drop_cache(pool=True)
                    elif kind == "save":
                        self._save_cache(*arg)
                    elif kind == "restore":
                        self._restore_cache(arg)
                    elif kind == "kernels":
                        message = metal_kernels.switch_backend(arg)
                        self._emit(KernelsSwitched(metal_kernels.backend(), message))
                    elif kind == "explain":
                        self._explain(*arg)
                    elif kind == "attention" and self._cache_ids:
                        self._attention(self._cache_ids[-1])
                    elif kind == "attention":
                        self._attention(None)
                except Exception:  # no job may end the engine thread
                    self._job_failed()
                finally:
                    self._busy.clear()
        finally:
            # MLX's thread-local streams must be destroyed by their own thread before it
            # exits, else the process aborts at exit ("terminate called ...").
            self.model = self.tokenizer = None
            self._drop_cache(pool=True)
            gc.collect()
            mx.clear_streams()

    def _job_failed(self) -> None:
        """A job other than a load or a turn (those report their own failures) raised:
        the cache may be half-written, so the next turn starts clean."""
        if os.environ.get("KVCHAT_DEBUG") == "1":
            traceback.print_exc()
        self._drop_cache()

    def _drop_cache(self, pool: bool = False) -> None:
        self._cache, self._cache_key, self._cache_ids = None, None, []
        if pool and self._pool is not None:
            self._pool.clear()

    def _swap_from_pool(self, ids: list[int], key: tuple[int | None, int]) -> None:
        """Make the pooled cache sharing the longest prefix with `ids` the current one;
        the current one goes back to the pool."""
        assert self._pool is not None
        if self._cache is not None and self._cache_key is not None:
            self._pool.put(self._cache_ids, self._cache, self._cache_key)
        self._drop_cache()
        found = self._pool.take(ids, key)
        if found is not None:
            self._cache_ids, self._cache = found
            self._cache_key = key

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
        except Exception as e:  # keep the old model whatever went wrong
            self._emit(LoadFailed(path, error_line(e)))
            return
        before = mx.get_active_memory()
        self.model, self.tokenizer = model, tokenizer
        self._drop_cache(pool=True)
        del model
        gc.collect()
        mx.clear_cache()
        freed = max(0, before - mx.get_active_memory())
        self.model_info = info
        self._emit(Loaded(dict(self.model_info), freed))

    def _explain(self, gap: int, block: str) -> None:
        if self.model is None:
            return
        if self._views.explain is None:
            raise KVChatError("this engine was built without the explain views")
        self._emit(Explained(self._views.explain(self.model, self._cache, self.model_info,
                                                 gap, block)))

    def _attention(self, token: int | None) -> None:
        """One AttentionView of the newest cached token (id `token`) for the watched layer.
        A failure is the view's note: it must never cost the cache (see _job_failed)."""
        watch = self._watch
        if watch is None or self.model is None:
            return
        layer, group = watch
        empty = AttentionView(layer, group, self.model.config.num_hidden_layers,
                              self.model.config.num_key_value_heads)
        if hasattr(self.model, "pipeline_stats"):
            empty.note = "not available for a model split across hosts"
        elif not self._cache or token is None:
            empty.note = "the cache is empty: send a message"
        elif self._views.attention is None:
            empty.note = "this engine was built without the attention view"
        else:
            try:
                empty = self._views.attention(self.model, self._cache, layer, group, token)
            except Exception as e:
                empty.note = f"cannot compute the attention view: {error_line(e)}"
        self._emit(empty)

    def _cache_identity(self) -> dict[str, str]:
        """What a saved cache must match to be reused: the model and the cache bound."""
        keys = ("path", "architecture", "parameters", "n_layers", "n_kv_heads", "head_dim")
        identity = {k: self.model_info.get(k) for k in keys}
        # the weights, config and tokenizer as they are on disk now (cached per folder)
        identity["fingerprint"] = model_fingerprint(str(self.model_info.get("path") or ""))
        return {
            "kvchat_model": json.dumps(identity),
            "kvchat_bound": json.dumps(list(self._cache_key or ())),
        }

    def _save_cache(self, path: Path, max_bytes: int | None) -> None:
        cache = self._cache
        if self.model is None or not cache or not self._cache_ids:
            return
        too_big = max_bytes is not None and sum(c.nbytes for c in cache) > max_bytes
        if too_big or not savable(cache):
            path.unlink(missing_ok=True)  # an older, shorter cache would only mislead
            return
        meta = {**self._cache_identity(), "kvchat_ids": json.dumps(self._cache_ids)}
        try:
            written = save_cache(path, cache, meta)
        except Exception as e:  # a full disk raises from MLX: one notice, the cache stays
            self._emit(CacheSaved(str(path), error=f"K/V cache not saved to {path.name}:"
                                  f" {error_line(e)}; it stays in memory"))
            return
        self._emit(CacheSaved(str(path), len(self._cache_ids), written))

    def _restore_cache(self, path: Path) -> None:
        try:
            if self.model is None:
                raise KVChatError("no model loaded")
            caches, meta = load_cache(path)
            if meta.get("kvchat_model") != self._cache_identity()["kvchat_model"]:
                raise KVChatError("it was saved with another model")
            ids = json.loads(meta["kvchat_ids"])
            bound = json.loads(meta["kvchat_bound"])
            if not isinstance(ids, list) or not isinstance(bound, list) or (
                    len(bound) not in (2, 5)):
                raise KVChatError("its token ids or bound are malformed")
            bound = [*bound, None, None, 0][:5]  # files before K/V quantization: float
            cfg = self.model.config
            try:
                check_layers(caches, ids, _make_cache(self.model, _bound_params(bound)),
                             n_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                             dtype=self.model_info.get("dtype"), vocab_size=cfg.vocab_size)
            except KVChatError as e:
                raise KVChatError(f"{path.name}: {e}") from None
        except (KVChatError, ValueError, KeyError, TypeError) as e:
            self._emit(CacheRestored(str(path), 0, f"K/V cache not restored: {e}"))
            return
        self._cache, self._cache_key, self._cache_ids = caches, tuple(bound), ids
        self._emit(CacheRestored(str(path), len(ids)))

    def _prompt_ids(self, prompt: Prompt, should_stop: Callable[[], bool] | None = None
                    ) -> list[int]:
        assert self.tokenizer is not None
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if all(isinstance(x, int) for x in prompt):
            vocab = self.model.config.vocab_size if self.model is not None else None
            bad = [x for x in prompt if vocab is not None and not 0 <= x < vocab]  # type: ignore
            if bad:  # an embedding lookup out of range reads past the table (a crash)
                raise KVChatError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
            return list(prompt)  # type: ignore[arg-type]
        # a cancel stops a slow template at once (rendering is bounded in time anyway)
        return self.tokenizer.encode_chat(list(prompt), should_stop=should_stop)  # type: ignore[arg-type]

    def _prepare_cache(self, ids: list[int], params: GenParams) -> tuple[int, int, str | None]:
        """Reuse the longest common prefix; return (cached tokens, tokens the cache held
        that run again, why the prefix was not reused)."""
        assert self.model is not None
        key = _cache_key(params)
        reason = None
        if self._pool is not None and self.reuse_prefix:
            self._swap_from_pool(ids, key)
        if self._cache is not None and key != self._cache_key:
            reason = "cache bound changed"
            self._drop_cache()
        elif not self.reuse_prefix:
            self._drop_cache()
        if self._cache is None:
            self._cache = _make_cache(self.model, params)
            self._cache_key = key
        else:  # a restored float cache waiting for --quantized-kv-start
            plan_quantization(self._cache, params.kv_quant())
        # at least one token must run through the model to give the next logits
        shared = common_prefix_len(self._cache_ids, ids)
        keep_n = min(shared, len(ids) - 1)
        if keep_n < len(self._cache_ids):
            if can_trim_to(self._cache, keep_n):
                trim_to(self._cache, keep_n)
                del self._cache_ids[keep_n:]
            else:
                why = why_not_trimmable(self._cache, self.model.config, keep_n)
                reason = f"{why}; prefilling again"
                self._cache = _make_cache(self.model, params)
                self._cache_ids, keep_n = [], 0
        return keep_n, shared - keep_n, reason

    def _capacity(self, params: GenParams) -> int:
        assert self.model is not None
        return params.max_kv_size or self.model.config.max_position_embeddings

    def _runtime_stats(self) -> TurnStats:
        """Allocator counters and where the model runs (no arrays read)."""
        return TurnStats(
            peak_memory=mx.get_peak_memory(),
            active_memory=mx.get_active_memory(),
            kernels_backend=metal_kernels.backend(),
            device=str(mx.default_device()),
        )

    def _stats_now(self, turn: TurnStats | None = None) -> TurnStats:
        """`turn`'s numbers with the cache's and the runtime's as they are now."""
        assert self.model is not None
        s = turn or TurnStats()
        if self._cache:
            s = s.merged(cache_stats(self._cache, self.model.config))
        if hasattr(self.model, "pipeline_stats"):  # per-rank bytes and time split
            s = s.with_(pipeline=self.model.pipeline_stats(self._cache))
        if self._pool is not None:
            s = s.with_(prefix_pool=self._pool.stats())
        return s.merged(self._runtime_stats())

    def _turn(self, turn: int, prompt: Prompt, params: GenParams, t_submit: float) -> None:
        prompt_ids: list[int] = []
        context_room: int | None = None  # --overflow refuse: the window ends the reply here
        try:
            if self.model is None or self.tokenizer is None:
                raise KVChatError("no model loaded")
            params.validate()
            if is_blank(prompt):
                raise KVChatError("empty prompt: type a message first")
            prompt_ids = self._prompt_ids(prompt, lambda: turn <= self._cancel_upto)
            if not prompt_ids:
                raise KVChatError("empty prompt")
            if params.overflow == "refuse":
                room = self._capacity(params) - len(prompt_ids) + 1
                if room < 1:
                    raise KVChatError(
                        f"prompt of {len(prompt_ids)} tokens exceeds the"
                        f" {self._capacity(params)}-token context; shorten it or allow rotation"
                    )
                context_room = room if room < params.max_tokens else None
                params = dataclasses.replace(params, max_tokens=min(params.max_tokens, room))
            self._generate(turn, prompt_ids, params, t_submit, context_room)
        except TemplateCancelled:
            self._emit(Done("cancelled", "", [], prompt_ids))
        except PartialReply as p:
            if os.environ.get("KVCHAT_DEBUG") == "1":
                traceback.print_exception(p.error)
            self._drop_cache()  # it may hold a half-written step
            # the reply so far is kept (the client marks it), with its ids for --json
            self._emit(Done("error", p.text, p.ids, prompt_ids, error=error_line(p.error)))
        except KVChatError as e:
            self._emit(Done("error", "", [], prompt_ids, error=str(e)))
        except Exception as e:
            if os.environ.get("KVCHAT_DEBUG") == "1":
                traceback.print_exc()
            # the cache may hold a half-written step: start clean next turn
            self._drop_cache()
            self._emit(Done("error", "", [], prompt_ids, error=error_line(e)))

    def _generate(
        self, turn: int, prompt_ids: list[int], params: GenParams, t_submit: float,
        context_room: int | None = None,
    ) -> None:
        model, tok = self.model, self.tokenizer
        assert model is not None and tok is not None
        cancelled = lambda: turn <= self._cancel_upto  # noqa: E731
        mx.reset_peak_memory()
        cached, again, reason = self._prepare_cache(prompt_ids, params)
        cache = self._cache
        self._emit(Started(len(prompt_ids), cached, reason, again))
        stats = TurnStats(prompt_tokens=len(prompt_ids), cached_tokens=cached)
        evicted = self._evicted()

        sampler = Sampler(params.sampling())
        # embedding tables are often padded past the tokenizer's vocabulary; an id the
        # tokenizer cannot decode must never be sampled
        n_ids = min(model.config.vocab_size, tok.vocab_size)
        window = params.repetition_context_size
        history = mx.array(prompt_ids[-window:], dtype=mx.int32)
        use_history = params.repetition_penalty != 1.0

        def sample(logits: mx.array) -> mx.array:
            nonlocal history
            y = sampler(logits[..., :n_ids], history if use_history else [])
            if use_history:
                history = mx.concatenate([history, y.astype(mx.int32)])[-window:]
            return y

        todo = prompt_ids[cached:]
        progress = Progress()

        def prefilled(done: int, secs: float) -> None:
            nonlocal evicted
            self._emit(PrefillProgress(done, len(todo), secs))
            if done == len(todo):  # the prompt is in: what reading it evicted, before decoding
                evicted = self._note_overflow(evicted, "prompt")

        steps = generate_step(
            model, todo, cache, sample=sample, max_tokens=params.max_tokens,
            prefill_chunk=self.prefill_chunk, compiled=self.compiled,
            cancelled=cancelled, progress=progress, clock=self.clock,
            on_prefill=prefilled,
        )
        generated: list[int] = []
        detok = tok.detokenizer(skip_special_tokens=True)  # control tokens are never text
        stops = _StopMatcher(params.stop)
        eos = set(tok.end_ids)  # EOS, and BOS: a base model starting a new document
        reason_done = "length"
        t_first = t_last = None
        last_stats = last_view = self.clock()
        failure: Exception | None = None
        try:
            for token in steps:
                now = self.clock()
                t_last = now
                if t_first is None:
                    t_first = now
                    stats.ttft_s = now - t_submit
                    p_s = progress.prefill_s
                    stats.prefill_tps = len(todo) / p_s if p_s > 0 else 0.0
                    stats.compiled_step = progress.compiled
                generated.append(token)
                if token in eos and not params.ignore_eos:
                    reason_done = "eos"
                    break
                text, hit = stops.feed(detok.add_token(token))
                if text:
                    self._emit(TextDelta(text, token))
                if hit:
                    reason_done = "stop"
                    break
                if cancelled():
                    reason_done = "cancelled"
                    break
                if now - last_stats >= self.stats_interval_s:
                    last_stats = now
                    self._decode_stats(stats, generated, t_first, t_last)
                    self._emit(Stats(self._stats_now(stats)))
                if self._watch is not None and now - last_view >= ATTENTION_INTERVAL_S:
                    last_view = now  # the newest token in the cache: the last one fed
                    self._attention(generated[progress.fed - 1] if progress.fed else todo[-1])
        except Exception as e:  # a pipeline rank died, MLX failed: keep what was shown
            failure = e
        finally:
            try:
                steps.close()  # waits for the in-flight step before the cache is touched
            except Exception as e:  # the in-flight step failed: as above
                failure = failure or e
        if failure is not None:
            raise PartialReply(failure, stops.text[: stops.emitted], generated) from failure
        self._cache_ids.extend(todo[: progress.prefilled])
        if progress.prefilled < len(todo):  # cancelled during prefill
            self._emit(Done("cancelled", "", [], prompt_ids, self._stats_now(stats)))
            return

        if reason_done != "stop":  # flush text held for UTF-8 completion or stop matching
            tail, _ = stops.feed(detok.finalize())
            tail += stops.flush()
            if tail:
                self._emit(TextDelta(tail, generated[-1]))
        self._cache_ids.extend(generated[: progress.fed])
        self._note_overflow(evicted, "reply")
        if reason_done == "length" and context_room is not None and len(generated) >= context_room:
            reason_done = "context_full"
        self._decode_stats(stats, generated, t_first, t_last)
        final = self._stats_now(stats)
        self._emit(Stats(final))
        self._emit(Done(reason_done, stops.text, generated, prompt_ids, final))

    def _evicted(self) -> int:
        assert self.model is not None and self._cache is not None
        return cache_stats(self._cache, self.model.config).evicted_tokens or 0

    def _note_overflow(self, evicted_before: int, during: str) -> int:
        """Emit Overflow when rotation evicted tokens since `evicted_before`; returns the total."""
        assert self.model is not None and self._cache is not None
        s = cache_stats(self._cache, self.model.config)
        evicted = s.evicted_tokens or 0
        if evicted > evicted_before:
            self._emit(Overflow(evicted - evicted_before, s.cache_capacity or 0, during))
        return evicted

    @staticmethod
    def _decode_stats(
        stats: TurnStats, generated: list[int], t_first: float | None, t_last: float | None
    ) -> None:
        n = len(generated)
        span = (t_last - t_first) if (t_first is not None and t_last is not None) else 0.0
        stats.generated_tokens = n
        stats.decode_tps = (n - 1) / span if n > 1 and span > 0 else 0.0
