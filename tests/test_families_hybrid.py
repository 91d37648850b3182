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
no trimming but of a verify pass's own tokens), the server's prefix pool, an engine
conversation that reuses the state, restarts from a checkpoint or prefills again when it
cannot go back, `kvchat inspect` and `kvchat explain`.
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
FAST |= {"recurrent_gemma"}  # the RG-LRU
FAST |= {"kimi_linear"}  # Kimi Delta Attention
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


def _moonshot_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Kimi Linear's config as Moonshot's checkpoints spell it: the layers listed in
    linear_attn_config (counted from 1) with the KDA sizes, first_k_dense_replace instead
    of mlp_layer_types."""
    kinds, mlp = cfg.pop("layer_types"), cfg.pop("mlp_layer_types")
    linear = {
        "full_attn_layers": [i + 1 for i, k in enumerate(kinds) if k == "full_attention"],
        "kda_layers": [i + 1 for i, k in enumerate(kinds) if k == "linear_attention"],
        "num_heads": cfg.pop("linear_num_heads"), "head_dim": cfg.pop("linear_head_dim"),
        "short_conv_kernel_size": cfg.pop("linear_conv_kernel_dim")}
    return {**cfg, "linear_attn_config": linear,
            "first_k_dense_replace": mlp.index("sparse") if "sparse" in mlp else len(mlp)}


# a fixture's config.json rewritten the way older checkpoints spell it (transformers reads
# both; the weights are those of the same seed)
CLASSIC_CONFIGS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "nemotron_h_classic": _pattern_config,
    "jamba_auto_rank": lambda cfg: {**cfg, "mamba_dt_rank": "auto"},
    "zamba2_classic": lambda cfg: {**cfg, "layers_block_type": [
        "mamba" if k == "linear_attention" else k for k in cfg["layers_block_type"]]},
    "kimi_linear_classic": _moonshot_config,
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
    ("recurrent_gemma", None, "RRA"),  # block_types' default, repeated
    ("olmo_hybrid", None, "RRA"),  # every 4th attends, else the last
    ("kimi_linear", None, "RRRRARRRA"),  # every 4th from layer 4 attends
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


def test_kimi_linear_reads_moonshots_config_keys() -> None:
    """Moonshot's spelling: layers listed from 1 in linear_attn_config with the KDA sizes,
    the dense layers from first_k_dense_replace, the router's keys under their own names;
    a layer in neither list is one clear line."""
    from kvchat.model.decoder.config import ModelConfig
    from kvchat.model.errors import ConfigError

    raw = {"model_type": "kimi_linear", "hidden_size": 64, "num_attention_heads": 4,
           "num_hidden_layers": 4, "intermediate_size": 96, "vocab_size": 256,
           "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
           "linear_attn_config": {"full_attn_layers": [2, 4], "kda_layers": [1, 3],
                                  "num_heads": 2, "head_dim": 8, "short_conv_kernel_size": 3},
           "first_k_dense_replace": 2, "num_experts": 8, "num_experts_per_token": 3,
           "moe_renormalize": False, "num_expert_group": 4, "topk_group": 2,
           "num_shared_experts": 2, "moe_intermediate_size": 32, "model_max_length": 4096}
    cfg = ModelConfig.from_dict(raw)
    assert [s.mixer for s in cfg.layers] == ["kda", None, "kda", None]
    assert [s.moe for s in cfg.layers] == [False, False, True, True]
    assert all(s.rope is None for s in cfg.layers)  # no rotary anywhere, MLA's included
    m, moe = cfg.mixer, cfg.moe
    assert (m.k_heads, m.v_heads, m.k_dim, m.v_dim, m.conv_kernel) == (2, 2, 8, 8, 3)
    assert (moe.experts, moe.top_k, moe.norm_topk, moe.groups, moe.topk_groups,
            moe.shared_size) == (8, 3, False, 4, 2, 64)
    assert cfg.max_position_embeddings == 4096
    raw["linear_attn_config"]["kda_layers"] = [1]
    with pytest.raises(ConfigError, match="^config.json: layer 3 is in neither"):
        ModelConfig.from_dict(raw)
    raw["linear_attn_config"]["kda_layers"] = [0, 1]
    with pytest.raises(ConfigError, match="kda_layers must list layer numbers 1 to 4"):
        ModelConfig.from_dict(raw)


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
    """Turns on a tiny Mamba through the engine: the second extends the first (its state
    is reused as is); a third goes back to where the first reply ended, which a state can
    only do through its checkpoint there (model/cache/checkpoints.py); a fourth branches
    before any checkpoint, so it is prefilled again and says why. Every reply equals a
    fresh engine's on the whole conversation."""
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
        d = b[:-4] + [5, 5]  # differs where the first reply's last token was fed
        third = c.run(d, params)
        s3 = next(e for e in c.events if isinstance(e, Started))
        e = a[:5] + [5, 5]  # differs inside the first prompt: no checkpoint there
        fourth = c.run(e, params)
        s4 = next(ev for ev in c.events if isinstance(ev, Started))
    assert s2.cached_tokens == len(a) + len(first.ids) - 1 and s2.reprefill_reason is None
    assert s3.cached_tokens == len(b) - 4 and s3.reprefill_reason is None
    assert third.stats.cache["miss_reason"] == "prefix_differs"
    assert s4.cached_tokens == 0 and "recurrent layers" in s4.reprefill_reason
    assert fourth.stats.cache["miss_reason"] == "no_checkpoint"
    assert fourth.stats.cache["differs_at"] == 5
    for prompt, done in ((b, second), (d, third), (e, fourth)):
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


