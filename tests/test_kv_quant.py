"""Quantized K/V caches (8 and 4 bits) of every kind: stored exactly as `mx.quantize` of
what the float cache holds, slot for slot (written in place, rotated, trimmed alike);
attention on the packed K/V against a NumPy reference; the compiled step against the
plain one; bytes equal to the arrays' sizes and to kv_math's formula; flat memory over
30,000 tokens; mlx-lm's save/load and ours round-trip them; quality on the real models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as mlx_cache

from kvchat.model.cache.file import load_cache, save_cache
from kvchat.model.cache.kv import (
    KVCache,
    QuantizedKVCache,
    QuantizedRotatingKVCache,
    RotatingKVCache,
    cache_stats,
    layer_stats,
    make_cache,
    parts,
)
from kvchat.model.cache.kv_math import kv_bytes_at
from kvchat.model.decoder.config import ModelConfig
from kvchat.model.decoder.kv_format import KVQuant, KVQuantError
from kvchat.model.decoder.kv_quant import Packed, quantized_attention
from kvchat.model.decoder.transformer import Transformer
from kvchat.model.runtime.generate import CompiledStep, Progress, generate_step

REPO = Path(__file__).resolve().parents[1]
MINI = REPO / "assets" / "kvchat-mini"


def cfg(head_dim: int = 16, window: int | None = None, kv: int = 2) -> ModelConfig:
    return ModelConfig.from_dict({
        "model_type": "llama", "hidden_size": 4 * head_dim, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": kv, "intermediate_size": 96,
        "vocab_size": 97, "max_position_embeddings": 256, "sliding_window": window,
    })


def model_of(c: ModelConfig, seed: int = 0) -> Transformer:
    mx.random.seed(seed)
    m = Transformer(c)
    mx.eval(m.parameters())
    return m


# ---- storage: slot for slot what mx.quantize makes of the float cache ------------------
def _reference(c: Any, packed: Packed) -> tuple[Any, ...]:
    return tuple(packed.encode(x) for x in c.state[:2])


MAKERS = {
    "full": (lambda: KVCache(), lambda q: QuantizedKVCache(q)),
    "rotating": (lambda: RotatingKVCache(24, 4), lambda q: QuantizedRotatingKVCache(24, 4, q)),
    "ring": (lambda: RotatingKVCache(16, 0), lambda q: QuantizedRotatingKVCache(16, 0, q)),
}


@pytest.mark.parametrize("kind", sorted(MAKERS))
@pytest.mark.parametrize("bits,head_dim", [(8, 24), (4, 64)])
def test_storage_is_quantize_of_the_float_cache(kind: str, bits: int, head_dim: int) -> None:
    q = KVQuant(bits)
    packed = Packed.of(q, head_dim)
    make_f, make_q = MAKERS[kind]
    f, qc = make_f(), make_q(q)
    key = mx.random.key(1)
    # chunks that fit, that cross the buffer end, single decode tokens, a trim, more
    for step, n in enumerate([5, 1, 1, 17, 1, 30, 1, 1, -3, 1, 9, -40, 2, 1]):
        if n < 0:
            assert f.trim(-n) == qc.trim(-n)
            continue
        key, k1, k2 = mx.random.split(key, 3)
        keys = mx.random.normal((1, 2, n, head_dim), key=k1)
        values = mx.random.normal((1, 2, n, head_dim), key=k2)
        mask_f, mask_q = f.make_mask(n, return_array=True), qc.make_mask(n, return_array=True)
        assert mx.array_equal(mask_f, mask_q), step
        fk, fv = f.update_and_fetch(keys, values)
        qk, qv = qc.update_and_fetch(keys, values)
        # what attention reads: the float keys, quantized (same slots, same order)
        for got, want in ((qk, packed.encode(fk)), (qv, packed.encode(fv))):
            assert all(mx.array_equal(a, b) for a, b in zip(got, want, strict=True)), step
        assert (f.offset, f.size()) == (qc.offset, qc.size())
        want_k, want_v = _reference(f, packed)
        got_k, got_v = qc.state[:2]
        for got, want in ((got_k, want_k), (got_v, want_v)):
            assert all(mx.array_equal(a, b) for a, b in zip(got, want, strict=True)), step


def test_group_and_padding_choice() -> None:
    assert (KVQuant(8).group_for(128), KVQuant(8).padded_dim(128)) == (64, 128)
    assert (KVQuant(8).group_for(96), KVQuant(8).padded_dim(96)) == (32, 96)
    assert (KVQuant(4).group_for(24), KVQuant(4).padded_dim(24)) == (32, 32)
    assert KVQuant(4, 128).padded_dim(80) == 128
    for bad in ({"bits": 3}, {"bits": 8, "group_size": 16}, {"bits": 4, "start": -1}):
        with pytest.raises(KVQuantError):
            KVQuant(**bad)


# ---- attention on packed K/V against NumPy ---------------------------------------------
def _numpy_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float,
                     mask: np.ndarray, cap: float | None) -> np.ndarray:
    B, H, T, D = q.shape
    rep = H // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = q @ k.transpose(0, 1, 3, 2) * scale
    if cap is not None:
        s = np.tanh(s / cap) * cap
    s = np.where(mask, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


@pytest.mark.parametrize("head_dim,bits,cap", [(24, 8, None), (64, 4, None), (32, 8, 5.0)])
def test_quantized_attention_matches_numpy(head_dim: int, bits: int, cap: float | None) -> None:
    k1, k2, k3 = mx.random.split(mx.random.key(4), 3)
    T, S = 3, 11
    q = mx.random.normal((1, 4, T, head_dim), key=k1)
    k = mx.random.normal((1, 2, S, head_dim), key=k2)
    v = mx.random.normal((1, 2, S, head_dim), key=k3)
    packed = Packed.of(KVQuant(bits), head_dim)
    kq, vq = packed.encode(k), packed.encode(v)
    # the reference sees exactly the values the packed arrays hold
    kd, vd = (np.array(packed.decode(x)) for x in (kq, vq))
    causal = np.arange(S - T, S)[:, None] >= np.arange(S)[None]
    ring = causal & (np.arange(S)[None] % 3 != 1)  # an arbitrary explicit mask
    for mask, np_mask in (("causal", causal), (mx.array(ring), ring)):
        got = quantized_attention(q, kq, vq, packed, head_dim**-0.5, mask, cap)
        want = _numpy_attention(np.array(q), kd, vd, head_dim**-0.5, np_mask, cap)
        assert got.shape == (1, 4, T, head_dim)
        np.testing.assert_allclose(np.array(got), want, rtol=1e-4, atol=1e-4)


# ---- the compiled step ----------------------------------------------------------------
@pytest.mark.parametrize("bound,window", [(None, None), (40, None), (None, 24)])
def test_compiled_step_equals_plain_on_quantized_caches(bound: int | None,
                                                        window: int | None) -> None:
    """Full / rotating past its window / sliding rings: the same ids and cache state."""
    model = model_of(cfg(head_dim=24, window=window))  # 24: padded to 32
    prompt = [1, 5, 9, 13, 2, 7] * 4
    runs = []
    for compiled in (False, True):
        caches = make_cache(model.config, max_kv_size=bound, kv=KVQuant(8))
        prog = Progress()
        ids = list(generate_step(model, prompt, caches, max_tokens=60, compiled=compiled,
                                 prefill_chunk=10, progress=prog))
        assert prog.compiled == compiled
        assert all(isinstance(c, QuantizedRotatingKVCache) for c in caches)
        runs.append((ids, caches))
    (ids_p, c_p), (ids_c, c_c) = runs
    assert ids_p == ids_c
    for a, b in zip(c_p, c_c, strict=True):
        assert a.offset == b.offset == len(prompt) + 59
        for x, y in zip(parts(a.state[0]), parts(b.state[0]), strict=True):
            assert mx.array_equal(x, y)


def test_quantized_kv_start_switches_at_the_offset() -> None:
    model = model_of(cfg())
    prompt = [1, 5, 9, 13]
    float_ids = list(generate_step(model, prompt, make_cache(model.config), max_tokens=30))
    caches = make_cache(model.config, kv=KVQuant(8, start=20))
    assert all(type(c) is RotatingKVCache for c in caches)
    ids = []
    for t in generate_step(model, prompt, caches, max_tokens=30):
        ids.append(t)
        # positions < 20 are written by the float cache, every later one quantized (at
        # offset 20 exactly the switch happens before the next write)
        kinds, offset = {type(c) for c in caches}, caches[0].offset
        if offset != 20:
            assert kinds == ({RotatingKVCache} if offset < 20
                             else {QuantizedRotatingKVCache}), offset
    assert ids[:17] == float_ids[:17]  # positions < 20 came from float K/V
    assert all(isinstance(c, QuantizedRotatingKVCache) for c in caches)


# ---- bytes ----------------------------------------------------------------------------
def _array_bytes(c: Any) -> int:
    n = c.size()
    return sum(p[..., :n, :].nbytes for p in (*parts(c.keys), *parts(c.values)))


@pytest.mark.parametrize("bits", [8, 4])
def test_bytes_are_the_arrays_sizes(bits: int) -> None:
    c = cfg(head_dim=24)
    model = model_of(c)
    q = KVQuant(bits)
    caches = make_cache(c, max_kv_size=30, kv=q)
    float_caches = make_cache(c, max_kv_size=30)
    for cs in (caches, float_caches):
        list(generate_step(model, [1, 2, 3], cs, max_tokens=12))
    s = cache_stats(caches, c)
    measured = sum(_array_bytes(x) for x in caches)
    assert measured == s.cache_bytes == sum(x.nbytes for x in caches)
    assert measured == kv_bytes_at(c, s.cache_tokens, 4, q=q)  # scales in float32
    assert [r["cache_bytes"] for r in layer_stats(caches, c)] == [_array_bytes(x) for x in caches]
    assert s.float_bytes == cache_stats(float_caches, c).cache_bytes
    assert s.kv_saving == s.float_bytes / s.cache_bytes
    assert (s.kv_bits, s.kv_group_size) == (bits, 32)
    # after rotation: the resident slots only
    list(generate_step(model, [1], caches, max_tokens=40))
    s = cache_stats(caches, c)
    assert s.cache_tokens == 30 and s.wrapped
    assert sum(_array_bytes(x) for x in caches) == s.cache_bytes == kv_bytes_at(c, 30, 4, q=q)


@pytest.mark.slow  # a 30,000-token soak
def test_4bit_rotating_cache_memory_is_flat_over_30000_tokens() -> None:
    q = KVQuant(4)
    c = QuantizedRotatingKVCache(256, 4, q)
    kv = mx.random.normal((1, 2, 1, 64))
    samples = []
    for t in range(30_000):
        c.update_and_fetch(kv, kv)
        if t % 1000 == 999:
            mx.eval([*parts(c.keys), *parts(c.values)])
            samples.append((mx.get_active_memory(), sum(p.nbytes for p in parts(c.keys))))
    assert c.offset == 30_000 and c.size() == 256
    assert {b for _, b in samples} == {samples[0][1]}  # the buffers never grew
    assert max(m for m, _ in samples[1:]) <= samples[1][0]  # nor did memory


# ---- files: mlx-lm's save/load and ours -------------------------------------------------
def _continue(model: Transformer, caches: list[Any], first: int, n: int) -> list[int]:
    y, out = mx.array([first]), []
    for _ in range(n):
        y = mx.argmax(model(y[None], cache=caches)[:, -1, :], axis=-1)
        out.append(int(y.item()))
    return out


KINDS = {
    "full": (lambda c: [KVCache() for _ in range(2)], mlx_cache.KVCache),
    "rotating": (lambda c: [RotatingKVCache(24, 4) for _ in range(2)], mlx_cache.RotatingKVCache),
    "quantized": (lambda c: [QuantizedKVCache(KVQuant(8)) for _ in range(2)],
                  mlx_cache.QuantizedKVCache),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_mlx_lm_save_and_load_round_trip_our_caches(kind: str, tmp_path: Path) -> None:
    c = cfg(head_dim=32)  # a head_dim mlx-lm's QuantizedKVCache takes unpadded
    model = model_of(c)
    make, theirs = KINDS[kind]
    caches = make(c)
    model(mx.array([[1, 4, 9, 16, 25, 36, 49, 64, 81, 3] * 3]), cache=caches)
    path = str(tmp_path / "c.safetensors")
    mlx_cache.save_prompt_cache(path, caches, {"note": "x"})
    loaded, meta = mlx_cache.load_prompt_cache(path, return_metadata=True)
    assert meta["note"] == "x" and all(type(x) is theirs for x in loaded)
    assert loaded[0].offset == caches[0].offset == 30
    # mlx-lm's classes continue from our state exactly as ours do (same logits)
    ours_again = [type(x).from_state(x.state) for x in caches]
    assert _continue(model, loaded, 5, 20) == _continue(model, ours_again, 5, 20)


def test_our_files_round_trip_every_kind(tmp_path: Path) -> None:
    """Quantized rotating with a padded head_dim and a trim past evicted slots, and
    mlx-lm's QuantizedKVCache layout with a padded head_dim: our loader restores both."""
    c = cfg(head_dim=24)
    model = model_of(c)
    for make in (lambda: make_cache(c, max_kv_size=24, kv=KVQuant(4)),
                 lambda: [QuantizedKVCache(KVQuant(8)) for _ in range(2)]):
        caches = make()
        list(generate_step(model, [1, 2, 3, 4, 5, 6], caches, max_tokens=40))
        caches_b = make()
        list(generate_step(model, [1, 2, 3, 4, 5, 6], caches_b, max_tokens=40))
        for x in (*caches, *caches_b):
            x.trim(3)
        path = tmp_path / "c.kv.safetensors"
        save_cache(path, caches, {"m": "1"})
        loaded, meta = load_cache(path)
        assert meta == {"m": "1"} and [type(x) for x in loaded] == [type(x) for x in caches]
        assert [x.head_dim for x in loaded] == [24, 24]
        assert _continue(model, loaded, 7, 25) == _continue(model, caches_b, 7, 25)


