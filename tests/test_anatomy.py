"""`kvchat explain` / model/explain/anatomy.py: every annotation against config.json, every worked
number against an independent NumPy computation (or the design's hand-computed figure)."""

from __future__ import annotations

import io
import json
import math
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvchat import metal_kernels
from kvchat.app.main import main
from kvchat.model.decoder.config import ModelConfig
from kvchat.model.explain.anatomy import explain, render_text

MINI = Path(__file__).resolve().parents[1] / "assets" / "kvchat-mini"
GiB = 1024**3


@pytest.fixture(scope="module")
def mini() -> dict[str, Any]:
    """`kvchat explain --model assets/kvchat-mini --json`, through the real entry point."""
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = main(["explain", "--model", str(MINI), "--json"])
    assert rc == 0
    return json.loads(buf.getvalue())


@pytest.fixture(scope="module")
def mini_config() -> dict[str, Any]:
    return json.loads((MINI / "config.json").read_text())


def test_annotations_come_from_the_config(mini: dict[str, Any],
                                          mini_config: dict[str, Any]) -> None:
    c, b = mini_config, mini["block"]
    assert b["pipeline"] == ["x", "norm", "RoPE", "attention", "+", "norm", "FFN", "+"]
    assert b["differences_from_llama"] == []
    assert b["norm"]["kind"] == "RMSNorm" and b["norm"]["placement"] == "pre"
    assert b["norm"]["eps"] == c["rms_norm_eps"]
    f = b["ffn"]
    assert (f["kind"], f["activation"]) == ("SwiGLU", "silu")
    assert (f["hidden"], f["intermediate"]) == (c["hidden_size"], c["intermediate_size"])
    assert f"{c['hidden_size']} → {c['intermediate_size']}" in f["gate"]
    p = b["positions"]
    assert p["base"] == c["rope_theta"] and p["scaling"] == "default"
    assert p["rotary_dims"] == p["head_dim"] == c["head_dim"] and p["nope_layers"] == []
    a = b["attention"]
    assert (a["query_heads"], a["kv_heads"], a["G"]) == (
        c["num_attention_heads"], c["num_key_value_heads"], c["num_key_value_heads"])
    assert a["queries_per_group"] == c["num_attention_heads"] // c["num_key_value_heads"]
    assert a["kind"] == "GQA" and math.isclose(a["scale"], c["head_dim"] ** -0.5)
    assert a["layer_kinds"] == [{"kind": "global", "window": None,
                                 "layers": list(range(c["num_hidden_layers"]))}]
    assert mini["kernels"] == metal_kernels.backend()


def test_norm_numbers_match_numpy(mini: dict[str, Any], mini_config: dict[str, Any]) -> None:
    n = mini["worked"]["norms"]
    x = np.array([2.4, -1.2, 0.8, 3.1], dtype=np.float64)
    eps = mini_config["rms_norm_eps"]  # the worked example uses the model's own eps
    assert (n["eps"], n["eps_from"]) == (eps, "model")
    rms = x / np.sqrt(np.mean(x * x) + eps)
    ln = (x - x.mean()) / np.sqrt(x.var() + eps)
    np.testing.assert_allclose(n["rmsnorm"]["y"], rms, rtol=1e-5)
    np.testing.assert_allclose(n["layernorm"]["y"], ln, rtol=1e-5, atol=1e-6)
    assert abs(n["layernorm"]["mean"]) < 1e-6  # LayerNorm centres
    assert n["rmsnorm"]["mean"] == pytest.approx(rms.mean(), rel=1e-5)  # RMSNorm does not
    assert n["rmsnorm"]["mean"] > 0.5
    assert n["rmsnorm"]["rms"] == pytest.approx(1.0, abs=1e-5)
    assert n["layernorm"]["rms"] == pytest.approx(1.0, abs=1e-5)


def _dial_check(d: dict[str, Any], dims: int, base: float, gap: int) -> None:
    theta = base ** (-np.arange(0, dims, 2) / dims)
    got = np.array([r["theta"] for r in d["pairs"]])
    np.testing.assert_allclose(got, theta, rtol=1e-4)
    np.testing.assert_allclose([r["cos_gap"] for r in d["pairs"]], np.cos(gap * theta),
                               atol=2e-6)


def test_rope_dials_seed_and_model(mini: dict[str, Any], mini_config: dict[str, Any]) -> None:
    w = mini["worked"]
    _dial_check(w["rope_seed"], 8, 10000.0, 3)
    cos = [r["cos_gap"] for r in w["rope_seed"]["pairs"]]
    assert cos[0] == pytest.approx(-0.98999, abs=1e-4) and cos[-1] == pytest.approx(1.0, abs=1e-5)
    _dial_check(w["rope_model"], mini_config["head_dim"], mini_config["rope_theta"], 3)


