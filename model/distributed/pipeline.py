"""Pipeline parallelism over mx.distributed: a model split by layers across ranks.

Rank r holds a contiguous slice of the decoder's layers (balanced by parameter bytes),
only those layers' K/V, and: rank 0 the embedding, the last rank the final norm and the
head (the embedding matrix again when the head is tied). Rank 0 runs the normal Engine
(tokenizer, sampler, UI) over a `PipelineModel`, which looks like a `Transformer` to it;
the other ranks run `serve()`. Every hop is two messages from rank r to rank r + 1 (the
last rank sends back to rank 0, its ring neighbour), so MLX's ring backend, which only
talks to neighbours, carries it:

    control (int32): op, cache id, offset, B, T, logits to keep, dtype, cache bound,
                     then each rank's compute time for this step (µs)
    payload:         hidden states (B, T, hidden), or from the last rank the logits

The control message also keeps the other ranks' caches in step with rank 0's: a new
cache id means "make fresh caches", an offset below theirs means "trim back to it". So
the Engine's prefix reuse, edits and regenerate work unchanged.

Prefill chunks are split into micro-chunks, all sent before any reply is awaited, so
rank 0 runs piece k+1 while later ranks still work on piece k; each call then collects
the replies in order. Decode is one token per step, and timed: per-rank compute against the step's
wall time.
"""

from __future__ import annotations

import re
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from kvchat.model.cache.kv import can_trim_to, make_cache, trim_to
from kvchat.model.decoder.config import ModelConfig, load_config
from kvchat.model.decoder.layers import make_block, make_norm
from kvchat.model.decoder.mla import attention_class
from kvchat.model.decoder.transformer import Transformer
from kvchat.model.decoder.weights import load_model, parameter_count, weight_bytes
from kvchat.model.errors import KVChatError, ModelLoadError
from kvchat.model.files import tensor_bytes
from kvchat.model.gguf_file import is_gguf

from .link import Link, PipelineError, check_same_model, current_link, gather_ints

DTYPES = (mx.float32, mx.float16, mx.bfloat16)
OP_FORWARD = 1
# op, cache_id, offset, B, T, keep, dtype, max_kv (-1: none), sink keep; then per rank µs
CTRL_FIXED = 9
MICRO_MIN = 32  # the smallest prefill micro-chunk worth a hop
TIMING_WINDOW = 32  # decode steps averaged in the per-rank time split

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


# ---- the plan: which rank holds what ---------------------------------------------------
@dataclass(frozen=True)
class Slice:
    rank: int
    start: int  # first layer
    stop: int  # one past the last layer
    embed: bool  # the token embedding (rank 0; the last rank too when the head is tied)
    head: bool  # final norm + LM head (the last rank)
    weight_bytes: int  # planned from the checkpoint's tensor sizes

    @property
    def layers(self) -> range:
        return range(self.start, self.stop)


def config_tensor_bytes(cfg: ModelConfig, dtype_bytes: int) -> dict[str, int]:
    """The same table estimated from a config alone (no weights): dense shapes × bytes."""
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    layer = d * q + 2 * d * kv + q * d + 3 * d * f + 2 * d
    sizes = {f"model.layers.{i}.all": layer * dtype_bytes for i in range(cfg.num_hidden_layers)}
    sizes["model.embed_tokens.weight"] = cfg.vocab_size * d * dtype_bytes
    sizes["model.norm.weight"] = d * dtype_bytes
    if not cfg.tie_word_embeddings:
        sizes["lm_head.weight"] = cfg.vocab_size * d * dtype_bytes
    return sizes