# ---- quality on the real models --------------------------------------------------------
def _agreement(folder: Path) -> float:
    """Share of 512 positions where the 8-bit rotating cache picks the float rotating
    cache's greedy token, both given the float run's ids (a 128-token window: the run
    rotates past it). The float run is greedy, so its ids are its own argmaxes."""
    from kvchat.model.decoder.weights import load_model
    from kvchat.model.explain.kv_quality import stepwise_logprobs, texts
    from kvchat.model.text.tokenizer import load_tokenizer

    model = load_model(folder)
    prompt, _ = texts(load_tokenizer(folder))
    ids = list(generate_step(model, prompt, make_cache(model.config, max_kv_size=128),
                             max_tokens=512))
    lp = stepwise_logprobs(model, make_cache(model.config, max_kv_size=128, kv=KVQuant(8)),
                           prompt, ids)
    return float((mx.argmax(lp, -1) == mx.array(ids)).astype(mx.float32).mean().item())


def test_8bit_rotating_agrees_on_stories260k(stories260k: Path) -> None:
    assert _agreement(stories260k) >= 0.95


@pytest.mark.slow  # the same check on stories260k stays fast
def test_8bit_rotating_agrees_on_the_shipped_model() -> None:
    assert _agreement(MINI) >= 0.95


def test_compiled_step_layout_includes_the_quantization() -> None:
    model = model_of(cfg())
    a = make_cache(model.config, kv=KVQuant(8))
    b = make_cache(model.config, kv=KVQuant(4))
    for cs in (a, b):
        model(mx.array([[1, 2, 3]]), cache=cs)
    la, lb = CompiledStep(model, a).layout, CompiledStep(model, b).layout
    assert la != lb and la[0][1].bits == 8 and lb[0][1].bits == 4


