"""Speculative decoding on models with recurrent layers (model/decoder/state_steps.py,
model/cache/state.py's rollback): a verify pass keeps every position's state and a
rejected draft puts the state back to the one after the last accepted token, so greedy
ids equal plain decoding's for both draft sources on Mamba, Mamba-2 (SSD), the gated
delta rule (Qwen3-Next), LFM2's short convolution and the hybrids with attention (Bamba,
Granite 4); the state after a rollback equals the state plain decoding reaches token by
token; sampling keeps the target's distribution (a chi-square test that a rollback which
keeps the rejected drafts' state fails). Tiny random checkpoints built by transformers
(tests/helpers/hybrid_families.py)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from itertools import product
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map

from kvchat.model import load_model
from kvchat.model.cache.kv import make_prompt_cache, trim_to
from kvchat.model.cache.state import StateCache, set_rollback
from kvchat.model.runtime.generate import CompiledStep, Progress, generate_step, prefill
from kvchat.model.runtime.sampling import Sampler, SamplingParams
from kvchat.model.runtime.speculative import (
    DraftModel,
    PromptLookup,
    speculative_decode,
    why_not,
)
from tests.helpers.drafts import Corrupted
from tests.helpers.families import build
from tests.helpers.hybrid_families import HYBRID_SPECS
from tests.helpers.stats import chi2_sf

FAMILIES = ["mamba", "mamba2", "qwen3_next", "lfm2", "bamba", "granitemoehybrid"]
# layers that attend and keep a state (Falcon-H1, Zamba2), and Jamba
KV_BESIDE_STATE = ["falcon_h1", "zamba2", "jamba"]
BASE = [5, 17, 9, 30, 41, 17, 9, 30, 22, 41, 7, 5, 17, 9, 30]
GEN = 60
N_IDS = 256  # the tiny checkpoints' vocabulary
# Per family, what makes these random models' replies partly follow a prompt lookup (their
# replies are chaotic elsewhere): a scale on every weight, and the prompt, either the model's
# own reply to BASE quoted between two copies of BASE ("quote") or one 4-id period
# repeated ("periodic"). Found by trying a few; the test asserts the acceptance it needs.
LOOKUP: dict[str, tuple[float, str]] = {
    "mamba": (1.0, "periodic"), "mamba2": (1.0, "quote"), "qwen3_next": (0.3, "periodic"),
    "lfm2": (1.0, "quote"), "bamba": (1.0, "quote"), "granitemoehybrid": (1.0, "quote")}
# noise on the draft's weights (× each weight's std): a draft that agrees sometimes
DRAFT_NOISE = {"mamba": 0.3}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build(HYBRID_SPECS[name], tmp_path_factory.mktemp(f"spec_{name}"))
        return built[name]

    return get


def scaled(path: Path, scale: float = 1.0, noise: float = 0.0, seed: int = 7) -> Any:
    model = load_model(path)
    if scale != 1.0:
        model.update(tree_map(lambda w: w * scale, model.parameters()))
    if noise:
        mx.random.seed(seed)
        model.update(tree_map(lambda w: w + noise * mx.random.normal(w.shape) * w.std(),
                              model.parameters()))
    mx.eval(model.parameters())
    return model


def plain(model: Any, prompt: list[int], n: int, compiled: bool = True) -> list[int]:
    return list(generate_step(model, prompt, make_prompt_cache(model), max_tokens=n,
                              prefill_chunk=8, compiled=compiled))


def speculative(model: Any, caches: list[Any], prompt: list[int], n: int, source: Any,
                progress: Progress, *, sampler: Sampler | None = None, k: int = 4,
                compiled: bool = True) -> list[int]:
    logits = list(prefill(model, prompt, caches, prefill_chunk=8, progress=progress))[-1]
    return list(speculative_decode(
        model, logits, caches, source=source, sampler=sampler or Sampler(), n_ids=N_IDS,
        history=prompt, max_tokens=n, draft_tokens=k, adaptive=False, compiled=compiled,
        progress=progress))


class TrimSpy:
    """Counts trims that took tokens back out of a recurrent layer's state."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.state_trims = 0
        trim = StateCache.trim
        spy = self

        def counted(cache: StateCache, n: int) -> int:
            if n and type(cache) is StateCache:
                spy.state_trims += 1
            return trim(cache, n)

        monkeypatch.setattr(StateCache, "trim", counted)