def test_scaled_rope_dials_are_the_scaled_schedule() -> None:
    """llama3 scaling: the dials are transformers' scaled inverse frequencies (NumPy)."""
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32}
    cfg = ModelConfig.from_dict({
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 64,
        "vocab_size": 16, "rope_scaling": rope})
    d = explain(cfg, dtype_bytes=2, gap=5)["worked"]["rope_model"]
    inv = 500000.0 ** (-np.arange(0, 32, 2) / 32)
    wavelen = 2 * np.pi / inv
    smooth = (32 / wavelen - 1.0) / (4.0 - 1.0)
    ref = np.where(wavelen > 32, inv / 8, inv)
    mid = (wavelen >= 8) & (wavelen <= 32)
    ref = np.where(mid, (1 - smooth) * inv / 8 + smooth * inv, ref)
    np.testing.assert_allclose([r["theta"] for r in d["pairs"]], ref, rtol=1e-4)
    assert d["type"] == "llama3"


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x) + eps) * w


def _rotate(v: np.ndarray, pos: int, base: float) -> np.ndarray:
    d = v.shape[0]
    inv = base ** (-np.arange(0, d, 2) / d)
    a, b = v[: d // 2], v[d // 2 :]
    c, s = np.cos(pos * inv), np.sin(pos * inv)
    return np.concatenate([a * c - b * s, a * s + b * c])


def test_relative_position_demo_matches_numpy(mini: dict[str, Any],
                                              mini_config: dict[str, Any]) -> None:
    """q·k of the model's own layer-0 q and k at (2, 5) and (102, 105), recomputed in
    NumPy from the (dequantized) weights."""
    from kvchat.model.decoder.weights import load_model

    rel = mini["worked"]["rope_relative"]
    assert rel["equal"] and rel["layer"] == 0
    c = mini_config
    model = load_model(MINI)
    blk = model.model.layers[0]
    emb = np.array(model.model.embed_tokens.weight[c["bos_token_id"]], dtype=np.float64)
    x = _rms(emb, np.array(blk.input_layernorm.weight, dtype=np.float64), c["rms_norm_eps"])
    hd = c["head_dim"]
    q = np.array(blk.self_attn.q_proj.weight, dtype=np.float64)[:hd] @ x
    k = np.array(blk.self_attn.k_proj.weight, dtype=np.float64)[:hd] @ x
    for row in rel["pairs"]:
        ref = _rotate(q, row["q_pos"], c["rope_theta"]) @ _rotate(k, row["k_pos"], c["rope_theta"])
        assert row["dot"] == pytest.approx(ref, rel=1e-4, abs=1e-4)
    assert rel["difference"] <= rel["tolerance"]


def test_silu_minimum_matches_numpy(mini: dict[str, Any]) -> None:
    x = -1.0
    for _ in range(50):  # Newton on d/dx x·σ(x) = σ(1 + x(1 − σ)) = 0
        s = 1 / (1 + math.exp(-x))
        g = 1 + x * (1 - s)
        dg = (1 - s) - x * s * (1 - s)
        x -= g / dg
    y = x / (1 + math.exp(-x))
    m = mini["worked"]["silu_minimum"]
    assert m["x"] == pytest.approx(x, abs=2e-4) and m["y"] == pytest.approx(y, abs=1e-7)
    assert round(m["y"], 3) == -0.278 and round(m["x"], 2) == -1.28


def test_cache_figures(mini: dict[str, Any], mini_config: dict[str, Any]) -> None:
    c70 = mini["worked"]["cache_70b"]
    assert c70["bytes_per_token"] == 327_680
    at = {r["context"]: r for r in c70["at"]}
    assert at[8192]["bytes"] == 2.5 * GiB and at[8192]["mha_bytes"] == 20 * GiB
    assert at[131072]["bytes"] == 40 * GiB
    assert [(r["name"], r["G"]) for r in c70["wiring"]] == [("MHA", 64), ("GQA", 8), ("MQA", 1)]
    c = mini_config
    dtype_bytes = mini["worked"]["cache_model"]["dtype_bytes"]
    assert dtype_bytes in (2, 4)  # what this backend computes a float16 checkpoint in
    per = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * dtype_bytes
    top = c["max_position_embeddings"]
    cm = mini["worked"]["cache_model"]
    assert cm["bytes_per_token"] == per and cm["bytes_at_max"] == per * top
    rows = {r["name"]: r for r in mini["what_if"]}
    heads = c["num_attention_heads"]
    assert rows["MHA"]["G"] == heads and rows["MQA"]["G"] == 1
    assert rows["GQA"]["this_model"] and rows["GQA"]["G"] == c["num_key_value_heads"]
    for r in rows.values():
        each = 2 * c["num_hidden_layers"] * r["G"] * c["head_dim"] * dtype_bytes
        assert r["bytes_per_token"] == each
        assert r["bytes_at_context"] == each * r["context"] and r["bytes_at_max"] == each * top


@pytest.mark.parametrize("family,expected", [
    ({"model_type": "gemma2", "num_hidden_layers": 2, "head_dim": 16, "sliding_window": 8},
     ["offset RMSNorm", "sandwich norms", "GeGLU", "soft-capped: 50",
      "sliding-window attention on 1 of 2 layers"]),
    ({"model_type": "phi3", "num_hidden_layers": 2}, ["fused projections"]),
    # a schedule that changes with the sequence's length: one sequence, one schedule
    ({"model_type": "phi3", "num_hidden_layers": 2, "partial_rotary_factor": 0.5,
      "original_max_position_embeddings": 32, "max_position_embeddings": 128,
      "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 4,
                       "long_factor": [2.0] * 4}},
     ["longrope RoPE scaling", "partial rotary: 8 of 16 dims"]),
    ({"model_type": "olmo2", "num_hidden_layers": 2}, ["post-norm", "q/k RMSNorm over"]),
])
def test_family_differences_are_named(family: dict[str, Any], expected: list[str]) -> None:
    cfg = ModelConfig.from_dict({"hidden_size": 64, "num_attention_heads": 4,
                                 "num_key_value_heads": 1, "intermediate_size": 96,
                                 "vocab_size": 32, **family})
    data = explain(cfg, dtype_bytes=2, context=10)
    diffs = " | ".join(data["block"]["differences_from_llama"])
    for text in expected:
        assert text in diffs
    assert data["block"]["attention"]["kind"] == "MQA"
    assert data["worked"]["rope_relative"]["equal"]  # seeded q, k through the schedule
    if cfg.block == "post":
        assert data["block"]["pipeline"][:3] == ["x", "RoPE", "attention"]
    text = render_text(data)
    assert "what if" in text and "MHA" in text


