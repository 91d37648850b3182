"""`kvchat bench --json` reports every field, and a dtype mismatch with mlx-lm is
reported (ratio refused) rather than hidden."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from kvchat.app.main import main

pytest.importorskip("mlx_lm")

SUMMARY = {"min", "median", "max", "runs"}


def _bench(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main(["bench", "--runs", "1", "--json", "--prompt-tokens", "12",
                 "--gen-tokens", "6", *argv]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _check_side(side: dict[str, Any], runs: int) -> None:
    for k in ("prefill_tps", "decode_tps", "ttft_s"):
        assert set(side[k]) == SUMMARY
        assert len(side[k]["runs"]) == runs
        assert 0 < side[k]["min"] <= side[k]["median"] <= side[k]["max"]
    assert side["peak_memory"] > 0 and side["weight_bytes"] > 0
    assert side["dtype"] == "float32"


def test_bench_json_reports_every_field(stories260k: Path, capsys) -> None:
    r = _bench(capsys, "--model", str(stories260k), "--against", "mlx-lm")
    assert r["runs"] == 1 and r["prompt_tokens"] == 12 and r["gen_tokens"] == 6
    assert "interleaved" in r["order"]
    m = r["machine"]
    assert m["cores"] >= 1 and m["mlx"] == mx.__version__ and m["device"]
    assert set(m["blas"]) == {"name", "path", "fast", "core", "core_chosen", "note", "fix"}
    _check_side(r["kvchat"], 1)
    _check_side(r["mlx_lm"], 1)
    assert r["kvchat"]["compiled_step"] is True
    # stories260K: 1,040,128 bytes of float32 weights, same on both sides
    assert r["kvchat"]["weight_bytes"] == r["mlx_lm"]["weight_bytes"] == 1_040_128
    assert r["dtype_mismatch"] is False
    for k in ("prefill_tps", "decode_tps"):
        ratio = r["ratio"][k]
        a, b = r["kvchat"][k]["runs"][0], r["mlx_lm"][k]["runs"][0]
        assert ratio["runs"] == [pytest.approx(a / b)]
    rf = r["roofline"]
    # 5 layers × 4 KV heads × head_dim 8 × 2 (K and V) × 4 bytes
    assert rf["kv_bytes_per_token"] == 5 * 4 * 8 * 2 * 4
    assert rf["context_tokens"] == 12 + 3
    assert rf["bytes_per_token"] == 1_040_128 + rf["kv_bytes_per_token"] * 15
    assert rf["bandwidth_bytes_per_s"] > 1e8
    assert rf["roofline_tps"] == pytest.approx(rf["bandwidth_bytes_per_s"] / rf["bytes_per_token"])
    # one roofline, both sides' fractions of that same roofline
    for side, key in (("kvchat", "kvchat_fraction"), ("mlx_lm", "mlx_lm_fraction")):
        assert rf[key] == pytest.approx(r[side]["decode_tps"]["median"] / rf["roofline_tps"])
    assert r["ratio_of"] == "kvchat ÷ mlx-lm"
    assert r["machine"]["threads"].startswith(("auto", "1 fixed", "2 fixed"))


@pytest.fixture
def fp16_checkpoint(tiny_checkpoint: Any, tmp_path: Path) -> Path:
    src = tiny_checkpoint("llama")
    dst = tmp_path / "fp16"
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        w = mx.load(str(f))
        mx.save_safetensors(str(f), {k: v.astype(mx.float16) for k, v in w.items()},
                            metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["torch_dtype"] = cfg["dtype"] = "float16"
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.slow
def test_dtype_mismatch_is_reported_not_hidden(fp16_checkpoint: Path, capsys) -> None:
    base = ("--model", str(fp16_checkpoint), "--against", "mlx-lm", "--mlx-lm-dtype", "native")
    r = _bench(capsys, *base)
    assert r["kvchat"]["dtype"] == "float32" and r["mlx_lm"]["dtype"] == "float16"
    assert r["dtype_mismatch"] is True and r["ratio"] is None
    assert "float32" in r["ratio_refused"] and "float16" in r["ratio_refused"]
    r = _bench(capsys, *base, "--allow-dtype-mismatch")
    assert r["dtype_mismatch"] is True and r["ratio"]["decode_tps"]["median"] > 0
    # the default casts mlx-lm to our dtype: same dtype, ratio given
    r = _bench(capsys, "--model", str(fp16_checkpoint), "--against", "mlx-lm")
    assert r["mlx_lm"]["dtype"] == "float32" and r["dtype_mismatch"] is False
    assert r["ratio"]["decode_tps"]["median"] > 0


def test_text_output_names_dtypes_and_roofline(stories260k: Path, capsys) -> None:
    assert main(["bench", "--runs", "2", "--prompt-tokens", "8", "--gen-tokens", "4",
                 "--model", str(stories260k), "--against", "mlx-lm"]) == 0
    out = capsys.readouterr().out
    assert "computes in float32" in out and "BLAS" in out and "\nthreads: " in out
    lines = out.splitlines()
    # every ratio row says which side is divided by which, with its two pairs
    ratios = [ln for ln in lines if "÷" in ln]
    assert [ln.split()[:4] for ln in ratios] == [
        ["kvchat", "÷", "mlx-lm", "prefill_tps"], ["kvchat", "÷", "mlx-lm", "decode_tps"]]
    assert all(ln.count(",") == 1 and "per pair:" in ln for ln in ratios)
    # one roofline line (bytes/token and bandwidth), then both sides' share of it
    assert sum("roofline" in ln and "bytes/token" in ln and "GB/s" in ln for ln in lines) == 1
    share = next(ln for ln in lines if ln.startswith("of that roofline:"))
    assert "kvchat " in share and "mlx-lm " in share


@pytest.mark.slow
def test_bench_chat_runs_both_sides(stories260k: Path, capsys) -> None:
    """`python -m tests.benchmarks.chat`: the real app and the UI-less client decode the
    same number of tokens and each reports a rate (docs/performance.md)."""
    from tests.benchmarks import chat as bench_chat

    assert bench_chat.main(["--model", str(stories260k), "--tokens", "48", "--runs", "1",
                            "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    for side in ("generate", "chat"):
        assert [row["tokens"] for row in r[side]] == [48]
        assert r[side][0]["decode_tps"] > 0
    assert r["ratio_runs"] == [r["chat"][0]["decode_tps"] / r["generate"][0]["decode_tps"]]
    assert r["ratio_of"] == "chat ÷ generate" and r["chat_mode"] == "headless app (Pilot)"


@pytest.mark.slow  # the chat in tmux: tests/test_tmux_chat.py is the fast tier's
@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_bench_chat_drives_the_real_app_in_tmux(stories260k: Path, capsys) -> None:
    """`bench_chat --tmux`: the real app in a real terminal answers the typed prompt with
    exactly --tokens tokens, and reports the UI process's CPU time over the reply."""
    from tests.benchmarks import chat as bench_chat

    assert bench_chat.main(["--model", str(stories260k), "--tokens", "48", "--runs", "1",
                            "--tmux", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["chat_mode"] == "real app in tmux"
    chat = r["chat"][0]
    assert chat["tokens"] == r["generate"][0]["tokens"] == 48 and chat["decode_tps"] > 0
    assert 0 <= chat["ui_cpu_s"] and chat["reply_s"] > 0


@pytest.mark.slow
def test_the_concurrency_benchmark_runs_its_levels(capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m tests.benchmarks.serve_concurrency` (docs/serve.md's table) against a
    real `kvchat serve`: every level's tokens counted, each figure the median of its runs
    and within the range it reports."""
    from tests.benchmarks import serve_concurrency

    assert serve_concurrency.main(["--no-mlx-lm", "--clients", "1", "2", "--requests", "1",
                                   "--max-tokens", "4", "--runs", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    levels = {(r["server"], r["clients"]): r for r in out["levels"]}
    assert set(levels) == {("serve", 1), ("serve", 2)} and out["runs"] == 2
    assert levels[("serve", 1)]["tokens"] == 4 and levels[("serve", 2)]["tokens"] == 8
    for r in levels.values():
        lo, hi = r["aggregate_range"]
        assert 0 < lo <= r["aggregate_tps"] <= hi


@pytest.mark.slow
def test_the_exp_benchmark_compares_both_ways(capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m tests.benchmarks.fast_exp` (docs/performance.md, "exp on x86"): every op
    and step timed both ways, and fast_exp's own choice left as it was."""
    from kvchat.model.decoder import fast_exp
    from tests.benchmarks import fast_exp as bench

    before = fast_exp.power_exp()
    assert bench.main(["--rounds", "2", "--steps", "2", "--warm", "2", "--prompt", "8"]) == 0
    assert fast_exp.power_exp() is before
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in capsys.readouterr().out.splitlines() if line.startswith("| ")}
    for name in ("exp", "sigmoid", "softmax", "MLX exp", "mx.power"):
        assert all(float(c) > 0 for c in rows[name]), name
    assert len(rows["MLX exp"]) == len(rows["mx.power"]) == 3