def plan(cfg: ModelConfig, sizes: dict[str, int], n_ranks: int) -> list[Slice]:
    """Contiguous layer slices minimising the largest rank's bytes (weights only).

    Rank 0 also carries the embedding, the last rank the norm and the head (the
    embedding again when tied), so with a large vocabulary the end ranks get fewer layers.
    """
    L = cfg.num_hidden_layers
    if n_ranks < 1:
        raise KVChatError(f"need at least one rank, got {n_ranks}")
    if n_ranks > L:
        raise KVChatError(f"{n_ranks} ranks but the model has only {L} layers to split")
    per_layer = [0] * L
    embed = norm = head = 0
    for name, b in sizes.items():
        m = _LAYER.match(name)
        if m and int(m.group(1)) < L:
            per_layer[int(m.group(1))] += b
        elif name.startswith("model.embed_tokens."):
            embed += b
        elif name.startswith("model.norm."):
            norm += b
        elif name.startswith("lm_head."):
            head += b
    if cfg.tie_word_embeddings:
        head = embed  # the last rank needs the embedding matrix as its head
    fixed = [0] * n_ranks
    fixed[0] += embed
    fixed[-1] += norm + head
    prefix = [0]
    for b in per_layer:
        prefix.append(prefix[-1] + b)

    # best[r][i]: the smallest possible max-bytes placing layers [0, i) on ranks [0, r]
    inf = float("inf")
    best = [[inf] * (L + 1) for _ in range(n_ranks)]
    cut = [[0] * (L + 1) for _ in range(n_ranks)]
    for i in range(1, L + 1):
        best[0][i] = fixed[0] + prefix[i]
    for r in range(1, n_ranks):
        for i in range(r + 1, L + 1):
            for j in range(r, i):  # rank r holds layers [j, i)
                cost = max(best[r - 1][j], fixed[r] + prefix[i] - prefix[j])
                if cost < best[r][i]:
                    best[r][i], cut[r][i] = cost, j
    bounds = [L]
    for r in range(n_ranks - 1, 0, -1):
        bounds.append(cut[r][bounds[-1]])
    bounds.append(0)
    bounds.reverse()
    return [
        Slice(
            rank=r,
            start=bounds[r],
            stop=bounds[r + 1],
            embed=r == 0 or (r == n_ranks - 1 and cfg.tie_word_embeddings),
            head=r == n_ranks - 1,
            weight_bytes=fixed[r] + prefix[bounds[r + 1]] - prefix[bounds[r]],
        )
        for r in range(n_ranks)
    ]


# ---- one rank's part of the model -----------------------------------------------------
class SliceModel(Transformer):
    """The HF-named sub-tree one rank holds. Layers outside the slice are empty modules,
    so names keep their global index (`model.layers.N.*`) and per-layer quantization
    overrides in config.json apply unchanged. Embedding, blocks and head run through
    Transformer's own code, so every family's quirks hold on every rank."""

    def __init__(self, cfg: ModelConfig, part: Slice):
        nn.Module.__init__(self)
        if cfg.block == "shared_block":  # its layers read the embeddings and shared blocks
            raise ModelLoadError(f"{cfg.model_type} cannot be split across hosts: its layers"
                                 " share transformer blocks and read the token embeddings")
        self.config = cfg
        self.model_type = cfg.model_type
        self.part = part
        self.model = nn.Module()
        if part.embed:
            self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = [
            make_block(cfg, spec, attention_class(cfg)) if i in part.layers else nn.Module()
            for i, spec in enumerate(cfg.layers)
        ]
        if part.head:
            self.model.norm = make_norm(cfg, cfg.hidden_size)
            if not cfg.tie_word_embeddings:
                self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def excluded_prefixes(self) -> tuple[str, ...]:
        """Checkpoint names this rank never reads."""
        out = [f"model.layers.{i}." for i in range(self.config.num_hidden_layers)
               if i not in self.part.layers]
        if not self.part.embed:
            out.append("model.embed_tokens.")
        if not self.part.head:
            out += ["model.norm.", "lm_head."]
        return tuple(out)

    def run_slice(self, h: mx.array, caches: Sequence[Any]) -> mx.array:
        """This rank's layers; `caches` holds one cache per local layer. The hidden state
        leaves the rank whole (the pending residual added)."""
        h, pending = self.run_layers(h, list(caches), self.part.layers)
        return h if pending is None else h + pending

    def make_local_cache(self, max_kv_size: int | None, keep: int) -> list[Any]:
        caches = make_cache(self.config, max_kv_size=max_kv_size, keep=keep)
        return caches[self.part.start : self.part.stop]