def test_engine_saves_a_quantized_cache_and_reopens_warm(tmp_path: Path) -> None:
    """Through the real Engine on the shipped model: an 8-bit chat's cache saves beside
    the chat and a new engine continues from it without prefilling the history again,
    giving the ids the uninterrupted engine gives."""
    from kvchat.model.runtime.client import EngineClient
    from kvchat.model.runtime.events import CacheRestored, CacheSaved, GenParams, Started

    params = GenParams(max_tokens=12, temp=0.0, kv_bits=8)
    chat = [{"role": "user", "content": "Tell me about the cache."}]
    path = tmp_path / "chat.kv.safetensors"
    with EngineClient(str(MINI), timeout=60) as a:
        done = a.run(chat, params)
        a.engine.save_cache(path)
        saved = a.wait(CacheSaved)
        assert isinstance(saved, CacheSaved) and saved.error is None, saved
        follow = chat + [{"role": "assistant", "content": done.text},
                         {"role": "user", "content": "And then?"}]
        straight = a.run(follow, params)
    loaded, _ = load_cache(path)
    assert all(type(x) is QuantizedRotatingKVCache for x in loaded)
    with EngineClient(str(MINI), timeout=60) as b:
        b.engine.restore_cache(path)
        ev = b.wait(CacheRestored)
        assert isinstance(ev, CacheRestored) and ev.error is None and ev.tokens > 0
        again = b.run(follow, params)
        started = [e for e in b.events if isinstance(e, Started)][-1]
        assert started.cached_tokens >= ev.tokens - 1 and started.reprefill_reason is None
        assert again.ids == straight.ids
        assert again.stats.kv_bits == 8 and again.stats.kv_saving > 1


