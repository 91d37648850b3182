"""The families with recurrent layers (state-space models and hybrids) against transformers
on fresh random tiny checkpoints, with test_families.py's builders: logits of a 40-token
sequence whole, token by token and in two prefill chunks through our caches (a state
carried across calls), 20 greedy tokens through the cache (compiled step and plain)
against transformers' `generate`, and the same 4-bit (quantized linear layers kept
quantized) against transformers on the dequantized weights. Both config spellings where
transformers reads two. Tolerance: max |ours − ref| ≤ 1e-4 · max(1, max |ref|).

One fixture per block kind runs by default (Mamba's selective scan, Mamba-2's SSD, the
gated delta rule, LFM2's short convolution); the other families are marked slow.

Beside them: the layer kinds each spelling gives, the prompt forms across several blocks,
the state caches (kind per layer, bytes constant as tokens grow, reported apart from K/V,
no trimming), the server's prefix pool, an engine conversation that reuses the state or
prefills again when it cannot go back, `kvchat inspect` and `kvchat explain`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from kvchat.model import load_model
from kvchat.model.cache.kv import cache_stats, can_trim_to, layer_stats, make_prompt_cache
from kvchat.model.cache.state import StateCache, StateError
from tests.helpers.families import (
    IDS,
    SEQ,
    _quantize_here,
    build,
    hf_logits,
    rel_err,
)
from tests.helpers.hybrid_families import HYBRID_SPECS

# one fixture per block kind runs by default; the rest are slow
FAST = {"mamba", "mamba2", "qwen3_next", "lfm2"}
NAMES = [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in HYBRID_SPECS]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build(HYBRID_SPECS[name], tmp_path_factory.mktemp(f"hyb_{name}"))
            _random_buffers(built[name])
            if name in CLASSIC_CONFIGS:
                path = built[name] / "config.json"
                path.write_text(json.dumps(CLASSIC_CONFIGS[name](json.loads(path.read_text()))))
        return built[name]

    return get


def _pattern_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Nemotron-H's config as the released checkpoints spell it: the layers as
    hybrid_override_pattern (M Mamba-2, * attention, - MLP, E experts), num_hidden_layers."""
    marks = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
    kinds = cfg.pop("layers_block_type")
    return {**cfg, "hybrid_override_pattern": "".join(marks[k] for k in kinds),
            "num_hidden_layers": len(kinds)}


# a fixture's config.json rewritten the way older checkpoints spell it (transformers reads
# both; the weights are those of the same seed)
CLASSIC_CONFIGS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "nemotron_h_classic": _pattern_config,
    "jamba_auto_rank": lambda cfg: {**cfg, "mamba_dt_rank": "auto"},
    "zamba2_classic": lambda cfg: {**cfg, "layers_block_type": [
        "mamba" if k == "linear_attention" else k for k in cfg["layers_block_type"]]},
}


def _random_buffers(folder: Path) -> None:
    """Tensors transformers initialises to zero and never randomises (LFM2-MoE's
    expert_bias, the correction bias of Nemotron-H's router; buffers): random here, so
    that a bias which picks other experts shows."""
    from safetensors.numpy import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    rng = np.random.default_rng(7)
    names = [k for k in tensors if k.endswith((".expert_bias", ".e_score_correction_bias"))]
    for k in names:
        tensors[k] = rng.normal(0, 0.3, tensors[k].shape).astype(tensors[k].dtype)
    if names:
        save_file(tensors, str(path), metadata={"format": "pt"})