@pytest.mark.parametrize("name", ["mamba", "nemotron_h", "kimi_linear"])
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
    expected = {"mamba": "2 of 2", "nemotron_h": "1 of 4", "kimi_linear": "2 of 3"}[name]
    assert f"recurrent layers: {expected} keep a fixed-size state" in out
    if name == "kimi_linear":  # no layer rotates: no RoPE stage in the block
        assert "x → norm → attention or Kimi delta → + → norm → FFN → +" in out


def test_compiled_step_verifies_drafts_on_a_state_and_steps_one_token(
    hybrid: Callable[[str], Path]
) -> None:
    """Nemotron-H (a Mamba-2 state, attention K/V, mixer-less MLP and expert layers): the
    compiled step drives every cache one token at a time with the plain model's logits;
    a speculative verify pass of several tokens gives the plain model's logits too and
    keeps each position's state, so taking back its last token is exact
    (tests/test_speculative_hybrid.py runs whole replies)."""
    from kvchat.model.cache.kv import trim_to
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
    verified = step.verify(mx.array(nxt))
    assert verified is not None
    assert [c.offset for c in caches] == [14] * len(caches)
    assert trim_to(caches, 13) == 1  # the second token taken back, the state too
    assert [c.offset for c in caches] == [13] * len(caches)
    want = model(mx.array(nxt[None, :1]), cache=plain)[0]
    np.testing.assert_allclose(np.array(verified[:1]), np.array(want), rtol=1e-4, atol=1e-4)
    got = step(mx.array(nxt[1:2]))
    want = model(mx.array(nxt[None, 1:2]), cache=plain)[:, -1, :]
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.array(verified[1:]), np.array(want), rtol=1e-4, atol=1e-4)
    assert [c.offset for c in caches] == [14] * len(caches)
    p = next(c for c in caches if isinstance(c, PassCache))
    assert p.next_slot(3) == (14, 0, 0, 0)  # nothing to write: any token count


# ---- attention and a state in one layer (Falcon-H1) ------------------------------------------
# per layer: K/V of 2 heads × 16 (fp32) per token; a conv state 3 × (128 + 2·2·16) and a
# recurrent state 8 × 16 × 16, float32
FALCON_KV_PER_TOKEN = 2 * 2 * 16 * 4
FALCON_STATE = (3 * (128 + 2 * 2 * 16) + 8 * 16 * 16) * 4


@pytest.mark.slow
def test_parallel_layers_keep_kv_and_a_state(hybrid: Callable[[str], Path]) -> None:
    """Falcon-H1's layers each hold K/V that grow with the tokens and a state that does not;
    cache_stats reports both; the layer cannot go back past what its state kept (nothing,
    outside a speculative pass); a clone (the server's prefix pool) and a 4-bit K/V cache
    continue as the original does."""
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