@pytest.mark.parametrize("source", ["lookup", "draft"])
@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_ids_equal_plain_decoding(name: str, source: str, folder: Callable[[str], Path],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    scale, form = LOOKUP[name] if source == "lookup" else (1.0, "")
    model = scaled(folder(name), scale)
    if form == "quote":
        prompt = BASE + plain(model, BASE, 40) + BASE
    elif form == "periodic":
        prompt = [5, 17, 9, 30] * 10
    else:
        prompt = BASE
    want = plain(model, prompt, GEN)
    src: Any = PromptLookup(3) if source == "lookup" else DraftModel(
        scaled(folder(name), noise=DRAFT_NOISE.get(name, 0.05)), "noisy")  # a hybrid too
    spy = TrimSpy(monkeypatch)
    progress = Progress()
    caches = make_prompt_cache(model)
    assert why_not(model, caches) is None
    got = speculative(model, caches, prompt, GEN, src, progress)
    assert got == want
    assert progress.compiled
    # drafts were kept and rejected: the states went back to the last accepted token
    assert 0 < progress.accepted < progress.drafted, (progress.accepted, progress.drafted)
    assert spy.state_trims > 0
    assert all(c.offset == len(prompt) + GEN - 1 for c in caches)
    assert all(not c._back and not c.rollback for c in caches if isinstance(c, StateCache))


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "plain_step"])
@pytest.mark.parametrize("name", [*FAMILIES, "nemotron_h", *KV_BESIDE_STATE])
def test_partly_kept_passes_roll_back_exactly(name: str, compiled: bool,
                                              folder: Callable[[str], Path]) -> None:
    """Every pass keeps part of its drafts, through the compiled verify pass and through
    the model's own multi-token path (the cache asks the mixers for each position's
    states); Nemotron-H adds layers without a token mixer; Falcon-H1 and Zamba2 layers
    whose K/V and state go back together (model/cache/hybrid.py), Jamba Mamba's weighted
    Δ/B/C norms beside attention and experts."""
    model = scaled(folder(name))
    want = plain(model, BASE, GEN, compiled)
    progress = Progress()
    caches = make_prompt_cache(model)
    got = speculative(model, caches, BASE, GEN, Corrupted(BASE, want, N_IDS), progress, k=5,
                      compiled=compiled)
    assert got == want
    assert progress.compiled == compiled
    assert 0 < progress.accepted < progress.drafted
    assert all(c.offset == len(BASE) + GEN - 1 for c in caches)


def _states(caches: list[Any]) -> list[np.ndarray]:
    """Every state's arrays (a hybrid layer's state part too) and every K/V's keys."""
    parts = [m for c in caches for m in getattr(c, "members", (c,))]
    return [np.array(a) for c in parts if type(c) is StateCache
            for a in (c.conv, c.recurrent) if a is not None] + [
        np.array(c.state[0])[..., : c.offset, :] for c in parts if hasattr(c, "keys")]


@pytest.mark.parametrize("name", ["mamba", "mamba2", "qwen3_next", "lfm2", "falcon_h1",
                                  "zamba2"])
def test_state_after_a_rollback_is_plain_decodings(name: str,
                                                   folder: Callable[[str], Path]) -> None:
    """Verify 5 tokens, keep j + 1 of them: the conv and recurrent states equal those of
    the same j + 1 tokens fed one at a time (the decode form plain decoding runs), for
    every j, compiled and not; the logits of the pass equal the prompt form's."""
    model = scaled(folder(name))
    ys = [41, 7, 22, 3, 60]
    for compiled, j in product((True, False), range(len(ys))):
        caches, ref = make_prompt_cache(model), make_prompt_cache(model)
        for c in (caches, ref):
            model(mx.array([BASE]), cache=c)
        if compiled:
            step = CompiledStep(model, caches)
            assert step.supported
            logits = step.verify(mx.array(ys))
            assert logits is not None
        else:
            set_rollback(caches, len(ys))
            logits = model(mx.array([ys]), cache=caches)[0]
        whole = model(mx.array([BASE + ys]))[0, len(BASE):]
        np.testing.assert_allclose(np.array(logits), np.array(whole), rtol=1e-4, atol=1e-4)
        trim_to(caches, len(BASE) + j + 1)
        for y in ys[: j + 1]:
            model(mx.array([[y]]), cache=ref)
        assert all(c.offset == len(BASE) + j + 1 for c in caches)
        for got, want in zip(_states(caches), _states(ref), strict=True):
            # summation order differs between CPUs' BLAS kernels (1.3e-5 seen): a wrong
            # rollback is off by a whole token's update, far more than this
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_a_state_refuses_to_go_back_past_what_it_kept(folder: Callable[[str], Path]) -> None:
    model = scaled(folder("mamba"))
    caches = make_prompt_cache(model)
    model(mx.array([BASE]), cache=caches)
    set_rollback(caches, 2)
    for y in (3, 4, 5):
        model(mx.array([[y]]), cache=caches)
    n = len(BASE) + 3
    assert caches[0].can_trim_to(n - 2) and not caches[0].can_trim_to(n - 3)
    set_rollback(caches, 0)  # the kept states are forgotten
    assert not caches[0].can_trim_to(n - 1)


