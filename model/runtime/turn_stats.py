"""A turn's statistics, each by its one definition (docs/design.md, "Statistics").

The cache's numbers come from its metadata (`cache_stats`), the runtime's from MLX's
allocator counters; none reads an array back. `TurnMeter` times one turn (prefill speed,
TTFT, decode speed), `Evictions` notices what rotation dropped, `current_stats` puts a
turn's numbers together with the cache's and the runtime's as they are now.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from kvchat import metal_kernels
from kvchat.model.cache.checkpoints import Checkpoints, stateful
from kvchat.model.cache.kv import cache_stats

from .events import Overflow, TurnStats
from .generate import Progress

STATS_INTERVAL_S = 0.1  # ~10 stats events a second, never one per token


def runtime_stats() -> TurnStats:
    """Allocator counters and where the model runs (no arrays read)."""
    return TurnStats(
        peak_memory=mx.get_peak_memory(),
        active_memory=mx.get_active_memory(),
        kernels_backend=metal_kernels.backend(),
        device=str(mx.default_device()),
    )


def current_stats(model: Any, caches: list[Any] | None, pool: dict[str, Any] | None,
                  runtime: TurnStats, turn: TurnStats | None = None,
                  checkpoints: Checkpoints | None = None) -> TurnStats:
    """`turn`'s numbers with the cache's (and its recurrent states' `checkpoints`), the
    pool's (ChatCache.pool_stats) and `runtime`'s as they are now."""
    s = turn or TurnStats()
    if caches:
        s = s.merged(cache_stats(caches, model.config))
        if checkpoints is not None and stateful(caches):
            s = s.with_(checkpoints=len(checkpoints), checkpoint_bytes=checkpoints.nbytes)
    if hasattr(model, "pipeline_stats"):  # per-rank bytes and time split
        s = s.with_(pipeline=model.pipeline_stats(caches))
    if pool is not None:
        s = s.with_(prefix_pool=pool)
    return s.merged(runtime)


@dataclass
class TurnMeter:
    """One turn's clock readings and the statistics they give: `prefill_tps` and `ttft_s`
    at the first generated token, `decode_tps` over the tokens after it."""

    stats: TurnStats
    t_submit: float
    t_first: float | None = None
    t_last: float | None = None
    progress: Progress | None = None  # the decode's counts (speculation)

    def token(self, now: float, progress: Progress, prefilled: int) -> None:
        """A generated token arrived at `now`; `prefilled` prompt tokens ran before it."""
        self.t_last = now
        self.progress = progress
        if self.t_first is None:
            self.t_first = now
            self.stats.ttft_s = now - self.t_submit
            p_s = progress.prefill_s
            self.stats.prefill_tps = prefilled / p_s if p_s > 0 else 0.0
            self.stats.compiled_step = progress.compiled

    def decoded(self, generated: int) -> TurnStats:
        """The stats with the decode figures of `generated` tokens so far."""
        first, last = self.t_first, self.t_last
        span = (last - first) if (first is not None and last is not None) else 0.0
        self.stats.generated_tokens = generated
        self.stats.decode_tps = (generated - 1) / span if generated > 1 and span > 0 else 0.0
        if self.progress is not None:
            self._speculation(self.progress, generated)
        return self.stats

    def _speculation(self, p: Progress, generated: int) -> None:
        """Drafted, accepted, acceptance and tokens per forward pass, when it ran; the
        reason when it was asked for and could not."""
        s = self.stats
        s.speculation_note = p.speculation_off
        if p.speculation is None:
            return
        s.speculation, s.drafted, s.accepted = p.speculation, p.drafted, p.accepted
        s.acceptance = p.accepted / p.drafted if p.drafted else 0.0
        s.tokens_per_forward = (generated - 1) / p.forwards if p.forwards else 0.0


class Evictions:
    """What the cache's rotation has dropped, so that each phase of a turn (reading the
    prompt, writing the reply) that evicted tokens says so once, with an Overflow."""

    def __init__(self, model: Any, caches: list[Any]):
        self.model, self.caches = model, caches
        self.seen = cache_stats(caches, model.config).evicted_tokens or 0

    def overflow(self, during: str) -> Overflow | None:
        """An Overflow for the tokens evicted since the last call (None when none were)."""
        s = cache_stats(self.caches, self.model.config)
        before, self.seen = self.seen, s.evicted_tokens or 0
        if self.seen > before:
            return Overflow(self.seen - before, s.cache_capacity or 0, during)
        return None
