"""Whole models on each kernel backend: the same logits with `KVCHAT_KERNELS=ops` as with
`fast`; on Apple silicon the custom kernels (`metal`) against `fast`; and a whole prompt
prefilled with every RMSNorm / fused residual norm / RoPE call executed by the CPU Metal
emulator on the shipped `.metal` sources (the 20-token greedy decode on the emulator is
in tests/test_emulator_kernels.py).

Tolerance for logits: max |a - b| <= 1e-4 * max(1, max |b|) (float32 models; the kernels
differ only in summation order and in how the rotary angle is rounded, ~1e-7 relative).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from kvchat import metal_kernels
from kvchat.metal_kernels.metal import MetalBackend
from kvchat.model import load_model
from kvchat.model.cache.kv import make_prompt_cache

IDS = np.random.default_rng(99).integers(3, 256, size=(1, 40))


def tolerance(ref: np.ndarray) -> float:
    return 1e-4 * max(1.0, float(np.abs(ref).max()))


def logits_on(name: str, model, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(whole-sequence logits, token-by-token logits through the KV cache) on a backend."""
    with metal_kernels.using(name):
        whole = np.array(model(mx.array(ids)))
        cache = make_prompt_cache(model)
        steps = [model(mx.array(ids[:, t : t + 1]), cache=cache) for t in range(ids.shape[1])]
        return whole, np.array(mx.concatenate(steps, axis=1))


def env_backend(monkeypatch: pytest.MonkeyPatch, name: str) -> str:
    """Select through the environment variable, as a user does."""
    monkeypatch.setenv("KVCHAT_KERNELS", name)
    return metal_kernels.configure()


@pytest.fixture
def restore_backend(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    yield
    monkeypatch.delenv("KVCHAT_KERNELS", raising=False)
    metal_kernels.configure()


def assert_same_logits(model, monkeypatch: pytest.MonkeyPatch, ids: np.ndarray) -> None:
    assert env_backend(monkeypatch, "ops") == "ops"
    ops = logits_on(metal_kernels.backend(), model, ids)
    assert env_backend(monkeypatch, "fast") == "fast"
    fast = logits_on(metal_kernels.backend(), model, ids)
    for a, b in zip(ops, fast, strict=True):
        assert a.shape == b.shape
        diff = float(np.abs(a - b).max())
        print(f"ops vs fast max abs diff {diff:.2e}")
        assert diff <= tolerance(b)


def test_stories260k_ops_equals_fast(
    stories260k: Path, monkeypatch: pytest.MonkeyPatch, restore_backend: None
) -> None:
    assert_same_logits(load_model(stories260k), monkeypatch, IDS)


# llama3 periods (freqs path, GQA 2/1), mistral (MQA 4/1), qwen2 (biases, theta 1e6),
# head_dim 32 with hidden / heads = 16
@pytest.mark.parametrize("name", ["llama3", "mistral", "qwen2", "head_dim"])
def test_transformers_checkpoint_ops_equals_fast(
    name: str, tiny_checkpoint: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch,
    restore_backend: None,
) -> None:
    assert_same_logits(load_model(tiny_checkpoint(name)), monkeypatch, IDS)


@pytest.mark.skipif(not mx.metal.is_available(),
                    reason="mx.metal.is_available() is false: no Metal GPU")
def test_stories260k_metal_equals_fast(stories260k: Path) -> None:
    """On Apple silicon: the real custom kernels against mx.fast, whole model."""
    model = load_model(stories260k)
    for a, b in zip(logits_on("metal", model, IDS), logits_on("fast", model, IDS), strict=True):
        assert float(np.abs(a - b).max()) <= tolerance(b)


# ----------------------------------------------------------------------------- emulator


@pytest.fixture
def emulated() -> Iterator[object]:
    """The `metal` backend's launch code with the emulator as its kernel factory."""
    emulator = pytest.importorskip("tests.metal_emulator")
    if not emulator.available():
        pytest.skip("no C++ compiler for the Metal emulator (CI installs g++)")
    metal_kernels.register_backend("emulated", MetalBackend(emulator.metal_kernel, "emulated"))
    try:
        yield emulator
    finally:
        metal_kernels.unregister_backend("emulated")


def test_prefill_on_the_emulated_metal_kernels(stories260k: Path, emulated) -> None:
    """A whole 40-token prompt at once (RoPE over many positions, one norm row per token)."""
    model = load_model(stories260k)
    ids = IDS % model.config.vocab_size
    with metal_kernels.using("emulated"):
        emu = np.array(model(mx.array(ids)))
    with metal_kernels.using("fast"):
        fast = np.array(model(mx.array(ids)))
    assert float(np.abs(emu - fast).max()) <= tolerance(fast)


def test_each_block_fuses_its_residual_adds_into_the_next_norm(
    stories260k: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per forward pass of an L-layer pre-norm model: one plain rms_norm (the first
    block's input norm), and 2L fused add_rms_norm calls (each block's mid-block add +
    second norm; each block's last add fused into the next block's input norm, the last
    one into the final norm). Counted at the entry points the model calls."""
    model = load_model(stories260k)
    L = len(model.layers)
    calls = {"rms_norm": 0, "add_rms_norm": 0}
    for name in calls:
        real = getattr(metal_kernels, name)

        def counted(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(metal_kernels, name, counted)
    logits = model(mx.array(IDS))
    mx.eval(logits)
    assert calls == {"rms_norm": 1, "add_rms_norm": 2 * L}
