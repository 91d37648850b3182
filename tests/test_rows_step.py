"""A batched decode step (model/runtime/batch.py: the compiled `RowsStep`, or the model
run op by op on `Rows`) gives each row the logits its own compiled step gives it alone.

The reference is the row alone (`CompiledStep` on a copy of the same caches), fed the
same ids; rows differ in length (so in position, mask and the slots they read), and run
on float, rotating (past its window) and 4-bit K/V caches, with a RoPE whose schedule
reads the position (dynamic NTK: each row rotated at its own offset, row by row).
"""

from __future__ import annotations

import copy
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
    assert [c.offset for c in rows[0]] == [c.offset for c in alone_caches[0]]


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
        traced.append(batch._compiled.traced)
    assert traced == [True] + [False] * 9
