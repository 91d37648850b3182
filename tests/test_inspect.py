"""`kvchat inspect` through app.inspect_cmd.run with parsed arguments."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from app import inspect_cmd

STORIES = Path(__file__).resolve().parents[1].parent / "shared/models/stories260K"
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
    if not (STORIES / "config.json").is_file():
        pytest.skip(f"real model absent: {STORIES}")
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
    bad.write_text(json.dumps({**LLAMA_70B, "model_type": "gpt2"}))
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
    with pytest.raises(SystemExit) as e:  # argparse: one of --model/--config required
        run([], capsys)
    assert e.value.code == 2
