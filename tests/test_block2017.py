"""The 2017 block (`python -m kvchat.model.training train --block 2017`): post-LayerNorm,
ReLU FFN, sinusoidal positions, MHA. Its forward pass against a NumPy transcription of
"Attention Is All You Need" (decoder-only), decode through the caches, a short training
run that learns, the side-by-side table, and how `explain` names it."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from kvchat.model.cache.kv import make_prompt_cache
from kvchat.model.decoder.config import ModelConfig
from kvchat.model.decoder.transformer import Transformer
from kvchat.model.explain.anatomy import explain
from kvchat.model.runtime.generate import generate_step
from kvchat.model.training import loop as L

CFG = {"model_type": "kvchat2017", "hidden_size": 32, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 48,
       "vocab_size": 40, "max_position_embeddings": 64, "rms_norm_eps": 1e-5}


@pytest.fixture(scope="module")
def model() -> Transformer:
    mx.random.seed(3)
    m = Transformer(ModelConfig.from_dict(CFG))
    # LayerNorm starts at weight 1, bias 0: perturb them so the reference must use both
    m.update({"model": {"layers": [
        {k: {"weight": 1 + 0.1 * mx.random.normal((32,)), "bias": 0.1 * mx.random.normal((32,))}
         for k in ("post_attention_layernorm", "post_feedforward_layernorm")}
        for _ in range(2)]}})
    mx.eval(m.parameters())
    return m


def _numpy_forward(m: Transformer, ids: list[int]) -> np.ndarray:
    P = {k: np.array(v, dtype=np.float64) for k, v in tree_flatten(m.parameters())}
    T, d, H = len(ids), CFG["hidden_size"], CFG["num_attention_heads"]
    hd = d // H
    pos = np.arange(T)[:, None] / 10000 ** (np.arange(0, d, 2)[None] / d)
    pe = np.zeros((T, d))
    pe[:, 0::2], pe[:, 1::2] = np.sin(pos), np.cos(pos)
    x = P["model.embed_tokens.weight"][ids] + pe

    def ln(v: np.ndarray, name: str) -> np.ndarray:
        mu, var = v.mean(-1, keepdims=True), v.var(-1, keepdims=True)
        normed = (v - mu) / np.sqrt(var + CFG["rms_norm_eps"])
        return normed * P[name + ".weight"] + P[name + ".bias"]

    for i in range(CFG["num_hidden_layers"]):
        p = f"model.layers.{i}."

        def proj(name: str, v: np.ndarray, p: str = p) -> np.ndarray:
            return v @ P[p + name + ".weight"].T

        q, k, v = (proj(f"self_attn.{n}_proj", x).reshape(T, H, hd).transpose(1, 0, 2)
                   for n in "qkv")
        s = q @ k.transpose(0, 2, 1) / np.sqrt(hd) + np.triu(np.full((T, T), -np.inf), 1)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        o = proj("self_attn.o_proj", (a @ v).transpose(1, 0, 2).reshape(T, d))
        h = ln(x + o, p + "post_attention_layernorm")
        f = proj("mlp.down_proj", np.maximum(proj("mlp.up_proj", h), 0))
        x = ln(h + f, p + "post_feedforward_layernorm")
    x = ln(x, "model.norm")  # the final norm, LayerNorm too
    return x @ P["lm_head.weight"].T


def test_forward_matches_numpy(model: Transformer) -> None:
    ids = [3, 17, 5, 9, 22, 1, 30, 8]
    ours = np.array(model(mx.array([ids]))[0])
    ref = _numpy_forward(model, ids)
    np.testing.assert_allclose(ours, ref, atol=2e-4, rtol=2e-4)


def test_decode_through_caches_equals_the_full_pass(model: Transformer) -> None:
    ids = [3, 17, 5, 9, 22, 1, 30, 8, 2, 11]
    full = np.array(model(mx.array([ids])))
    cache = make_prompt_cache(model)
    steps = np.array(mx.concatenate([model(mx.array([[t]]), cache=cache) for t in ids], 1))
    np.testing.assert_allclose(steps, full, atol=1e-5)
    compiled = list(generate_step(model, [3, 17], make_prompt_cache(model, max_kv_size=8),
                                  max_tokens=20))
    plain = list(generate_step(model, [3, 17], make_prompt_cache(model, max_kv_size=8),
                               max_tokens=20, compiled=False))
    assert compiled == plain  # sinusoidal positions follow the rotating cache's offset


def test_explain_names_the_2017_block() -> None:
    data = explain(ModelConfig.from_dict(CFG), dtype_bytes=2)
    b = data["block"]
    assert b["pipeline"] == ["x + sinusoid", "attention", "+", "LayerNorm", "FFN", "+",
                             "LayerNorm"]
    diffs = " | ".join(b["differences_from_llama"])
    for text in ("LayerNorm", "post-LN", "no gate", "sinusoidal"):
        assert text in diffs
    assert (b["norm"]["kind"], b["ffn"]["kind"], b["attention"]["kind"]) == (
        "LayerNorm", "ReLU FFN", "MHA")
    assert data["worked"]["rope_relative"] is None  # no RoPE layer to show it on


def test_training_switch_and_table(tmp_path: Path) -> None:
    from kvchat.model.training import data as D
    from kvchat.model.training.blocks import compare_blocks

    data = tmp_path / "data"
    D.build_data(data, n_train=300, n_val=40, vocab_size=400, seed=0)
    c24, c17 = (L.model_config("tiny", 400, 64, b) for b in ("2024", "2017"))
    assert c17["num_key_value_heads"] == c17["num_attention_heads"] == 4
    assert c24["num_key_value_heads"] == 2
    metas = {}
    for block in ("2024", "2017"):
        args = L.TrainArgs(data=str(data), run=str(tmp_path / block), steps=20, preset="tiny",
                           batch=4, seq_len=64, warmup=3, eval_every=0, log_every=10,
                           block=block)
        metas[block] = L.train(args)
        losses = [loss for _, loss in metas[block]["history"]]
        assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5  # it learns
    # SwiGLU's three matrices vs the 2017 FFN's two, 1.5x wider: the same weights
    # per layer: MHA's k and v are 64x64 instead of 64x32, two LayerNorm biases of 64;
    # plus the final norm's bias
    assert metas["2017"]["params"] - metas["2024"]["params"] == 2 * (2 * 64 * 32 + 2 * 64) + 64
    table = compare_blocks([tmp_path / "2017", tmp_path / "2024"], gen_tokens=8)
    rows = [r for r in table.splitlines() if r.startswith("| 20")]
    assert [r.split("|")[1].strip() for r in rows] == ["2017", "2024"]
    kv = [int(r.split("|")[5].replace(",", "")) for r in rows]
    assert kv == [2 * 2 * 4 * 16 * 2, 2 * 2 * 2 * 16 * 2]  # MHA holds twice GQA's K/V