@pytest.mark.parametrize("name", ["falcon_h1", "zamba2", "jamba"])
def test_batched_rows_of_hybrid_layers_decode_as_each_alone(
    name: str, hybrid: Callable[[str], Path]
) -> None:
    """Continuous batching (model/decoder/rows.py): two conversations of different
    lengths decode 6 greedy tokens in one forward per step, each row's K/V and state
    parts its own (a hybrid layer's too), and give the ids each gets alone."""
    from kvchat.model.decoder.rows import Rows
    from kvchat.model.runtime.generate import generate_step

    model = load_model(hybrid(name))
    prompts = [[int(x) for x in IDS[0, :9]], [int(x) for x in IDS[0, 3:16]]]
    alone = [list(generate_step(model, p, make_prompt_cache(model), max_tokens=6))
             for p in prompts]
    caches = [make_prompt_cache(model) for _ in prompts]
    last = [model(mx.array([p]), cache=c)[:, -1] for p, c in zip(prompts, caches, strict=True)]
    got: list[list[int]] = [[int(mx.argmax(x, axis=-1).item())] for x in last]
    for _ in range(5):
        layers = [Rows(c) for c in zip(*caches, strict=True)]
        logits = model(mx.array([[g[-1]] for g in got]), cache=layers)[:, -1]
        for g, y in zip(got, np.array(mx.argmax(logits, axis=-1)).tolist(), strict=True):
            g.append(int(y))
    assert got == alone
    assert all(c.offset == len(p) + 5 for p, cs in zip(prompts, caches, strict=True)
               for c in cs)


@pytest.mark.parametrize("name", ["falcon_h1", "zamba2", "jamba"])
def test_compiled_batched_rows_of_hybrid_layers_decode_as_each_alone(
    name: str, hybrid: Callable[[str], Path]
) -> None:
    """The same through the compiled batched step (model/runtime/rows_step.py), which
    drives a hybrid layer's K/V and state as two members and hands the model one
    HybridCache of their stand-ins per row."""
    from kvchat.model.runtime.generate import CompiledStep, generate_step
    from kvchat.model.runtime.rows_step import RowsStep

    model = load_model(hybrid(name))
    prompts = [[int(x) for x in IDS[0, :9]], [int(x) for x in IDS[0, 3:16]]]
    alone = [list(generate_step(model, p, make_prompt_cache(model), max_tokens=6))
             for p in prompts]
    caches = [make_prompt_cache(model) for _ in prompts]
    last = [model(mx.array([p]), cache=c)[:, -1] for p, c in zip(prompts, caches, strict=True)]
    got: list[list[int]] = [[int(mx.argmax(x, axis=-1).item())] for x in last]
    steps = [CompiledStep(model, c) for c in caches]
    assert all(s.supported for s in steps)
    assert any(k > 1 for k in steps[0].counts) == (name != "jamba")  # members apart
    batched = RowsStep(model)
    for _ in range(5):
        logits = batched([(s.caches, s.layout, s.counts) for s in steps],
                         mx.array([g[-1] for g in got], dtype=mx.int32))
        for g, y in zip(got, np.array(mx.argmax(logits, axis=-1)).tolist(), strict=True):
            g.append(int(y))
    assert got == alone


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


