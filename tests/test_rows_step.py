"""A batched decode step (model/runtime/batch.py: shared K/V buffers (`Slab`), the
compiled `RowsStep`, or the model run op by op on `Rows`) gives each row the logits its
own compiled step gives it alone, and leaves each row's cache as alone.

The reference is the row alone (`CompiledStep` on a copy of the same caches), fed the
same ids; rows differ in length (so in position, mask and the slots they read), and run
on float, rotating (past its window) and 4-bit K/V caches, with a RoPE whose schedule
reads the position (dynamic NTK: each row rotated at its own offset, row by row).
"""

from __future__ import annotations

import copy
import gc
import math
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from kvchat.model.cache.kv import KVQuant, make_prompt_cache
from kvchat.model.decoder.config import ModelConfig
from kvchat.model.decoder.transformer import Transformer
from kvchat.model.runtime.batch import Batch, BatchRow
from kvchat.model.runtime.generate import CompiledStep, Progress, prefill

CONFIG = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "vocab_size": 256, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
          "rope_theta": 10000.0, "tie_word_embeddings": True}
ROPES = {"default": {}, "dynamic": {"rope_scaling": {"type": "dynamic", "factor": 4.0},
                                    "max_position_embeddings": 24}}
CACHES: dict[str, dict[str, Any]] = {
    "float": {}, "rotating": {"max_kv_size": 20, "keep": 2},
    "kv4": {"kv": KVQuant(bits=4, group_size=32)}}
PROMPTS = [5, 17, 30, 41]  # prompt lengths: the rows' positions differ, and so do views
STEPS = 12


def model_for(rope: str) -> Transformer:
    mx.random.seed(3)
    model = Transformer(ModelConfig.from_dict({**CONFIG, **ROPES[rope]}))
    mx.eval(model.parameters())
    return model


def prefilled(model: Transformer, n: int, cache: str) -> list[Any]:
    caches = make_prompt_cache(model, **CACHES[cache])
    ids = np.random.default_rng(n).integers(1, 256, size=n).tolist()
    for _ in prefill(model, ids, caches, progress=Progress()):
        pass
    mx.eval([c.state for c in caches])
    return caches


def feed(i: int, step: int) -> int:
    return (37 * i + 11 * step) % 255 + 1


@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("compiled", [True, False])
def test_a_batched_step_gives_each_row_its_logits_alone(rope: str, cache: str,
                                                        compiled: bool) -> None:
    model = model_for(rope)
    rows = [prefilled(model, n, cache) for n in PROMPTS]
    alone_caches = [copy.deepcopy(c) for c in rows]
    alone = [CompiledStep(model, c) for c in alone_caches]
    batch = Batch(model)
    batch_rows = [BatchRow(c, compiled) for c in rows]
    for step in range(STEPS):
        for i, r in enumerate(batch_rows):
            batch.park(r, feed(i, step))
        batch.step()
        for i, r in enumerate(batch_rows):
            assert r.error is None and r.logits is not None
            want = alone[i](mx.array([feed(i, step)], dtype=mx.int32))
            np.testing.assert_allclose(np.array(r.logits), np.array(want), atol=2e-4,
                                       rtol=1e-4, err_msg=f"row {i} step {step}")
    # float rows with a RoPE that rotates a batch share buffers; the others do not
    assert (batch._slab is not None) == (compiled and cache != "kv4" and rope == "default")
    for r in batch_rows:
        batch.leave(r)
    assert batch._slab is None
    for mine, theirs in zip(rows, alone_caches, strict=True):
        assert_same_cache(mine, theirs)


def assert_same_cache(caches: list[Any], want: list[Any]) -> None:
    """Same offsets and, for float K/V, the same K/V in every resident slot (a batched
    projection may differ from a row's alone in the last bit)."""
    for c, w in zip(caches, want, strict=True):
        assert c.offset == w.offset
        for got, ref in zip(c.state[:2], w.state[:2], strict=True):
            if isinstance(got, mx.array):
                np.testing.assert_allclose(np.array(got), np.array(ref), atol=1e-5)


