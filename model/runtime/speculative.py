"""Speculative decoding: draft a few tokens cheaply, check them all with one call of the
model, keep the longest run it agrees with (docs/design.md, "Speculative decoding").

Draft sources (`propose(history, k) -> (ids, q)`):
- `PromptLookup`: the last n ids of the conversation (n = `ngram` down to 1) found earlier
  in it; the ids that followed their latest earlier occurrence are the draft. Free to run;
  it drafts when a reply quotes the conversation (a rewrite, a fix, names).
- `DraftModel`: a smaller model with the same tokenizer, from its own cache, which
  follows the conversation (the common prefix kept across turns, the rest prefilled).

One step feeds the last sampled token and the k drafts in one call (`CompiledStep.verify`
where every cache takes them in consecutive slots, else the model's own multi-token
path), so the cache holds them all; the rejected ones are trimmed again. A ring past its
window puts back the keys they displaced (model/cache/kv.py), so the trim is exact.

Exactness:
- greedy: a draft is kept iff it is the token plain decoding would pick at its position
  (the same sampler, with the repetition history that position has), so the ids are
  plain decoding's;
- temperature > 0: the standard rule (Leviathan et al. 2023; Chen et al. 2023): keep
  draft d with probability min(1, p(d) / q(d)); at the first rejection draw from
  max(p − q, 0) renormalised; when all k are kept draw one more from p. The emitted ids
  follow the target's distribution p exactly. A prompt lookup's draft is certain
  (q = one-hot): kept with probability p(d), else a draw from p without d.

A recurrent layer's state cannot take tokens back in general, but for the reply it keeps
the states of its last few tokens (`set_rollback`; a verify pass hands back every
position's: model/decoder/state_steps.py), so a rejected draft is taken back to the very
state after the last accepted token. A cache that cannot take tokens back at all, or a
model split across hosts (its other ranks' caches are out of reach), runs plain decoding,
and `Progress.speculation_off` says why.

The draft length adapts (`DraftLength`): each pass drafts the k that maximises the
expected tokens per second, E(α, k) / c(k + 1), where α is the recent acceptance rate per
drafted token and c(n) the measured seconds of a pass that runs n tokens, on this machine
under its present load. Where a pass of k + 1 tokens costs k + 1 single steps (a busy
CPU) no k pays and it drafts nothing; where it costs little more than one (a
memory-bound machine) it drafts as long as drafts are accepted. Without drafts (none
pays, or the lookup found nothing) plain steps run in a stretch, pipelined as
`generate.decode` runs them; the rate estimate drifts back to a prior meanwhile, so
drafting is tried again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import mlx.core as mx

from kvchat.model.cache.hybrid import HybridCache
from kvchat.model.cache.kv import (
    make_prompt_cache,
    maybe_quantize,
    pending_quantization,
    trim_to,
)
from kvchat.model.cache.state import StateCache, set_rollback

from . import threads
from .events import MAX_DRAFT_TOKENS, GenParams
from .generate import PREFILL_CHUNK, CompiledStep, Progress, decode_step
from .sampling import Sampler

DEFAULTS = GenParams()  # draft_tokens, lookup_ngram
# the acceptance estimate: a prior of PRIOR_RATE over PRIOR_TRIALS drafted tokens, and the
# weight each step keeps of the past (for the rate and for the costs)
PRIOR_RATE = 0.5
PRIOR_TRIALS = 2.0
DECAY = 0.8
# plain steps run in stretches, pipelined as decode's: after a lookup found nothing, and
# (longer) while no draft length pays
NO_MATCH_STRETCH = 4
NO_GAIN_STRETCH = 16

Q = mx.array | None  # the draft's distributions (k, V), None: certain drafts


class DraftSource(Protocol):
    name: str

    def propose(self, history: list[int], k: int) -> tuple[list[int], Q]: ...


# ---- draft sources ------------------------------------------------------------------------
class PromptLookup:
    """Drafts by n-gram match against the conversation so far (`history`, append-only:
    the prompt's ids, then the reply's). An index per n maps each n-gram to where the
    id after its latest occurrence is, updated as ids arrive: a proposal is one lookup."""

    name = "prompt lookup"

    def __init__(self, ngram: int = DEFAULTS.lookup_ngram) -> None:
        self.ngram = ngram
        self._seen = 0  # ids of the history indexed so far
        self._after: list[dict[tuple[int, ...], int]] = [{} for _ in range(ngram)]

    def _index(self, history: list[int]) -> None:
        for i in range(self._seen, len(history)):  # history[i] follows each n-gram before it
            for n in range(1, min(self.ngram, i) + 1):
                self._after[n - 1][tuple(history[i - n : i])] = i
        self._seen = len(history)

    def propose(self, history: list[int], k: int) -> tuple[list[int], Q]:
        if len(history) < self._seen:  # another history: index it afresh
            self._seen, self._after = 0, [{} for _ in range(self.ngram)]
        self._index(history)
        end = len(history)
        for n in range(min(self.ngram, end), 0, -1):  # the longest match first
            at = self._after[n - 1].get(tuple(history[end - n :]))
            if at is not None:
                return history[at : at + k], None
        return [], None


class DraftModel:
    """Drafts by a smaller model with the same tokenizer. Its cache follows the
    conversation: a proposal keeps what the cache holds of `history`, trims the rest and
    feeds what is new, then drafts k ids one step at a time (greedy, or drawn from the
    draft's own distribution q with the target's sampling settings)."""

    def __init__(self, model: Any, name: str, *, max_kv_size: int | None = None,
                 keep: int = 4) -> None:
        self.model, self.name = model, name
        self.bound = (max_kv_size, keep)
        self.caches: list[Any] | None = None
        self.ids: list[int] = []  # what the cache holds
        self.sampler: Sampler | None = None  # None: greedy drafts
        self.n_ids = model.config.vocab_size

    def start(self, sampler: Sampler | None, n_ids: int, max_kv_size: int | None,
              keep: int) -> None:
        """A new reply: its sampling (None: greedy) and the cache bound it runs under."""
        self.sampler, self.n_ids = sampler, n_ids
        if (max_kv_size, keep) != self.bound:
            self.bound, self.caches, self.ids = (max_kv_size, keep), None, []

    def _sync(self, history: list[int]) -> list[int]:
        """Trim the cache to its common prefix with `history`; the ids still to feed
        (at least one: the next draft needs its logits)."""
        limit = min(len(self.ids), len(history) - 1)
        n = limit if self.ids[:limit] == history[:limit] else 0  # the usual case, at C speed
        while n < limit and self.ids[n] == history[n]:
            n += 1
        if self.caches is not None and n < len(self.ids) and not all(
                c.can_trim_to(n) for c in self.caches
                if isinstance(c, (StateCache, HybridCache))):
            self.caches = None  # a state that cannot go back that far: start again
        if self.caches is None:
            self.caches = make_prompt_cache(self.model, *self.bound)
            self.ids, n = [], 0
        elif n < len(self.ids):
            # inexact past a ring's evicted keys (a shorter window for a while): a draft
            # only proposes, the target decides
            trim_to(self.caches, n)
            del self.ids[n:]
        return history[n:]

    def _choose(self, logits: mx.array) -> tuple[mx.array, mx.array | None]:
        """The next draft (on the device) and the distribution it was drawn from; the
        draft needs no repetition penalty: q only has to be what d was drawn from."""
        x = logits[None, : self.n_ids]
        if self.sampler is None:
            return mx.argmax(x, axis=-1), None
        probs = self.sampler.probs(x)
        return self.sampler.pick(probs), probs[0]

    def propose(self, history: list[int], k: int) -> tuple[list[int], Q]:
        todo = self._sync(history)
        assert self.caches is not None
        set_rollback(self.caches, 0)  # a prompt runs in the parallel form
        for i in range(0, len(todo) - 1, PREFILL_CHUNK):  # a new prompt: all but its last id
            chunk = todo[i : min(i + PREFILL_CHUNK, len(todo) - 1)]
            self.model(mx.array([chunk]), cache=self.caches, logits_to_keep=1)
            mx.eval([c.state for c in self.caches])
        # a recurrent layer keeps the states of the drafts, which the next `_sync` may
        # take back (the target rejects some)
        set_rollback(self.caches, k)
        step = decode_step(self.model, self.caches)
        logits = step(mx.array(todo[-1:]))[0]
        ys: list[mx.array] = []
        qs: list[mx.array] = []
        for i in range(k):  # each draft feeds the next on the device: one wait, at the end
            y, q = self._choose(logits)
            ys.append(y)
            if q is not None:
                qs.append(q)
            if i + 1 < k:
                logits = step(y)[0]
        drafts: list[int] = mx.concatenate(ys).tolist()  # type: ignore[assignment]
        self.ids = list(history) + drafts[:-1]
        return drafts, (mx.stack(qs) if qs else None)


# text whose ids two tokenizers must agree on, beside their specials and vocabularies
PROBE = "The quick brown fox, 42 times: naïve café — 東京 🙂\n\tdef f(x): return x**2"


def tokenizer_mismatch(target: Any, draft: Any) -> str | None:
    """How a draft model's tokenizer differs from the target's (None: the same ids for
    the same text): vocabulary size, special ids, every 7th token's text, a probe text."""
    if target.vocab_size != draft.vocab_size:
        return f"its vocabulary has {draft.vocab_size} tokens, the model's {target.vocab_size}"
    if (target.bos_id, sorted(target.end_ids)) != (draft.bos_id, sorted(draft.end_ids)):
        return "its BOS or end-of-text ids differ"
    for i in range(0, target.vocab_size, 7):
        if target.id_to_token(i) != draft.id_to_token(i):
            return f"token {i} differs"
    if target.encode(PROBE) != draft.encode(PROBE):
        return "it splits text differently"
    return None


