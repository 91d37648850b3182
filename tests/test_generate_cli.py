"""`kvchat generate` end to end, as a user runs it: a subprocess, its stdout, exit status."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.helpers import processes
from tests.helpers.paths import REPO_ROOT, STORIES260K


def kvchat(*args: str, stdin: str | None = None, env: dict | None = None):
    return processes.run(
        [sys.executable, "-m", "kvchat.app", *args],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, **(env or {})},
        timeout=300,
    )


def test_generate_json_matches_mlx_lm_greedy():
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    r = kvchat(
        "generate", "--model", str(STORIES260K), "--raw", "--prompt", "Once upon a time",
        "--temp", "0", "--max-tokens", "56", "--json",
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)  # exactly one JSON object on stdout
    assert out["prompt_ids"] == [1, 403, 407, 261, 378]

    model, _ = load(str(STORIES260K))
    ref = []
    for tok, _ in generate_step(
        mx.array(out["prompt_ids"]), model, max_tokens=56,
        sampler=lambda x: mx.argmax(x, axis=-1),
    ):
        ref.append(int(tok))
        if ref[-1] == 2:  # mlx_lm.generate stops at EOS; so do we
            break
    assert out["ids"] == ref
    for key in (
        "text", "finish_reason", "prompt_tokens", "cached_tokens", "prefill_tps", "ttft_s",
        "decode_tps", "cache_offset", "cache_tokens", "cache_capacity", "cache_bytes",
        "mha_bytes", "gqa_saving", "evicted_tokens", "peak_memory",
    ):
        assert key in out, key
    assert out["finish_reason"] in ("length", "eos")
    assert out["cache_bytes"] == 2 * 5 * 4 * out["cache_tokens"] * 8 * 4


def test_both_tokenizer_files_give_the_same_generation():
    outs = []
    for kind in ("hf", "sentencepiece"):
        r = kvchat("generate", "--model", str(STORIES260K), "--raw", "--prompt",
                   "Once upon a time", "--max-tokens", "24", "--tokenizer", kind, "--json")
        assert r.returncode == 0, r.stderr
        outs.append(json.loads(r.stdout))
    assert outs[0]["prompt_ids"] == outs[1]["prompt_ids"] == [1, 403, 407, 261, 378]
    assert outs[0]["ids"] == outs[1]["ids"] and outs[0]["text"] == outs[1]["text"]


def test_generate_streams_text_and_reads_stdin():
    r = kvchat("generate", "--model", str(STORIES260K), "--raw", "--max-tokens", "20",
               stdin="Once upon a time")
    assert r.returncode == 0, r.stderr
    assert "Lily" in r.stdout


def test_base_model_prompt_is_the_one_mlx_lm_generate_builds():
    """stories260K has no chat template: mlx_lm.generate encodes the prompt text itself
    (BOS as its tokenizer adds it, no newline after it); so does generate without --raw."""
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(STORIES260K)
    assert not tok.has_chat_template
    want = tok.encode("Once upon a time", add_special_tokens=True)
    outs = []
    for extra in ([], ["--raw"]):
        r = kvchat("generate", "--model", str(STORIES260K), "--prompt", "Once upon a time",
                   "--max-tokens", "12", "--json", *extra)
        assert r.returncode == 0, r.stderr
        outs.append(json.loads(r.stdout))
    assert outs[0]["prompt_ids"] == want == outs[1]["prompt_ids"]
    assert outs[0]["ids"] == outs[1]["ids"]


def test_only_a_lone_prompt_to_a_model_without_template_is_sent_as_text():
    from kvchat.app.cli.generate import as_the_model_expects

    user = [{"role": "user", "content": "Once upon a time"}]
    system = [{"role": "system", "content": "Be brief."}, *user]
    assert as_the_model_expects(user, {"chat_template": False}) == "Once upon a time"
    assert as_the_model_expects(user, {"chat_template": True}) == user
    assert as_the_model_expects(system, {"chat_template": False}) == system  # kept whole
    assert as_the_model_expects("raw text", {"chat_template": False}) == "raw text"


def test_generate_chat_template_fallback_and_system():
    r = kvchat("generate", "--model", str(STORIES260K), "--system", "Be brief.",
               "--prompt", "Tell me a story.", "--max-tokens", "8", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["prompt_ids"][0] == 1 and len(out["prompt_ids"]) > 8


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (["--model", "/nonexistent/model", "--prompt", "hi"], 1, "not found"),
        (["--model", str(STORIES260K), "--prompt", "hi", "--temp", "-1"], 2, "temp"),
        (["--model", str(STORIES260K), "--prompt", "hi", "--top-p", "0"], 2, "top_p"),
        (["--model", str(STORIES260K), "--prompt", "hi", "--max-tokens", "0"], 2, "max_tokens"),
        (["--model", str(STORIES260K), "--prompt", "hi", "--max-kv-size", "4"], 2, "keep"),
        (["--bogus-flag"], 2, "unrecognized"),
    ],
)
def test_generate_errors_are_one_line_with_status(args, code, needle):
    r = kvchat("generate", *args)
    assert r.returncode == code
    lines = r.stderr.strip().splitlines()
    assert needle in lines[-1]  # the error itself is the last line (argparse puts usage first)
    assert "Traceback" not in r.stderr
    if code == 1:
        assert len(lines) == 1


def test_malformed_config_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    r = kvchat("generate", "--model", str(tmp_path), "--prompt", "hi")
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1
    assert "config.json" in r.stderr
