"""The engine's K/V cache of the conversation: the caches, the ids whose K/V they hold,
the bound they were made for, and how a new prompt reuses them.

A turn keeps the longest common prefix of its prompt with the ids the cache holds and
prefills only the rest (docs/design.md, "Data flow of one chat turn"). A server keeps the
caches of its other conversations in a pool (model/cache/prefix_pool.py) and swaps in the
one that shares the most with a request. A chat's cache is saved beside it and restored
only for the same model, bound and files (model/cache/integrity.py). Each turn's `use`
says how many prompt tokens it reused and, when the cache could have given more, why not
(model/cache/misses.py): the server returns it with every answer.

Used on the engine thread only, except `caches`, read (metadata only) by the engine's
`layer_stats` from any thread.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvchat.model.cache.checkpoints import Checkpoints, reach
from kvchat.model.cache.file import load_cache_and_checkpoints, savable, save_cache
from kvchat.model.cache.integrity import check_checkpoints, check_layers, model_fingerprint
from kvchat.model.cache.kv import (
    make_prompt_cache,
    plan_quantization,
    trim_to,
    why_not_trimmable,
)
from kvchat.model.cache.kv_math import cached_widths
from kvchat.model.cache.misses import (
    MODEL_CHANGED,
    NEW_CONVERSATION,
    PREFIX_DIFFERS,
    REUSE_OFF,
    CacheUse,
    DroppedCaches,
    Miss,
)
from kvchat.model.cache.prefix_pool import (
    EntryInfo,
    PrefixPool,
    cache_nbytes,
    common_prefix_len,
)
from kvchat.model.errors import KVChatError, error_line
from kvchat.model.files import model_name

from .events import CacheRestored, CacheSaved, GenParams

CacheKey = tuple[Any, ...]


def cache_key(params: GenParams) -> CacheKey:
    """What makes a cache: a change of any of these starts a new one. It is also the key
    the prefix pool is looked up by, so a server's client (`cache_partition`) never
    continues another's cache (docs/serve.md); without one, the five values a saved cache
    records."""
    bound = (params.max_kv_size, params.keep, params.kv_bits, params.kv_group_size,
             params.quantized_kv_start)
    return bound if params.cache_partition is None else (*bound, params.cache_partition)


def key_partition(key: CacheKey | None) -> str | None:
    """The client partition in a `cache_key` (None: the shared one)."""
    return key[5] if key is not None and len(key) > 5 else None


def _bound_params(bound: list[Any]) -> GenParams:
    """The cache settings a saved bound (`cache_key`'s values) stands for."""
    return GenParams(max_kv_size=bound[0], keep=bound[1], kv_bits=bound[2],
                     kv_group_size=bound[3], quantized_kv_start=bound[4])


def new_cache(model: Any, params: GenParams) -> list[Any]:
    kv = params.kv_quant()
    extra = {} if kv is None else {"kv": kv}  # a float cache asks nothing new of the model
    return make_prompt_cache(model, max_kv_size=params.max_kv_size, keep=params.keep, **extra)


def model_identity(model_info: dict[str, Any]) -> str:
    """What a saved cache's model must match to be reused: the model as loaded, and its
    weights, config and tokenizer as they are on disk now (fingerprint cached per folder)."""
    keys = ("path", "architecture", "parameters", "n_layers", "n_kv_heads", "head_dim")
    identity = {k: model_info.get(k) for k in keys}
    identity["fingerprint"] = model_fingerprint(str(model_info.get("path") or ""))
    return json.dumps(identity)


def other_model(saved_identity: Any, model_info: dict[str, Any]) -> str:
    """Why a saved cache's model is not the loaded one, naming both when they are two
    folders (a chat continued on another model saves that model's cache)."""
    try:
        saved_path = json.loads(saved_identity)["path"]
    except (TypeError, ValueError, KeyError):
        saved_path = None
    here = str(model_info.get("path") or "")
    if isinstance(saved_path, str) and saved_path and saved_path != here:
        return (f"it was saved with another model ({model_name(saved_path)},"
                f" not {model_name(here)})")
    return "it was saved with another model (this folder's files have changed since)"


class ChatCache:
    """The current conversation's caches (None: none yet) and the ids whose K/V they hold,
    in order; a server's pool of other conversations' caches (None: the chat's one)."""

    def __init__(self, pool_bytes: int = 0) -> None:
        self.caches: list[Any] | None = None
        self.key: CacheKey | None = None
        self.ids: list[int] = []
        # a hybrid model's recurrent states at earlier tokens (model/cache/checkpoints.py)
        self.checkpoints = Checkpoints()
        self.pool = PrefixPool(pool_bytes) if pool_bytes > 0 else None
        # the ids of caches let go, to name what a later prompt lost (the pool's own)
        self.dropped = self.pool.dropped if self.pool is not None else DroppedCaches()
        self.info: EntryInfo | None = None  # the current cache's age and hits (a server's)
        self.use: CacheUse | None = None  # how the last prepared turn used the cache
        self._parent: ChatCache | None = None  # the engine's, for a row (`row`)

    @property
    def last_id(self) -> int | None:
        """The newest token whose K/V the cache holds."""
        return self.ids[-1] if self.ids else None

    def drop(self, pool: bool = False, why: str | None = None) -> None:
        """Forget the cache (a new chat, a failed turn that may have half-written a step,
        a new model); `pool`: the pooled ones too. `why` (a misses.py reason) is
        remembered for them, for the next prompt that would have continued one."""
        if why is not None and self.caches is not None and self.key is not None:
            self.dropped.add(self.ids, self.key, why)
        self.caches, self.key, self.ids, self.info = None, None, [], None
        self.checkpoints = Checkpoints()
        if pool and self.pool is not None:
            self.pool.clear(why)

    def prepare(self, model: Any, ids: list[int], params: GenParams, reuse_prefix: bool
                ) -> tuple[int, int, str | None]:
        """Make the cache ready for prompt `ids`: reuse the longest common prefix (unless
        `reuse_prefix` is off). Returns (cached tokens, tokens the cache held that run
        again, why the prefix was not reused); `use` then says how the cache was used."""
        key = cache_key(params)
        reason = None
        if self.pool is not None and reuse_prefix:
            miss = self._swap_from_pool(ids, key)
        else:
            miss = self._single_miss(ids, key, reuse_prefix)
        if self.caches is not None and key != self.key:
            reason = "cache bound changed"
            self.drop()
        elif not reuse_prefix:
            self.drop()
        if self.caches is None:
            self.caches = new_cache(model, params)
            self.key = key
            self.info = self.pool.new_info() if self.pool is not None else None
            self.checkpoints = Checkpoints()
        else:  # a restored float cache waiting for --quantized-kv-start
            plan_quantization(self.caches, params.kv_quant())
        # at least one token must run through the model to give the next logits
        shared = common_prefix_len(self.ids, ids)
        keep_n = min(shared, len(ids) - 1)
        if keep_n < len(self.ids):
            got, cp, short = reach(self.caches, self.checkpoints, keep_n)
            if cp is not None:  # a recurrent state: back to its checkpoint at or before
                self.checkpoints.restore(self.caches, cp)
                keep_n = cp.at
                del self.ids[keep_n:]
            elif short is None:
                trim_to(self.caches, keep_n)
                self.checkpoints.drop_after(keep_n)
                del self.ids[keep_n:]
            else:
                why = why_not_trimmable(self.caches, model.config, keep_n)
                reason = f"{why}; prefilling again"
                self.caches, self.checkpoints = new_cache(model, params), Checkpoints()
                self.ids, keep_n = [], 0
            if short is not None and miss.reason in (None, PREFIX_DIFFERS):
                miss = short
        self.use = CacheUse(keep_n, len(ids) - keep_n, miss.reason, miss.differs_at)
        return keep_n, shared - keep_n, reason

    def _single_miss(self, ids: list[int], key: CacheKey, reuse_prefix: bool) -> Miss:
        """Why the one cache (no pool) gives no more of `ids`."""
        if not reuse_prefix:
            return Miss(REUSE_OFF)
        if self.caches is None:
            _, why = self.dropped.best(ids, key)
            return Miss(why) if why is not None else Miss(NEW_CONVERSATION)
        if key != self.key:
            return Miss(MODEL_CHANGED)
        shared = common_prefix_len(self.ids, ids)
        if shared < len(self.ids) and shared < len(ids):
            return Miss(PREFIX_DIFFERS, shared)
        return Miss()

    def _swap_from_pool(self, ids: list[int], key: CacheKey) -> Miss:
        """Make the pooled cache sharing the longest prefix with `ids` the current one;
        the current one goes back to the pool. Why no more of `ids` was found."""
        assert self.pool is not None
        if self.caches is not None and self.key is not None:
            self.pool.put(self.ids, self.caches, self.key, self.info, self.checkpoints)
        self.drop()
        found = self.pool.find(ids, key)
        if found.found is not None:
            self.ids, self.caches = found.found
            self.key, self.info, self.checkpoints = key, found.info, found.checkpoints
        return found.miss

    def row(self) -> ChatCache:
        """A cache for one of a server's turns running side by side, sharing this one's
        pool. The current cache (the last finished turn's) goes to the pool, where the
        row finds it as any other; without a pool the row takes it."""
        row = ChatCache()
        row.pool, row.dropped, row._parent = self.pool, self.dropped, self
        if self.pool is None:
            row.caches, row.key, row.ids, row.info = self.caches, self.key, self.ids, self.info
            row.checkpoints = self.checkpoints
            self.caches, self.key, self.ids, self.info = None, None, [], None
            self.checkpoints = Checkpoints()
        else:
            self._to_pool()
        return row

    def release(self) -> None:
        """The turn is over: its cache becomes the engine's current one (the previous
        current one goes to the pool), as a turn alone leaves it."""
        parent = self._parent
        if parent is not None and self.caches is not None and self.key is not None:
            parent._to_pool()
            parent.caches, parent.key, parent.ids = self.caches, self.key, self.ids
            parent.info, parent.checkpoints = self.info, self.checkpoints
            self.caches = None  # moved, not dropped
        self.drop()

    def _to_pool(self) -> None:
        if self.pool is not None and self.caches is not None and self.key is not None:
            self.pool.put(self.ids, self.caches, self.key, self.info, self.checkpoints)
        self.caches, self.key, self.ids, self.info = None, None, [], None
        self.checkpoints = Checkpoints()

    def pool_stats(self) -> dict[str, Any] | None:
        """The pool's counters and its conversations, the current one first (JSON-ready;
        None without a pool): tokens, bytes, when made and last used, turns that
        continued it, and its client partition (the server shows each client its own)."""
        if self.pool is None:
            return None
        held = [(*entry, False) for entry in self.pool.entries()]
        if self.caches is not None and self.ids and self.info is not None:
            held.insert(0, (len(self.ids), cache_nbytes(self.caches, self.checkpoints), self.key,
                            self.info, True))
        return {**self.pool.stats(), "conversations": [
            {"tokens": tokens, "bytes": nbytes, "created": info.created, "used": info.used,
             "hits": info.hits, "current": current, "partition": key_partition(key)}
            for tokens, nbytes, key, info, current in held]}

    def save(self, path: Path, max_bytes: int | None, model_info: dict[str, Any]
             ) -> CacheSaved | None:
        """Write the cache to `path`, with the newest checkpoints that fit beside it;
        skipped (and an older file removed) when it would exceed `max_bytes` or cannot be
        saved; None when there is nothing to save."""
        caches = self.caches
        if not caches or not self.ids:
            return None
        nbytes = sum(c.nbytes for c in caches)
        too_big = max_bytes is not None and nbytes > max_bytes
        if too_big or not savable(caches):
            path.unlink(missing_ok=True)  # an older, shorter cache would only mislead
            return None
        kept = []  # newest first: they serve the edits and regenerations most likely next
        for cp in reversed(self.checkpoints.items):
            if cp.at > len(self.ids):
                continue
            if max_bytes is not None and nbytes + cp.nbytes > max_bytes:
                break
            nbytes += cp.nbytes
            kept.insert(0, cp)
        meta = {"kvchat_model": model_identity(model_info),
                "kvchat_bound": json.dumps(list(self.key or ())),
                "kvchat_ids": json.dumps(self.ids)}
        try:
            written = save_cache(path, caches, meta, kept)
        except Exception as e:  # a full disk raises from MLX: one notice, the cache stays
            return CacheSaved(str(path), error=f"K/V cache not saved to {path.name}:"
                              f" {error_line(e)}; it stays in memory")
        return CacheSaved(str(path), len(self.ids), written)

    def restore(self, path: Path, model: Any, model_info: dict[str, Any]) -> CacheRestored:
        """Load a cache `save` wrote for this model (`model` None: none loaded); the next
        turn reuses its prefix. A file that does not match is refused and the cache kept."""
        try:
            if model is None:
                raise KVChatError("no model loaded")
            caches, meta, checkpoints = load_cache_and_checkpoints(path)
            if (saved_with := meta.get("kvchat_model")) != model_identity(model_info):
                raise KVChatError(other_model(saved_with, model_info))
            ids = json.loads(meta["kvchat_ids"])
            bound = json.loads(meta["kvchat_bound"])
            if not isinstance(ids, list) or not isinstance(bound, list) or (
                    len(bound) not in (2, 5)):
                raise KVChatError("its token ids or bound are malformed")
            bound = [*bound, None, None, 0][:5]  # files before K/V quantization: float
            cfg = model.config
            try:
                check_layers(caches, ids, new_cache(model, _bound_params(bound)),
                             widths=cached_widths(cfg), dtype=model_info.get("dtype"),
                             vocab_size=cfg.vocab_size, mixer=cfg.mixer)
                check_checkpoints(checkpoints, caches, ids, mixer=cfg.mixer,
                                  dtype=model_info.get("dtype"))
            except KVChatError as e:
                raise KVChatError(f"{path.name}: {e}") from None
        except (KVChatError, ValueError, KeyError, TypeError) as e:
            return CacheRestored(str(path), 0, f"K/V cache not restored: {e}")
        self.caches, self.key, self.ids = caches, tuple(bound), ids
        self.checkpoints = Checkpoints(items=checkpoints)
        return CacheRestored(str(path), len(ids))