# ---- the rule -------------------------------------------------------------------------------
def history_window(sampler: Sampler, history: Sequence[int]) -> mx.array | tuple[()]:
    """The ids the repetition penalty looks at for the next position (none when off)."""
    p = sampler.params
    if p.repetition_penalty == 1.0:
        return ()
    return mx.array(list(history[-p.repetition_context_size :]), dtype=mx.int32)


def accept(p: mx.array, drafts: Sequence[int], q: Q, u: Sequence[float],
           draw: Callable[[mx.array], int]) -> tuple[int, int]:
    """The standard accept/resample rule. `p` (k+1, V): the target's distributions at the
    k drafted positions and the one after; `q` (k, V) the draft's (None: certain drafts);
    `u` k uniform draws; `draw(probs (V,)) -> id`. Returns (drafts kept, the next id)."""
    k = len(drafts)
    rows = mx.arange(k)
    idx = mx.array(list(drafts), dtype=mx.int32)
    p_d = p[rows, idx].tolist() if k else []
    q_d = q[rows, idx].tolist() if q is not None and k else [1.0] * k
    for i in range(k):
        if u[i] * q_d[i] < p_d[i]:  # u < p / q, without dividing by a tiny q
            continue
        if q is None:  # q one-hot at the draft: p without it
            residual = mx.where(mx.arange(p.shape[-1]) == drafts[i], 0.0, p[i])
        else:
            residual = mx.maximum(p[i] - q[i], 0.0)
        total = residual.sum()
        # p == q leaves nothing (a rejection then has probability 0 but for float error)
        residual = mx.where(total > 0, residual / mx.maximum(total, 1e-30), p[i])
        return i, draw(residual)
    return k, draw(p[k])


