"""Sampling: validation, exact filter sets, repetition penalty numbers, seeding, frequencies."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvchat.model.errors import KVChatError
from kvchat.model.runtime.sampling import (
    Sampler,
    SamplingError,
    SamplingParams,
    apply_repetition_penalty,
    apply_temperature,
    min_p_mask,
    top_k_mask,
    top_p_mask,
)

PROBS = [0.5, 0.3, 0.15, 0.05]
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def logits_of(probs, perm=None) -> mx.array:
    """(1, V) logits whose softmax is `probs` (optionally placed at permuted ids)."""
    p = np.asarray(probs, dtype=np.float64)
    if perm is not None:
        out = np.empty_like(p)
        out[perm] = p
        p = out
    return mx.array(np.log(p)[None].astype(np.float32))


def kept(x: mx.array) -> set[int]:
    """Ids whose logit survived a filter (is finite)."""
    return {int(i) for i in np.flatnonzero(np.isfinite(np.array(x[0])))}


# ---------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------


def test_defaults_are_valid_greedy() -> None:
    p = SamplingParams()
    assert p.validate() is p
    assert (p.temp, p.top_p, p.top_k, p.min_p) == (0.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.repetition_context_size, p.seed) == (1.0, 64, None)
    assert Sampler(p).greedy
    assert issubclass(SamplingError, KVChatError)


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("temp", -0.1, "temp must be a finite number >= 0"),
        ("temp", float("inf"), "temp must be a finite number >= 0"),
        ("temp", float("nan"), "temp must be a finite number >= 0"),
        ("temp", "hot", "temp must be a finite number >= 0"),
        ("top_p", 0.0, "top_p must be in (0, 1]"),
        ("top_p", 1.01, "top_p must be in (0, 1]"),
        ("top_p", -0.5, "top_p must be in (0, 1]"),
        ("top_p", float("nan"), "top_p must be in (0, 1]"),
        ("top_k", -1, "top_k must be an integer >= 0"),
        ("top_k", 2.5, "top_k must be an integer >= 0"),
        ("top_k", True, "top_k must be an integer >= 0"),
        ("min_p", -0.01, "min_p must be in [0, 1)"),
        ("min_p", 1.0, "min_p must be in [0, 1)"),
        ("repetition_penalty", 0.0, "repetition_penalty must be a finite number > 0"),
        ("repetition_penalty", -1.2, "repetition_penalty must be a finite number > 0"),
        ("repetition_penalty", float("inf"), "repetition_penalty must be a finite number > 0"),
        ("repetition_context_size", 0, "repetition_context_size must be an integer >= 1"),
        ("repetition_context_size", 3.0, "repetition_context_size must be an integer >= 1"),
        ("seed", -1, "seed must be an integer in [0, 2**64 - 1]"),
        ("seed", 1.5, "seed must be an integer in [0, 2**64 - 1]"),
        ("seed", 2**64, "seed must be an integer in [0, 2**64 - 1]"),
    ],
)
def test_invalid_values_rejected_with_one_line(field: str, value, needle: str) -> None:
    params = SamplingParams(**{field: value})
    with pytest.raises(SamplingError) as exc:
        params.validate()
    msg = str(exc.value)
    assert needle in msg
    assert repr(value) in msg  # the message shows what was given
    assert "\n" not in msg
    with pytest.raises(SamplingError):
        Sampler(params)  # the Sampler validates too


@pytest.mark.parametrize(
    "kw",
    [
        dict(temp=0.7, top_p=1.0, top_k=40, min_p=0.0),
        dict(top_p=1e-9, min_p=0.999, repetition_penalty=0.5, repetition_context_size=1),
        dict(temp=3, seed=0),
        dict(seed=2**64 - 1),
    ],
)
def test_edge_values_accepted(kw) -> None:
    SamplingParams(**kw).validate()


# ---------------------------------------------------------------------------------------
# Greedy / shapes / laziness
# ---------------------------------------------------------------------------------------


def test_greedy_is_argmax_with_shape_and_dtype() -> None:
    lg = mx.random.normal((1, 1000), key=mx.random.key(0))
    tok = Sampler(SamplingParams())(lg, [])
    assert tok.shape == (1,) and tok.dtype == mx.int32
    assert tok.item() == int(np.argmax(np.array(lg)))
    # (V,) and (1, T, V) are accepted too (last position is used).
    assert Sampler()(lg[0]).item() == tok.item()
    assert Sampler()(mx.stack([-lg, lg], axis=1)).item() == tok.item()


@pytest.mark.parametrize("temp", [0.3, 1.0, 5.0])
def test_top_k_one_equals_greedy(temp: float) -> None:
    greedy = Sampler(SamplingParams())
    top1 = Sampler(SamplingParams(temp=temp, top_k=1, seed=3))
    for i in range(20):
        lg = mx.random.normal((1, 500), key=mx.random.key(i)) * 4
        assert top1(lg, []).item() == greedy(lg, []).item()


def test_tiny_temperature_is_greedy_not_nan() -> None:
    lg = mx.random.normal((1, 300), key=mx.random.key(1))
    s = Sampler(SamplingParams(temp=1e-30, seed=0))
    assert all(s(lg).item() == int(np.argmax(np.array(lg))) for _ in range(5))
    assert not np.isnan(np.array(apply_temperature(lg, 1e-30))).any()


def test_pipelines_lazily_with_async_eval() -> None:
    """Tokens can feed the next step's history before the host ever sees them."""
    lg = mx.random.normal((1, 64), key=mx.random.key(2))
    s = Sampler(SamplingParams(temp=1.0, top_k=10, top_p=0.9, repetition_penalty=1.3, seed=5))
    hist = mx.array([1, 2, 3], dtype=mx.int32)
    toks = []
    for _ in range(6):
        tok = s(lg, hist)
        mx.async_eval(tok)
        hist = mx.concatenate([hist, tok])
        toks.append(tok)
    ref = Sampler(SamplingParams(temp=1.0, top_k=10, top_p=0.9, repetition_penalty=1.3, seed=5))
    hist_list = [1, 2, 3]
    for tok in toks:
        t = ref(lg, hist_list).item()
        assert tok.item() == t
        hist_list.append(t)


