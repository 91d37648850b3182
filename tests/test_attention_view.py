"""The attention view (model/explain/attention_view.py) against transformers' own attention
weights (eager attention, output_attentions=True) over the same tokens: stories260K with
a 64-token rotating cache (4 sinks, then eviction; transformers gets the rotation as an
explicit mask) and a tiny Gemma 2 (soft-capping, a query_pre_attn_scalar scale, a
sliding layer). The engine's request/event pair is checked on stories260K too."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from kvchat.model.cache.kv import make_prompt_cache
from kvchat.model.decoder.weights import load_model
from kvchat.model.explain.attention_view import attention_view, newest_token_attention
from kvchat.model.explain.views import VIEWS
from kvchat.model.runtime.events import AttentionView, Event
from kvchat.model.runtime.generate import generate_step

MAX_KV, KEEP = 64, 4
PROMPT = [1, 403, 17, 29, 261, 45, 99, 300, 12, 77, 150, 8, 64, 201, 33, 90]


def _hf_last_row_attention(folder: Path, ids: list[int],
                           visible: Callable[[int, int], bool] | None = None) -> list[np.ndarray]:
    """Per layer, transformers' attention weights (heads, T) of the last position; with
    `visible(t, j)` a 4D additive mask replaces the causal one."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="eager").eval()
    x = torch.tensor([ids])
    kw: dict[str, Any] = {}
    if visible is not None:
        T = len(ids)
        m = torch.full((1, 1, T, T), torch.finfo(torch.float32).min)
        for t in range(T):
            for j in range(t + 1):
                if visible(t, j):
                    m[0, 0, t, j] = 0.0
        kw["attention_mask"] = m
    with torch.no_grad():
        out = model(x, output_attentions=True, **kw)
    return [a[0, :, -1, :].float().numpy() for a in out.attentions]


def _run(folder: Path, prompt: list[int], n: int, **cache_kw: Any) -> tuple[Any, list[Any],
                                                                            list[int]]:
    """Greedy decode through the compiled step; returns the model, its caches and the
    ids the caches hold."""
    model = load_model(folder)
    caches = make_prompt_cache(model, **cache_kw)
    gen = list(generate_step(model, prompt, caches, max_tokens=n))
    return model, caches, prompt + gen[:-1]  # the last id was sampled, never fed


@pytest.fixture(scope="module")
def stories_run(stories260k: Path) -> tuple[Any, list[Any], list[int]]:
    return _run(stories260k, PROMPT, 90, max_kv_size=MAX_KV, keep=KEEP)


@pytest.fixture(scope="module")
def stories_ref(stories260k: Path, stories_run: Any) -> list[np.ndarray]:
    """transformers over the same ids, the rotation (4 sinks + a 60-token ring) as a mask."""
    ring = MAX_KV - KEEP
    return _hf_last_row_attention(stories260k, stories_run[2],
                                  lambda t, j: j < KEEP or t - j < ring)


@pytest.mark.slow
def test_rotating_cache_matches_transformers(stories_run: Any, stories_ref: Any) -> None:
    model, caches, ids = stories_run
    T = len(ids)
    assert T > MAX_KV + 20  # rotation evicted tokens
    assert caches[0].stats()["evicted_tokens"] == T - MAX_KV
    ring = MAX_KV - KEEP
    ref = stories_ref
    for layer in range(len(caches)):
        sw = newest_token_attention(model, caches, layer, ids[-1])
        assert sw.query_position == T - 1
        pos = sw.positions[sw.visible]
        assert sorted(pos.tolist()) == list(range(KEEP)) + list(range(T - ring, T))
        np.testing.assert_allclose(sw.weights[:, sw.visible], ref[layer][:, pos], atol=2e-5)
        assert ref[layer][:, KEEP : T - ring].max() == 0.0  # evicted: nothing there
        np.testing.assert_allclose(sw.weights.sum(axis=1), 1.0, atol=1e-5)


def test_view_shares_match_the_reference(stories_run: Any, stories_ref: Any) -> None:
    model, caches, ids = stories_run
    T = len(ids)
    ring = MAX_KV - KEEP
    ref = stories_ref
    cfg = model.config
    per = cfg.num_attention_heads // cfg.num_key_value_heads
    for layer, group in ((0, None), (3, 1)):
        view = attention_view(model, caches, layer, group, ids[-1])
        heads = ref[layer] if group is None else ref[layer][group * per : (group + 1) * per]
        w = heads.mean(axis=0)
        assert view.sink_share == pytest.approx(w[:KEEP].sum(), abs=2e-5)
        assert view.recent_share == pytest.approx(w[T - 64 :].sum(), abs=2e-5)
        assert view.rest_share == pytest.approx(w[KEEP : T - 64].sum(), abs=2e-5)
        assert view.sink_share + view.recent_share + view.rest_share == pytest.approx(1.0)
        assert (view.keep, view.capacity, view.evicted) == (KEEP, MAX_KV, T - MAX_KV)
        assert view.position == T - 1 and view.tokens == MAX_KV
        assert sum(view.bins) == pytest.approx(1.0, abs=1e-5)
        assert view.bin_kinds[:KEEP] == ["sink"] * KEEP and "empty" not in view.bin_kinds
        # the next token overwrites the oldest ring entry: slot of position T - ring
        oldest = T - ring
        assert view.write_slot == KEEP + (oldest - KEEP) % ring