class Verifier:
    """The target's side of a step: what plain decoding would pick at each verified
    position (greedy), or its distributions there (sampling), each with the repetition
    history that position has."""

    def __init__(self, sampler: Sampler, n_ids: int) -> None:
        self.sampler, self.n_ids = sampler, n_ids
        self.penalised = sampler.params.repetition_penalty != 1.0

    def pick(self, logits: mx.array, history: list[int]) -> mx.array:
        """The next id after `history` from its logits (1, V): plain decoding's rule."""
        return self.sampler(logits[..., : self.n_ids], history_window(self.sampler, history))

    def lazy_picks(self, history: list[int]) -> Callable[[mx.array], mx.array]:
        """Plain decoding's pick as its loop runs it: each id stays on the device and
        joins the repetition window there (no wait for its value)."""
        window = self.sampler.params.repetition_context_size
        recent = mx.array(history[-window:], dtype=mx.int32)

        def pick(logits: mx.array) -> mx.array:
            nonlocal recent
            x = logits[..., : self.n_ids]
            if not self.penalised:
                return self.sampler(x)
            y = self.sampler(x, recent)
            recent = mx.concatenate([recent, y.astype(mx.int32)])[-window:]
            return y

        return pick

    def plan(self, logits: mx.array, history: list[int], drafts: list[int]) -> mx.array:
        """What `decide` needs from the logits (k+1, V) of [last id, *drafts], as arrays
        to evaluate with the step: the picks at each position (greedy, or no drafts),
        else the target's distributions there."""
        x = logits[:, : self.n_ids]
        if not drafts:
            return self.pick(x, history)
        hists = [history + drafts[:i] for i in range(len(drafts) + 1)]
        s = self.sampler
        if s.greedy:
            if self.penalised:
                return mx.concatenate([self.pick(x[i : i + 1], h) for i, h in enumerate(hists)])
            return mx.argmax(x, axis=-1)
        if self.penalised:
            return mx.concatenate([s.probs(x[i : i + 1], history_window(s, h))
                                   for i, h in enumerate(hists)])
        return s.probs(x)

    def decide(self, planned: mx.array, drafts: list[int], q: Q) -> tuple[int, int]:
        """(drafts kept, the next id)."""
        if not drafts:
            return 0, int(planned.item())
        s = self.sampler
        if s.greedy:
            targets = planned.tolist()
            a = 0
            while a < len(drafts) and targets[a] == drafts[a]:
                a += 1
            return a, targets[a]
        if q is not None:
            q = q[:, : self.n_ids]
        u = s.uniform(len(drafts)).tolist()
        return accept(planned, drafts, q, u, lambda probs: int(s.pick(probs[None]).item()))