# ---------------------------------------------------------------------------------------
# Filters: exact kept sets
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("top_p", "expect"),
    [
        (0.8, {0, 1}),  # 0.5 + 0.3 reaches 0.8 exactly: smallest set is two tokens
        (0.81, {0, 1, 2}),
        (0.5, {0}),
        (0.49, {0}),
        (1e-9, {0}),  # the top token is always kept
        (0.95, {0, 1, 2}),
        (0.951, {0, 1, 2, 3}),
        (1.0, {0, 1, 2, 3}),
    ],
)
def test_top_p_keeps_smallest_nucleus(top_p: float, expect: set[int]) -> None:
    assert kept(top_p_mask(logits_of(PROBS), top_p)) == expect
    # Same answer wherever the tokens sit in the vocabulary.
    perm = [2, 0, 3, 1]
    assert kept(top_p_mask(logits_of(PROBS, perm), top_p)) == {perm[i] for i in expect}


def test_top_p_keeps_logit_values_and_existing_minus_inf() -> None:
    lg = mx.array([[1.0, float("-inf"), 3.0, 2.0]])
    out = np.array(top_p_mask(lg, 0.99))
    assert out[0, 0] == 1.0 and out[0, 2] == 3.0 and out[0, 3] == 2.0
    assert out[0, 1] == float("-inf")


@pytest.mark.parametrize(
    ("min_p", "expect"),
    [
        (0.3, {0, 1, 2}),  # bar is 0.3 * 0.5 = 0.15: 0.15 itself is kept
        (0.31, {0, 1}),
        (0.1, {0, 1, 2, 3}),  # bar 0.05, a tie again
        (0.11, {0, 1, 2}),
        (0.0, {0, 1, 2, 3}),
        (0.99, {0}),
    ],
)
def test_min_p_keeps_probs_above_scaled_max(min_p: float, expect: set[int]) -> None:
    assert kept(min_p_mask(logits_of(PROBS), min_p)) == expect
    perm = [3, 1, 0, 2]
    assert kept(min_p_mask(logits_of(PROBS, perm), min_p)) == {perm[i] for i in expect}


