"""Every family in families.FAMILIES against transformers (the reference) on a fresh random
tiny checkpoint: logits of a 40-token sequence, whole and token by token through our
per-layer caches, with a sliding window (16) shorter than the sequence where the family
has one; the same 4-bit (mlx-lm's conversion, or the test's own quantizer where mlx-lm
cannot build the family) against transformers on the dequantized weights.
Tolerance: max |ours − ref| ≤ 1e-4 · max(1, max |ref|).

Beside ours, mlx-lm 0.32.2's error on the same folder is measured and asserted where it
is known to be off (the README's parity table prints both; run with -s to see them).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from kvchat.model import load_model
from kvchat.model.cache.kv import make_prompt_cache
from kvchat.model.decoder.config import ModelConfig
from kvchat.model.decoder.families import FAMILIES, SLIDING
from kvchat.model.errors import ConfigError
from tests.helpers.families import (
    FAMILY_SPECS,
    IDS,
    LONGROPE,
    NAMES,
    SEQ,
    WINDOW,
    _checkpoint,
    _quantize_here,
    build,
    hf_logits,
    rel_err,
    to_classic,
)

# The fast tier runs one family per block kind: sliding and global GQA layers
# (gemma3_text), a mixture of experts (mixtral), multi-head latent attention (deepseek_v3);
# llama's own parity is tests/test_parity.py. Every other family runs in the slow tier.
FAST = ("gemma3_text", "mixtral", "deepseek_v3")


def families(names: Iterable[str], fast: Iterable[str] = FAST) -> list[Any]:
    """`names` as test parameters, those not in `fast` marked slow."""
    return [pytest.param(n, marks=() if n in fast else pytest.mark.slow) for n in names]


def tolerance(ref: np.ndarray) -> float:
    return 1e-4 * max(1.0, float(np.abs(ref).max()))


def ours_whole(folder: Path) -> np.ndarray:
    return np.array(load_model(folder)(mx.array(IDS)))


def ours_stepwise(folder: Path) -> np.ndarray:
    model = load_model(folder)
    # the dynamic-NTK fixture's context (32) is shorter than the sequence: no rotation
    cache = make_prompt_cache(model, max_kv_size=max(SEQ, model.config.max_position_embeddings))
    steps = [model(mx.array(IDS[:, t : t + 1]), cache=cache) for t in range(SEQ)]
    return np.array(mx.concatenate(steps, axis=1))


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build(FAMILY_SPECS[name], tmp_path_factory.mktemp(f"fam_{name}"))
        return built[name]

    return get


@pytest.fixture(scope="module")
def quantized(
    family: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], tuple[Path, Path]]:
    """(4-bit folder, its dequantized float copy in transformers' layout) for a family.
    By mlx_lm.convert where mlx-lm can build the family (it converts a classic-RoPE copy
    where it cannot read transformers 5's form: the weights do not depend on it; our
    loader reads the converted config as is); else by `_quantize_here`, straight from
    the transformers checkpoint under its own tensor names."""
    built: dict[str, tuple[Path, Path]] = {}

    def get(name: str) -> tuple[Path, Path]:
        if name not in built:
            from mlx_lm import convert

            src = family(name)
            root = tmp_path_factory.mktemp(f"q4_{name}")
            if not FAMILY_SPECS[name].mlx_lm_converts:
                _quantize_here(src, root / "q4", root / "deq")
                built[name] = (root / "q4", root / "deq")
                return built[name]
            if FAMILY_SPECS[name].convert_classic:
                shutil.copytree(src, root / "classic")
                to_classic(root / "classic")
                src = root / "classic"
            convert(str(src), str(root / "q4"), quantize=True, q_bits=4, q_group_size=64)
            convert(str(root / "q4"), str(root / "deq"), dequantize=True)
            _to_transformers_layout(root / "deq")
            built[name] = (root / "q4", root / "deq")
        return built[name]

    return get


# mlx-lm's Mixtral names per expert -> transformers'
_MIXTRAL_EXPERT = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}


def _to_transformers_layout(folder: Path) -> None:
    """mlx-lm writes experts stacked (`switch_mlp`) and DeepSeek-V3's kv_b_proj split
    (`embed_q`, `unembed_out`); transformers reads neither. Rewrite the dequantized
    reference folder in transformers' layout (so its logits are the true reference)."""
    import mlx.core as mx

    cfg = json.loads((folder / "config.json").read_text())
    files = sorted(folder.glob("*.safetensors"))
    weights: dict[str, mx.array] = {}
    for f in files:
        weights.update(mx.load(str(f)))
    out: dict[str, mx.array] = {}
    for name, w in weights.items():
        if cfg["model_type"] == "gptj" and name.startswith("model."):  # mlx-lm: model.h.*
            name = "transformer." + name[len("model."):]
        name = re.sub(r"\.experts\.(gate_proj|up_proj|down_proj)\.", r".switch_mlp.\1.", name)
        if ".switch_mlp." in name and cfg["model_type"] == "granitemoe":  # fused, stacked
            prefix, rest = name.split(".switch_mlp.")
            if rest.startswith("down_proj."):
                out[f"{prefix}.output_linear.weight"] = w
            elif rest.startswith("gate_proj."):
                up = weights[f"{prefix}.switch_mlp.up_proj.weight"]
                out[f"{prefix}.input_linear.weight"] = mx.concatenate([w, up], axis=1)
        elif ".ffn.experts." in name:  # DBRX: one Linear per expert -> all experts' rows
            prefix, rest = name.split(".ffn.experts.")
            i, proj, _ = rest.split(".")
            if i == "0":
                n = cfg["ffn_config"]["moe_num_experts"]
                parts = [weights[f"{prefix}.ffn.experts.{e}.{proj}.weight"] for e in range(n)]
                out[f"{prefix}.ffn.experts.mlp.{proj}"] = mx.concatenate(
                    [w.T if proj == "w2" else w for w in parts])  # w2: (size, hidden) each
        elif ".switch_mlp." in name:
            prefix, rest = name.split(".switch_mlp.")
            proj, param = rest.split(".")
            if cfg["model_type"] in ("mixtral", "phimoe"):  # the same per-expert names
                proj = _MIXTRAL_EXPERT[proj]
            for i in range(w.shape[0]):
                out[f"{prefix}.experts.{i}.{proj}.{param}"] = w[i]
        elif name.endswith(".embed_q.weight"):
            prefix = name[: -len(".embed_q.weight")]
            wv = weights[f"{prefix}.unembed_out.weight"]  # (heads, v, rank)
            wk = w.swapaxes(-1, -2)  # (heads, nope, rank)
            out[f"{prefix}.kv_b_proj.weight"] = mx.concatenate([wk, wv], axis=1).reshape(
                -1, wk.shape[-1])
        elif not name.endswith(".unembed_out.weight"):
            out[name] = w
    for f in files:
        f.unlink()
    mx.save_safetensors(str(folder / "model.safetensors"), out, metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)


def errors(ours: Path, reference: Path, name: str) -> tuple[float, float]:
    """(whole, token by token) error of our model from folder `ours` against transformers
    on folder `reference` (its own token-by-token run where the RoPE needs it)."""
    ref = hf_logits(reference)
    step_ref = hf_logits(reference, True) if FAMILY_SPECS[name].incremental_reference else ref
    return rel_err(ours_whole(ours), ref), rel_err(ours_stepwise(ours), step_ref)


@pytest.mark.parametrize("name", families(NAMES))
def test_family_matches_transformers(name: str, family: Callable[[str], Path]) -> None:
    whole, step = errors(family(name), family(FAMILY_SPECS[name].reference or name), name)
    print(f"\n{name}: ours vs transformers, whole {whole:.1e}, token by token {step:.1e}")
    assert whole <= 1e-4 and step <= 1e-4


@pytest.mark.parametrize("name", families(
    [n for n in NAMES if FAMILY_SPECS[n].rope_form == "parameters"], fast=["gemma3_text"]))
def test_family_4bit_matches_transformers_on_dequantized(
    name: str, quantized: Callable[[str], tuple[Path, Path]]
) -> None:
    """Every family 4-bit: by mlx_lm.convert where it can, else by the test's own
    quantizer; either way at least one tensor of every layer is quantized."""
    q4, deq = quantized(name)
    assert json.loads((q4 / "config.json").read_text())["quantization"]["bits"] == 4
    model = load_model(q4)
    assert model.quantization["bits"] == 4
    layers = {int(m[1]) for k in _checkpoint(q4) if k.endswith(".scales")
              and (m := re.search(r"\.(?:layers|h|blocks)\.(\d+)\.", k))}
    assert layers == set(range(model.config.num_hidden_layers)), sorted(layers)
    whole, step = errors(q4, deq, name)
    print(f"\n{name} 4-bit: ours vs transformers (dequantized), whole {whole:.1e},"
          f" token by token {step:.1e}")
    assert whole <= 1e-4 and step <= 1e-4


@pytest.mark.parametrize("name", families(NAMES))
def test_mlx_lm_on_the_same_folder(name: str, family: Callable[[str], Path]) -> None:
    """Records mlx-lm 0.32.2's error next to ours (docs/models.md, the parity table)."""
    from mlx_lm.utils import load_model as mlx_lm_load

    spec = FAMILY_SPECS[name]
    folder = family(name)
    ref = hf_logits(family(spec.reference or name))
    ours = rel_err(ours_whole(folder), ref)
    if spec.mlx_lm == "fails":
        # any failure to build or run it (mlx-lm exits when a model needs a missing package)
        with pytest.raises((Exception, SystemExit)):
            mlx_lm_load(folder)[0](mx.array(IDS))
        print(f"\n{name}: ours {ours:.1e}, mlx-lm cannot load it ({spec.note})")
        assert ours <= 1e-4
        return
    theirs_model, _ = mlx_lm_load(folder)
    theirs = rel_err(np.array(theirs_model(mx.array(IDS)).astype(mx.float32)), ref)
    print(f"\n{name}: ours {ours:.1e}, mlx-lm {theirs:.1e} {spec.note}")
    assert ours <= 1e-4
    if spec.mlx_lm == "off":
        assert theirs > 1e-4
    else:
        assert theirs <= 1e-4


@pytest.mark.parametrize(("name", "recipe"), [
    pytest.param(name, recipe, id=f"{name}-{recipe}",
                 marks=() if (name, recipe) == ("gemma3_text", "mixed_3_6") else pytest.mark.slow)
    for name in ["gemma3_text", "phi3_longrope", "qwen3"] for recipe in ["bf16", "q8", "mixed_3_6"]
])
def test_family_8bit_and_per_layer_quantization(
    name: str, recipe: str, family: Callable[[str], Path], tmp_path: Path
) -> None:
    """mlx-community's other formats: bfloat16, 8-bit, and mlx-lm's mixed 3/6-bit recipe
    whose config lists per-layer bits; checked against transformers on the same weights
    (dequantized where quantized; bf16 read by transformers in float32)."""
    from mlx_lm import convert

    q = tmp_path / "q"
    if recipe == "bf16":
        convert(str(family(name)), str(q), dtype="bfloat16")
        err = rel_err(np.array(load_model(q)(mx.array(IDS))), hf_logits(q))
        print(f"\n{name} {recipe}: ours vs transformers {err:.1e}")
        assert err <= 1e-4
        return
    if recipe == "q8":
        convert(str(family(name)), str(q), quantize=True, q_bits=8, q_group_size=64)
    else:
        convert(str(family(name)), str(q), quantize=True, q_bits=4, q_group_size=64,
                quant_predicate=recipe)
        per_layer = json.loads((q / "config.json").read_text())["quantization"]
        assert any(isinstance(v, dict) for v in per_layer.values())  # overrides present
    convert(str(q), str(tmp_path / "deq"), dequantize=True)
    ref = hf_logits(tmp_path / "deq")
    err = rel_err(np.array(load_model(q)(mx.array(IDS))), ref)
    print(f"\n{name} {recipe}: ours vs transformers (dequantized) {err:.1e}")
    assert err <= 1e-4


# ---- the table resolves what each family needs ---------------------------------------------
def test_every_family_has_a_checkpoint_here() -> None:
    import transformers as tf

    from tests.helpers.hybrid_families import HYBRID_SPECS  # with recurrent layers

    tested = {
        (getattr(tf, s.config_class) if s.config_class else getattr(tf, s.hf_class).config_class)
        .model_type for s in (*FAMILY_SPECS.values(), *HYBRID_SPECS.values())
    }
    # test_parity covers llama, mistral and qwen2; the wrappers' text parts are rows too;
    # kvchat2017 (training's --block 2017) has no transformers class: test_block2017.py
    # checks it against NumPy
    assert set(FAMILIES) - tested <= {"llama", "mistral", "qwen2", "kvchat2017"}


def test_gemma3_layer_kinds_and_local_rope(family: Callable[[str], Path]) -> None:
    cfg = load_model(family("gemma3_text")).config
    assert cfg.layer_kinds == ["sliding_attention"] * 2 + ["full_attention", "sliding_attention"]
    assert [s.window for s in cfg.layers] == [WINDOW, WINDOW, None, WINDOW]
    assert cfg.layers[0].rope.theta == 1e4 and cfg.layers[0].rope.type == "default"
    assert cfg.layers[2].rope.theta == 1e6 and cfg.layers[2].rope.type == "linear"


@pytest.mark.slow  # a family beyond FAST
def test_sliding_window_changes_logits(family: Callable[[str], Path], tmp_path: Path) -> None:
    """The fixtures' window really bites at 40 tokens: without it, logits differ."""
    src = family("gemma2")
    plain = tmp_path / "plain"
    shutil.copytree(src, plain)
    cfg = json.loads((plain / "config.json").read_text())
    cfg["sliding_window"] = 4096
    (plain / "config.json").write_text(json.dumps(cfg))
    assert rel_err(ours_whole(plain), hf_logits(src)) > 1e-2


def test_mixed_caches_keep_window_and_full(family: Callable[[str], Path]) -> None:
    model = load_model(family("gemma3_text"))
    cache = make_prompt_cache(model)
    assert [c.max_size for c in cache] == [WINDOW, WINDOW, 256, WINDOW]
    assert [c.keep for c in cache] == [0, 0, 4, 0]
    model(mx.array(IDS), cache=cache)
    from kvchat.model.cache.kv import cache_stats, layer_stats

    s = cache_stats(cache, model.config)
    per = 2 * 2 * 16 * 4  # K+V × kv heads × head_dim × float32
    assert s.cache_tokens == SEQ and s.cache_offset == SEQ
    assert s.cache_bytes == per * (3 * WINDOW + SEQ)
    assert s.sliding_layers == 3 and s.sliding_bytes == per * 3 * WINDOW
    assert s.window_saving == pytest.approx(4 * SEQ / (3 * WINDOW + SEQ))
    rows = layer_stats(cache, model.config)
    assert [r["attention"] for r in rows] == ["sliding", "sliding", "global", "sliding"]
    assert [r["cache_tokens"] for r in rows] == [WINDOW, WINDOW, SEQ, WINDOW]


def test_user_bound_smaller_than_window(family: Callable[[str], Path]) -> None:
    """--max-kv-size below the window bounds every layer; keep applies to the global ones."""
    model = load_model(family("gemma3_text"))
    cache = make_prompt_cache(model, max_kv_size=8, keep=2)
    assert [(c.max_size, c.keep) for c in cache] == [(8, 2)] * 4


# ---- bad input -------------------------------------------------------------------------------
GEMMA3 = {
    "model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
    "vocab_size": 256, "sliding_window": 16,
}


PHIMOE = {"model_type": "phimoe", "layer_types": None, "sliding_window": None,
          "num_local_experts": 4, "num_experts_per_tok": 2}
DBRX_FFN = {"ffn_hidden_size": 96, "moe_num_experts": 4, "moe_top_k": 2}


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"layer_types": ["full_attention"] * 3}, "layer_types"),
        ({"layer_types": ["full_attention"] * 3 + ["local"]}, "layer_types"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"rope_parameters": {"full_attention": {"rope_type": "ntk-by-parts"},
                              "sliding_attention": {}}}, "rope_parameters.full_attention"),
        ({"rope_scaling": {"rope_type": "mrope", "factor": 2.0}}, "rope_type"),
        ({"hidden_activation": "relu3"}, "hidden_activation"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6,
                                                 "partial_rotary_factor": 1.5},
                              "sliding_attention": {}}}, "partial_rotary_factor"),
        ({"model_type": "phi3", "rope_scaling": {**LONGROPE, "long_factor": [1.0]}},
         "long_factor"),
        ({**PHIMOE, "num_experts_per_tok": 3}, "num_experts_per_tok"),
        ({**PHIMOE, "router_jitter_noise": "0.01"}, "router_jitter_noise"),
        ({**PHIMOE, "rope_scaling": {**LONGROPE, "short_factor": [1.0] * 4,
                                      "long_factor": [1.0] * 4, "short_mscale": 1.2,
                                      "long_mscale": 1.3}}, "long_mscale"),
        ({"model_type": "dbrx", "ffn_config": {**DBRX_FFN, "moe_top_k": 5}}, "moe_top_k"),
        ({"model_type": "dbrx", "ffn_config": {**DBRX_FFN, "moe_normalize_expert_weights": 0}},
         "moe_normalize_expert_weights"),
        ({"model_type": "dbrx", "ffn_config": DBRX_FFN, "attn_config": [2]}, "attn_config"),
    ],
)
def test_inconsistent_config_names_the_key(change: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict({**GEMMA3, **change})
    msg = str(e.value)
    assert key in msg and "\n" not in msg


def test_unsupported_family_lists_the_supported_ones() -> None:
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict({**GEMMA3, "model_type": "bitnet"})
    msg = str(e.value)
    assert "'bitnet'" in msg and "\n" not in msg
    for name in FAMILIES:
        assert name in msg


@pytest.mark.slow  # a family beyond FAST
def test_bad_family_folder_loads_nothing(family: Callable[[str], Path], tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(family("smollm3"), bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["no_rope_layers"] = [1]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="no_rope_layers"):
        load_model(bad)


def test_gemma3_default_pattern_without_layer_types() -> None:
    """No layer_types: every 6th layer is global (transformers' default pattern)."""
    cfg = ModelConfig.from_dict({**GEMMA3, "num_hidden_layers": 12})
    kinds = cfg.layer_kinds
    assert [i for i, k in enumerate(kinds) if k != SLIDING] == [5, 11]


# ---- the engine with mixed caches --------------------------------------------------------------
def _turns(folder: Path, prompts: list[list[int]], **kw: Any) -> list[tuple[Any, Any]]:
    """(Started, Done) of each prompt, in one engine (greedy, 3 tokens each)."""
    import queue

    from kvchat.model.runtime.engine import Engine
    from kvchat.model.runtime.events import Done, GenParams, Loaded, LoadFailed, Started

    events: queue.Queue[Any] = queue.Queue()
    engine = Engine(events.put, folder, **kw)
    try:
        ev = events.get(timeout=60)
        while not isinstance(ev, Loaded | LoadFailed):
            ev = events.get(timeout=60)
        assert isinstance(ev, Loaded), ev
        out = []
        for p in prompts:
            engine.submit(p, GenParams(max_tokens=3, ignore_eos=True))
            started = None
            while not isinstance(ev := events.get(timeout=60), Done):
                if isinstance(ev, Started):
                    started = ev
            assert ev.finish_reason == "length", ev.error
            out.append((started, ev))
        return out
    finally:
        engine.close()


def test_prompt_reuse_stays_exact_with_sliding_layers(family: Callable[[str], Path]) -> None:
    """Extending the conversation reuses every layer's cache; going back past what the
    sliding layers still hold prefills again and says why; the tokens always equal a
    run that never reuses anything."""
    folder = family("gemma3_text")
    a = [int(x) for x in IDS[0, :30]]
    first = _turns(folder, [a])[0][1]
    b = a + first.ids[:2] + [5, 6, 7]  # the cache holds a + the 2 fed reply tokens
    c = b[:-6] + [9, 9]  # differs 6 tokens back: the 16-token windows moved past that
    runs = _turns(folder, [a, b, c])
    fresh = _turns(folder, [a, b, c], reuse_prefix=False)
    (_, d1), (s2, d2), (s3, d3) = runs
    assert s2.cached_tokens == len(a) + 2 and s2.reprefill_reason is None
    assert s3.cached_tokens == 0 and "sliding-window layers (window 16)" in s3.reprefill_reason
    assert [d.ids for d in (d1, d2, d3)] == [d.ids for _, d in fresh]


def test_layer_view_summary_shows_window_and_gqa_savings(family: Callable[[str], Path]) -> None:
    from kvchat.app.tui.screens.layers import summary
    from kvchat.model.cache.kv import layer_stats

    model = load_model(family("gemma3_text"))
    cache = make_prompt_cache(model)
    model(mx.array(IDS), cache=cache)
    text = summary(layer_stats(cache, model.config))
    per = 2 * 2 * 16 * 4  # K+V × kv heads × head_dim × float32
    assert text.startswith("4 layers · ")
    assert f"3 sliding layers hold {3 * WINDOW * per // 1024} KiB" in text
    assert f"windows save {4 * SEQ / (3 * WINDOW + SEQ):.2f}x" in text
    assert "GQA saves 2.00x" in text


def test_inspect_live_with_sliding_layers(
    family: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvchat inspect --live`: bytes measured from the arrays of mixed caches equal the
    per-kind formula: 32 tokens in the global layer, 16 in each of 3 sliding ones."""
    import argparse

    from kvchat.app.cli import inspect as inspect_cmd

    p = argparse.ArgumentParser()
    inspect_cmd.add_arguments(p)
    assert inspect_cmd.run(p.parse_args(["--model", str(family("gemma3_text")), "--live",
                                         "--json"])) == 0
    live = json.loads(capsys.readouterr().out)["live"]
    per = 2 * 2 * 16 * 4  # K+V × kv heads × head_dim × float32, one layer, one token
    assert live["equal"] and live["tokens"] == 32
    assert live["measured_bytes"] == live["formula_bytes"] == per * (32 + 3 * WINDOW)


# ---- mixture of experts and latent attention -----------------------------------
def test_latent_cache_holds_the_latent_and_says_what_it_saves(
    family: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """DeepSeek-V3's cache holds kv_lora_rank + rope_dim features per token and layer;
    MHA with the same heads would hold heads × (qk + v); the GQA figure uses one KV head
    per 8 query heads (one here). Hand-computed against the tiny config (_MLA)."""
    import argparse

    from kvchat.app.cli import inspect as inspect_cmd
    from kvchat.app.tui.screens.layers import summary
    from kvchat.model.cache.kv import cache_stats, layer_stats

    model = load_model(family("deepseek_v3"))
    cache = make_prompt_cache(model)
    model(mx.array(IDS), cache=cache)
    layers, heads, f32 = 3, 4, 4
    latent = SEQ * layers * (16 + 8) * f32  # (kv_lora_rank + rope_dim) per token and layer
    mha = SEQ * layers * heads * ((16 + 8) + 16) * f32  # heads × (qk_head_dim + v_head_dim)
    s = cache_stats(cache, model.config)
    assert s.cache_bytes == latent == sum(c.nbytes for c in cache)
    assert s.mha_bytes == mha and s.gqa_saving == pytest.approx(mha / latent)
    rows = layer_stats(cache, model.config)
    assert {r["attention"] for r in rows} == {"latent"}
    assert f"MLA saves {mha / latent:.2f}x" in summary(rows)

    p = argparse.ArgumentParser()
    inspect_cmd.add_arguments(p)
    assert inspect_cmd.run(p.parse_args(["--model", str(family("deepseek_v3")), "--json",
                                         "--live"])) == 0
    out = json.loads(capsys.readouterr().out)
    table = {r["name"]: r["bytes_per_token"] for r in out["table"]}
    assert table == {"MHA": layers * heads * 40 * f32, "GQA (group 4)": layers * 40 * f32,
                     "MLA (this model)": layers * 24 * f32}
    assert out["bytes_per_token"] == layers * 24 * f32 and out["attention"] == "MLA"
    assert out["live"]["equal"] and out["layer_kinds"][0]["kind"] == "latent"


@pytest.mark.parametrize("name", families(["mixtral", "qwen2_moe", "deepseek_v3", "glm4_moe_lite",
                                           "gpt_oss", "gpt2", "llama4_text", "dbrx"]))
def test_compiled_step_serves_moe_and_latent_models(
    name: str, family: Callable[[str], Path]
) -> None:
    """The compiled decode step runs the gathered experts and the latent cache: the same
    20 greedy tokens as the plain step, and as transformers' own greedy decode."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvchat.model.runtime.generate import Progress, generate_step

    folder = family(name)
    model = load_model(folder)
    prompt = [int(x) for x in IDS[0, :8]]
    runs = []
    for compiled in (True, False):
        prog = Progress()
        runs.append(list(generate_step(model, prompt, make_prompt_cache(model), max_tokens=20,
                                       compiled=compiled, progress=prog)))
        assert prog.compiled == compiled
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # as ours: no stop, and eos not suppressed
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                          min_new_tokens=20)[0, len(prompt):].tolist()
    assert runs[0] == runs[1] == ref


def test_family_lookup_comes_before_the_generic_checks(tmp_path: Path) -> None:
    """transformers 5 writes qwen2_moe with sliding_window 0 (its flag off): it loads;
    an unknown type is always 'unknown architecture', whatever else is wrong."""
    from kvchat.model.decoder.config import load_config

    cfg = {"model_type": "qwen2_moe", "hidden_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
           "vocab_size": 256, "num_experts": 4, "num_experts_per_tok": 2,
           "moe_intermediate_size": 32, "sliding_window": 0, "use_sliding_window": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    loaded = load_config(tmp_path)
    assert loaded.sliding_window is None and loaded.moe is not None
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "bitnet"}))
    with pytest.raises(ConfigError, match="unknown architecture 'bitnet'; supported: "):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_experts_per_tok": 9}))
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "use_sliding_window": True}))
    with pytest.raises(ConfigError, match="sliding_window must be >= 1"):
        load_config(tmp_path)


@pytest.mark.slow  # a family beyond FAST
def test_missing_expert_names_the_tensor(family: Callable[[str], Path], tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    from kvchat.model.errors import ModelLoadError

    bad = tmp_path / "bad"
    shutil.copytree(family("qwen3_moe"), bad)
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.2.up_proj.weight"]
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"experts\.2\.up_proj") as e:
        load_model(bad)
    assert "\n" not in str(e.value)


@pytest.mark.slow  # a family beyond FAST
def test_dbrx_experts_that_do_not_split_name_the_tensor(
    family: Callable[[str], Path], tmp_path: Path
) -> None:
    """DBRX's w1/v1/w2 hold every expert's rows: a count that does not split evenly
    into moe_num_experts is refused with the tensor's name, in one line."""
    from safetensors.numpy import load_file, save_file

    from kvchat.model.errors import ModelLoadError

    bad = tmp_path / "bad"
    shutil.copytree(family("dbrx"), bad)
    tensors = load_file(str(bad / "model.safetensors"))
    name = "transformer.blocks.1.ffn.experts.mlp.v1"
    tensors[name] = tensors[name][:-1]
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"layers\.1\.mlp\.experts\.up_proj") as e:
        load_model(bad)
    assert "4 experts" in str(e.value) and "\n" not in str(e.value)


def test_gathered_experts_are_one_matmul_per_projection(family: Callable[[str], Path]) -> None:
    """Every routed expert of a layer is one stacked (experts, out, in) weight: the
    layer runs three gathered matmuls whatever the number of experts."""
    from kvchat.model.decoder.moe import MoE, SwitchLinear

    model = load_model(family("mixtral"))
    moe = model.layers[0].mlp
    assert isinstance(moe, MoE)
    projections = [m for _, m in moe.switch_mlp.named_modules() if isinstance(m, SwitchLinear)]
    assert len(projections) == 3 and all(p.weight.shape[0] == 4 for p in projections)


@pytest.mark.slow  # two families beyond FAST
@pytest.mark.parametrize(("wrapper", "text", "left_out"), [
    ("gemma3", "gemma3_text", "vision tower"), ("llama4", "llama4_text", "vision model")])
def test_multimodal_checkpoint_runs_its_language_model(
        wrapper: str, text: str, left_out: str, family: Callable[[str], Path]) -> None:
    model = load_model(family(wrapper))
    assert model.config.model_type == text and model.config.wrapper == wrapper
    assert f"{left_out} is not loaded" in model.config.note


@pytest.mark.slow  # a family beyond FAST
def test_llama4_chat_cache_is_saved_and_reopens_warm(family: Callable[[str], Path],
                                                    tmp_path: Path) -> None:
    """Through the real engine: a Llama 4 chat's cache (chunked layers of 16 and a global
    NoPE layer) is saved past a chunk boundary, restored whole, and the next reply equals
    the one after a cold prefill."""
    from kvchat.model.cache.kv import ChunkedKVCache
    from kvchat.model.runtime.client import EngineClient
    from kvchat.model.runtime.events import CacheRestored, CacheSaved, GenParams, Started

    folder, path = family("llama4_text"), tmp_path / "chat.kv.safetensors"
    params = GenParams(max_tokens=12, temp=0.0, ignore_eos=True)
    first = [int(i) for i in IDS[0, :20]]  # 20 + 11 fed tokens: past the first chunk
    with EngineClient(folder, timeout=60) as c:
        done = c.run(first, params)
        assert any(isinstance(x, ChunkedKVCache) for x in c.engine._chat.caches)
        c.engine.save_cache(path)
        saved = c.wait(CacheSaved)
        assert isinstance(saved, CacheSaved) and saved.error is None
        follow = first + list(done.ids) + [7, 9]
        c.reset()
        cold = c.run(follow, params)
    with EngineClient(folder, timeout=60) as c:
        c.engine.restore_cache(path)
        ev = c.wait(CacheRestored)
        warm = c.run(follow, params)
        started = [e for e in c.events if isinstance(e, Started)][-1]
    assert isinstance(ev, CacheRestored) and ev.error is None and ev.tokens == saved.tokens
    assert started.cached_tokens == saved.tokens == len(first) + len(done.ids) - 1
    assert list(warm.ids) == list(cold.ids)


@pytest.mark.parametrize("name", families(NAMES))
def test_a_batch_gives_each_row_its_logits_alone(name: str,
                                                 family: Callable[[str], Path]) -> None:
    """Three conversations of different lengths (past the sliding window where the
    family has one) prefilled in one batched step (padded to the longest, where their
    caches take padding) and decoded in batched steps (model/runtime/batch.py: shared
    K/V buffers where the family allows them, each row's own caches otherwise) give
    each row the logits of its own prefill and compiled step alone, step after step."""

    from kvchat.model.runtime.batch import Batch, BatchRow, PrefillRow
    from kvchat.model.runtime.generate import CompiledStep

    model = load_model(family(name))
    prompts = [[int(x) for x in IDS[0, :n]] for n in (9, 20, 31)]
    solo = [make_prompt_cache(model) for _ in prompts]
    want = [np.array(model(mx.array([p]), cache=c)[:, -1]) for p, c in zip(prompts, solo,
                                                                           strict=True)]
    batch = Batch(model)
    rows = [PrefillRow(make_prompt_cache(model), p) for p in prompts]
    for r in rows:
        batch.park_prefill(r)
    batch.step()
    for r, w in zip(rows, want, strict=True):
        assert r.error is None and np.abs(np.array(r.logits) - w).max() <= tolerance(w), name
        assert [c.offset for c in r.caches] == [len(r.chunk)] * len(r.caches)
    alone = [CompiledStep(model, c) for c in solo]
    if not all(s.supported for s in alone):
        pytest.skip(f"{name}: no compiled step")
    brows = [BatchRow(r.caches, True) for r in rows]
    for step in range(5):
        ids = [int(IDS[0, 32 + step + i]) for i in range(len(rows))]
        for r, y in zip(brows, ids, strict=True):
            batch.park(r, y)
        batch.step()
        for i, (r, y) in enumerate(zip(brows, ids, strict=True)):
            w = np.array(alone[i](mx.array([y], dtype=mx.int32)))
            got = np.array(r.logits)
            assert np.abs(got - w).max() <= tolerance(w), (name, step, i)