class DraftLength:
    """How many tokens to draft next (0..most): all `most` when not `adaptive`; else the
    k with the most expected tokens per second, E(α, k) / c(k + 1), from the recent
    acceptance α (per drafted token: a pass that keeps a of k drafts tried a + 1 of
    them, or k when it kept all) and the measured seconds c(n) of a pass of n tokens,
    c(1) from plain stretches (`estimate` for lengths not measured yet).

    `cost` may be shared between replies (the model's, per draft source: the engine
    keeps it), so what one reply measured the next one starts from; α starts at the
    prior every reply."""

    def __init__(self, most: int, adaptive: bool = True,
                 cost: dict[int, float] | None = None) -> None:
        self.most, self.adaptive = most, adaptive
        self.kept, self.tried = PRIOR_RATE * PRIOR_TRIALS, PRIOR_TRIALS
        self.cost = cost if cost is not None else {}  # tokens per pass -> seconds

    @property
    def rate(self) -> float:
        return self.kept / self.tried

    def next(self) -> int:
        if not self.adaptive or self.most == 0:
            return self.most
        one = self.cost.get(1)
        if one is None:  # draft first; once a drafted pass is timed, time plain steps
            return 0 if self.cost else self.most
        a = min(self.rate, 0.999)
        best, k_best = 1.0 / one, 0
        for k in range(1, self.most + 1):
            tokens = (1 - a ** (k + 1)) / (1 - a)  # expected tokens of a k-draft pass
            gain = tokens / self.estimate(k + 1)
            if gain > best:
                best, k_best = gain, k
        return k_best

    def estimate(self, n: int) -> float:
        """c(n): measured, else on the line from c(1) through the longest pass measured
        below n (c(1) itself when none is: so it gets tried)."""
        if n in self.cost:
            return self.cost[n]
        one = self.cost[1]
        below = [m for m in self.cost if 1 < m < n]
        if not below:
            return one
        m = max(below)
        return one + (self.cost[m] - one) * (n - 1) / (m - 1)

    def _cost(self, n: int, seconds: float) -> None:
        old = self.cost.get(n)
        self.cost[n] = seconds if old is None else DECAY * old + (1 - DECAY) * seconds

    def _rate(self, kept: int, tried: int) -> None:
        # back towards the prior while nothing is drafted, so drafting is tried again
        self.kept = DECAY * self.kept + (1 - DECAY) * PRIOR_RATE * PRIOR_TRIALS + kept
        self.tried = DECAY * self.tried + (1 - DECAY) * PRIOR_TRIALS + tried

    def drafted(self, drafted: int, kept: int, seconds: float | None) -> None:
        """A pass of `drafted` + 1 tokens took `seconds` (None: not a pass's time, it
        traced a new step) and kept `kept` drafts."""
        if not self.adaptive:
            return
        if seconds is not None:
            self._cost(drafted + 1, seconds)
        self._rate(kept, kept + (1 if kept < drafted else 0))

    def plain(self, tokens: int, seconds: float) -> None:
        """Plain steps made `tokens` tokens in `seconds` (pipelined, as decode runs)."""
        if self.adaptive:
            self._cost(1, seconds / tokens)
            self._rate(0, 0)

    def stretch(self, misses: int) -> int:
        """Plain steps to run before drafting is tried again: while no length pays the
        longest stretch (pipelined steps cost least); after `misses` lookups in a row that
        found nothing, a stretch that doubles from NO_MATCH_STRETCH."""
        if self.adaptive and 1 in self.cost and self.next() == 0:
            return NO_GAIN_STRETCH
        return min(NO_MATCH_STRETCH << min(misses, 8), NO_GAIN_STRETCH)