@pytest.mark.parametrize(
    ("k", "expect"), [(1, {0}), (2, {0, 1}), (3, {0, 1, 2}), (0, None), (9, None)]
)
def test_top_k_keeps_k_largest(k: int, expect) -> None:
    expect = {0, 1, 2, 3} if expect is None else expect
    perm = [1, 3, 2, 0]
    assert kept(top_k_mask(logits_of(PROBS, perm), k)) == {perm[i] for i in expect}


@FAST
@given(
    st.lists(st.floats(-8, 8, allow_nan=False), min_size=2, max_size=40, unique=True),
    st.floats(0.01, 0.99),
    st.floats(0.01, 0.99),
    st.integers(1, 45),
)
def test_filters_match_numpy_reference(vals, top_p: float, min_p: float, k: int) -> None:
    x = np.array(vals, dtype=np.float32)
    assume(np.diff(np.sort(x)).min() > 1e-3)  # no (near-)ties: their order is arbitrary
    p = np.exp(x - x.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    before = np.cumsum(p[order]) - p[order]
    # Stay clear of float ties at the top-p / min-p boundaries; exact ties are tested above.
    assume(np.all(np.abs(before - top_p) > 1e-4))
    assume(np.all(np.abs(p - min_p * p.max()) > 1e-4 * p.max()))
    lg = mx.array(x[None])

    want_p = {int(i) for i, b in zip(order, before, strict=True) if b < top_p} | {int(order[0])}
    assert kept(top_p_mask(lg, top_p)) == want_p
    assert kept(min_p_mask(lg, min_p)) == {int(i) for i in np.flatnonzero(p >= min_p * p.max())}
    assert kept(top_k_mask(lg, k)) == {int(i) for i in order[:k]}


# ---------------------------------------------------------------------------------------
# Repetition penalty
# ---------------------------------------------------------------------------------------


def test_repetition_penalty_formula_by_hand() -> None:
    lg = mx.array([[2.0, -1.0, 0.5, 3.0, -4.0, 0.0]])
    # ids 1 and 4 repeat; each is penalised once. 0 counts as "not positive": 0 * 2 = 0.
    out = apply_repetition_penalty(lg, [0, 1, 1, 4, 4, 4, 5], 2.0)
    np.testing.assert_allclose(np.array(out), [[1.0, -2.0, 0.5, 3.0, -8.0, 0.0]])
    # The caller's logits are untouched.
    np.testing.assert_array_equal(np.array(lg), [[2.0, -1.0, 0.5, 3.0, -4.0, 0.0]])
    # penalty < 1 rewards instead: 3 / 0.5 = 6, -4 * 0.5 = -2.
    out = apply_repetition_penalty(lg, mx.array([3, 4, 3]), 0.5)
    np.testing.assert_allclose(np.array(out), [[2.0, -1.0, 0.5, 6.0, -2.0, 0.0]])
    # 1.0 and an empty history are no-ops.
    assert apply_repetition_penalty(lg, [0, 1], 1.0) is lg
    assert apply_repetition_penalty(lg, [], 1.3) is lg
    assert apply_repetition_penalty(lg, mx.array([], dtype=mx.int32), 1.3) is lg


def test_repetition_penalty_window() -> None:
    lg = mx.array([[2.0, -1.0, 0.5, 3.0]])
    hist = [3, 3, 0, 1]  # last two ids: 0 and 1 only
    want = [[1.6, -1.25, 0.5, 3.0]]
    out = apply_repetition_penalty(lg, hist, 1.25, context_size=2)
    np.testing.assert_allclose(np.array(out), want)
    out = apply_repetition_penalty(lg, mx.array([hist]), 1.25, context_size=2)
    np.testing.assert_allclose(np.array(out), want)
    np.testing.assert_allclose(
        np.array(apply_repetition_penalty(lg, hist, 1.25, context_size=99)),
        [[1.6, -1.25, 0.5, 2.4]],
    )


def test_sampler_applies_penalty_within_its_window() -> None:
    lg = mx.array([[0.0, 1.0, 2.5, 3.0]])  # greedy picks 3; 3 / 1.5 = 2 < 2.5 picks 2
    for temp in (0.0, 1e-6):
        params = SamplingParams(temp=temp, repetition_penalty=1.5, repetition_context_size=2)
        assert Sampler(params)(lg, [0, 3]).item() == 2
        assert Sampler(params)(lg, mx.array([0, 3])).item() == 2
        assert Sampler(params)(lg, [3, 0, 1]).item() == 3  # 3 fell out of the window


# ---------------------------------------------------------------------------------------
# Seeding
# ---------------------------------------------------------------------------------------


def _run(sampler: Sampler, steps: list[mx.array]) -> list[int]:
    return [sampler(lg, []).item() for lg in steps]


def test_same_seed_reproduces_regardless_of_global_state() -> None:
    steps = [mx.random.normal((1, 200), key=mx.random.key(i)) for i in range(30)]
    params = SamplingParams(temp=1.2, top_p=0.95, min_p=0.01, seed=1234)
    mx.random.seed(1)
    a = _run(Sampler(params), steps)
    mx.random.seed(999)
    mx.random.normal((10,))  # disturb the global generator
    b = _run(Sampler(params), steps)
    assert a == b
    # Interleaved samplers keep independent streams.
    s1, s2 = Sampler(params), Sampler(params)
    c = []
    for lg in steps:
        c.append(s1(lg).item())
        s2(lg)
        mx.random.uniform(shape=(3,))
    assert c == a


def test_different_seeds_differ_and_steps_advance_on_flat_distribution() -> None:
    flat = [mx.zeros((1, 1000))] * 20
    a = _run(Sampler(SamplingParams(temp=1.0, seed=1)), flat)
    b = _run(Sampler(SamplingParams(temp=1.0, seed=2)), flat)
    assert a != b
    assert len(set(a)) > 15  # the key is split every step, not reused


def test_seed_none_follows_global_seed() -> None:
    flat = [mx.zeros((1, 1000))] * 10
    mx.random.seed(42)
    a = _run(Sampler(SamplingParams(temp=1.0)), flat)
    mx.random.seed(42)
    b = _run(Sampler(SamplingParams(temp=1.0)), flat)
    c = _run(Sampler(SamplingParams(temp=1.0)), flat)  # global state moved on
    assert a == b and a != c


# ---------------------------------------------------------------------------------------
# Frequencies match the kept, renormalised distribution
# ---------------------------------------------------------------------------------------

# 99.9% chi-square quantiles by degrees of freedom: a fixed seed makes this deterministic,
# the bound only guards against a wrong distribution, not bad luck.
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def _expected(probs, temp, kept_ids) -> np.ndarray:
    q = np.asarray(probs, dtype=np.float64) ** (1.0 / temp)
    mask = np.zeros_like(q)
    mask[list(kept_ids)] = 1
    q = q * mask
    return q / q.sum()


def _check_freq(counts: np.ndarray, expected: np.ndarray) -> None:
    n = counts.sum()
    assert counts[expected == 0].sum() == 0, "sampled a filtered-out token"
    nz = expected > 0
    chi2 = float((((counts[nz] - n * expected[nz]) ** 2) / (n * expected[nz])).sum())
    df = int(nz.sum()) - 1
    if df > 0:
        assert chi2 < CHI2_999[df], (chi2, counts, n * expected)


PROBS8 = [0.3, 0.2, 0.15, 0.12, 0.1, 0.07, 0.04, 0.02]
PERM8 = [5, 2, 7, 0, 3, 6, 1, 4]  # so the top-k index mapping is exercised


@pytest.mark.parametrize(
    ("kw", "kept_sorted"),
    [
        (dict(temp=1.0), range(8)),
        (dict(temp=0.5), range(8)),
        (dict(temp=2.0), range(8)),
        (dict(temp=1.0, top_k=3), range(3)),
        (dict(temp=1.0, top_p=0.6), range(3)),  # 0.3+0.2 < 0.6 <= 0.65
        (dict(temp=1.0, min_p=0.4), range(4)),  # bar 0.12
        # top-k first, then top-p on the renormalised top-4 (0.3,0.2,0.15,0.12)/0.77:
        # before-sums 0, .39, .649, .844 -> top_p 0.8 keeps three.
        (dict(temp=1.0, top_k=4, top_p=0.8), range(3)),
        # temp 2 flattens first: sqrt(p) renormalised, then min-p bar 0.5*sqrt(.3) keeps 5.
        (dict(temp=2.0, min_p=0.5), range(5)),
    ],
)
def test_batched_frequencies_match_renormalised_distribution(kw, kept_sorted) -> None:
    n = 4000
    lg = mx.broadcast_to(logits_of(PROBS8, PERM8), (n, 8))
    toks = Sampler(SamplingParams(seed=7, **kw))(lg)
    assert toks.shape == (n,) and toks.dtype == mx.int32
    counts = np.bincount(np.array(toks), minlength=8)
    exp_sorted = _expected(PROBS8, kw["temp"], kept_sorted)
    expected = np.empty(8)
    expected[PERM8] = exp_sorted
    _check_freq(counts, expected)


def test_sequential_frequencies_match() -> None:
    """One token per call, as the engine does: steps draw independent keys."""
    lg = logits_of(PROBS8, PERM8)
    s = Sampler(SamplingParams(temp=1.0, top_k=5, top_p=0.9, seed=11))
    toks = mx.concatenate([s(lg) for _ in range(2000)])
    counts = np.bincount(np.array(toks), minlength=8)
    # top-5 renormalised: .3,.2,.15,.12,.1 / .87 -> before-sums .., .747, .885 < .9: keeps 5.
    expected = np.empty(8)
    expected[PERM8] = _expected(PROBS8, 1.0, range(5))
    _check_freq(counts, expected)


def test_min_p_bar_is_log_exact() -> None:
    # Sanity of the log-space rewrite on a case far from ties.
    lg = logits_of([0.6, 0.3, 0.1])
    assert kept(min_p_mask(lg, 0.4)) == {0, 1}
    assert kept(min_p_mask(lg, 0.51)) == {0}


def test_unseeded_and_argmax_draw_as_the_sampler_does() -> None:
    """`Argmax` and `Unseeded` (what a turn samples with when a batch may draw its rows
    together, model/runtime/batch.py) are the Sampler's own draw: the same ids for the
    same logits and the same state of MLX's global generator, over the first n ids; a
    seeded Sampler draws the same way with its own key."""
    from kvchat.model.runtime.sampling import Argmax, Unseeded

    logits = mx.random.normal((3, 50), key=mx.random.key(2)) * 3
    p = SamplingParams(temp=0.9, top_k=20, top_p=0.9, min_p=0.01)
    plain = Sampler(p)
    for _ in range(5):
        mx.random.seed(11)
        want = plain.draw(logits[:, :40])  # the global generator's next key
        mx.random.seed(11)
        assert Unseeded.of(p, 40)(logits).tolist() == want.tolist()
        s = Sampler(SamplingParams(temp=0.9, top_k=20, top_p=0.9, min_p=0.01, seed=4))
        key = mx.random.split(mx.random.key(4))[1]  # a seeded sampler's first draw's key
        assert s(logits).tolist() == s.draw(logits, key=key).tolist()
        logits = logits + mx.random.normal(logits.shape, key=mx.random.key(3))
    assert Argmax(40)(logits).tolist() == Sampler(SamplingParams())(logits[:, :40]).tolist()
    assert max(Unseeded.of(p, 7)(logits).tolist()) < 7