def test_rows_of_different_lengths_share_one_trace() -> None:
    """The batch's trace is keyed by its rows' layouts and the longest row's view, not by
    every row's own length: rows that cross a view step at different tokens retrace
    only when the longest does."""
    model = model_for("default")
    rows = [BatchRow(prefilled(model, n, "float"), True) for n in (3, 29, 40)]
    batch = Batch(model)
    traced = []
    for step in range(10):  # row 0 and row 1 cross 32 slots; the longest stays within 64
        for i, r in enumerate(rows):
            batch.park(r, feed(i, step))
        batch.step()
        traced.append(batch.traced)
    assert traced == [True] + [False] * 9


def test_rows_join_and_leave_shared_buffers() -> None:
    """Rows in shared buffers (slab.py) as a server's come and go: one leaves (every
    row takes its K/V back, the rest share again), one joins with a prompt long enough
    that the shared buffers grow; every step's logits and every cache left behind are
    each row's alone."""
    model = model_for("default")
    rows = {n: prefilled(model, n, "float") for n in (5, 17, 30, 254)}
    alone = {n: CompiledStep(model, copy.deepcopy(c)) for n, c in rows.items()}
    batch = Batch(model)
    brows = {n: BatchRow(c, True) for n, c in rows.items()}
    running = [5, 17, 30]
    for step in range(12):
        if step == 4:  # 17 leaves
            running.remove(17)
            batch.leave(brows[17])
        if step == 7:  # 254 joins: its 255+ slots outgrow the shared 256-slot buffers
            running.append(254)
        for n in running:
            batch.park(brows[n], feed(n, step))
        batch.step()
        assert batch._slab is not None and len(batch._slab.rows) == len(running)
        for n in running:
            want = alone[n](mx.array([feed(n, step)], dtype=mx.int32))
            np.testing.assert_allclose(np.array(brows[n].logits), np.array(want), atol=2e-4,
                                       rtol=1e-4, err_msg=f"row {n} step {step}")
            # in the slab a cache's statistics still describe its tokens
            for c, a in zip(rows[n], alone[n].caches, strict=True):
                assert (c.offset, c.stats()["cache_bytes"]) == (a.offset, a.stats()["cache_bytes"])
    assert max(slots_of(b) for b in batch._slab.keys) > 256
    for n in running:
        batch.leave(brows[n])
    for n, caches in rows.items():
        assert_same_cache(caches, alone[n].caches)


def slots_of(buf: mx.array) -> int:
    return buf.shape[2]


def test_a_long_row_among_short_ones_keeps_its_own_buffers() -> None:
    """Shared buffers give every row the longest row's slots: with one 450-token row
    among eight short ones that would be most of the memory, so the batch steps each
    row's own cache instead (rows_step.py), and the logits are still each row's alone."""
    model = model_for("default")
    rows = [prefilled(model, n, "float") for n in (*range(3, 11), 450)]
    alone = [CompiledStep(model, copy.deepcopy(c)) for c in rows]
    batch = Batch(model)
    brows = [BatchRow(c, True) for c in rows]
    for step in range(3):
        for i, r in enumerate(brows):
            batch.park(r, feed(i, step))
        batch.step()
        assert batch._slab is None
        for i, r in enumerate(brows):
            want = alone[i](mx.array([feed(i, step)], dtype=mx.int32))
            np.testing.assert_allclose(np.array(r.logits), np.array(want), atol=2e-4,
                                       rtol=1e-4)
    # the same rows less the long one share buffers
    for i, r in enumerate(brows[:-1]):
        batch.park(r, feed(i, 3))
    batch.step()
    assert batch._slab is not None


def test_a_row_that_leaves_holds_only_its_own_memory() -> None:
    """A row leaving shared buffers (for the prefix pool, say) gets its K/V copied out:
    a slice would keep every row's K/V alive in its name. Two rows leave in one round,
    the second after the first dissolved the slab; once the batch and the other rows are
    gone, what the two hold is about their own K/V, not the shared buffers."""
    model = model_for("default")
    gc.collect()
    base = mx.get_active_memory()
    rows = [prefilled(model, 600, "float") for _ in range(6)]
    brows = [BatchRow(c, True) for c in rows]
    batch = Batch(model)
    for i, r in enumerate(brows):
        batch.park(r, feed(i, 0))
    batch.step()
    assert batch._slab is not None
    mx.eval([r.logits for r in brows])
    kept = rows[:2]
    one_row = sum(c.keys.nbytes + c.values.nbytes for c in kept[0])
    batch.leave(brows[0])
    batch.leave(brows[1])
    del batch, brows, rows, r
    gc.collect()
    mx.eval([c.state for row in kept for c in row])
    held = mx.get_active_memory() - base
    assert held < 3 * one_row, (held, one_row)  # six rows' shared buffers: 6 × one_row