def why_not(model: Any, caches: Sequence[Any]) -> str | None:
    """Why speculation cannot run exactly on these caches (None: it can)."""
    if hasattr(model, "pipeline_stats"):
        return "speculation off: the model is split across hosts"
    for c in caches:
        # a state takes back the last tokens it kept (`set_rollback`)
        if not (hasattr(c, "trim")
                and (c.is_trimmable() or isinstance(c, (StateCache, HybridCache)))):
            return (f"speculation off: the {type(c).__name__} cache cannot take back"
                    " rejected tokens")
    if ring_room(caches) < 2:
        return "speculation off: a one-token window cannot take back a draft"
    return None


def ring_room(caches: Sequence[Any]) -> int:
    """The most tokens one step may write: a ring takes back at most its own size."""
    sizes = [c.max_size - c.keep for layer in caches
             for c in getattr(layer, "members", (layer,)) if hasattr(c, "max_size")]
    return min(sizes, default=MAX_DRAFT_TOKENS + 1)


def _forward(model: Any, caches: Sequence[Any], step: Any, ys: list[int]) -> mx.array:
    """Logits (n, V) of `ys` fed to the model (written to the caches) in one call."""
    arr = mx.array(ys)
    if len(ys) == 1:
        return step(arr)
    if isinstance(step, CompiledStep):
        out = step.verify(arr)
        if out is not None:
            return out
    return model(arr[None], cache=caches)[0]