# ---- start-up: every rank runs this, in the same order of collectives -----------------
def load_part(link: Link, path: str | Path) -> tuple[SliceModel, list[Slice], list[dict]]:
    """Check that every rank has the same model, plan the split, load this rank's slice.

    Collective: all ranks call it together. A rank whose folder differs (config.json or
    weights) or fails to load is named in one line on every rank.
    """
    folder = Path(path).expanduser()
    if is_gguf(folder):  # every rank reads the same path: all refuse alike
        raise ModelLoadError(f"{folder.name}: a GGUF file cannot be split across hosts yet;"
                             " use a model folder (config.json + safetensors)")
    check_same_model(link, folder)
    cfg = load_config(folder)
    slices = plan(cfg, tensor_bytes(folder), link.size)
    mine = slices[link.rank]
    error = ""
    part: SliceModel | None = None
    try:
        part = load_model(folder, build=lambda c: SliceModel(c, mine))  # type: ignore[assignment]
    except KVChatError as e:
        error = str(e)
    own_params = 0
    if part is not None:
        own_params = parameter_count(part)
        if mine.embed and mine.rank != 0:  # the tied head's copy is not a new parameter
            own_params -= cfg.vocab_size * cfg.hidden_size
    rows = gather_ints(
        link,
        [0 if part is None else 1,
         0 if part is None else weight_bytes(part),
         mx.get_active_memory(),
         own_params],
    )
    failed = [r for r, row in enumerate(rows) if row[0] == 0]
    if failed:
        r = failed[0]
        why = f": {error}" if r == link.rank and error else ""
        raise ModelLoadError(f"rank {r} ({link.host(r)}) could not load {folder.name}{why}")
    ranks = [
        {
            "rank": s.rank,
            "host": link.host(s.rank),
            "layers": [s.start, s.stop],
            "planned_weight_bytes": s.weight_bytes,
            "weight_bytes": row[1],
            "active_memory": row[2],
            "parameters": row[3],
        }
        for s, row in zip(slices, rows, strict=True)
    ]
    assert part is not None
    part.path = folder  # type: ignore[attr-defined]
    return part, slices, ranks


def load(path: str | Path) -> nn.Module:
    """The Engine's loader: the whole model, or, in a process that joined a pipeline
    group as rank 0, the `PipelineModel` over every rank (collective with `serve`)."""
    link = current_link()
    if link is None or link.size < 2:
        return load_model(path)
    global _loaded
    if _loaded:
        raise ModelLoadError(
            "a model split across hosts cannot be swapped: restart with --model"
        )
    _loaded = True
    part, slices, ranks = load_part(link, path)
    return PipelineModel(part, slices, ranks, link)


_loaded = False


# ---- rank 0 -----------------------------------------------------------------------------
class RemoteLayerCache:
    """Rank 0's stand-in for a layer another rank holds. Every layer sees the same tokens,
    so offsets, rotation and trimming match rank 0's own first layer (`rep`); stats
    report the same bytes as that layer and name the rank whose memory holds them."""

    def __init__(self, rep: Any, rank: int):
        self.rep, self.rank = rep, rank

    @property
    def offset(self) -> int:
        return self.rep.offset

    @property
    def keys(self) -> Any:  # shape and dtype only (cache_stats reads them)
        return self.rep.keys

    @property
    def values(self) -> Any:
        return self.rep.values

    @property
    def nbytes(self) -> int:
        return self.rep.nbytes

    @property
    def state(self) -> tuple[()]:
        return ()  # nothing resident on this rank

    def size(self) -> int:
        return self.rep.size()

    def is_trimmable(self) -> bool:
        return True

    def can_trim_to(self, n: int) -> bool:
        return self.rep.can_trim_to(n)

    def trim(self, n: int) -> int:
        return max(0, min(self.rep.offset, n))  # the remote rank trims on the next step

    def empty(self) -> bool:
        return self.rep.empty()

    def make_mask(self, *a: Any, **kw: Any) -> Any:
        return self.rep.make_mask(*a, **kw)

    def stats(self) -> dict[str, Any]:
        return {**self.rep.stats(), "rank": self.rank}