def test_prompt_chunks_prefilled_together_are_each_rows_alone() -> None:
    """Prompt chunks parked together (batch.py, `_prefill`) run padded to the longest in
    one forward where their caches take padding: fresh or already holding a prefix,
    float, a ring with room, 4-bit K/V; a ring the padding would wrap runs alone. Each
    row's logits at its last token and its cache afterwards are those of its own prefill."""
    from kvchat.model.runtime.batch import PrefillRow

    model = model_for("default")
    rng = np.random.default_rng(7)
    cases = [("float", 0, 7), ("float", 12, 20), ("rotating64", 0, 30), ("rotating", 0, 25),
             ("kv4", 0, 15)]
    kinds = {**CACHES, "rotating64": {"max_kv_size": 64, "keep": 2}}
    rows, solo, want = [], [], []
    for kind, before, n in cases:
        prefix = rng.integers(1, 256, size=before).tolist()
        chunk = rng.integers(1, 256, size=n).tolist()
        mine, theirs = (make_prompt_cache(model, **kinds[kind]) for _ in range(2))
        if prefix:
            for c in (mine, theirs):
                model(mx.array([prefix]), cache=c)
        want.append(np.array(model(mx.array([chunk]), cache=theirs)[:, -1]))
        rows.append(PrefillRow(mine, chunk))
        solo.append(theirs)
    assert not rows[3].pads(30) and all(r.pads(30) for i, r in enumerate(rows) if i != 3)
    batch = Batch(model)
    for r in rows:
        batch.park_prefill(r)
    batch.step()
    assert not batch.prefilling
    for (kind, _, _), r, w, theirs in zip(cases, rows, want, solo, strict=True):
        assert r.error is None
        np.testing.assert_allclose(np.array(r.logits), w, atol=2e-4, rtol=1e-4, err_msg=kind)
        assert_same_cache(r.caches, theirs)


def test_a_turn_closed_while_its_chunk_is_parked_leaves_the_batch() -> None:
    from kvchat.model.runtime.batch import WAIT, row_prefill

    model = model_for("default")
    batch, caches = Batch(model), make_prompt_cache(model)
    progress = Progress()
    chunks = row_prefill(batch, list(range(1, 40)), caches, prefill_chunk=16,
                         progress=progress, clock=lambda: 0.0)
    assert next(chunks) is WAIT and len(batch.prefilling) == 1
    chunks.close()
    assert not batch.prefilling and progress.prefilled == 0
    batch.step()
    assert caches[0].offset == 0  # nothing ran


def test_uneven_chunks_prefill_with_their_like() -> None:
    """Two short chunks and a long one: padding the short ones to the long one would cost
    more than their tokens, so the long one runs alone and the short ones together; each
    row's logits and cache are its own prefill's."""
    from kvchat.model.runtime.batch import PrefillRow

    model = model_for("default")
    rng = np.random.default_rng(11)
    chunks = [rng.integers(1, 256, size=n).tolist() for n in (3, 4, 200)]
    rows = [PrefillRow(make_prompt_cache(model), c) for c in chunks]
    solo = [make_prompt_cache(model) for _ in chunks]
    want = [np.array(model(mx.array([c]), cache=s)[:, -1]) for c, s in zip(chunks, solo,
                                                                          strict=True)]
    batch = Batch(model)
    for r in rows:
        batch.park_prefill(r)
    batch.step()
    for r, w, s in zip(rows, want, solo, strict=True):
        np.testing.assert_allclose(np.array(r.logits), w, atol=2e-4, rtol=1e-4)
        assert_same_cache(r.caches, s)