def speculative_decode(
    model: Any,
    logits: mx.array,
    caches: list[Any],
    *,
    source: DraftSource,
    sampler: Sampler,
    n_ids: int,
    history: list[int],
    max_tokens: int = 256,
    draft_tokens: int = DEFAULTS.draft_tokens,
    adaptive: bool = True,
    compiled: bool = True,
    progress: Progress,
    clock: Callable[[], float] = time.perf_counter,
) -> Iterator[int]:
    """`generate.decode`'s contract (yield up to `max_tokens` ids, the first from
    `logits`; closed, the caches hold the prompt and the first `progress.fed` ids) with
    speculation from `source`. `history`: the prompt's ids (the conversation so far).

    Each pass queues the model call for [y, *drafts] before yielding y, so the caller's
    work on y overlaps it; then it keeps the accepted drafts (trimming the rest) and
    yields them, and the next id. Without drafts it runs plain steps, a stretch at a
    time, pipelined as `decode` runs them."""
    if max_tokens < 1:
        return
    pending = pending_quantization(caches)
    if pending is not None and maybe_quantize(caches):
        pending = pending_quantization(caches)
    threads.apply_decode(threads.step_work(model))
    step = decode_step(model, caches, compiled)
    progress.compiled = isinstance(step, CompiledStep)
    progress.speculation = source.name
    verifier = Verifier(sampler, n_ids)
    # what passes cost on this machine: kept with the model, per source, across replies
    costs = model.__dict__.setdefault("_kvchat_pass_costs", {}).setdefault(source.name, {})
    length = DraftLength(min(draft_tokens, ring_room(caches) - 1), adaptive, costs)
    set_rollback(caches, length.most)  # a recurrent state keeps what a pass may take back
    misses = 0  # lookups in a row that found nothing
    seen = list(history)
    y = int(verifier.pick(logits, seen).item())
    seen.append(y)
    n = 0  # ids yielded
    extra = 0  # ids in the cache past those yielded (drafts not yet kept or yielded)
    planned: mx.array | None = None  # the pass in flight
    try:
        while True:
            if n + 1 == max_tokens:  # the last id: nothing more to run
                n += 1
                yield y
                return
            t0 = clock()
            if pending is not None and maybe_quantize(caches):
                pending = pending_quantization(caches)  # the caches changed class
                step = decode_step(model, caches, compiled)
            k = min(length.next(), max_tokens - n - 2)
            drafts, q = source.propose(seen, k) if k > 0 else ([], None)
            if not drafts:  # plain steps, each queued before the id before it is read
                misses = misses + 1 if k > 0 else 0
                m = min(length.stretch(misses - 1 if k > 0 else 0), max_tokens - n - 1)
                pick = verifier.lazy_picks(seen)
                last = mx.array([y])
                for i in range(m):
                    planned = pick(step(last))
                    mx.async_eval(planned)
                    progress.fed += 1  # `last` is (being) fed
                    if i:
                        y = int(last.item())
                        progress.forwards += 1
                        seen.append(y)
                    n += 1
                    yield y
                    last = planned
                y = int(last.item())
                planned = None
                progress.forwards += 1
                seen.append(y)
                length.plain(m, clock() - t0)
                continue
            misses = 0
            out = _forward(model, caches, step, [y, *drafts])
            traced = getattr(step, "traced", False)
            planned = verifier.plan(out, seen, drafts)
            mx.async_eval(planned)
            progress.fed += 1  # y is (being) fed
            extra = len(drafts)
            n += 1
            yield y
            kept, y = verifier.decide(planned, drafts, q)  # waits for the pass
            planned = None
            progress.forwards += 1  # a pass whose ids the reply got
            trim_to(caches, caches[0].offset - (len(drafts) - kept))
            extra = kept
            progress.drafted += len(drafts)
            progress.accepted += kept
            length.drafted(len(drafts), kept, None if traced else clock() - t0)
            for d in drafts[:kept]:
                progress.fed += 1
                extra -= 1
                n += 1
                seen.append(d)
                yield d
            seen.append(y)
    finally:
        if planned is not None:
            mx.eval(planned)  # the pass in flight finishes before the cache is touched
        if extra:  # drafts in the cache that the reply did not get to
            trim_to(caches, caches[0].offset - extra)
        set_rollback(caches, 0)  # the kept states are released
