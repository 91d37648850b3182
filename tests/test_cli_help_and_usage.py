"""Issue 21's command-line paper cuts: an empty prompt is a usage error, --help shows every
default and the chat's own, plain `generate` ends with a newline and one statistics line
on stderr, `--overflow refuse` says why it stopped, `inspect` names quantized weights."""

from __future__ import annotations

import argparse
import json
import os
import re
import struct
import sys
from pathlib import Path

import pytest

from kvchat.app.cli import generate as generate_cmd
from kvchat.app.cli import inspect as inspect_cmd
from kvchat.app.core.settings import Settings
from tests.helpers import processes
from tests.helpers.paths import REPO_ROOT, STORIES260K

MINI = REPO_ROOT / "assets" / "kvchat-mini"
ENV = {**os.environ, "KVCHAT_NO_OPENBLAS": "1", "PYTHONPATH": str(REPO_ROOT)}
GREEDY = ["generate", "--model", str(STORIES260K), "--raw", "--prompt", "Once upon a time",
          "--temp", "0"]
STATS = re.compile(r"^kvchat: prompt (\d+) tokens at ([\d,.]+) tok/s · generated (\d+) tokens"
                   r" at ([\d,.]+) tok/s · peak memory ([\d.]+ (?:B|KiB|MiB|GiB))$")


def kvchat(*args: str, stdin: str | None = None):
    return processes.run([sys.executable, "-m", "kvchat.app", *args], input=stdin, text=True,
                         capture_output=True, cwd=REPO_ROOT, env=ENV, timeout=120)


@pytest.mark.parametrize("how", ["flag", "stdin"])
def test_empty_prompt_is_a_usage_error(how: str) -> None:
    r = (kvchat(*GREEDY[:4], "--prompt", "") if how == "flag"
         else kvchat(*GREEDY[:4], stdin=" \n\n"))
    assert r.returncode == 2
    assert r.stderr == ("kvchat: error: the prompt is empty: give --prompt TEXT or pipe text"
                        " on stdin\n")
    assert r.stdout == ""


def test_help_shows_every_default_and_the_chats_own() -> None:
    p = argparse.ArgumentParser(prog="kvchat generate")
    generate_cmd.add_arguments(p)
    for action in p._actions:  # every option whose default is a value says it in --help
        if action.default in (None, False, [], argparse.SUPPRESS) or not action.option_strings:
            continue
        assert action.help and "default" in action.help, action.option_strings
    text = " ".join(p.format_help().split())
    assert "--temp T sampling temperature; 0 = greedy (default 0.0)" in text
    assert "--seed S random seed (default: a new one each run)" in text
    s = Settings()  # the chat's defaults, as its settings file starts
    assert (f"temperature {s.temp}, top-p {s.top_p}, min-p {s.min_p}, repetition penalty"
            f" {s.repetition_penalty}") in text


def _command_parsers() -> dict[str, argparse.ArgumentParser]:
    from kvchat.app.main import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_option_of_every_command_says_what_it_does() -> None:
    for name, p in _command_parsers().items():
        for action in p._actions:
            assert action.help, (name, action.option_strings or action.dest)


@pytest.mark.parametrize("name", ["generate", "inspect", "bench", "models", "pull", "explain"])
def test_every_default_is_in_help(name: str) -> None:
    """An option whose default is a value says that it is the default, and the value,
    e.g. bench --prompt-tokens."""
    p = _command_parsers()[name]
    for action in p._actions:
        if action.default in (None, False, [], argparse.SUPPRESS) or not action.option_strings:
            continue
        shown = p._get_formatter()._expand_help(action)  # the text --help prints
        assert "default" in shown and str(action.default) in shown, (name, action.option_strings)


@pytest.mark.slow
def test_plain_generate_ends_with_a_newline_and_one_stats_line() -> None:
    ref = json.loads(kvchat(*GREEDY, "--max-tokens", "12", "--json").stdout)
    assert ref["finish_reason"] == "length"  # cut by --max-tokens mid-story
    r = kvchat(*GREEDY, "--max-tokens", "12")
    assert r.returncode == 0
    assert r.stdout == ref["text"] + "\n"
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    m = STATS.match(lines[0])
    assert m, lines[0]
    assert int(m[1]) == ref["prompt_tokens"] == 5 and int(m[3]) == len(ref["ids"]) == 12
    assert float(m[2].replace(",", "")) > 0 and float(m[4].replace(",", "")) > 0
    quiet = kvchat(*GREEDY, "--max-tokens", "12", "--quiet")
    assert quiet.stdout == r.stdout and quiet.stderr == ""


def test_overflow_refuse_says_why_it_stopped() -> None:
    r = kvchat(*GREEDY, "--max-kv-size", "24", "--overflow", "refuse", "--max-tokens", "100",
               "--ignore-eos")
    assert r.returncode == 0
    why, stats = r.stderr.splitlines()
    assert why == ("kvchat: stopped: the 24-token cache is full (--overflow refuse); give a"
                   " larger --max-kv-size or --overflow rotate")
    m = STATS.match(stats)
    assert m and int(m[1]) + int(m[3]) - 1 == 24  # the last token is never written back


def _header(file: Path) -> dict:
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n])


def test_inspect_names_quantized_weights(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = json.loads((MINI / "config.json").read_text())["quantization"]
    scales = {i["dtype"] for n, i in _header(MINI / "model.safetensors").items()
              if n.endswith(".scales")}
    assert scales == {"F16"}
    want = f"{cfg['bits']}-bit, group {cfg['group_size']}, float16 scales"
    p = argparse.ArgumentParser()
    inspect_cmd.add_arguments(p)
    assert inspect_cmd.run(p.parse_args(["--model", str(MINI)])) == 0
    text = capsys.readouterr().out
    assert f"quantized: {want})" in text and "float16 tensors" not in text
    assert inspect_cmd.run(p.parse_args(["--model", str(MINI), "--json"])) == 0
    assert json.loads(capsys.readouterr().out)["facts"]["quantization"] == want
    assert inspect_cmd.run(p.parse_args(["--model", str(STORIES260K), "--json"])) == 0
    assert json.loads(capsys.readouterr().out)["facts"]["quantization"] is None
