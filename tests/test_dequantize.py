"""Quantized checkpoints run dequantized to float32 on the CPU by default (measured
faster there, see README); KVCHAT_KEEP_QUANTIZED=1 or dequantize=False keeps them
quantized. Both give the same logits up to float rounding."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest

from kvchat.model.decoder.weights import dequantize_on_load, load_model, parameter_count


@pytest.mark.parametrize("bits", [4, 8])
def test_dequantized_matches_quantized(mlx_quantized: Any, bits: int) -> None:
    folder = mlx_quantized("llama", bits)
    q = load_model(folder, dequantize=False)
    d = load_model(folder, dequantize=True)
    assert isinstance(q.layers[0].mlp.up_proj, nn.QuantizedLinear)
    assert type(d.layers[0].mlp.up_proj) is nn.Linear
    assert d.layers[0].mlp.up_proj.weight.dtype == mx.float32
    assert d.dequantized and not q.dequantized
    assert d.quantization == q.quantization  # the checkpoint's format is still known
    assert parameter_count(d) == parameter_count(q)
    x = mx.array([[1, 17, 99, 5, 42, 200]])
    assert mx.allclose(q(x), d(x), atol=2e-4).item()


def test_cpu_default_dequantizes_unless_asked_not_to(mlx_quantized: Any, monkeypatch) -> None:
    folder = mlx_quantized("llama", 4)
    if mx.default_device() != mx.cpu:
        pytest.skip("the dequantize default applies to the CPU backend")
    monkeypatch.delenv("KVCHAT_KEEP_QUANTIZED", raising=False)
    assert load_model(folder).dequantized
    monkeypatch.setenv("KVCHAT_KEEP_QUANTIZED", "1")
    assert not load_model(folder).dequantized


def test_no_dequantize_when_it_would_not_fit(monkeypatch) -> None:
    monkeypatch.delenv("KVCHAT_KEEP_QUANTIZED", raising=False)
    monkeypatch.setattr("kvchat.model.decoder.weights._available_memory", lambda: 1_000_000)
    assert not dequantize_on_load(1_000_000, mx.float32)  # 4 MB of float32 > half of 1 MB
    assert dequantize_on_load(100_000, mx.float32) == (mx.default_device() == mx.cpu)