def test_greedy_rows_are_drawn_together_and_fed_back_as_drawn() -> None:
    """Rows whose sampler is `Argmax` get their ids from one argmax per vocabulary bound
    over the batch's logits, each its own row's; fed back unchanged, the next step takes
    the drawn array itself (no operation per row), and after a row leaves, the others'
    ids are gathered from it. A row with its own sampler keeps it."""
    from kvchat.model.runtime.batch import Pick, _ids
    from kvchat.model.runtime.sampling import Argmax, Sampler, SamplingParams

    model = model_for("default")
    caches = [prefilled(model, n, "float") for n in [*PROMPTS, 9]]
    alone = [CompiledStep(model, copy.deepcopy(c)) for c in caches]
    twin = Sampler(SamplingParams(temp=0.8, seed=5))  # row 3's draws, for row 3 alone
    samplers: list[Any] = [Argmax(256), Argmax(256), Argmax(256),
                           Sampler(SamplingParams(temp=0.8, seed=5)), Argmax(100)]
    rows = [BatchRow(c, True, s) for c, s in zip(caches, samplers, strict=True)]
    batch = Batch(model)
    fed: list[Any] = [feed(i, 0) for i in range(len(rows))]
    want_ids: list[int] = list(fed)
    for step in range(6):
        if step == 4:  # row 0 leaves: the others' picks are gathered from their draw
            batch.leave(rows[0])
            rows, fed, want_ids, alone, samplers = (
                rows[1:], fed[1:], want_ids[1:], alone[1:], samplers[1:])
            gathered = _ids(fed[:2])
            assert gathered is not fed[0].drawn.ids
            assert gathered.tolist() == [fed[0].item(), fed[1].item()]
        for r, t in zip(rows, fed, strict=True):
            batch.park(r, t)
        batch.step()
        fed = []
        for i, r in enumerate(rows):
            logits = alone[i](mx.array([want_ids[i]], dtype=mx.int32))
            s = samplers[i]
            want = int(mx.argmax(logits[0, : s.n]).item()) if isinstance(s, Argmax) \
                else int(twin(logits).item())
            assert isinstance(r.sampled, Pick) == isinstance(s, Argmax)
            got = r.sampled.item() if isinstance(r.sampled, Pick) else int(r.sampled.item())
            assert got == want, f"step {step} row {i}"
            fed.append(r.sampled)
            want_ids[i] = want
        picks = [t for t in fed if isinstance(t, Pick)]
        assert len({id(t.drawn) for t in picks}) == 2  # one draw per vocabulary bound
        wide = [t for t in picks if t.drawn is picks[0].drawn]
        assert _ids(wide) is wide[0].drawn.ids  # one draw's rows, in order: as drawn
    for r in rows:
        batch.leave(r)


def test_unseeded_rows_are_drawn_together_each_from_its_own_row() -> None:
    """Rows sampled alike with no seed (`Unseeded`) get one draw over their logits: each
    row's id comes from its own row (its own top-2 here, which no other row shares), and
    over many steps each row's ids follow its own softmax at the temperature."""
    from kvchat.model.runtime.batch import Pick, _draw
    from kvchat.model.runtime.sampling import Unseeded

    V, B, temp = 12, 6, 1.5
    base = np.full((B, V), -4.0, dtype=np.float32)
    for i in range(B):  # row i: tokens 2i and 2i+1 most likely, 3:1 before tempering
        base[i, 2 * i], base[i, 2 * i + 1] = 2.0 + 1.5 * math.log(3), 2.0
    logits = mx.array(base)
    draw = Unseeded(temp=temp, top_p=1.0, top_k=2, min_p=0.0, n=V)
    rows = [BatchRow([], True, draw) for _ in range(B)]
    for i, r in enumerate(rows):
        r._out = (logits, i)
    mx.random.seed(0)
    counts = np.zeros((B, V))
    for _ in range(600):
        queued = _draw(rows, logits)
        assert len(queued) == 1  # one draw for all six rows
        for i, r in enumerate(rows):
            assert isinstance(r.sampled, Pick)
            counts[i, r.sampled.item()] += 1
    for i in range(B):
        assert counts[i].sum() == counts[i, 2 * i] + counts[i, 2 * i + 1]  # its own top-2
        share = counts[i, 2 * i] / counts[i].sum()
        assert abs(share - 0.75) < 0.06, (i, share)  # 3:1 at temperature 1.5 on logit/1.5
