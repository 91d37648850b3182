"""model/decoder/fast_exp.py against MLX's own ops and float64 numpy: where exp goes
through `mx.power` (an x86 CPU), every function is MLX's up to float rounding; elsewhere
it is MLX's op itself, bit for bit."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from kvchat.model.decoder import fast_exp


@pytest.fixture(params=[True, False], ids=["power", "mlx"])
def power(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Both ways on any machine: `_X86` decides with the device (a CPU here)."""
    monkeypatch.setattr(fast_exp, "_X86", request.param)
    assert fast_exp.power_exp() is request.param
    return request.param


def _close(a: mx.array, b: mx.array, power: bool, rtol: float = 2e-6,
           atol: float = 1e-7) -> None:
    if power:
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=rtol, atol=atol)
    else:  # MLX's own op: the same bits
        assert mx.array_equal(a, b, equal_nan=True).item()


def test_exp_is_as_close_to_the_true_exp_as_mlx_exp() -> None:
    x = np.concatenate([np.linspace(-80, 88, 20001), [0.0, 1.0, -1.0]]).astype(np.float32)
    want = np.exp(x.astype(np.float64))
    # x·log2 e is rounded to float32 first (as MLX's exp does): about |x|·2^-24 relative
    bound = 1.25 * np.abs(x) * 2.0**-24 + 4 * 2.0**-24
    for exp in (fast_exp.exp, mx.exp):
        got = np.array(exp(mx.array(x)), dtype=np.float64)
        assert (np.abs(got - want) / want <= bound).all(), exp
    assert fast_exp.exp(mx.array([-mx.inf, mx.inf, 0.0])).tolist() == [0.0, math.inf, 1.0]


def test_activations_match_mlx(power: bool) -> None:
    x = mx.random.normal((4, 257), key=mx.random.key(0)) * 6
    _close(fast_exp.sigmoid(x), mx.sigmoid(x), power)
    _close(fast_exp.silu(x), nn.silu(x), power, atol=1e-6)
    _close(fast_exp.gelu_approx(x), nn.gelu_approx(x), power, atol=1e-6)
    _close(fast_exp.tanh(x), mx.tanh(x), power, atol=1e-6)
    _close(fast_exp.softmax(x), mx.softmax(x, axis=-1, precise=True), power)
    half = x.astype(mx.float16)
    assert fast_exp.softmax(half).dtype == mx.float16
    _close(fast_exp.softmax(half).astype(mx.float32),
           mx.softmax(half, axis=-1, precise=True).astype(mx.float32), power, rtol=1e-3,
           atol=1e-4)


@pytest.mark.parametrize("heads,kv", [(4, 4), (8, 2), (6, 1)], ids=["MHA", "GQA", "MQA"])
@pytest.mark.parametrize("mask", ["none", "causal", "bool", "bool_rows", "additive",
                                  "per_head"])
@pytest.mark.parametrize("sinks", [False, True])
def test_attention_matches_mlx_sdpa(power: bool, heads: int, kv: int, mask: str,
                                    sinks: bool) -> None:
    B, T, S, D = 2, 3, 11, 16
    keys = mx.random.split(mx.random.key(1), 6)
    q = mx.random.normal((B, heads, T, D), key=keys[0])
    k = mx.random.normal((B, kv, S, D), key=keys[1])
    v = mx.random.normal((B, kv, S, D), key=keys[2])
    m: str | mx.array | None = {
        "none": None,
        "causal": "causal",
        "bool": mx.random.uniform(shape=(T, S), key=keys[3]) > 0.3,
        "bool_rows": mx.random.uniform(shape=(B, 1, 1, S), key=keys[3]) > 0.3,
        "additive": mx.random.normal((1, 1, T, S), key=keys[3]),
        "per_head": mx.random.uniform(shape=(B, heads, T, S), key=keys[3]) > 0.2,
    }[mask]
    s = mx.random.normal((heads,), key=keys[4]) if sinks else None
    scale = D**-0.5
    got = fast_exp.attention(q, k, v, scale=scale, mask=m, sinks=s)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=m, sinks=s)
    assert got.shape == want.shape == (B, heads, T, D)
    _close(got, want, power, rtol=1e-5, atol=2e-6)


def test_power_exp_only_where_mlx_computes_on_an_x86_cpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU (MLX's CUDA backend on an x86 host, Metal) and an ARM CPU keep MLX's ops."""
    monkeypatch.setattr(fast_exp, "_X86", True)
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.cpu))
    assert fast_exp.power_exp()
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    assert not fast_exp.power_exp()
    x = mx.array([-3.0, 0.5, 2.0])
    assert mx.array_equal(fast_exp.exp(x), mx.exp(x)).item()  # MLX's op itself
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.cpu))
    monkeypatch.setattr(fast_exp, "_X86", False)  # an ARM CPU
    assert not fast_exp.power_exp()