# ---- the RG-LRU, OLMo-hybrid and Kimi-Linear families ----------------------------------------
@pytest.mark.parametrize(("name", "per_layer"), [
    # conv state (K − 1) × lru_width and the RG-LRU's lru_width, float32
    ("recurrent_gemma", (3 * 64 + 64) * 4),
    # conv state (K − 1) × (q, k, v: 64 + 64 + 64), the delta rule's 4 heads × 16 × 16
    ("olmo_hybrid", (3 * 192 + 4 * 16 * 16) * 4),
    # KDA: conv state 3 × (q, k, v: 4 heads × 16 each), a 16 × 16 state per head, float32
    ("kimi_linear", (3 * (3 * 4 * 16) + 4 * 16 * 16) * 4),
])
def test_inspect_counts_each_recurrent_layers_state(
    name: str, per_layer: int, hybrid: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvchat inspect --live` on each new hybrid: the state bytes from the config (the
    sizes counted by hand here) equal what the caches hold after a prompt."""
    from kvchat.app.cli import inspect as inspect_cmd

    p = argparse.ArgumentParser()
    inspect_cmd.add_arguments(p)
    folder = hybrid(name)
    layers = load_model(folder).config.recurrent_layers
    assert inspect_cmd.run(p.parse_args(["--model", str(folder), "--json", "--live"])) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["state_layers"] == layers and out["state_bytes"] == layers * per_layer
    assert out["live"]["equal"] and out["live"]["state_bytes"] == layers * per_layer


def test_delta_rule_with_a_gate_per_channel_matches_transformers_kda() -> None:
    """The gated delta rule with one decay per key channel (Kimi's KDA), against
    transformers' own chunked and recurrent KDA functions: 150 tokens in chunks of 64 (the
    last partial), the same as two calls (the state carried) and token by token."""
    import torch
    from transformers.models.kimi_linear import modeling_kimi_linear as kimi

    from kvchat.model.decoder.delta import gated_delta, l2norm

    rng = np.random.default_rng(11)
    b, T, H, D = 1, 150, 2, 16
    q, k, v = (rng.normal(size=(b, T, H, D)).astype(np.float32) for _ in range(3))
    g = -np.log1p(np.exp(rng.normal(size=(b, T, H, D)))).astype(np.float32) * 0.3
    beta = (1 / (1 + np.exp(-rng.normal(size=(b, T, H))))).astype(np.float32)
    t = [torch.from_numpy(x) for x in (q, k, v, g, beta)]
    with torch.no_grad():
        ref, ref_state = kimi.chunk_kimi_delta_attention(
            *t[:3], g=t[3], beta=t[4], output_final_state=True, use_qk_l2norm_in_kernel=True)
        step_ref, _ = kimi.recurrent_kimi_delta_attention(
            *t[:3], g=t[3], beta=t[4], initial_state=None, output_final_state=True,
            use_qk_l2norm_in_kernel=True)
    qn, kn = l2norm(mx.array(q)) * D**-0.5, l2norm(mx.array(k))
    vm, gm, bm = mx.array(v), mx.array(g), mx.array(beta)
    whole, state = gated_delta(qn, kn, vm, gm, bm, None)
    first, mid = gated_delta(qn[:, :70], kn[:, :70], vm[:, :70], gm[:, :70], bm[:, :70], None)
    second, _ = gated_delta(qn[:, 70:], kn[:, 70:], vm[:, 70:], gm[:, 70:], bm[:, 70:], mid)
    steps, S = [], None
    for i in range(T):
        y, S = gated_delta(qn[:, i:i + 1], kn[:, i:i + 1], vm[:, i:i + 1], gm[:, i:i + 1],
                           bm[:, i:i + 1], S)
        steps.append(y)
    ref_np = ref.numpy()
    assert rel_err(np.array(whole), ref_np) <= 1e-4
    assert rel_err(np.array(state), ref_state.numpy()) <= 1e-4
    assert rel_err(np.array(mx.concatenate([first, second], axis=1)), ref_np) <= 1e-4
    assert rel_err(np.array(mx.concatenate(steps, axis=1)), step_ref.numpy()) <= 1e-4
    assert rel_err(np.array(S), ref_state.numpy()) <= 1e-4
    # the gate per channel bites: its mean over the channels gives another output
    flat, _ = gated_delta(qn, kn, vm, gm.mean(axis=-1), bm, None)
    assert rel_err(np.array(flat), ref_np) > 1e-2


def test_kimi_linear_long_prompt_chunked_equals_recurrent_decode(
    hybrid: Callable[[str], Path]
) -> None:
    """A 150-token prompt (KDA's chunks of 64: two whole, one partial) against transformers'
    whole forward, and the same tokens fed one by one through our caches (the recurrent
    form), and a 100-token prefill followed by 50 single-token steps."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = hybrid("kimi_linear")
    ids = np.random.default_rng(5).integers(3, 256, size=(1, 150))
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                              attn_implementation="eager").eval()
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    model = load_model(folder)
    whole = np.array(model(mx.array(ids)))
    cache = make_prompt_cache(model)
    steps = [model(mx.array(ids[:, t:t + 1]), cache=cache) for t in range(150)]
    cache = make_prompt_cache(model)
    mixed = [model(mx.array(ids[:, :100]), cache=cache)]
    mixed += [model(mx.array(ids[:, t:t + 1]), cache=cache) for t in range(100, 150)]
    assert rel_err(whole, ref) <= 1e-4
    assert rel_err(np.array(mx.concatenate(steps, axis=1)), ref) <= 1e-4
    assert rel_err(np.array(mx.concatenate(mixed, axis=1)), ref) <= 1e-4


def test_kimi_linear_inspect_counts_latent_kv_and_kda_state(
    hybrid: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvchat inspect` on Kimi Linear: K/V per token from its one MLA layer, the latent
    (16) and the unrotated shared key (8) in float32, = 96 B; the state of its two KDA
    layers, 2 × (3 × 192 + 4 × 16 × 16) × 4 = 12,800 B; the layers named by kind."""
    from kvchat.app.cli import inspect as inspect_cmd
    from kvchat.model.cache.layer_kinds import layer_kinds

    p = argparse.ArgumentParser()
    inspect_cmd.add_arguments(p)
    folder = hybrid("kimi_linear")
    assert inspect_cmd.run(p.parse_args(["--model", str(folder), "--json", "--live"])) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bytes_per_token"] == (16 + 8) * 4
    assert out["state_layers"] == 2 and out["state_bytes"] == 12_800
    assert out["live"]["equal"] and out["live"]["state_bytes"] == 12_800
    assert layer_kinds(load_model(folder).config) == ["Kimi delta", "MLA", "Kimi delta"]