def test_closing_mid_reply_leaves_the_state_at_what_was_yielded(
        folder: Callable[[str], Path]) -> None:
    """A reply closed between a pass and its kept drafts: the caches take back the drafts
    the reply did not get, to the states of the ids it fed, one at a time."""
    model = scaled(folder("qwen3_next"))
    want = plain(model, BASE, 20)
    progress = Progress()
    caches = make_prompt_cache(model)
    logits = list(prefill(model, BASE, caches, prefill_chunk=8, progress=progress))[-1]
    steps = speculative_decode(model, logits, caches, source=Corrupted(BASE, want, N_IDS),
                               sampler=Sampler(), n_ids=N_IDS, history=BASE, max_tokens=20,
                               draft_tokens=4, adaptive=False, progress=progress)
    got = [next(steps) for _ in range(3)]  # mid-way through a pass's kept drafts
    steps.close()
    assert got == want[:3] and all(c.offset == len(BASE) + progress.fed for c in caches)
    ref = make_prompt_cache(model)
    model(mx.array([BASE]), cache=ref)
    for y in got[: progress.fed]:
        model(mx.array([[y]]), cache=ref)
    for a, b in zip(_states(caches), _states(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_the_engine_speculates_on_a_hybrid(folder: Callable[[str], Path]) -> None:
    """Through the engine a hybrid model now runs speculation (no note), with plain
    decoding's ids."""
    from kvchat.model.runtime.client import EngineClient
    from kvchat.model.runtime.events import GenParams

    path = folder("mamba")
    prompt = [5, 17, 9, 30] * 10
    with EngineClient(path, timeout=60) as c:
        base = c.run(prompt, GenParams(max_tokens=30, ignore_eos=True))
        c.reset()
        done = c.run(prompt, GenParams(max_tokens=30, ignore_eos=True, speculation="lookup"))
    assert list(done.ids) == list(base.ids)
    assert done.stats.speculation == "prompt lookup" and done.stats.speculation_note is None
    assert done.stats.drafted > 0


# ---- sampling keeps the target distribution --------------------------------------------
SAMPLING = SamplingParams(temp=1.0, top_k=2, seed=3)
CHI_PROMPT = [5, 17, 9, 30, 41, 17, 9, 30]
DRAWS = 800


def _target(model: Any) -> dict[tuple[int, ...], float]:
    """The exact probability of each first three ids under plain sampling (top-2: eight
    sequences), from the model run on each prefix."""
    def probs(ids: list[int]) -> dict[int, float]:
        p = np.array(Sampler(SAMPLING).probs(model(mx.array([ids]))[:, -1, :]))[0]
        return {int(i): float(p[i]) for i in np.nonzero(p)[0]}

    out: dict[tuple[int, ...], float] = {}
    for a, pa in probs(CHI_PROMPT).items():
        for b, pb in probs(CHI_PROMPT + [a]).items():
            for c, pc in probs(CHI_PROMPT + [a, b]).items():
                out[(a, b, c)] = pa * pb * pc
    return out


class Guess:
    """Certain drafts (q one-hot), each one of the ids the target may pick somewhere in
    the first three, in turn: kept with probability p(d) (often 0: rejected)."""

    name = "guess"

    def __init__(self, support: list[int]) -> None:
        self.support, self.i = support, 0

    def propose(self, history: list[int], k: int) -> tuple[list[int], None]:
        self.i += 1
        return [self.support[(self.i + j) % len(self.support)] for j in range(k)], None


def _first_three(model: Any, support: list[int], draws: int) -> Counter[tuple[int, ...]]:
    sampler = Sampler(SAMPLING)
    counts: Counter[tuple[int, ...]] = Counter()
    for _ in range(draws):
        ids = speculative(model, make_prompt_cache(model), CHI_PROMPT, 3, Guess(support),
                          Progress(), sampler=sampler, k=2)
        counts[tuple(ids)] += 1
    return counts


def _chi_square_p(counts: Counter[tuple[int, ...]], target: dict[tuple[int, ...], float],
                  draws: int) -> float:
    if any(k not in target for k in counts):
        return 0.0  # a sequence plain sampling never makes
    keys = list(target)
    observed = np.array([counts[k] for k in keys])
    expected = np.array([target[k] for k in keys]) * draws
    return chi2_sf(float(((observed - expected) ** 2 / expected).sum()), len(keys) - 1)


@pytest.mark.slow
def test_sampled_speculation_on_a_hybrid_keeps_the_distribution(
        folder: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The first three ids of replies sampled speculatively (k = 2, drafts often
    rejected, so the third id is drawn from a state rolled back) follow the target's
    joint distribution; a rollback that keeps the rejected drafts' state is caught."""
    model = scaled(folder("mamba2"), 0.5)
    target = _target(model)
    assert min(target.values()) > 0.05  # every cell expects ≥ 40 draws
    support = sorted({i for ids in target for i in ids})
    assert _chi_square_p(_first_three(model, support, DRAWS), target, DRAWS) > 1e-3

    def kept_the_drafts(cache: StateCache, n: int) -> int:  # the offset alone goes back
        cache.offset -= n
        return n

    monkeypatch.setattr(StateCache, "trim", kept_the_drafts)
    assert _chi_square_p(_first_three(model, support, 200), target, 200) < 1e-6