class PipelineModel(nn.Module):
    """What rank 0's Engine drives: `__call__(tokens, cache, logits_to_keep)` and
    `make_cache` as on `Transformer`, running the other ranks' layers remotely."""

    def __init__(self, part: SliceModel, slices: list[Slice], ranks: list[dict], link: Link):
        super().__init__()
        self.part = part
        self.config = part.config
        self.model_type = part.config.model_type
        self.path = part.path  # type: ignore[attr-defined]
        self.quantization = part.config.quantization
        self._slices, self._ranks, self._link = slices, ranks, link
        self._cache_id = 0
        self._bound: tuple[int, int] = (-1, 4)
        self._local = 0  # layers on rank 0
        self._steps: deque[tuple[float, list[float]]] = deque(maxlen=TIMING_WINDOW)

    @property
    def layers(self) -> list[Any]:
        return self.part.model.layers

    # -- the Transformer interface --
    def make_cache(self, max_kv_size: int | None = None, keep: int = 4,
                   kv: Any = None) -> list[Any]:
        if kv is not None:  # the ranks' wire format carries float K/V only
            raise PipelineError("a quantized K/V cache (--kv-bits) is not supported for a"
                                " model split across machines")
        local = self.part.make_local_cache(max_kv_size, keep)
        self._cache_id += 1
        self._bound = (-1 if max_kv_size is None else max_kv_size, keep)
        self._local = len(local)
        owner = [s.rank for s in self._slices for _ in s.layers]
        return local + [RemoteLayerCache(local[0], owner[i])
                        for i in range(len(local), len(owner))]

    def __call__(
        self, tokens: mx.array, cache: list[Any] | None = None, logits_to_keep: int = 0
    ) -> mx.array:
        if cache is None:
            cache = self.make_cache()
        B, T = tokens.shape
        local = cache[: self._local]
        t0 = time.perf_counter()
        try:
            # send every piece first: rank 0 runs piece k+1 while the others work on k
            sent = []
            for s, e in self._micro_chunks(T, logits_to_keep):
                keep = (logits_to_keep or T) if e == T else 0
                sent.append((keep, self._send_piece(tokens[:, s:e], local, keep)))
            # then the replies, in order, each receive queued only once the previous one
            # arrived: MLX's ring drops a socket's queue after a failure, so a receive
            # queued behind a failed one would wait forever
            for keep, dtype in sent:
                self._link.check_alive()
                back = self._link.recv((CTRL_FIXED + self._link.size,), mx.int32)
                mx.eval(back)  # one eval each: MLX may run one eval's outputs in any order
                out = self._link.recv((B, keep, self.config.vocab_size), dtype) if keep \
                    else back
                mx.eval(out)
        except RuntimeError as e:  # MLX raises when a ring peer is gone
            raise self._link.failure_error(e) from None
        if T == 1:  # a decode step: per-rank compute against the step's wall time
            wall = time.perf_counter() - t0
            self._steps.append((wall, [x / 1e6 for x in back.tolist()[CTRL_FIXED:]]))
        return out

    def _micro_chunks(self, T: int, logits_to_keep: int) -> list[tuple[int, int]]:
        """Split a prefill chunk so ranks overlap; only when the logits wanted all lie
        in the last piece."""
        n = min(self._link.size, T // MICRO_MIN)
        if n < 2 or logits_to_keep == 0:
            return [(0, T)]
        step = -(-T // n)
        bounds = list(range(0, T, step)) + [T]
        if logits_to_keep > bounds[-1] - bounds[-2]:
            return [(0, T)]
        return list(zip(bounds[:-1], bounds[1:], strict=True))

    def _send_piece(self, tokens: mx.array, local: list[Any], keep: int) -> mx.Dtype:
        """Run rank 0's layers on `tokens` and queue the hop to rank 1 (not waited)."""
        self._link.check_alive()
        B, T = tokens.shape
        offset = local[0].offset
        mx.eval(tokens)  # the sampled token of the previous step: not our compute time
        t0 = time.perf_counter()
        h = self.part.run_slice(self.part.embed(tokens, offset), local)
        mx.eval(h)
        ctrl = [OP_FORWARD, self._cache_id, offset, B, T, keep, DTYPES.index(h.dtype),
                *self._bound] + [0] * self._link.size
        ctrl[CTRL_FIXED] = int((time.perf_counter() - t0) * 1e6)
        self._link.send_async(mx.array(ctrl, dtype=mx.int32), h)
        return h.dtype

    # -- statistics --
    def pipeline_info(self) -> dict[str, Any]:
        """Whole-model totals for the Engine's model info, with each rank's share."""
        return {
            "parameters": sum(r["parameters"] for r in self._ranks),
            "weight_bytes": sum(r["weight_bytes"] for r in self._ranks),
            "ranks": [dict(r) for r in self._ranks],
        }

    def pipeline_stats(self, cache: list[Any] | None) -> dict[str, Any]:
        """Per rank: weights, K/V bytes (from cache metadata) and mean decode compute;
        plus the step's wall time and the part no rank computed (transfer and waiting)."""
        kv = [0] * len(self._slices)
        if cache:
            for s in self._slices:
                kv[s.rank] = sum(cache[i].nbytes for i in s.layers)
        steps = list(self._steps)
        n = len(steps)
        compute = [sum(c[r] for _, c in steps) / n if n else 0.0 for r in range(len(kv))]
        wall = sum(w for w, _ in steps) / n if n else 0.0
        rows = [
            {"rank": r["rank"], "host": r["host"], "layers": r["layers"],
             "weight_bytes": r["weight_bytes"], "kv_bytes": kv[r["rank"]],
             "compute_ms": compute[r["rank"]] * 1e3}
            for r in self._ranks
        ]
        return {
            "ranks": rows,
            "weight_bytes": sum(r["weight_bytes"] for r in rows),  # the totals beside them
            "kv_bytes": sum(kv),
            "step_ms": wall * 1e3,
            "transfer_ms": max(0.0, wall - sum(compute)) * 1e3,
            "steps_timed": n,
        }


# ---- ranks 1..N-1 -----------------------------------------------------------------------
def serve(link: Link, path: str | Path) -> None:
    """Load this rank's slice and run steps for rank 0, forever: the control channel
    ends this process when rank 0 stops or goes away (see pipeline_link)."""
    part, _, _ = load_part(link, path)
    cfg, me, last = part.config, link.rank, link.rank == link.size - 1
    caches: list[Any] = []
    cache_id = -1
    while True:
        ctrl_a = link.recv((CTRL_FIXED + link.size,), mx.int32)
        mx.eval(ctrl_a)
        ctrl = ctrl_a.tolist()
        op, cid, offset, B, T, keep, dt, max_kv, sinks = ctrl[:CTRL_FIXED]
        if op != OP_FORWARD:
            raise PipelineError(f"rank {me}: unknown pipeline op {op}")
        if cid != cache_id:
            caches = part.make_local_cache(None if max_kv < 0 else max_kv, sinks)
            cache_id = cid
        have = caches[0].offset
        if have != offset:
            if not can_trim_to(caches, offset):
                raise PipelineError(f"rank {me}: cache at {have} cannot go back to {offset}")
            trim_to(caches, offset)
        h = link.recv((B, T, cfg.hidden_size), DTYPES[dt])
        mx.eval(h)
        t0 = time.perf_counter()
        h = part.run_slice(h, caches)
        out = part.head(h[:, -keep:, :]) if last and keep else h
        mx.eval(out)
        ctrl[CTRL_FIXED + me] = int((time.perf_counter() - t0) * 1e6)
        link.send_wait(mx.array(ctrl, dtype=mx.int32), None if last and not keep else out)


def split_table(
    cfg: ModelConfig, sizes: dict[str, int], n_ranks: int, kv_dtype_bytes: int, context: int
) -> list[dict[str, Any]]:
    """`kvchat inspect --hosts N`: what each rank would hold, before running anything."""
    from kvchat.model.cache.kv_math import kv_bytes_per_token

    rows = []
    for s in plan(cfg, sizes, n_ranks):
        per_token = kv_bytes_per_token(s.stop - s.start, cfg.num_key_value_heads,
                                       cfg.head_dim, kv_dtype_bytes)
        rows.append({
            "rank": s.rank,
            "layers": [s.start, s.stop],
            "embedding": s.embed,
            "head": s.head,
            "weight_bytes": s.weight_bytes,
            "kv_bytes_per_token": per_token,
            "kv_bytes_at_context": per_token * context,
        })
    return rows
