"""Pure KV-cache arithmetic (model/cache/kv_math.py)."""

from __future__ import annotations

import pytest

from kvchat.model.cache.kv_math import (
    BudgetError,
    attention_table,
    dtype_bytes_of,
    human_bytes,
    kv_bytes,
    kv_bytes_per_token,
    parse_size,
    tokens_that_fit,
)
from kvchat.model.decoder.config import ModelConfig
from tests.helpers.paths import STORIES260K as STORIES

GiB = 1024**3

LLAMA_70B = {
    "model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80,
    "num_attention_heads": 64, "num_key_value_heads": 8, "intermediate_size": 28672,
    "vocab_size": 128256, "max_position_embeddings": 8192, "torch_dtype": "float16",
}


def test_llama_70b_numbers() -> None:
    per = kv_bytes_per_token(80, 8, 128, 2)
    assert per == 327_680
    assert kv_bytes(8192, 80, 8, 128, 2) == 2_684_354_560 == int(2.5 * GiB)
    assert kv_bytes(8192, 80, 64, 128, 2) == 8 * 2_684_354_560 == 20 * GiB
    assert kv_bytes(131_072, 80, 8, 128, 2) == 40 * GiB


def test_attention_table() -> None:
    cfg = ModelConfig.from_dict(LLAMA_70B)
    rows = attention_table(cfg, 2, 8192)
    assert [(r.name, r.kv_heads) for r in rows] == [
        ("MHA", 64), ("GQA (this model)", 8), ("MQA", 1)]
    assert [r.bytes_at_context for r in rows] == [20 * GiB, int(2.5 * GiB), 320 * 1024**2]
    assert [r.saving_vs_mha for r in rows] == [1.0, 8.0, 64.0]
    mha = ModelConfig.from_dict({**LLAMA_70B, "num_key_value_heads": 64})
    assert attention_table(mha, 2, 1)[1].name == "MHA (this model)"


def test_tokens_that_fit() -> None:
    assert tokens_that_fit(8 * GiB, 327_680) == 26_214
    assert tokens_that_fit(8 * GiB, 327_680, reserved_bytes=4 * GiB) == 13_107
    assert tokens_that_fit(1 * GiB, 327_680, reserved_bytes=4 * GiB) == 0
    with pytest.raises(ValueError):
        tokens_that_fit(1, 0)


@pytest.mark.parametrize(
    ("text", "value"),
    [("8GiB", 8 * GiB), ("8 GiB", 8 * GiB), ("8gib", 8 * GiB), ("8G", 8 * GiB),
     ("8GB", 8 * 10**9), ("512MiB", 512 * 1024**2), ("1.5GiB", 3 * GiB // 2),
     ("123456", 123456), ("1_000", 1000), ("64KiB", 65536), ("2TiB", 2 * 1024**4)],
)
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "8Q", "GiB", "-1GiB", "1e3", "8 G i B"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(BudgetError, match="cannot read memory size"):
        parse_size(text)


def test_human_bytes() -> None:
    assert human_bytes(2_684_354_560) == "2.5 GiB"
    assert human_bytes(327_680) == "320 KiB"
    assert human_bytes(1023) == "1023 B"
    assert human_bytes(40 * GiB) == "40 GiB"
    assert human_bytes(1_040_128) == "1015.75 KiB"


def test_dtype_bytes() -> None:
    assert [dtype_bytes_of(d) for d in ("float16", "bfloat16", "float32", "torch.float16")] == [
        2, 2, 4, 2]
    assert dtype_bytes_of(None) is None and dtype_bytes_of("int3") is None


def test_weights_bytes_from_headers() -> None:
    from kvchat.model.decoder.weights import load_model, weight_bytes
    from kvchat.model.explain.facts import model_facts

    facts = model_facts(STORIES)
    # the model loads as float32 on the CPU, as stored: every header byte is a parameter byte
    assert facts.file_bytes == facts.weight_bytes == weight_bytes(load_model(STORIES))
    assert facts.file_bytes == 1_040_128 and facts.file_dtype == "float32"