@pytest.mark.parametrize("name", ["gemma2", pytest.param("gpt_oss", marks=pytest.mark.slow)])
def test_softcap_sinks_and_window_match_transformers(tmp_path: Path, name: str) -> None:
    """Gemma 2: soft-capping and its query_pre_attn_scalar scale; gpt-oss: a learned sink
    logit per head (it takes a share, then is dropped); both: sliding and global layers."""
    from tests.helpers.families import FAMILY_SPECS, IDS, WINDOW, build

    folder = build(FAMILY_SPECS[name], tmp_path / name)
    prompt = [int(i) for i in IDS[0, :20]]
    model, caches, ids = _run(folder, prompt, 12)
    assert len(ids) > WINDOW
    assert model.config.attn_softcap is not None or model.config.attention_sinks
    ref = _hf_last_row_attention(folder, ids)
    kinds = set()
    for layer in range(len(caches)):
        sw = newest_token_attention(model, caches, layer, ids[-1])
        pos = sw.positions[sw.visible]
        window = model.config.layers[layer].window
        kinds.add(window)
        expect = range(len(ids) - window, len(ids)) if window else range(len(ids))
        assert sorted(pos.tolist()) == list(expect)
        np.testing.assert_allclose(sw.weights[:, sw.visible], ref[layer][:, pos], atol=2e-5)
    assert kinds == {None, WINDOW}  # a global and a sliding layer were both checked


def test_engine_sends_views_only_while_watched(stories260k: Path) -> None:
    from kvchat.model.runtime.engine import Engine
    from kvchat.model.runtime.events import Done, GenParams, Loaded

    events: list[Event] = []
    done = threading.Event()

    def on_event(ev: Event) -> None:
        events.append(ev)
        if isinstance(ev, (Done, Loaded)):
            done.set()

    engine = Engine(on_event, str(stories260k), views=VIEWS)
    try:
        assert done.wait(60)
        done.clear()
        params = GenParams(max_tokens=40, max_kv_size=MAX_KV, keep=KEEP, ignore_eos=True)
        engine.submit(PROMPT, params)
        assert done.wait(60)
        assert not [e for e in events if isinstance(e, AttentionView)]  # closed: none
        done.clear()
        engine.watch_attention(2, None)
        engine.submit(PROMPT + [5] * 30, params)
        assert done.wait(60)
        views = [e for e in events if isinstance(e, AttentionView)]
        assert views and all(v.layer == 2 and v.note is None for v in views)
        # after the turn: one view of the newest cached token, equal to a direct computation
        engine.watch_attention(2, 1)
        for _ in range(200):
            if any(isinstance(e, AttentionView) and e.group == 1 for e in events):
                break
            threading.Event().wait(0.05)
        last = [e for e in events if isinstance(e, AttentionView) and e.group == 1][-1]
        assert last.position == engine._chat.caches[2].offset - 1
        mine = attention_view(engine.model, engine._chat.caches, 2, 1, engine._chat.ids[-1])
        assert last.sink_share == pytest.approx(mine.sink_share, abs=1e-6)
        engine.watch_attention(None)
    finally:
        engine.close()
    mx.clear_cache()


def test_engine_process_forwards_explain_and_views(stories260k: Path) -> None:
    """The chat's engine runs in a child process: both requests cross the pipe and the
    events come back (the anatomy computed there, on the child's kernels)."""
    from kvchat.model.runtime.engine_process import EngineProcess
    from kvchat.model.runtime.events import Done, Explained, GenParams, Loaded

    events: list[Event] = []
    got = threading.Condition()

    def on_event(ev: Event) -> None:
        with got:
            events.append(ev)
            got.notify_all()

    def wait(kind: type) -> Any:
        with got:
            assert got.wait_for(lambda: any(isinstance(e, kind) for e in events), 60)
            return [e for e in events if isinstance(e, kind)][-1]

    engine = EngineProcess(on_event, str(stories260k), views=VIEWS)
    try:
        wait(Loaded)
        engine.submit(PROMPT, GenParams(max_tokens=8, max_kv_size=MAX_KV, keep=KEEP))
        wait(Done)
        engine.explain()
        data = wait(Explained).data
        assert data["block"]["attention"]["kv_heads"] == 4
        assert data["worked"]["rope_relative"]["equal"]
        assert data["what_if"][1]["context"] == len(PROMPT) + 7  # the cache's tokens now
        engine.watch_attention(4, 0)
        view = wait(AttentionView)
        assert (view.layer, view.group, view.note) == (4, 0, None)
        assert view.sink_share + view.recent_share + view.rest_share == pytest.approx(1.0)
    finally:
        engine.close()


def test_bins_cover_a_long_cache() -> None:
    """A 1024-slot cache (the shipped model's context) is sent as 512 bins of 2 slots."""
    mini = Path(__file__).resolve().parents[1] / "assets" / "kvchat-mini"
    model, caches, ids = _run(mini, [1, 40, 41, 42, 43, 44, 45], 6)
    view = attention_view(model, caches, 1, None, ids[-1])
    sw = newest_token_attention(model, caches, 1, ids[-1])
    assert (view.capacity, view.slots_per_bin, len(view.bins)) == (1024, 2, 512)
    w = np.zeros(1024)
    w[: sw.weights.shape[1]] = sw.weights.mean(axis=0)
    np.testing.assert_allclose(view.bins, w.reshape(512, 2).sum(axis=1), atol=1e-6)
    n = len(ids)
    assert view.bin_kinds[:2] == ["sink", "sink"] and view.bin_kinds[2] == "held"
    assert set(view.bin_kinds[(n + 1) // 2 :]) == {"empty"} and view.write_slot == n
    assert view.recent_share == pytest.approx(1.0 - view.sink_share, abs=1e-6)
