"""The compiled decode step gives the same greedy ids as the plain (uncompiled) step, on
the real stories260K and on transformers-built checkpoints, with the unbounded cache,
the default (context-sized) cache and a small rotating cache that wraps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from kvchat.model.cache.kv import KVCache, make_prompt_cache, trim_to
from kvchat.model.decoder.weights import load_model
from kvchat.model.runtime.generate import CompiledStep, Progress, generate_step


def _caches(model: Any, kind: str) -> list[Any]:
    if kind == "unbounded":
        return [KVCache() for _ in model.layers]
    if kind == "context":
        return make_prompt_cache(model)
    return make_prompt_cache(model, max_kv_size=40, keep=4)  # wraps within these runs


def _ids(model: Any, prompt: list[int], kind: str, compiled: bool, n: int) -> list[int]:
    caches = _caches(model, kind)
    prog = Progress()
    ids = list(generate_step(model, prompt, caches, max_tokens=n, compiled=compiled,
                             prefill_chunk=16, progress=prog))
    assert prog.compiled == compiled
    return ids


# on the real model the fast tier runs the rotating cache; every kind runs on the tiny
# checkpoints below
@pytest.mark.parametrize("kind", [pytest.param("unbounded", marks=pytest.mark.slow),
                                  pytest.param("context", marks=pytest.mark.slow), "rotating"])
def test_stories260k_compiled_ids_equal_plain(stories260k: Path, kind: str) -> None:
    model = load_model(stories260k)
    for prompt in ([1], [1, 403, 407, 261, 426, 297] * 10):  # BOS; a prompt past the ring
        plain = _ids(model, prompt, kind, False, 120)
        assert _ids(model, prompt, kind, True, 120) == plain
        assert len(set(plain)) > 10  # real text, not one repeated id


@pytest.mark.parametrize("name", ["llama", "mistral_swa", "qwen2", "llama3_classic"])
@pytest.mark.parametrize("kind", ["unbounded", "context", "rotating"])
def test_checkpoint_compiled_ids_equal_plain(tiny_checkpoint: Any, name: str, kind: str) -> None:
    model = load_model(tiny_checkpoint(name))
    prompt = [1, 17, 99, 5, 42, 200, 31, 7]
    assert _ids(model, prompt, kind, True, 80) == _ids(model, prompt, kind, False, 80)


def test_compiled_logits_match_after_trim_past_evicted(stories260k: Path) -> None:
    """After a trim past evicted ring slots (edit/regenerate in a long chat) the compiled
    step must mask exactly what the cache's own make_mask masks."""
    model = load_model(stories260k)
    runs = []
    for compiled in (False, True):
        caches = make_prompt_cache(model, max_kv_size=24, keep=2)
        list(generate_step(model, [1], caches, max_tokens=60, compiled=compiled))
        trim_to(caches, caches[0].offset - 30)
        step = CompiledStep(model, caches) if compiled else None
        y = mx.array([300])
        outs = []
        for _ in range(12):
            logits = step(y) if step else model(y[None], cache=caches)[:, -1, :]
            outs.append(logits)
            y = mx.argmax(logits, axis=-1)
        runs.append(mx.stack(outs))
    assert mx.allclose(runs[0], runs[1], atol=1e-4).item()


def test_caches_consistent_after_early_close(stories260k: Path) -> None:
    """Closing the generator mid-way leaves the caches holding prompt + `fed` ids."""
    model = load_model(stories260k)
    caches = make_prompt_cache(model)
    prog = Progress()
    gen = generate_step(model, [1, 403, 407], caches, max_tokens=50, progress=prog)
    got = [next(gen) for _ in range(7)]
    gen.close()
    assert prog.fed == 7 and len(got) == 7
    assert caches[0].offset == 3 + prog.fed


@pytest.mark.slow  # a 4,000-token prefill
def test_compiled_step_writes_kv_in_place(stories260k: Path) -> None:
    """The step's slice_update must reuse the cache buffers (MLX donates them when the
    cache no longer holds the old ones): the K buffer keeps its address step after
    step. A copy would move it, and cost a whole buffer per layer every token."""
    model = load_model(stories260k)
    caches = make_prompt_cache(model, max_kv_size=8192)
    steps = generate_step(model, list(range(3, 503)) * 8, caches, max_tokens=40)
    next(steps)  # prefill 4,000 tokens: each layer's K and V buffers hold 4,096 slots

    def address(a: mx.array) -> int:
        mx.eval(a)
        return np.array(a, copy=False).__array_interface__["data"][0]

    seen = set()
    for _ in range(6):
        next(steps)
        seen.add(address(caches[0].keys))
    steps.close()
    assert len(seen) == 1


def test_view_slots_round_up_to_an_eighth_of_the_next_power_of_two() -> None:
    from kvchat.model.runtime.generate import view_slots

    assert [view_slots(u, 4096) for u in (1, 32, 33, 160, 257, 1000, 1025, 4096)] == [
        32, 32, 64, 160, 320, 1024, 1280, 4096]
    assert view_slots(300, 256) == 256  # never past what is allocated


def test_compiled_step_attends_over_the_slots_in_use(stories260k: Path) -> None:
    """A 40-token context in a 256-slot buffer: the traces attend over 64 and then 96
    slots (view_slots), not the 256 allocated; the ids equal the plain step's."""
    model = load_model(stories260k)
    model.__dict__.pop("_kvchat_decode_traces", None)
    caches = [KVCache() for _ in model.layers]
    prompt = [1, 403, 407, 261, 426, 297] * 6
    ids = list(generate_step(model, prompt, caches, max_tokens=40))
    assert caches[0].keys.shape[2] == 256
    views = {v for key in model._kvchat_decode_traces for v in key[2]}
    assert views == {64, 96}
    assert ids == _ids(model, prompt, "unbounded", False, 40)
