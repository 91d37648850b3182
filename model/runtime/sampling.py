"""Turning next-token logits into a token: repetition penalty, temperature, top-k/top-p/min-p.

Pipeline of one ``Sampler`` step (logits ``(B, V)`` -> token ids ``(B,)`` int32):

1. repetition penalty over the last ``repetition_context_size`` ids of the history
   (HF/CTRL rule: positive logit / penalty, negative logit * penalty; each distinct id once).
   Applied for greedy decoding too: it is a logits processor, not a sampling filter.
2. ``temp == 0`` -> argmax (greedy); nothing below runs and no PRNG key is used.
3. temperature: logits / temp.
4. top-k, then top-p, then min-p. Each filter sees the distribution *renormalised over the
   survivors of the previous one* (softmax of the temperature-scaled logits with removed
   tokens at -inf), as HF's chained logits warpers do. min-p is unaffected by the
   renormalisation since it compares ratios to the top probability.
5. categorical sample with the sampler's own PRNG key (split every step).

Every step is pure ``mx`` ops (no ``.item()``/``.tolist()``), so the engine can queue the
next forward pass with ``mx.async_eval`` before the token is known on the host.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from kvchat.model.errors import KVChatError

__all__ = [
    "MIN_P_TOLERANCE",
    "Argmax",
    "TOP_P_TOLERANCE",
    "Sampler",
    "SamplingError",
    "SamplingParams",
    "Unseeded",
    "apply_repetition_penalty",
    "apply_temperature",
    "min_p_mask",
    "top_k_mask",
    "top_p_mask",
]

# float32 softmax/cumsum are off by a few ulps, so "cumulative prob >= top_p" and
# "prob >= min_p * max prob" would flip on exact ties (e.g. 0.5 + 0.3 vs top_p 0.8)
# depending on rounding. These tolerances make ties count as reaching the bar.
TOP_P_TOLERANCE = 1e-6  # absolute, on cumulative probability
MIN_P_TOLERANCE = 1e-5  # absolute, on log-probability (i.e. ~1e-5 relative on probability)

_NEG_INF = float("-inf")
_MAX_SEED = 2**64 - 1  # mx.random.key takes a uint64 seed
_MIN_TEMP = 1e-30  # 1 / temp must stay finite in float32; below this it is greedy anyway


class SamplingError(KVChatError):
    """Invalid sampling settings; str(e) is one line naming the setting and the bad value."""


def _is_int(x: Any) -> bool:
    # bool is an int subclass, but `top_k=True` is surely a mistake.
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """Decoding settings; defaults are greedy decoding with every filter off."""

    temp: float = 0.0
    top_p: float = 1.0  # 1.0 = off
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0.0 = off
    repetition_penalty: float = 1.0  # 1.0 = off
    repetition_context_size: int = 64
    seed: int | None = None

    def validate(self) -> SamplingParams:
        """Raise SamplingError on the first invalid value; return self so calls can chain."""
        t = self.temp
        if not _is_real(t) or not math.isfinite(t) or t < 0:
            raise SamplingError(f"temp must be a finite number >= 0 (got {t!r})")
        p = self.top_p
        if not _is_real(p) or not 0 < p <= 1:  # NaN fails the comparison too
            raise SamplingError(f"top_p must be in (0, 1] (got {p!r})")
        k = self.top_k
        if not _is_int(k) or k < 0:
            raise SamplingError(f"top_k must be an integer >= 0, 0 = off (got {k!r})")
        m = self.min_p
        if not _is_real(m) or not 0 <= m < 1:
            raise SamplingError(f"min_p must be in [0, 1) (got {m!r})")
        r = self.repetition_penalty
        if not _is_real(r) or not math.isfinite(r) or r <= 0:
            raise SamplingError(f"repetition_penalty must be a finite number > 0 (got {r!r})")
        c = self.repetition_context_size
        if not _is_int(c) or c < 1:
            raise SamplingError(f"repetition_context_size must be an integer >= 1 (got {c!r})")
        s = self.seed
        if s is not None and (not _is_int(s) or not 0 <= s <= _MAX_SEED):
            raise SamplingError(f"seed must be an integer in [0, 2**64 - 1] (got {s!r})")
        return self


# ---------------------------------------------------------------------------------------
# Public building blocks (each returns new logits; removed tokens are -inf)
# ---------------------------------------------------------------------------------------


def _as_2d(logits: mx.array) -> mx.array:
    """Accept (V,), (B, V) or (B, T, V) (last position) and return (B, V)."""
    if logits.ndim == 1:
        return logits[None]
    if logits.ndim == 3:
        return logits[:, -1, :]
    if logits.ndim != 2:
        raise SamplingError(f"logits must have shape (B, V), got {tuple(logits.shape)}")
    return logits


def apply_repetition_penalty(
    logits: mx.array,
    history: list[int] | tuple[int, ...] | mx.array,
    penalty: float,
    context_size: int | None = None,
) -> mx.array:
    """Penalise ids seen in ``history`` (its last ``context_size`` ids when given).

    HF/CTRL rule per distinct id: logit > 0 -> logit / penalty, else logit * penalty, so a
    penalty > 1 always makes a seen token less likely. An id seen many times is penalised
    once. Ids must lie in [0, V); out-of-range ids in a Python list are ignored.
    """
    if penalty == 1.0:
        return logits
    if isinstance(history, mx.array):
        ids = history.reshape(-1)
        if context_size is not None:
            ids = ids[max(ids.size - context_size, 0) :]  # static shapes: no host sync
        if ids.size == 0:
            return logits
        ids = ids.astype(mx.int32)
    else:
        if context_size is not None:
            history = list(history)[-context_size:] if context_size > 0 else []
        vocab = logits.shape[-1]
        uniq = sorted({int(t) for t in history if 0 <= int(t) < vocab})
        if not uniq:
            return logits
        ids = mx.array(uniq, dtype=mx.int32)
    # Gather -> penalise -> scatter. Duplicate ids gather the same original value and
    # scatter the same result back, so each distinct id is penalised exactly once.
    picked = logits[..., ids]
    picked = mx.where(picked > 0, picked / penalty, picked * penalty)
    out = mx.array(logits)  # copy: don't mutate the caller's array
    out[..., ids] = picked
    return out


def apply_temperature(logits: mx.array, temp: float) -> mx.array:
    """logits / temp in float32, shifted so the max is 0 (no overflow at tiny temps)."""
    x = logits.astype(mx.float32)
    x = x - mx.max(x, axis=-1, keepdims=True)  # <= 0 everywhere, top token exactly 0
    return x * (1.0 / max(float(temp), _MIN_TEMP))


def top_k_mask(logits: mx.array, k: int) -> mx.array:
    """Keep the ``k`` largest logits (ties broken arbitrarily), -inf elsewhere.

    ``k <= 0`` or ``k >= V`` is a no-op. Uses argpartition (O(V)), not a full sort.
    """
    vocab = logits.shape[-1]
    if k <= 0 or k >= vocab:
        return logits
    drop = mx.argpartition(-logits, kth=k - 1, axis=-1)[..., k:]
    return mx.put_along_axis(logits, drop, mx.array(_NEG_INF, dtype=logits.dtype), axis=-1)


def top_p_mask(logits: mx.array, top_p: float) -> mx.array:
    """Nucleus filter: keep the smallest set of most likely tokens whose probability sum
    reaches ``top_p`` (within TOP_P_TOLERANCE); the top token is always kept.

    Probabilities are softmax(logits), i.e. already renormalised over non -inf tokens.
    ``top_p >= 1`` is a no-op (skips the full sort).
    """
    if top_p >= 1.0:
        return logits
    x = logits.astype(mx.float32)
    order = mx.argsort(-x, axis=-1)  # descending; -inf sorts last
    sorted_logits = mx.take_along_axis(x, order, axis=-1)
    sorted_probs = mx.softmax(sorted_logits, axis=-1)
    # Token i (in sorted order) is needed iff the tokens before it have not reached top_p.
    before = mx.cumsum(sorted_probs, axis=-1, inclusive=False)
    keep = before < (top_p - TOP_P_TOLERANCE)
    keep = keep | (mx.arange(x.shape[-1]) == 0)  # tiny top_p must still leave one token
    filtered = mx.where(keep, sorted_logits, _NEG_INF).astype(logits.dtype)
    # order is a permutation, so scattering back fills every position.
    return mx.put_along_axis(logits, order, filtered, axis=-1)


def min_p_mask(logits: mx.array, min_p: float) -> mx.array:
    """Keep tokens with prob >= min_p * (max prob) (within MIN_P_TOLERANCE), -inf elsewhere.

    Done in log space (logit - max logit >= log min_p): same set, no softmax, no sort.
    ``min_p <= 0`` is a no-op. The top token always survives.
    """
    if min_p <= 0.0:
        return logits
    x = logits.astype(mx.float32)
    rel = x - mx.max(x, axis=-1, keepdims=True)
    keep = rel >= (math.log(min_p) - MIN_P_TOLERANCE)
    return mx.where(keep, logits, mx.array(_NEG_INF, dtype=logits.dtype))


# ---------------------------------------------------------------------------------------
# Sampler
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Argmax:
    """The draw of a greedy Sampler with no repetition penalty over the first `n` ids: the
    argmax of each row, no PRNG key, no history. A batch draws every row sampled this way
    with one operation over all their logits (model/runtime/batch.py)."""

    n: int

    def __call__(self, logits: mx.array) -> mx.array:
        return mx.argmax(_as_2d(logits)[:, : self.n], axis=-1).astype(mx.int32)


@dataclass(frozen=True)
class Unseeded:
    """The draw of a Sampler with no seed and no repetition penalty over the first `n`
    ids: tempered and filtered as `Sampler` does, drawn with MLX's global generator's next
    key at each call (a seeded Sampler keeps a key of its own, so its draws repeat).
    A batch draws every row sampled with the same settings with one draw over all their
    logits, each row with its own noise (model/runtime/batch.py)."""

    temp: float
    top_p: float
    top_k: int
    min_p: float
    n: int

    @classmethod
    def of(cls, p: SamplingParams, n: int) -> Unseeded:
        return cls(p.temp, p.top_p, p.top_k, p.min_p, n)

    def __call__(self, logits: mx.array) -> mx.array:
        return _filters(self).draw(_as_2d(logits)[:, : self.n])


@functools.lru_cache(maxsize=64)
def _filters(d: Unseeded) -> Sampler:
    """A Sampler with `d`'s settings, for its filters: its own key is never used, so it
    is seeded (building it takes nothing from the global generator)."""
    return Sampler(SamplingParams(temp=d.temp, top_p=d.top_p, top_k=d.top_k, min_p=d.min_p,
                                  seed=0))


class Sampler:
    """Stateful per-generation sampler: ``sampler(logits, history) -> (B,) int32`` ids.

    Holds its own PRNG key, split every sampled step, so two Samplers built with the same
    seed produce the same tokens for the same logits whatever happens to the global
    ``mx.random`` state. ``seed=None`` draws the starting key from the global state.
    """

    def __init__(self, params: SamplingParams | None = None) -> None:
        self.params = (params or SamplingParams()).validate()
        seed = self.params.seed
        if seed is not None:
            self._key = mx.random.key(seed)
        else:
            # Two 31-bit draws from the global generator (honours mx.random.seed).
            self._key = mx.random.randint(0, 2**31 - 1, (2,)).astype(mx.uint32)

    @property
    def greedy(self) -> bool:
        """Whether every draw is the argmax (temperature 0, or top-k 1)."""
        return self.params.temp == 0 or self.params.top_k == 1

    def _next_key(self) -> mx.array:
        keys = mx.random.split(self._key)
        self._key = keys[0]
        return keys[1]

    def _filtered(
        self, logits: mx.array, history: list[int] | tuple[int, ...] | mx.array
    ) -> tuple[mx.array, mx.array | None]:
        """The logits a draw is made from, (B, V) penalised — and unless greedy, tempered
        and filtered (removed tokens -inf) over the top-k `candidates` (None: all)."""
        p = self.params
        logits = _as_2d(logits)
        if p.repetition_penalty != 1.0:
            logits = apply_repetition_penalty(
                logits, history, p.repetition_penalty, p.repetition_context_size
            )
        if self.greedy:
            return logits, None
        x = apply_temperature(logits, p.temp)
        vocab = x.shape[-1]
        candidates = None
        if 0 < p.top_k < vocab:
            # Narrow to the k candidates once (argpartition, O(V)); top-p then sorts only
            # k values instead of the whole vocabulary.
            candidates = mx.argpartition(-x, kth=p.top_k - 1, axis=-1)[..., : p.top_k]
            x = mx.take_along_axis(x, candidates, axis=-1)
        if p.top_p < 1.0:
            x = top_p_mask(x, p.top_p)
        if p.min_p > 0.0:
            x = min_p_mask(x, p.min_p)
        return x, candidates

    def __call__(
        self,
        logits: mx.array,
        history: list[int] | tuple[int, ...] | mx.array = (),
    ) -> mx.array:
        return self.draw(logits, history, None if self.greedy else self._next_key())

    def draw(
        self,
        logits: mx.array,
        history: list[int] | tuple[int, ...] | mx.array = (),
        key: mx.array | None = None,
    ) -> mx.array:
        """One id per row, drawn with `key` (None: MLX's global generator's next key)."""
        x, candidates = self._filtered(logits, history)
        if self.greedy:
            # top_k == 1 leaves only the argmax whatever the temperature; argmax also
            # breaks ties exactly like greedy does.
            return mx.argmax(x, axis=-1).astype(mx.int32)
        tok = mx.random.categorical(x, axis=-1, key=key)
        if candidates is not None:
            tok = mx.take_along_axis(candidates, tok[..., None].astype(mx.int32), axis=-1)
            tok = tok[..., 0]
        return tok.astype(mx.int32)

    # ---- speculative sampling (model/runtime/speculative.py) -----------------------------
    def probs(
        self, logits: mx.array, history: list[int] | tuple[int, ...] | mx.array = ()
    ) -> mx.array:
        """The distribution (B, V) a draw of `__call__` follows (not for greedy)."""
        x, candidates = self._filtered(logits, history)
        p = mx.softmax(x.astype(mx.float32), axis=-1)
        if candidates is None:
            return p
        full = mx.zeros((p.shape[0], _as_2d(logits).shape[-1]), dtype=mx.float32)
        return mx.put_along_axis(full, candidates.astype(mx.int32), p, axis=-1)

    def pick(self, probs: mx.array) -> mx.array:
        """One id per row of `probs` (B, V), drawn with this sampler's key."""
        return mx.random.categorical(mx.log(probs), axis=-1, key=self._next_key()).astype(
            mx.int32)

    def uniform(self, n: int) -> mx.array:
        """`n` draws from U[0, 1) with this sampler's key (speculative acceptance tests)."""
        return mx.random.uniform(shape=(n,), key=self._next_key())