def test_explain_numbers_do_not_depend_on_the_backend() -> None:
    cfg = ModelConfig.from_dict({"model_type": "llama", "hidden_size": 32,
                                 "num_hidden_layers": 1, "num_attention_heads": 2,
                                 "intermediate_size": 32, "vocab_size": 8})
    with metal_kernels.using("ops"):
        ops = explain(cfg, dtype_bytes=2)
    with metal_kernels.using("fast"):
        fast = explain(cfg, dtype_bytes=2)
    assert (ops["kernels"], fast["kernels"]) == ("ops", "fast")
    np.testing.assert_allclose(ops["worked"]["norms"]["rmsnorm"]["y"],
                               fast["worked"]["norms"]["rmsnorm"]["y"], rtol=1e-6)


def test_text_says_each_figure_once_and_whose_eps(mini: dict[str, Any],
                                                  mini_config: dict[str, Any]) -> None:
    """At the default context (the model's maximum) the cache figure and the what-if
    table have one column, not the same number twice; the norm example names its eps."""
    top = mini_config["max_position_embeddings"]
    text = render_text(mini)
    assert mini["what_if"][0]["context"] == mini["what_if"][0]["max_context"] == top
    assert f"    at {top:,} tokens: " in text and f", at {top:,}" not in text
    assert "(its maximum context)" in text
    table = text.split("what if: the same model with another G\n", 1)[1].splitlines()
    assert table[0].split() == ["G", "B/token", "at", f"{top:,}", "(the", "maximum", "context)"]
    for row in table[1:4]:
        # name, G, B/token, the bytes at the context ("1.5 MiB"): one figure per row
        assert len(row.removesuffix("  ← this model").split()) == 5, row
    assert f"eps {mini_config['rms_norm_eps']:g} (the model's)" in text


def test_text_at_a_shorter_context_has_both_columns() -> None:
    data = explain(ModelConfig.from_dict(json.loads((MINI / "config.json").read_text())),
                   dtype_bytes=4, context=100)
    text = render_text(data)
    top = data["what_if"][0]["max_context"]
    assert "    at 100 tokens: " in text and f", at {top:,} (its maximum): " in text
    header = text.split("what if: the same model with another G\n", 1)[1].splitlines()[0]
    assert header.split() == ["G", "B/token", "at", "100", "at", f"{top:,}", "(max)"]


def test_explain_as_a_2017_block() -> None:
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main(["explain", "--model", str(MINI), "--block", "2017", "--json"]) == 0
    data = json.loads(buf.getvalue())
    c = json.loads((MINI / "config.json").read_text())
    a = data["block"]["attention"]
    assert (a["kind"], a["kv_heads"]) == ("MHA", c["num_attention_heads"])
    assert data["block"]["norm"]["kind"] == "LayerNorm"
    assert data["block"]["ffn"]["intermediate"] == c["intermediate_size"] * 3 // 2
    # the widened FFN is explained with the model's own numbers, in the singular for G = 1
    d, f = c["hidden_size"], c["intermediate_size"]
    text = render_text(data)
    assert (f"size:   {f * 3 // 2} = 1.5 × the loaded model's SwiGLU width {f}"
            f" (the 2017 paper used 4 × d_model = {4 * d})") in text
    assert (f"so 2 matrices of {d} × {f * 3 // 2} hold as many weights as SwiGLU's 3"
            f" of {d} × {f}") in text
    assert 2 * d * (f * 3 // 2) == 3 * d * f  # what the sentence claims
    assert ", 1 query per group," in text and "1 queries" not in text
    dtype_bytes = data["worked"]["cache_model"]["dtype_bytes"]
    assert data["worked"]["cache_model"]["bytes_per_token"] == (
        2 * c["num_hidden_layers"] * c["num_attention_heads"] * c["head_dim"] * dtype_bytes)