def test_settings_entries_for_kv_bits() -> None:
    from kvchat.app.core.settings import Settings, SettingsError

    s = Settings.from_dict({"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 256})
    assert not s.warnings
    assert s.gen_params().kv_quant() == KVQuant(8, 32, 256)
    bad = Settings.from_dict({"kv_bits": 5})
    assert bad.kv_bits is None and "kv_bits" in bad.warnings[0]
    orphan = Settings.from_dict({"quantized_kv_start": 100})  # without bits: the defaults
    assert (orphan.quantized_kv_start, orphan.kv_group_size) == (0, None) and orphan.warnings
    with pytest.raises(SettingsError, match="kv_group_size"):
        Settings(kv_bits=4, kv_group_size=16).validate()
    with pytest.raises(SettingsError) as e:  # the form focuses the bits field
        Settings(quantized_kv_start=64).validate()
    assert e.value.field == "kv_bits"


def test_agreement_line_reads_what_bench_recorded(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from kvchat.app.core import kv_quality

    monkeypatch.setenv("KVCHAT_CONFIG_DIR", str(tmp_path))
    assert "not measured" in kv_quality.agreement_line(str(MINI))
    kv_quality.record(MINI, {"bits": 8, "group_size": 32, "tokens": 512,
                             "first_divergence": 285, "forced_match": 0.994,
                             "free_match": 0.62, "mean_kl": 7.8e-5}, how="kvchat bench")
    line = kv_quality.agreement_line(str(MINI))
    assert "8-bit 99.4% of 512 tokens" in line and "token 285" in line
    assert "not measured" in kv_quality.agreement_line(str(tmp_path))  # another model


def test_side_panel_rows_for_a_quantized_cache() -> None:
    from kvchat.app.tui.widgets.stats_panel import quant_rows
    from kvchat.model.runtime.events import TurnStats

    assert quant_rows(TurnStats(kv_bits=32, cache_bytes=10, float_bytes=10)) == []
    rows = [r.plain for r in quant_rows(TurnStats(
        kv_bits=8, kv_group_size=32, cache_bytes=640, float_bytes=1536, kv_saving=2.4))]
    assert "8-bit K/V · group 32" in rows[0] and "2.4× smaller" in rows[1]
    padded = [r.plain for r in quant_rows(TurnStats(
        kv_bits=8, kv_group_size=32, cache_bytes=1600, float_bytes=1280, kv_saving=0.8))]
    # the panel wraps a long value onto an indented line: compare the words
    assert "1.2× larger (padding)" in " ".join(padded[1].split())


def test_mlx_lm_generate_quantizes_our_rotating_cache() -> None:
    """mlx-lm's own generate_step with kv_bits converts our rotating caches through
    `to_quantized` (its RotatingKVCache raises NYI there) and decodes the ids ours does."""
    from mlx_lm.generate import generate_step as mlx_generate_step

    model = model_of(cfg(head_dim=32))
    prompt = [1, 5, 9, 13, 2, 7, 11]
    ours = list(generate_step(model, prompt, make_cache(model.config, max_kv_size=16,
                                                        kv=KVQuant(8, 32)), max_tokens=30))
    caches = make_cache(model.config, max_kv_size=16)
    theirs = [int(t) for t, _ in mlx_generate_step(
        mx.array(prompt), model, prompt_cache=caches, max_tokens=30, kv_bits=8,
        kv_group_size=32, quantized_kv_start=0, sampler=lambda x: mx.argmax(x, axis=-1))]
    assert all(type(c) is QuantizedRotatingKVCache for c in caches)
    assert caches[0].offset >= len(prompt) + 29 and caches[0].size() == 16  # rotated
    assert theirs == ours


def test_serve_takes_the_kv_flags_to_every_request() -> None:
    import argparse

    from kvchat.app.core.errors import UsageError
    from kvchat.app.serve import command
    from kvchat.app.serve.protocol import Limits, _params

    p = argparse.ArgumentParser()
    command.add_arguments(p)
    args = p.parse_args(["--kv-bits", "8", "--kv-group-size", "32"])
    bound = command._check(args)
    assert (bound.kv_bits, bound.kv_group_size) == (8, 32)
    limits = Limits(("m",), 256, None, 4, {}, command.kv_fields(args))
    params = _params({"messages": []}, limits, 256)
    assert params.kv_quant() == KVQuant(8, 32, 0)
    with pytest.raises(UsageError, match="need --kv-bits"):
        command._check(p.parse_args(["--quantized-kv-start", "64"]))
