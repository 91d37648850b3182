"""Facts about the decoder's building blocks, checked against hand computations."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from kvchat.model.decoder import layers
from kvchat.model.decoder.config import ModelConfig
from kvchat.model.decoder.layers import MLP, Attention, RMSNorm, RoPE
from kvchat.model.decoder.rope import RopeConfig

X = [2.4, -1.2, 0.8, 3.1]


def tiny_config(heads: int = 4, kv_heads: int = 4, **extra: object) -> ModelConfig:
    return ModelConfig.from_dict(
        {
            "model_type": "llama",
            "hidden_size": 32,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "num_hidden_layers": 1,
            "intermediate_size": 48,
            "vocab_size": 16,
            **extra,
        }
    )


def np_(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32), dtype=np.float64)


# --- RMSNorm vs LayerNorm -------------------------------------------------------------


def test_rms_norm_by_hand() -> None:
    # mean of squares = (5.76 + 1.44 + 0.64 + 9.61) / 4 = 17.45 / 4 = 4.3625
    # RMS = sqrt(4.3625 + 1e-6) = 2.0886601
    # y = x / RMS = [2.4, -1.2, 0.8, 3.1] / 2.0886601
    expected = [1.1490620, -0.5745310, 0.3830207, 1.4842051]
    y = RMSNorm(4, eps=1e-6)(mx.array(X))
    np.testing.assert_allclose(np_(y), expected, rtol=1e-6, atol=1e-6)


def test_rms_norm_scales_but_does_not_center() -> None:
    x = mx.array(X)
    rms_out = np_(RMSNorm(4, eps=1e-6)(x))
    ln_out = np_(nn.LayerNorm(4, eps=1e-6, affine=False)(x))
    assert abs(ln_out.mean()) < 1e-6  # LayerNorm subtracts the mean
    # RMSNorm keeps it: mean of y = 2.44177 / 4 = 0.6104
    assert rms_out.mean() == pytest.approx(0.6104392, abs=1e-5)
    assert math.sqrt((rms_out**2).mean()) == pytest.approx(1.0, abs=1e-6)


def test_rms_norm_weight_multiplies() -> None:
    norm = RMSNorm(4, eps=1e-6)
    norm.weight = mx.array([1.0, 2.0, -1.0, 0.5])
    expected = np.array([1.1490620, -0.5745310, 0.3830207, 1.4842051]) * [1, 2, -1, 0.5]
    np.testing.assert_allclose(np_(norm(mx.array(X))), expected, rtol=1e-6, atol=1e-6)


# --- SiLU -----------------------------------------------------------------------------


def test_silu_minimum() -> None:
    """SiLU(x) = x * sigmoid(x) dips below zero: min ≈ -0.278 at x ≈ -1.278."""
    grid = mx.arange(-5.0, 1.0, 1e-4)
    y = layers.nn.silu(grid)  # the activation our MLP calls
    i = int(mx.argmin(y).item())
    assert float(grid[i].item()) == pytest.approx(-1.2785, abs=1e-3)
    assert float(y[i].item()) == pytest.approx(-0.2785, abs=1e-3)


# --- RoPE -----------------------------------------------------------------------------

HEAD_DIM = 16


def rope_score(rope: RoPE, q: mx.array, k: mx.array, q_pos: int, k_pos: int) -> float:
    """q · k after rotating q to position q_pos and k to k_pos."""
    qr = rope.rotate(q.reshape(1, 1, 1, -1), offset=q_pos)
    kr = rope.rotate(k.reshape(1, 1, 1, -1), offset=k_pos)
    return float((qr * kr).sum().item())


@pytest.mark.parametrize(
    "rope_cfg",
    [
        RopeConfig(),
        RopeConfig(theta=500000.0, type="llama3", factor=8.0, original_max_position_embeddings=32),
        RopeConfig(type="linear", factor=4.0),
    ],
    ids=["default", "llama3", "linear"],
)
def test_rope_score_depends_only_on_distance(rope_cfg: RopeConfig) -> None:
    rng = np.random.default_rng(0)
    q = mx.array(rng.standard_normal(HEAD_DIM).astype(np.float32))
    k = mx.array(rng.standard_normal(HEAD_DIM).astype(np.float32))
    rope = RoPE(HEAD_DIM, rope_cfg)
    base = rope_score(rope, q, k, 7, 3)
    for shift in (1, 10, 100):
        assert rope_score(rope, q, k, 7 + shift, 3 + shift) == pytest.approx(base, abs=1e-4)
    for other_k in (0, 2, 5):  # distance 7, 5, 2 instead of 4
        assert abs(rope_score(rope, q, k, 7, other_k) - base) > 1e-2


def test_rope_rotation_keeps_norm_and_position_zero_is_identity() -> None:
    x = mx.array(np.random.default_rng(1).standard_normal((1, 1, 1, HEAD_DIM)).astype(np.float32))
    rope = RoPE(HEAD_DIM, RopeConfig())
    np.testing.assert_allclose(np_(rope.rotate(x, offset=0)), np_(x), atol=1e-6)
    rotated = np_(rope.rotate(x, offset=37))
    assert np.linalg.norm(rotated) == pytest.approx(np.linalg.norm(np_(x)), rel=1e-5)


# --- attention: MHA, GQA, MQA through one class ------------------------------------------


def np_rope(x: np.ndarray, theta: float = 10000.0) -> np.ndarray:
    """HF "rotate_half" RoPE, positions 0..T-1, x: (B, H, T, D)."""
    d = x.shape[-1]
    inv_freq = theta ** (-np.arange(0, d, 2) / d)
    angles = np.arange(x.shape[2])[:, None] * inv_freq[None]  # (T, D/2)
    cos = np.concatenate([np.cos(angles)] * 2, axis=-1)
    sin = np.concatenate([np.sin(angles)] * 2, axis=-1)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + np.concatenate([-x2, x1], axis=-1) * sin


def naive_attention(attn: Attention, x: np.ndarray) -> np.ndarray:
    """Attention with K/V repeated explicitly to every query head, causal mask, softmax."""
    B, T, _ = x.shape
    h, kv, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim

    def proj(layer: nn.Linear, heads: int) -> np.ndarray:
        y = x @ np_(layer.weight).T
        if "bias" in layer:
            y = y + np_(layer.bias)
        return y.reshape(B, T, heads, hd).transpose(0, 2, 1, 3)

    q = np_rope(proj(attn.q_proj, h))
    k = np_rope(proj(attn.k_proj, kv))
    v = proj(attn.v_proj, kv)
    k, v = np.repeat(k, h // kv, axis=1), np.repeat(v, h // kv, axis=1)  # head i -> kv i // g
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(hd)
    scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = (p @ v).transpose(0, 2, 1, 3).reshape(B, T, h * hd)
    out = out @ np_(attn.o_proj.weight).T
    return out + np_(attn.o_proj.bias) if "bias" in attn.o_proj else out


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["MHA", "GQA", "MQA"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "qkv_bias"])
def test_attention_matches_naive_repeat_kv(kv_heads: int, bias: bool) -> None:
    mx.random.seed(kv_heads)
    attn = Attention(tiny_config(4, kv_heads, attention_bias=bias))
    head_dim = 32 // 4
    # K/V are projected to n_kv_heads only; never repeated to n_heads in the model
    assert attn.k_proj.weight.shape == (kv_heads * head_dim, 32)
    x = np.random.default_rng(kv_heads).standard_normal((2, 9, 32)).astype(np.float32)
    ours = np_(attn(mx.array(x), mask="causal"))
    np.testing.assert_allclose(ours, naive_attention(attn, x.astype(np.float64)), atol=1e-5)


def test_attention_is_causal() -> None:
    """Changing a later token leaves earlier outputs unchanged."""
    mx.random.seed(0)
    attn = Attention(tiny_config(4, 2))
    x = np.random.default_rng(0).standard_normal((1, 6, 32)).astype(np.float32)
    y = x.copy()
    y[0, 4:] += 1.0
    a, b = np_(attn(mx.array(x), mask="causal")), np_(attn(mx.array(y), mask="causal"))
    np.testing.assert_allclose(a[0, :4], b[0, :4], atol=1e-6)
    assert np.abs(a[0, 4:] - b[0, 4:]).max() > 1e-3


# --- SwiGLU ---------------------------------------------------------------------------


def test_swiglu_mlp_by_hand() -> None:
    mx.random.seed(3)
    mlp = MLP(tiny_config())
    x = np.random.default_rng(3).standard_normal((5, 32))
    gate = x @ np_(mlp.gate_proj.weight).T
    up = x @ np_(mlp.up_proj.weight).T
    silu = gate / (1 + np.exp(-gate))  # SiLU on the gate path only
    expected = (silu * up) @ np_(mlp.down_proj.weight).T
    ours = np_(mlp(mx.array(x.astype(np.float32))))
    np.testing.assert_allclose(ours, expected, atol=1e-5)


def test_logits_to_keep_equals_the_tail_of_all_logits():
    import mlx.core as mx

    from kvchat.model.decoder.config import ModelConfig
    from kvchat.model.decoder.transformer import Transformer

    cfg = ModelConfig.from_dict({
        "model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
        "vocab_size": 100,
    })
    mx.random.seed(0)
    m = Transformer(cfg)
    tokens = mx.array([[5, 9, 3, 7, 1, 2]])
    full = m(tokens)
    tail = m(tokens, logits_to_keep=2)
    assert tail.shape == (1, 2, 100)
    assert mx.allclose(tail, full[:, -2:, :], atol=1e-6).item()
