"""model/cache/prefix_pool.py: longest-prefix choice, LRU within a byte budget that counts what
the entries really hold (checked against MLX's allocator), partitions that never match each
other, and clones that never write into the entry they came from (checked against NumPy
copies)."""

from __future__ import annotations

import gc

import mlx.core as mx
import numpy as np

from kvchat.model.cache.kv import KVCache, RotatingKVCache, trim_to
from kvchat.model.cache.prefix_pool import PrefixPool

H, D = 2, 4  # KV heads, head_dim
KEY = (None, 4)


def filled(n: int, seed: int, cls: type = KVCache, heads: int = H, dim: int = D, **kw) -> list:
    """A 2-layer cache holding n tokens of random K/V."""
    rng = np.random.default_rng(seed)
    layers = []
    for _ in range(2):
        c = cls(**kw)
        c.update_and_fetch(mx.array(rng.standard_normal((1, heads, n, dim)), dtype=mx.float32),
                           mx.array(rng.standard_normal((1, heads, n, dim)), dtype=mx.float32))
        layers.append(c)
    mx.eval([c.keys for c in layers], [c.values for c in layers])
    return layers


def nbytes(n: int, heads: int = H, dim: int = D) -> int:
    """What a 2-layer cache of n tokens holds: its buffers grow in steps of 256 slots."""
    slots = -(-n // KVCache.step) * KVCache.step
    return 2 * 2 * heads * slots * dim * 4  # layers x (K and V) x heads x slots x dim x f32


def test_budget_evicts_least_recently_used_first() -> None:
    pool = PrefixPool(budget_bytes=nbytes(10) + nbytes(10))
    pool.put([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], filled(10, 0), KEY)
    pool.put([20] * 10, filled(10, 1), KEY)
    assert pool.total_bytes == 2 * nbytes(10) and pool.stats()["entries"] == 2
    pool.put([30] * 10, filled(10, 2), KEY)  # over budget: [1..10] goes
    assert pool.stats()["evictions"] == 1
    assert pool.take([1, 2, 3], KEY) is None  # gone
    assert pool.stats()["tokens"] == [10, 10]
    pool.put([40] * 600, filled(600, 3), KEY)  # larger than the whole budget: not kept
    assert pool.stats()["entries"] == 2 and pool.stats()["evictions"] == 2


def test_the_budget_counts_the_memory_the_entries_hold() -> None:
    """Entries of 10 tokens each hold 256-slot buffers: the pool counts what MLX's
    allocator gives back when they go (12 MiB here, so that other frees are noise), not
    the 10 tokens' bytes (25x less)."""
    pool = PrefixPool(budget_bytes=10**9)
    for i in range(6):
        pool.put([100 + i] * 10, filled(10, i, heads=8, dim=64), KEY)
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    counted = pool.total_bytes
    pool.clear()
    gc.collect()
    mx.clear_cache()
    freed = before - mx.get_active_memory()
    assert counted == 6 * nbytes(10, heads=8, dim=64)
    assert abs(freed - counted) <= 0.05 * counted, (freed, counted)


def test_partitions_never_match_each_other() -> None:
    """A server's clients: the same prompt under another partition is a miss."""
    pool = PrefixPool(budget_bytes=10**9)
    a, b = (*KEY, "client-a"), (*KEY, "client-b")
    pool.put([1, 2, 3, 4, 5, 6], filled(6, 0), a)
    assert pool.take([1, 2, 3, 4, 5, 6, 7], b) is None
    assert pool.take([1, 2, 3, 4, 5, 6, 7], KEY) is None  # nor the shared partition
    assert pool.stats()["misses"] == 2 and pool.stats()["reused_tokens"] == 0
    ids, _ = pool.take([1, 2, 3, 4, 5, 6, 7], a)
    assert ids == [1, 2, 3, 4, 5, 6]


def test_longest_prefix_wins_and_a_full_match_moves_out() -> None:
    pool = PrefixPool(budget_bytes=10**9)
    short, long_ = filled(3, 0), filled(6, 1)
    pool.put([1, 2, 3], short, KEY)
    pool.put([1, 2, 9, 9, 9, 9], long_, (256, 4))  # another cache bound: never matched
    pool.put([5, 1, 2, 3, 4, 5], filled(6, 2), KEY)
    ids, cache = pool.take([1, 2, 3, 4], KEY)
    assert ids == [1, 2, 3] and cache is short  # extended in place, not copied
    assert pool.stats()["entries"] == 2
    assert pool.stats()["hits"] == 1 and pool.stats()["reused_tokens"] == 3
    assert pool.take([7, 7], KEY) is None and pool.stats()["misses"] == 1


class KVCache8(KVCache):
    step = 8  # 8 tokens fill the buffer: its state is the buffer object itself


def test_a_partial_match_gets_a_clone_and_the_entry_stays_intact() -> None:
    pool = PrefixPool(budget_bytes=10**9)
    # full buffers: a clone holding the entry's own array objects would write into them
    for cls, kw in ((KVCache8, {}), (RotatingKVCache, {"max_size": 8, "keep": 2})):
        original = filled(8, 5, cls, **kw)
        before = [np.array(c.state[0]) for c in original]
        pool.put(list(range(8)), original, KEY)
        ids, clone = pool.take([0, 1, 2, 3, 99], KEY)  # a branch after 4 tokens
        assert ids == list(range(8)) and clone is not original
        # the engine trims the clone back to the shared prefix and writes the branch
        trim_to(clone, 4)
        for c in clone:
            c.update_and_fetch(mx.full((1, H, 1, D), 7.0), mx.full((1, H, 1, D), 7.0))
        mx.eval([c.keys for c in clone])
        assert all(np.array_equal(np.array(c.state[0]), b) for c, b in zip(original, before,
                                                                           strict=True))
        assert np.array_equal(np.array(clone[0].state[0])[:, :, :4], before[0][:, :, :4])
        assert float(np.array(clone[0].state[0])[0, 0, 4, 0]) == 7.0
        # the entry is still there for its own conversation
        ids, again = pool.take(list(range(8)) + [8], KEY)
        assert again is original
        pool.clear()


def test_an_entry_the_new_one_extends_is_dropped() -> None:
    pool = PrefixPool(budget_bytes=10**9)
    pool.put([1, 2, 3], filled(3, 0), KEY)
    pool.put([1, 2, 3, 4, 5], filled(5, 1), KEY)  # trimmable back to [1, 2, 3]
    assert pool.stats()["tokens"] == [5]


# ---- why a lookup found no more (model/cache/misses.py) ------------------------------------
def test_a_lookup_says_why_it_found_no_more() -> None:
    """Each reason from the ids alone: nothing of this key, the first differing token,
    the whole entry (no miss), the whole prompt (no miss), an eviction, a model change."""
    from kvchat.model.cache.misses import EVICTED, MODEL_CHANGED, NEW_CONVERSATION, PREFIX_DIFFERS

    clock = iter(range(100, 200)).__next__
    pool = PrefixPool(budget_bytes=nbytes(10), clock=lambda: float(clock()))
    mine, other = (*KEY, "me"), (*KEY, "someone else")
    pool.put([1, 2, 3, 4, 5, 6], filled(6, 0), other)
    first = pool.find([1, 2, 3], mine)  # another partition's entry is no entry of mine
    assert first.found is None and first.miss.reason == NEW_CONVERSATION
    pool.put([1, 2, 3, 4, 5, 6], filled(6, 1), mine)  # (evicts the other: one fits)
    branch = pool.find([1, 2, 3, 9, 9], mine)
    assert branch.found is not None and len(branch.found[0]) == 6
    assert (branch.miss.reason, branch.miss.differs_at) == (PREFIX_DIFFERS, 3)
    assert pool.find([7, 7], mine).miss.reason == PREFIX_DIFFERS  # held, shares nothing
    assert pool.find([7, 7], mine).miss.differs_at == 0
    assert pool.find([1, 2, 3], mine).miss.reason is None  # the whole prompt was there
    whole = pool.find([1, 2, 3, 4, 5, 6, 7], mine)  # continues the whole entry: it moves out
    assert whole.miss.reason is None and whole.info.hits == 3  # branch, [1, 2, 3], this
    # its cache goes back; another conversation's pushes it out of the budget
    pool.put(*whole.found, mine, whole.info)
    pool.put([8, 8, 8], filled(3, 2), mine)
    evicted = pool.find([1, 2, 3, 4, 5, 6, 7, 8], mine)
    assert evicted.miss.reason == EVICTED and pool.stats()["evictions"] == 2
    # what a cleared pool held is remembered with the reason it went
    pool.put([4, 4, 4, 4], filled(4, 3), mine)
    pool.clear(MODEL_CHANGED)
    assert pool.find([4, 4, 4, 4, 5], mine).miss.reason == MODEL_CHANGED
    assert pool.find([4, 4, 4, 4, 5], other).miss.reason == NEW_CONVERSATION  # not theirs


def test_a_cache_held_again_outranks_the_memory_of_its_eviction() -> None:
    from kvchat.model.cache.misses import EVICTED

    pool = PrefixPool(budget_bytes=nbytes(10))
    pool.put([1, 2, 3, 4], filled(4, 0), KEY)
    pool.put([5, 5], filled(2, 1), KEY)  # [1..4] evicted
    assert pool.find([1, 2, 3, 4, 9], KEY).miss.reason == EVICTED
    pool.put([1, 2, 3, 4, 9], filled(5, 2), KEY)  # prefilled again, held again
    assert pool.find([1, 2, 3, 4, 9, 10], KEY).miss.reason is None


def test_the_memory_of_dropped_caches_is_bounded() -> None:
    from kvchat.model.cache.misses import EVICTED, DroppedCaches

    d = DroppedCaches(max_records=3, max_tokens=10)
    for i in range(5):
        d.add([i, i, i], KEY, EVICTED)
    assert d.best([0, 0, 0], KEY) == (0, None) and d.best([4, 4], KEY) == (2, EVICTED)
    d.add(list(range(100, 109)), KEY, EVICTED)  # 9 tokens: the older ones go
    assert d.best([4, 4], KEY) == (0, None) and d.best([100, 101], KEY) == (2, EVICTED)
    d.add([100, 101], KEY, EVICTED)
    d.covered(list(range(100, 110)), KEY)  # a cache now extends both
    assert d.best([100, 101], KEY) == (0, None)


def test_a_recurrent_state_that_cannot_go_back_says_so() -> None:
    """A hybrid's cache holds attention K/V and a recurrent state; a prompt that leaves
    the cached conversation at token 5 cannot reuse the state (it only stands for all 8
    tokens): the reason names the missing checkpoint and the token, not a differing
    prefix; the attention-only cache of the same prompt is cut back and reused."""
    from kvchat.model.cache.misses import NO_CHECKPOINT, PREFIX_DIFFERS
    from kvchat.model.cache.state import StateCache

    ids = list(range(1, 9))
    state = StateCache()
    state.update(8, mx.zeros((1, 3, 4)), mx.zeros((1, 2, 4, 4)))
    pool = PrefixPool(1 << 30)
    pool.put(ids, [*filled(8, 1), state], key=("k",))
    look = pool.find([*ids[:5], 99, 100], ("k",))
    assert look.found is None
    assert (look.miss.reason, look.miss.differs_at) == (NO_CHECKPOINT, 5)
    plain = PrefixPool(1 << 30)
    plain.put(ids, filled(8, 1), key=("k",))
    look = plain.find([*ids[:5], 99, 100], ("k",))
    assert look.found is not None and look.miss.reason == PREFIX_DIFFERS
