"""KV caches: exact rotation semantics, mlx-lm interoperability, statistics, memory.

Semantics under test (docs/design.md): with capacity M and keep K, the query at absolute
position t attends to [0, K) ∪ [t − (M − K) + 1, t]; with a sliding window W also only
keys with t − p < W.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvchat.model.cache.kv import (
    CacheError,
    KVCache,
    RotatingKVCache,
    cache_stats,
    can_trim_to,
    layer_stats,
    make_cache,
    trim_to,
)
from kvchat.model.cache.stats import CacheStats
from kvchat.model.decoder.config import ModelConfig
from kvchat.model.decoder.transformer import Transformer
from tests.helpers.paths import STORIES260K as STORIES


def tiny_cfg(kv_heads: int = 2, window: int | None = None, layers: int = 2) -> ModelConfig:
    return ModelConfig.from_dict({
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": layers,
        "num_attention_heads": 4, "num_key_value_heads": kv_heads, "intermediate_size": 96,
        "vocab_size": 97, "max_position_embeddings": 256, "sliding_window": window,
    })


def tiny_model(kv_heads: int = 2, window: int | None = None, seed: int = 0) -> Transformer:
    mx.random.seed(seed)
    m = Transformer(tiny_cfg(kv_heads, window))
    mx.eval(m.parameters())
    return m


def semantic_mask(T: int, M: int | None, K: int, W: int | None = None) -> mx.array:
    """Boolean (T, T) mask straight from the definition (no cache involved)."""
    t = mx.arange(T)[:, None]
    p = mx.arange(T)[None]
    mask = p <= t
    if M is not None:
        mask = mask & ((p < K) | (t - p < M - K))
    if W is not None:
        mask = mask & (t - p < W)
    return mask


def reference_logits(model: Transformer, tokens: mx.array, mask: mx.array) -> mx.array:
    """Full attention over the whole sequence, no cache, with an explicit mask."""
    h = model.model.embed_tokens(tokens)
    for layer in model.layers:
        h = layer(h, mask, None)
    h = model.model.norm(h)
    if model.config.tie_word_embeddings:
        return model.model.embed_tokens.as_linear(h)
    return model.lm_head(h)


def chunked_logits(model: Transformer, tokens: mx.array, caches: list[Any], chunk: int) -> mx.array:
    outs = []
    for i in range(0, tokens.shape[1], chunk):
        out = model(tokens[:, i : i + chunk], cache=caches)
        mx.eval(out)
        outs.append(out)
    return mx.concatenate(outs, axis=1)


def max_diff(a: mx.array, b: mx.array) -> float:
    return mx.abs(a - b).max().item()


# ---- logits ---------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [1, 3, 7, 40])
def test_capacity_covering_the_sequence_is_identical_to_unbounded(chunk: int) -> None:
    model = tiny_model()
    tokens = mx.random.randint(0, 97, (1, 40), key=mx.random.key(1))
    full = chunked_logits(model, tokens, [KVCache() for _ in range(2)], chunk)
    for caches in (
        [RotatingKVCache(40, 4) for _ in range(2)],
        [RotatingKVCache(64, 0) for _ in range(2)],
        make_cache(model.config),  # default: full context, then rotation
    ):
        got = chunked_logits(model, tokens, caches, chunk)
        assert mx.array_equal(got, full), type(caches[0])


W = 16


@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
@pytest.mark.parametrize("keep", [0, 4])
@pytest.mark.parametrize("chunk", [1, 3, W - 1, W + 5])
def test_rotation_matches_full_attention_with_sink_window_mask(
    kv_heads: int, keep: int, chunk: int
) -> None:
    model = tiny_model(kv_heads)
    T = 3 * W + 7
    tokens = mx.random.randint(0, 97, (1, T), key=mx.random.key(2))
    ref = reference_logits(model, tokens, semantic_mask(T, W, keep))
    got = chunked_logits(model, tokens, [RotatingKVCache(W, keep) for _ in range(2)], chunk)
    assert max_diff(got, ref) < 1e-4
    # the reference really differs from unbounded attention past the window
    causal = reference_logits(model, tokens, semantic_mask(T, None, 0))
    assert max_diff(causal[:, W + 2 :], ref[:, W + 2 :]) > 1e-2


def test_irregular_chunks_and_a_prompt_larger_than_the_window() -> None:
    model = tiny_model()
    sizes = [40, 1, 1, 5, 15, 16, 17, 2, 1, 33, 1]  # first chunk 2.5 windows
    T = sum(sizes)
    tokens = mx.random.randint(0, 97, (1, T), key=mx.random.key(3))
    caches = [RotatingKVCache(W, 3) for _ in range(2)]
    outs, i = [], 0
    for n in sizes:
        outs.append(model(tokens[:, i : i + n], cache=caches))
        i += n
    ref = reference_logits(model, tokens, semantic_mask(T, W, 3))
    assert max_diff(mx.concatenate(outs, axis=1), ref) < 1e-4
    assert caches[0].offset == T  # RoPE positions keep counting after the wrap


@pytest.mark.parametrize("chunk", [1, 5, 21])
def test_sliding_window_model_uses_a_window_ring(chunk: int) -> None:
    model = tiny_model(window=W)
    caches = make_cache(model.config)
    assert (caches[0].max_size, caches[0].keep) == (W, 0)
    T = 3 * W + 4
    tokens = mx.random.randint(0, 97, (1, T), key=mx.random.key(4))
    ref = reference_logits(model, tokens, semantic_mask(T, None, 0, W))
    assert max_diff(chunked_logits(model, tokens, caches, chunk), ref) < 1e-4


def test_sliding_window_with_a_smaller_rotating_cache_intersects_both() -> None:
    model = tiny_model(window=W)
    caches = make_cache(model.config, max_kv_size=10, keep=2)
    assert (caches[0].max_size, caches[0].keep) == (10, 2)
    T = 3 * W
    tokens = mx.random.randint(0, 97, (1, T), key=mx.random.key(5))
    ref = reference_logits(model, tokens, semantic_mask(T, 10, 2, W))
    for chunk in (1, 7):
        got = chunked_logits(model, tokens, make_cache(model.config, 10, 2), chunk)
        assert max_diff(got, ref) < 1e-4


@pytest.mark.parametrize(("chunk", "drop"), [(1, 1), (5, 1), (5, 3), (5, 4), (6, 2), (6, 6)])
def test_exact_trim_after_wrap_then_continue(chunk: int, drop: int) -> None:
    """After the wrap a trim is exact within the last write (a chunk puts back the keys
    it displaced; one token displaces only a key no query needs again) and not beyond."""
    model = tiny_model()
    M, K = W, 2
    a = mx.random.randint(0, 97, (1, 3 * W), key=mx.random.key(6))
    b = mx.random.randint(0, 97, (1, 10), key=mx.random.key(7))
    caches = [RotatingKVCache(M, K) for _ in range(2)]
    chunked_logits(model, a, caches, chunk)
    last = a.shape[1] - (a.shape[1] - 1) // chunk * chunk  # tokens of the last write
    # and one more: the token before a write displaced only a key no query needs again
    reach = last + 1 if last > 1 else 1
    assert can_trim_to(caches, a.shape[1] - reach)
    assert not can_trim_to(caches, a.shape[1] - reach - 1)
    n = a.shape[1] - drop
    if drop > 1:  # in two steps: the second trim still finds what the write displaced
        trim_to(caches, n + 1)
    trim_to(caches, n)
    assert caches[0].offset == n
    seq = mx.concatenate([a[:, :n], b], axis=1)
    got = chunked_logits(model, b, caches, 3)
    ref = reference_logits(model, seq, semantic_mask(seq.shape[1], M, K))[:, n:]
    assert max_diff(got, ref) < 1e-4


def test_trim_before_wrap_is_exact() -> None:
    model = tiny_model()
    a = mx.random.randint(0, 97, (1, 12), key=mx.random.key(8))
    b = mx.random.randint(0, 97, (1, 30), key=mx.random.key(9))
    caches = [RotatingKVCache(W, 4) for _ in range(2)]
    chunked_logits(model, a, caches, 4)
    assert can_trim_to(caches, 3) and not can_trim_to(caches, 13)
    trim_to(caches, 3)
    seq = mx.concatenate([a[:, :3], b], axis=1)
    got = chunked_logits(model, b, caches, 4)
    ref = reference_logits(model, seq, semantic_mask(seq.shape[1], W, 4))[:, 3:]
    assert max_diff(got, ref) < 1e-4


# ---- what each query sees, end to end through update_and_fetch -----------------------
def _expand(mask: Any, n: int, L: int) -> list[list[bool]]:
    if mask is None:
        return [[True] * L for _ in range(n)]
    if isinstance(mask, str):
        return [[j <= L - n + i for j in range(L)] for i in range(n)]
    return mx.broadcast_to(mask, (n, L)).tolist()


@settings(max_examples=150, deadline=None)
@given(
    M=st.integers(2, 12),
    K=st.integers(0, 4),
    W=st.one_of(st.none(), st.integers(1, 14)),
    ops=st.lists(
        st.one_of(st.tuples(st.just("w"), st.integers(1, 30)),
                  st.tuples(st.just("t"), st.integers(1, 20))),
        min_size=1, max_size=12,
    ),
)
def test_every_query_sees_exactly_its_window(
    M: int, K: int, W: int | None, ops: list[tuple[str, int]]
) -> None:
    """Keys carry (position, version) in their two features; whatever the mask lets a
    query see must be live tokens of the current sequence, and exactly the semantic set
    unless a trim went past evicted tokens (then a subset)."""
    K = min(K, M - 1)
    c = RotatingKVCache(M, K)
    seq: list[int] = []  # version of the token at each position of the current sequence
    version, exact = 0, True
    for op, n in ops:
        if op == "t":
            keep_n = max(0, len(seq) - n)
            exact = exact and c.can_trim_to(keep_n)
            assert c.trim(len(seq) - keep_n) == len(seq) - keep_n
            del seq[keep_n:]
            continue
        version += 1
        o = len(seq)
        mask = c.make_mask(n, window_size=W)
        full = c.make_mask(n, return_array=True, window_size=W)
        kv = mx.stack(
            [mx.arange(o, o + n, dtype=mx.float32), mx.full((n,), version, mx.float32)], axis=-1
        )[None, None]
        keys, _ = c.update_and_fetch(kv, kv)
        seq += [version] * n
        got = keys[0, 0].tolist()
        L = len(got)
        lazy, explicit = _expand(mask, n, L), _expand(full, n, L)
        for i in range(n):
            t = o + i
            seen = [tuple(map(int, got[j])) for j in range(L) if explicit[i][j]]
            assert seen == [tuple(map(int, got[j])) for j in range(L) if lazy[i][j]]
            positions = sorted(p for p, _ in seen)
            assert len(set(positions)) == len(positions)  # no position twice
            for p, ver in seen:  # live tokens only: never the future, never stale
                assert p <= t and seq[p] == ver
            want = [p for p in range(t + 1)
                    if (p < K or t - p < M - K) and (W is None or t - p < W)]
            if exact:
                assert positions == want
            else:
                assert set(positions) <= set(want)
        assert c.offset == len(seq)
        assert c.nbytes == c.size() * 2 * 2 * 4


# ---- mlx-lm interoperability ----------------------------------------------------------
def test_mlx_lm_generate_step_drives_our_model_and_caches() -> None:
    from mlx_lm.generate import generate_step

    model = tiny_model()
    prompt = mx.array([1, 5, 9, 13, 40, 41, 42])
    caches = make_cache(model.config, max_kv_size=12, keep=2)
    ids = [t for t, _ in generate_step(prompt, model, prompt_cache=caches, max_tokens=40)]
    assert caches[0].offset == len(prompt) + 40 and caches[0].stats()["wrapped"]
    # the same greedy decode by hand
    caches = make_cache(model.config, max_kv_size=12, keep=2)
    model(prompt[None, :-1], cache=caches)
    y, mine = prompt[-1:], []
    for _ in range(40):
        y = mx.argmax(model(y[None], cache=caches)[:, -1, :], axis=-1)
        mine.append(y.item())
    assert ids == mine


@pytest.fixture(scope="module")
def stories() -> Path:
    return STORIES


@pytest.mark.slow
def test_greedy_rotation_matches_mlx_lm_on_stories260k(stories: Path) -> None:
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import RotatingKVCache as MlxRotating
    from mlx_lm.utils import load_model as mlx_load_model

    from kvchat.model.decoder.weights import load_model

    ours, theirs = load_model(stories), mlx_load_model(stories)[0]
    prompt = mx.array([1, 100, 200, 300, 50])  # BOS + 4 ids: short, same prefill both sides
    our_caches = [RotatingKVCache(max_size=64, keep=4) for _ in range(5)]
    a = [t for t, _ in generate_step(prompt, ours, prompt_cache=our_caches, max_tokens=300)]
    b = [t for t, _ in generate_step(prompt, theirs, max_tokens=300,
                                     prompt_cache=[MlxRotating(64, 4) for _ in range(5)])]
    assert len(a) == 300 and a == b
    # rotation really mattered: the unbounded cache diverges
    c = [t for t, _ in generate_step(prompt, ours, prompt_cache=[KVCache() for _ in range(5)],
                                     max_tokens=300)]
    assert c != a
    expected = 2 * 5 * 4 * 64 * 8 * 4
    assert sum(c.nbytes for c in our_caches) == expected
    measured = sum(c.keys[..., : c.size(), :].nbytes + c.values[..., : c.size(), :].nbytes
                   for c in our_caches)
    assert measured == expected == cache_stats(our_caches, ours.config).cache_bytes


def test_memory_stays_flat_while_rotating() -> None:
    model = tiny_model()
    window = 32
    caches = make_cache(model.config, max_kv_size=window)
    y = mx.array([1])
    samples = []
    for step in range(10 * window):
        y = mx.argmax(model(y[None], cache=caches)[:, -1, :], axis=-1)
        mx.eval(y)
        if step == window + 1:
            samples.append(mx.get_active_memory())
    samples.append(mx.get_active_memory())
    assert caches[0].offset == 10 * window and caches[0].size() == window
    assert samples[1] <= samples[0], samples


# ---- statistics -----------------------------------------------------------------------
def test_stats_and_nbytes_match_the_formula() -> None:
    cfg = tiny_cfg(kv_heads=2)
    model = tiny_model(2)
    caches = make_cache(cfg, max_kv_size=20, keep=4)
    s = cache_stats(caches, cfg)
    assert s.cache_bytes == 0 and s.cache_tokens == 0
    model(mx.array([list(range(9))]), cache=caches)
    s = cache_stats(caches, cfg)
    per_tok = 2 * 2 * 16 * 4  # K+V × kv heads × head_dim × float32
    assert s == CacheStats(
        cache_offset=9, cache_tokens=9, cache_capacity=20,
        cache_bytes=2 * per_tok * 9, mha_bytes=2 * 2 * per_tok * 9, gqa_saving=2.0,
        evicted_tokens=0, keep=4, wrapped=False, sliding_layers=0, sliding_bytes=0,
        window_saving=1.0, kv_bits=32, kv_group_size=None, float_bytes=2 * per_tok * 9,
        kv_saving=1.0, state_bytes=0, state_layers=0,  # no recurrent layer
    )
    model(mx.array([list(range(30))]), cache=caches)
    s = cache_stats(caches, cfg)
    assert (s.cache_offset, s.cache_tokens, s.evicted_tokens, s.wrapped) == (39, 20, 19, True)
    assert s.cache_bytes == 2 * 2 * 2 * 20 * 16 * 4  # 2 × layers × kv × tokens × hd × 4
    for c in caches:
        assert c.nbytes == c.keys[..., :20, :].nbytes + c.values[..., :20, :].nbytes
    rows = layer_stats(caches, cfg)
    assert [r["layer"] for r in rows] == [0, 1]
    assert sum(r["cache_bytes"] for r in rows) == s.cache_bytes
    assert sum(r["mha_bytes"] for r in rows) == s.mha_bytes


def test_stats_read_metadata_only() -> None:
    """A cache whose arrays have only shape and dtype still reports every statistic."""
    cfg = tiny_cfg()
    c = RotatingKVCache(64, 4)
    fake = SimpleNamespace(shape=(1, 2, 256, 16), dtype=mx.float16, nbytes=1 << 40)
    c.keys = c.values = fake  # type: ignore[assignment]
    c.offset = 100
    s = cache_stats([c], cfg)
    assert s.cache_tokens == 64 and s.cache_bytes == 2 * 2 * 64 * 16 * 2
    assert c.nbytes == s.cache_bytes and s.evicted_tokens == 36


def test_unbounded_cache_stats_use_the_model_context() -> None:
    cfg = tiny_cfg()
    caches = [KVCache() for _ in range(2)]
    tiny_model()(mx.array([[1, 2, 3]]), cache=caches)
    s = cache_stats(caches, cfg)
    assert s.cache_capacity == 256 and s.cache_tokens == 3 and not s.wrapped
    assert caches[0].nbytes == caches[0].keys[..., :3, :].nbytes * 2


# ---- construction ---------------------------------------------------------------------
def test_make_cache_bounds_and_step_growth() -> None:
    cfg = tiny_cfg()
    default = make_cache(cfg)
    assert len(default) == 2 and (default[0].max_size, default[0].keep) == (256, 4)
    bounded = make_cache(cfg, max_kv_size=100, keep=1)
    assert (bounded[0].max_size, bounded[0].keep) == (100, 1)
    c = RotatingKVCache(1000, 4)
    c.step = 64
    k = mx.zeros((1, 2, 10, 8))
    c.update_and_fetch(k, k)
    assert c.keys.shape == (1, 2, 64, 8)  # one step, not the capacity
    for _ in range(60):
        c.update_and_fetch(k[..., :1, :], k[..., :1, :])
    assert c.keys.shape == (1, 2, 128, 8)
    big = mx.zeros((1, 2, 2000, 8))
    c.update_and_fetch(big, big)
    assert c.keys.shape == (1, 2, 1000, 8)  # capped at the capacity
    with pytest.raises(CacheError):
        make_cache(cfg, max_kv_size=4, keep=4)
    with pytest.raises(CacheError):
        make_cache(cfg, max_kv_size=0)


def test_state_round_trip() -> None:
    model = tiny_model()
    tokens = mx.random.randint(0, 97, (1, 40), key=mx.random.key(10))
    nxt = mx.array([[7, 8, 9]])
    runs = []
    for restore in (False, True):
        caches = [RotatingKVCache(W, 4) for _ in range(2)]
        model(tokens, cache=caches)
        if restore:  # (state shares the arrays: each run builds its own)
            caches = [RotatingKVCache.from_state(c.state) for c in caches]
        runs.append(model(nxt, cache=caches))
    assert mx.array_equal(runs[0], runs[1])
    kv = mx.zeros((1, 1, 2, 4))
    assert KVCache.from_state((kv, kv)).offset == 2  # mlx-lm < 0.32: arrays only
    assert KVCache.from_state((kv, kv, 1)).offset == 1
