"""`kvchat inspect` through app.cli.inspect.run with parsed arguments."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvchat.app.cli import inspect as inspect_cmd
from tests.helpers.paths import STORIES260K as STORIES

GiB = 1024**3

LLAMA_70B = {
    "model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80,
    "num_attention_heads": 64, "num_key_value_heads": 8, "intermediate_size": 28672,
    "vocab_size": 128256, "max_position_embeddings": 8192, "torch_dtype": "float16",
}


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    p = argparse.ArgumentParser(prog="kvchat inspect")
    inspect_cmd.add_arguments(p)
    rc = inspect_cmd.run(p.parse_args(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def llama70b(tmp_path: Path) -> Path:
    f = tmp_path / "config.json"
    f.write_text(json.dumps(LLAMA_70B))
    return f


@pytest.fixture
def stories() -> Path:
    return STORIES


def test_llama_70b_text(llama70b: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(["--config", str(llama70b)], capsys)
    assert rc == 0
    assert "per token (all layers): 327,680 B (320 KiB)" in out
    assert "at 8,192 tokens: 2,684,354,560 B (2.5 GiB)" in out
    assert "21,474,836,480 B (20 GiB)" in out  # MHA row: 8x
    assert "from torch_dtype float16" in out


def test_llama_70b_json(llama70b: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(["--config", str(llama70b), "--json", "--context", "131072",
                      "--budget", "48GiB"], capsys)
    assert rc == 0
    o = json.loads(out)  # exactly one JSON object
    assert o["bytes_per_token"] == 327_680 and o["dtype_bytes"] == 2
    assert o["bytes_at_context"] == 40 * GiB and o["context"] == 131_072
    rows = {r["name"]: r for r in o["table"]}
    assert rows["MHA"]["bytes_at_context"] == 8 * 40 * GiB
    assert rows["GQA (this model)"]["kv_heads"] == 8 and rows["MQA"]["kv_heads"] == 1
    assert o["gqa_saving"] == 8.0 and o["weights_bytes"] is None
    assert o["budget_bytes"] == 48 * GiB and o["budget_tokens"] == 157_286


def test_default_context_and_dtype_override(llama70b: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(["--config", str(llama70b), "--json", "--dtype-bytes", "4"], capsys)
    o = json.loads(out)
    assert rc == 0 and o["context"] == 8192 and o["bytes_per_token"] == 2 * 327_680


def test_model_folder_weights_and_budget(stories: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(["--model", str(stories), "--budget", "2MiB", "--json"], capsys)
    o = json.loads(out)
    assert rc == 0 and o["weights_bytes"] == 1_040_128
    assert o["bytes_per_token"] == 2 * 5 * 4 * 8 * 4  # float32 per config
    assert o["budget_tokens"] == (2 * 1024**2 - 1_040_128) // 1280


def test_live_measured_equals_formula(stories: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(["--model", str(stories), "--live", "--json"], capsys)
    live = json.loads(out)["live"]
    assert rc == 0 and live["equal"]
    assert live["dtype_bytes"] == 4  # CPU compute dtype float32
    assert live["measured_bytes"] == live["formula_bytes"] == live["nbytes_sum"]
    assert live["formula_bytes"] == 2 * 5 * 4 * live["tokens"] * 8 * 4
    assert live["cache_stats"]["cache_bytes"] == live["measured_bytes"]
    rc, out, _ = run(["--model", str(stories), "--live"], capsys)
    assert rc == 0 and "-> equal" in out


def test_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run(["--model", str(tmp_path / "nope")], capsys)
    assert rc == 1 and err.strip().count("\n") == 0 and "not found" in err
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({**LLAMA_70B, "model_type": "bitnet"}))
    rc, _, err = run(["--config", str(bad)], capsys)
    assert rc == 1 and "unknown architecture" in err and err.strip().count("\n") == 0
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(LLAMA_70B))
    rc, _, err = run(["--model", str(tmp_path / "m")], capsys)
    assert rc == 1 and "safetensors" in err


def test_usage_errors(llama70b: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["--config", str(llama70b), "--budget", "lots"], capsys)[0] == 2
    assert run(["--config", str(llama70b), "--live"], capsys)[0] == 2
    assert run(["--config", str(llama70b), "--context", "0"], capsys)[0] == 2
    with pytest.raises(SystemExit) as e:  # argparse: --model and --config exclude each other
        run(["--config", str(llama70b), "--model", "x"], capsys)
    assert e.value.code == 2


def test_without_a_source_it_inspects_the_shipped_model(
        capsys: pytest.CaptureFixture[str]) -> None:
    """As generate, explain, bench and serve: no --model means the shipped model."""
    from kvchat.app.core.discovery import DEFAULT_MODEL

    rc, out, _ = run(["--json"], capsys)
    o = json.loads(out)
    assert rc == 0 and Path(o["source"]) == DEFAULT_MODEL
    cfg = json.loads((DEFAULT_MODEL / "config.json").read_text())
    assert o["layers"] == cfg["num_hidden_layers"] and o["kv_heads"] == cfg["num_key_value_heads"]
    p = argparse.ArgumentParser(prog="kvchat inspect")
    inspect_cmd.add_arguments(p)
    assert "default: " + str(DEFAULT_MODEL) in " ".join(p.format_help().split())


def test_budget_beyond_the_context_says_the_context_caps_a_sequence(
        stories: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """stories260K: 1,280 B/token after 1,040,128 B of weights, a 512-token context."""
    rc, out, _ = run(["--model", str(stories), "--budget", "1GiB"], capsys)
    tokens = (GiB - 1_040_128) // 1280
    line = next(ln for ln in out.splitlines() if ln.startswith("budget "))
    assert rc == 0 and f"{tokens:,} tokens of KV cache fit after the weights" in line
    assert line.endswith(f"one sequence stops at the model's 512-token context"
                         f" (room for {tokens // 512:,} such)")
    rc, out, _ = run(["--model", str(stories), "--budget", "1MiB"], capsys)  # fewer than 512
    line = next(ln for ln in out.splitlines() if ln.startswith("budget "))
    assert "context" not in line and line.endswith("fit after the weights")


# Gemma 3 1B's shape: 26 layers, every 6th global (layers 5, 11, 17, 23), the other 22
# slide over 512 tokens; 1 KV head of 256, bfloat16.
GEMMA3_1B = {
    "model_type": "gemma3_text", "hidden_size": 1152, "num_hidden_layers": 26,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
    "intermediate_size": 6912, "vocab_size": 262144, "max_position_embeddings": 32768,
    "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16",
}


@pytest.mark.parametrize("context", [1024, 32768])
def test_gemma3_bytes_by_layer_kind(context: int, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "config.json"
    f.write_text(json.dumps(GEMMA3_1B))
    rc, out, _ = run(["--config", str(f), "--json", "--context", str(context)], capsys)
    o = json.loads(out)
    per_layer_token = 2 * 1 * 256 * 2  # K+V × kv heads × head_dim × bf16 = 1024 B
    global_bytes = 4 * context * per_layer_token
    sliding_bytes = 22 * 512 * per_layer_token
    expected = {1024: 4 * 1024**2 + 11 * 1024**2, 32768: 128 * 1024**2 + 11 * 1024**2}
    assert rc == 0 and global_bytes + sliding_bytes == expected[context]
    assert o["bytes_at_context"] == expected[context]
    assert o["layer_kinds"] == [
        {"kind": "global", "layers": 4, "window": None, "tokens": context,
         "bytes": global_bytes},
        {"kind": "sliding", "layers": 22, "window": 512, "tokens": 512,
         "bytes": sliding_bytes},
    ]
    assert o["bytes_per_token"] == 26 * per_layer_token  # while every layer grows
    assert o["bytes_per_token_at_context"] == expected[context] / context
    assert o["window_saving"] == 26 * per_layer_token * context / expected[context]
    rows = {r["name"]: r for r in o["table"]}
    assert rows["MHA"]["bytes_at_context"] == 4 * expected[context]  # 4 query heads
    rc, text, _ = run(["--config", str(f), "--context", str(context)], capsys)
    assert "22 sliding (window 512) layers: 512 tokens each" in text
    assert f"4 global layers: {context:,} tokens each" in text


def test_budget_with_sliding_layers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """64 MiB: the 22 sliding layers take their 11 MiB once, the rest grows 4 KiB/token."""
    f = tmp_path / "config.json"
    f.write_text(json.dumps(GEMMA3_1B))
    rc, out, _ = run(["--config", str(f), "--json", "--budget", "64MiB"], capsys)
    assert rc == 0 and json.loads(out)["budget_tokens"] == (64 - 11) * 1024**2 // 4096
    f.write_text(json.dumps({**GEMMA3_1B, "model_type": "mistral"}))  # every layer slides
    rc, out, _ = run(["--config", str(f), "--budget", "64MiB"], capsys)
    assert rc == 0 and "any context length fits" in out


def test_llama_70b_quantized_kv(llama70b: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--kv-bits: per token and at a context, by hand: head_dim 128 in groups of 64,
    4 bits -> 64 packed bytes + 2 groups × (scale + bias) × 2 B = 72 B per head row."""
    rc, out, _ = run(["--config", str(llama70b), "--json", "--kv-bits", "4",
                      "--context", "131072"], capsys)
    o = json.loads(out)
    q = o["quantized"]
    assert rc == 0 and (o["kv_bits"], o["kv_group_size"]) == (4, 64)
    assert q["bytes_per_token"] == 2 * 80 * 8 * (128 * 4 // 8 + 2 * 2 * 2) == 92_160
    assert q["bytes_at_context"] == 92_160 * 131_072
    assert q["saving_vs_float"] == 327_680 / 92_160
    mha = next(r for r in q["table"] if r["name"] == "MHA")
    assert mha["bytes_per_token"] == 92_160 * 8
    rc, text, _ = run(["--config", str(llama70b), "--kv-bits", "8"], capsys)
    # 8 bits: 128 packed bytes + 8 B of scales/biases per row
    assert rc == 0 and f"{2 * 80 * 8 * (128 + 8):,} B" in text and "smaller than" in text
    with pytest.raises(SystemExit) as e:  # argparse's usage error: exit 2
        run(["--config", str(llama70b), "--kv-bits", "3"], capsys)
    assert e.value.code == 2
    assert run(["--config", str(llama70b), "--kv-group-size", "64"], capsys)[0] == 2


def test_live_quantized_bytes_equal_the_formula(capsys: pytest.CaptureFixture[str]) -> None:
    mini = Path(__file__).resolve().parents[1] / "assets" / "kvchat-mini"
    rc, out, _ = run(["--model", str(mini), "--live", "--kv-bits", "4", "--json"], capsys)
    live = json.loads(out)["live"]
    # 4 layers × 2 KV heads, head_dim 24 padded to 32: 16 packed bytes + 2 × 4 B (float32)
    assert rc == 0 and live["equal"] and live["kv_bits"] == 4
    assert live["measured_bytes"] == 2 * 4 * 2 * (16 + 8) * live["tokens"]
    assert live["float_bytes"] == 2 * 4 * 2 * 24 * 4 * live["tokens"]