def _ours(folder: Path, **load: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Our logits: whole, token by token, and prefilled in two chunks (17 + 23)."""
    model = load_model(folder, **load)
    whole = np.array(model(mx.array(IDS)))
    cache = make_prompt_cache(model)
    step = [model(mx.array(IDS[:, t : t + 1]), cache=cache) for t in range(SEQ)]
    cache = make_prompt_cache(model)
    chunks = [model(mx.array(IDS[:, :17]), cache=cache), model(mx.array(IDS[:, 17:]), cache=cache)]
    return whole, np.array(mx.concatenate(step, axis=1)), np.array(mx.concatenate(chunks, axis=1))


@pytest.mark.parametrize("name", NAMES)
def test_hybrid_matches_transformers(name: str, hybrid: Callable[[str], Path]) -> None:
    ref = hf_logits(hybrid(name))
    whole, step, chunks = (rel_err(x, ref) for x in _ours(hybrid(name)))
    print(f"\n{name}: ours vs transformers, whole {whole:.1e}, token by token {step:.1e},"
          f" two chunks {chunks:.1e}")
    assert whole <= 1e-4 and step <= 1e-4 and chunks <= 1e-4


# fixtures whose transformers greedy decode is not transformers' own forward pass
GREEDY_DIFFERS = {"zamba2_dt_floor"}


@pytest.mark.parametrize("name", [n for n in NAMES
                                  if getattr(n, "values", [n])[0] not in GREEDY_DIFFERS])
def test_hybrid_greedy_tokens_through_the_cache(name: str, hybrid: Callable[[str], Path]) -> None:
    """20 greedy tokens: prefill in the parallel form, then the one-token recurrence in the
    compiled step (and in the plain one), against transformers' own greedy decode through
    its cache."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from kvchat.model.runtime.generate import Progress, generate_step

    folder = hybrid(name)
    model = load_model(folder)
    prompt = [int(x) for x in IDS[0, :8]]
    runs = []
    for compiled in (True, False):  # the compiled step carries the states as the plain one
        prog = Progress()
        runs.append(list(generate_step(model, prompt, make_prompt_cache(model), max_tokens=20,
                                       compiled=compiled, progress=prog)))
        assert prog.compiled == compiled
    ours = runs[0]
    assert runs[0] == runs[1]
    arch = json.loads((folder / "config.json").read_text())["architectures"][0]
    hf_class = getattr(transformers, arch) if "ForConditionalGeneration" in arch else (
        AutoModelForCausalLM)  # a multimodal checkpoint: its own class, on text alone
    hf = hf_class.from_pretrained(str(folder), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # as ours: no stop, and eos not suppressed
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                          min_new_tokens=20)[0, len(prompt):].tolist()
    assert ours == ref


@pytest.mark.parametrize("name", [  # not a classic twin: the same weights
    n for n in NAMES if HYBRID_SPECS[name := getattr(n, "values", [n])[0]].rope_form
    == "parameters" and name not in CLASSIC_CONFIGS])
def test_hybrid_4bit_matches_transformers_on_dequantized(
    name: str, hybrid: Callable[[str], Path], tmp_path: Path
) -> None:
    """The linear layers 4-bit (group 64, the test's own quantizer), kept quantized on
    load, against transformers on the same weights dequantized."""
    q4, deq = tmp_path / "q4", tmp_path / "deq"
    _quantize_here(hybrid(name), q4, deq)
    model = load_model(q4, dequantize=False)
    assert model.quantization["bits"] == 4 and not model.dequantized
    quantized = {int(k.split(".")[2]) for k, _ in tree_flatten(model.parameters())
                 if k.startswith("model.layers.") and k.endswith(".scales")}
    assert quantized == set(range(model.config.num_hidden_layers))  # every layer has some
    ref = hf_logits(deq)
    whole, step, chunks = (rel_err(x, ref) for x in _ours(q4, dequantize=False))
    print(f"\n{name} 4-bit: ours vs transformers (dequantized), whole {whole:.1e},"
          f" token by token {step:.1e}, two chunks {chunks:.1e}")
    assert whole <= 1e-4 and step <= 1e-4 and chunks <= 1e-4


@pytest.mark.parametrize(("family", "types", "kinds"), [
    ("granitemoehybrid", ["mamba", "attention"], "RA"),  # Granite 4's own spelling
    ("lfm2", ["conv", "full_attention"], "RA"),
    ("bamba", None, "RAR"),  # attn_layer_indices [1]
    ("qwen3_next", None, "RRRA"),  # every 4th layer attends
    ("nemotron_h", ["mamba", "attention", "mlp", "moe"], "RAFF"),
    ("falcon_h1", None, "HHHH"),  # every layer both (transformers writes no layer list)
    ("jamba", None, "RRRRARRR"),  # attn_layer_period 8, offset 4 (Jamba's defaults)
    ("zamba2", ["mamba", "hybrid", "linear_attention", "hybrid"], "RHRH"),  # old and new
])
def test_layer_kinds_from_each_spelling(family: str, types: list[str] | None,
                                        kinds: str) -> None:
    """R: a recurrent mixer, A: attention, F: the feed-forward alone (Nemotron-H), H:
    attention and the recurrent mixer side by side (Falcon-H1)."""
    from kvchat.model.decoder.config import ModelConfig

    raw = {"model_type": family, "hidden_size": 64, "num_attention_heads": 4,
           "num_hidden_layers": len(kinds), "intermediate_size": 96, "vocab_size": 256,
           "layer_types": types, "attn_layer_indices": [1], "mamba_n_heads": 8,
           "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
           "linear_value_head_dim": 16, "num_experts": 4, "num_local_experts": 4,
           "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    cfg = ModelConfig.from_dict({k: v for k, v in raw.items() if v is not None})
    assert "".join("H" if s.mixer and s.attends else "R" if s.mixer else "A" if s.attends
                   else "F" for s in cfg.layers) == kinds
    assert all(s.rope is None for s in cfg.layers if not s.attends)
    if family == "nemotron_h":  # only its "moe" layer is the mixture of experts
        assert [s.moe for s in cfg.layers] == [False, False, False, True]
    if family == "zamba2":  # attention_head_dim absent: 2·hidden / heads, as transformers
        assert cfg.head_dim == 32


def test_prompt_forms_cross_their_block_boundaries(
    hybrid: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The 40-token prompt in blocks of 8 (Mamba's parallel scan) and chunks of 16 (the
    delta rule; Mamba-2's fixture already has chunk 16): several blocks in one call, the
    state carried between them, still exact."""
    from kvchat.model.decoder import delta, ssm

    monkeypatch.setattr(ssm, "SCAN_BLOCK", 8)
    monkeypatch.setattr(delta, "CHUNK", 16)
    for name in ("mamba", "qwen3_next"):
        whole = np.array(load_model(hybrid(name))(mx.array(IDS)))
        assert rel_err(whole, hf_logits(hybrid(name))) <= 1e-4, name


# ---- the state caches ----------------------------------------------------------------------
def test_state_cache_is_constant_and_reported_apart(hybrid: Callable[[str], Path]) -> None:
    """Mamba-2's layers each hold a conv state (K − 1) × (inner + 2·groups·N) and a
    recurrent state heads × head_dim × N (float32), the same after 8 tokens as after 40;
    no K/V bytes; cache_stats counts them as state."""
    model = load_model(hybrid("mamba2"))
    cache = make_prompt_cache(model)
    assert all(isinstance(c, StateCache) for c in cache)
    per_layer = (3 * (128 + 2 * 2 * 16) + 8 * 16 * 16) * 4
    seen = []
    for n in (8, 40):
        cache = make_prompt_cache(model)
        model(mx.array(IDS[:, :n]), cache=cache)
        s = cache_stats(cache, model.config)
        seen.append(s.state_bytes)
        assert s.state_layers == 2 and s.cache_bytes == 0 and s.cache_offset == n
        assert sum(c.nbytes for c in cache) == s.state_bytes
        rows = layer_stats(cache, model.config)
        assert [r["attention"] for r in rows] == ["mamba2", "mamba2"]
        assert [r["state_bytes"] for r in rows] == [per_layer, per_layer]
    assert seen == [2 * per_layer, 2 * per_layer]


def test_state_cache_refuses_to_go_back(hybrid: Callable[[str], Path]) -> None:
    model = load_model(hybrid("mamba"))
    cache = make_prompt_cache(model)
    model(mx.array(IDS[:, :10]), cache=cache)
    assert not cache[0].is_trimmable()
    assert can_trim_to(cache, 10) and not can_trim_to(cache, 9)
    assert cache[0].trim(0) == 0
    with pytest.raises(StateError, match="cannot drop its last 3 tokens"):
        cache[0].trim(3)
    clone = StateCache.from_state(cache[0].state)
    assert clone.offset == 10 and clone.nbytes == cache[0].nbytes


def test_prefix_pool_offers_a_state_only_where_it_extends(hybrid: Callable[[str], Path]) -> None:
    """The server's pool of idle caches: a Mamba cache serves a prompt that extends what
    it holds, never one that branches inside it (its state cannot go back there)."""
    from kvchat.model.cache.prefix_pool import PrefixPool

    model = load_model(hybrid("mamba"))
    held = [int(x) for x in IDS[0, :10]]
    cache = make_prompt_cache(model)
    model(mx.array([held]), cache=cache)
    pool = PrefixPool(budget_bytes=10**9)
    pool.put(held, cache, ("k",))
    assert pool.take(held[:6] + [3, 4], ("k",)) is None  # a branch after 6 tokens
    assert pool.stats()["misses"] == 1 and pool.stats()["entries"] == 1
    ids, got = pool.take(held + [5], ("k",))
    assert ids == held and got is cache and pool.stats()["reused_tokens"] == 10


def test_engine_turns_prefill_again_when_the_state_cannot_go_back(
    hybrid: Callable[[str], Path]
) -> None:
    """Two turns on a tiny Mamba through the engine: the second extends the first (its
    state is reused as is); a third goes back into the conversation, which a state cannot
    do, so it is prefilled again and says why. Every reply equals a fresh engine's on
    the whole conversation."""
    from kvchat.model.runtime.client import EngineClient
    from kvchat.model.runtime.events import GenParams, Started

    folder = hybrid("mamba")
    params = GenParams(max_tokens=6, temp=0.0, ignore_eos=True)
    a = [int(x) for x in IDS[0, :12]]
    with EngineClient(folder, timeout=60) as c:
        first = c.run(a, params)
        b = a + list(first.ids) + [7, 9, 11]
        second = c.run(b, params)
        s2 = next(e for e in c.events if isinstance(e, Started))
        d = b[:-4] + [5, 5]  # differs inside what the state already folded in
        third = c.run(d, params)
        s3 = next(e for e in c.events if isinstance(e, Started))
    assert s2.cached_tokens == len(a) + len(first.ids) - 1 and s2.reprefill_reason is None
    assert s3.cached_tokens == 0 and "recurrent layers" in s3.reprefill_reason
    for prompt, done in ((b, second), (d, third)):
        with EngineClient(folder, timeout=60) as fresh:
            assert list(fresh.run(prompt, params).ids) == list(done.ids)


def test_inspect_prints_state_bytes_next_to_kv(
    hybrid: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvchat inspect` on a recurrent model: no K/V per token, the state's bytes (the
    same at every context), and --live measures them from the arrays."""
    from kvchat.app.cli import inspect as inspect_cmd

    p = argparse.ArgumentParser()
    inspect_cmd.add_arguments(p)
    folder = hybrid("mamba2")
    assert inspect_cmd.run(p.parse_args(["--model", str(folder), "--json", "--live"])) == 0
    out = json.loads(capsys.readouterr().out)
    per_layer = (3 * (128 + 2 * 2 * 16) + 8 * 16 * 16) * 4
    assert out["attention"] == "none" and out["bytes_per_token"] == 0
    assert out["state_bytes"] == 2 * per_layer and out["state_layers"] == 2
    assert out["live"]["equal"] and out["live"]["state_bytes"] == 2 * per_layer
    assert inspect_cmd.run(p.parse_args(["--model", str(folder), "--context", "4096"])) == 0
    text = capsys.readouterr().out
    assert f"state of 2 recurrent layers: {2 * per_layer:,} B" in text
    assert "KV cache per token (all layers): 0 B" in text


@pytest.mark.parametrize("name", ["mamba", "nemotron_h"])
def test_explain_names_the_recurrent_layers(
    name: str, hybrid: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvchat explain` runs on a model without attention (Mamba) and one with layers of
    every kind (Nemotron-H), and says which layers keep a state."""
    from kvchat.app.cli import explain as explain_cmd

    p = argparse.ArgumentParser()
    explain_cmd.add_arguments(p)
    assert explain_cmd.run(p.parse_args(["--model", str(hybrid(name))])) == 0
    out = capsys.readouterr().out
    expected = {"mamba": "2 of 2", "nemotron_h": "1 of 4"}[name]
    assert f"recurrent layers: {expected} keep a fixed-size state" in out


def test_compiled_step_verifies_no_drafts_on_a_state_and_steps_one_token(
    hybrid: Callable[[str], Path]
) -> None:
    """Nemotron-H (a Mamba-2 state, attention K/V, mixer-less MLP and expert layers): the
    compiled step drives every cache one token at a time with the plain model's logits;
    a speculative verify pass of several tokens is refused (None) and writes nothing,
    since a state cannot take back the drafts it rejects."""
    from kvchat.model.cache.state import PassCache
    from kvchat.model.runtime.generate import CompiledStep

    model = load_model(hybrid("nemotron_h"))
    prompt, nxt = IDS[:, :12], IDS[0, 12:14]
    caches, plain = make_prompt_cache(model), make_prompt_cache(model)
    model(mx.array(prompt), cache=caches)
    model(mx.array(prompt), cache=plain)
    kinds = {type(c).__name__ for c in caches}
    assert {"StateCache", "PassCache"} <= kinds and any(hasattr(c, "keys") for c in caches)
    step = CompiledStep(model, caches)
    assert step.supported
    assert step.verify(mx.array(nxt)) is None
    assert [c.offset for c in caches] == [12] * len(caches)
    got = step(mx.array(nxt[:1]))
    want = model(mx.array(nxt[None, :1]), cache=plain)[:, -1, :]
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)
    assert [c.offset for c in caches] == [13] * len(caches)
    p = next(c for c in caches if isinstance(c, PassCache))
    assert p.next_slot(3) == (13, 0, 0, 0)  # nothing to write: any token count


# ---- attention and a state in one layer (Falcon-H1) ------------------------------------------
# per layer: K/V of 2 heads × 16 (fp32) per token; a conv state 3 × (128 + 2·2·16) and a
# recurrent state 8 × 16 × 16, float32
FALCON_KV_PER_TOKEN = 2 * 2 * 16 * 4
FALCON_STATE = (3 * (128 + 2 * 2 * 16) + 8 * 16 * 16) * 4


@pytest.mark.slow
def test_parallel_layers_keep_kv_and_a_state(hybrid: Callable[[str], Path]) -> None:
    """Falcon-H1's layers each hold K/V that grow with the tokens and a state that does not;
    cache_stats reports both; the layer cannot go back; a clone (the server's prefix pool)
    and a 4-bit K/V cache continue as the original does."""
    from kvchat.model.cache.hybrid import HybridCache
    from kvchat.model.cache.prefix_pool import clone_cache
    from kvchat.model.decoder.kv_format import KVQuant

    model = load_model(hybrid("falcon_h1"))
    for n in (8, 40):
        cache = make_prompt_cache(model)
        model(mx.array(IDS[:, :n]), cache=cache)
        assert all(isinstance(c, HybridCache) for c in cache)
        s = cache_stats(cache, model.config)
        assert s.cache_offset == n and s.state_layers == 2
        assert s.cache_bytes == 2 * n * FALCON_KV_PER_TOKEN
        assert s.state_bytes == 2 * FALCON_STATE
        assert sum(c.nbytes for c in cache) == s.cache_bytes + s.state_bytes
        rows = layer_stats(cache, model.config)
        assert [r["attention"] for r in rows] == ["global + mamba2"] * 2
    assert not can_trim_to(cache, 39) and can_trim_to(cache, 40)
    with pytest.raises(StateError):
        cache[0].trim(1)
    clone = clone_cache(cache)
    assert clone is not None
    nxt = mx.array(IDS[:, :1])
    np.testing.assert_array_equal(np.array(model(nxt, cache=clone)),
                                  np.array(model(nxt, cache=cache)))
    whole = np.array(model(mx.array(IDS[:, :9])))[:, -1]
    q = make_prompt_cache(model, kv=KVQuant(bits=8, group_size=32))
    model(mx.array(IDS[:, :8]), cache=q)
    assert rel_err(np.array(model(mx.array(IDS[:, 8:9]), cache=q))[:, -1], whole) <= 1e-2


# Zamba2's fixture: 3 hybrid layers of K/V (4 heads × 16) and 5 states, each a conv state
# 3 × (64 + 2·2·16) and a recurrent state 8 × 8 × 16
ZAMBA2_STATE = (3 * (64 + 2 * 2 * 16) + 8 * 8 * 16) * 4


@pytest.mark.slow
@pytest.mark.parametrize(("name", "kv_per_token", "layers", "state"), [
    ("falcon_h1", 2 * FALCON_KV_PER_TOKEN, 2, 2 * FALCON_STATE),
    ("zamba2", 3 * 2 * 4 * 16 * 4, 5, 5 * ZAMBA2_STATE),
])
def test_inspect_counts_kv_and_state_of_hybrid_layers(
    name: str, kv_per_token: int, layers: int, state: int, hybrid: Callable[[str], Path],
    capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvchat inspect` on layers that attend and keep a state (Falcon-H1's side by side,
    Zamba2's shared blocks): K/V per token of those layers and every state beside them,
    measured live from the arrays equal to the formula."""
    from kvchat.app.cli import inspect as inspect_cmd

    p = argparse.ArgumentParser()
    inspect_cmd.add_arguments(p)
    folder = hybrid(name)
    assert inspect_cmd.run(p.parse_args(["--model", str(folder), "--json", "--live"])) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bytes_per_token"] == kv_per_token
    assert out["state_layers"] == layers and out["state_bytes"] == state
    assert out["live"]["equal"] and out["live"]["state_bytes"] == state


def test_zamba2_is_not_split_across_hosts() -> None:
    """A rank of a split Zamba2 would lack the embeddings its hybrid layers read and the
    shared blocks stored under other ranks' layers: refused in one line."""
    from kvchat.model.decoder.config import ModelConfig
    from kvchat.model.distributed.pipeline import Slice, SliceModel
    from kvchat.model.errors import ModelLoadError

    cfg = ModelConfig.from_dict({
        "model_type": "zamba2", "hidden_size": 32, "num_attention_heads": 4,
        "num_hidden_layers": 2, "vocab_size": 256, "layers_block_type": ["mamba", "hybrid"],
        "adapter_rank": 8})
    with pytest.raises(ModelLoadError, match="cannot be split across hosts"):
        SliceModel(cfg, Slice(rank=1, start=1, stop=2, embed=False, head=True, weight_bytes=0))
