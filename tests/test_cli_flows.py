"""Issue 14 on the command line and in the engine: special tokens, --overflow refuse,
empty prompts, folders without a tokenizer, one set of numbers, prefill/overflow events,
--version, and the README's key table and command table (and docs/design.md's command
synopsis) against the app and --help."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvchat.app.main import build_parser
from kvchat.app.tui.app import KVChatApp
from kvchat.model.decoder.weights import load_model, weight_bytes
from kvchat.model.explain.facts import check_model_folder, model_facts
from tests.helpers import processes
from tests.helpers.paths import REPO_ROOT, STORIES260K

MINI = REPO_ROOT / "assets" / "kvchat-mini"


def kvchat(*args: str, env: dict[str, str] | None = None, cwd: Path = REPO_ROOT
           ) -> subprocess.CompletedProcess[str]:
    return processes.run(
        [sys.executable, "-m", "kvchat.app", *args], capture_output=True, text=True, cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})}, timeout=300,
    )


# ---- 4. special tokens --------------------------------------------------------------


def test_bos_ends_the_reply_and_never_shows_as_text() -> None:
    # greedy from "Once upon a time" stories260K finishes its story and writes BOS (id 1)
    r = kvchat("generate", "--model", str(STORIES260K), "--raw", "--prompt", "Once upon a time",
               "--max-tokens", "400", "--temp", "0", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["finish_reason"] == "eos" and out["ids"][-1] == 1  # BOS ended it
    assert "<s>" not in out["text"] and "</s>" not in out["text"]
    assert len(out["ids"]) < 400
    # --ignore-eos: the same run goes on past that BOS to --max-tokens; still no "<s>" text
    r = kvchat("generate", "--model", str(STORIES260K), "--raw", "--prompt", "Once upon a time",
               "--max-tokens", "400", "--temp", "0", "--json", "--ignore-eos")
    assert r.returncode == 0, r.stderr
    longer = json.loads(r.stdout)
    assert longer["finish_reason"] == "length" and len(longer["ids"]) == 400
    assert longer["ids"][:len(out["ids"])] == out["ids"]  # greedy: the same start
    assert "<s>" not in longer["text"]


def test_control_tokens_are_dropped_from_streamed_text() -> None:
    from kvchat.model.text.tokenizer import load_tokenizer

    tok = load_tokenizer(MINI)
    hello = tok.encode("Hello there", add_special_tokens=False)
    im_start = tok.token_to_id("<|im_start|>")
    assert im_start is not None and tok.bos_id is not None
    ids = [*hello, im_start, tok.bos_id, *hello]
    d = tok.detokenizer(skip_special_tokens=True)
    text = "".join(d.add_token(i) for i in ids) + d.finalize()
    assert "<|im_start|>" not in text and "<s>" not in text
    assert text == tok.decode(ids, skip_special_tokens=True)
    assert tok.bos_id in tok.end_ids and set(tok.eos_ids) <= set(tok.end_ids)


# ---- 5. folders, --overflow refuse, empty prompts -------------------------------------


def test_folder_without_tokenizer_exits_before_the_ui(tmp_path: Path) -> None:
    folder = tmp_path / "no-tok"
    shutil.copytree(MINI, folder)
    (folder / "tokenizer.model").unlink()
    r = kvchat("--model", str(folder), env={"KVCHAT_CONFIG_DIR": str(tmp_path / "c")})
    assert r.returncode == 1
    assert r.stderr.strip() == (f"kvchat: error: {folder}: no tokenizer.json or tokenizer.model"
                                " (kvchat needs one)")


def test_overflow_refuse_finishes_with_context_full_not_length() -> None:
    base = ["generate", "--model", str(STORIES260K), "--raw", "--prompt",
            "Once upon a time there", "--temp", "0", "--json", "--max-kv-size", "24"]
    full = json.loads(kvchat(*base, "--overflow", "refuse", "--max-tokens", "100").stdout)
    assert full["finish_reason"] in ("context_full", "eos")
    if full["finish_reason"] == "context_full":
        assert len(full["prompt_ids"]) + len(full["ids"]) - 1 == 24  # the window is full
    short = json.loads(kvchat(*base, "--overflow", "refuse", "--max-tokens", "3").stdout)
    assert short["finish_reason"] == "length" and len(short["ids"]) == 3


@pytest.mark.slow
def test_empty_prompt_is_refused() -> None:
    for extra in (["--raw"], []):
        r = kvchat("generate", "--model", str(STORIES260K), "--prompt", "  ", *extra)
        assert r.returncode == 2  # a usage error, in the command line's words
        assert r.stderr.strip() == ("kvchat: error: the prompt is empty: give --prompt TEXT"
                                    " or pipe text on stdin")


# ---- 3. one set of numbers ------------------------------------------------------------


@pytest.mark.slow
def test_models_inspect_and_the_loaded_model_agree(tmp_path: Path) -> None:
    facts = model_facts(MINI)
    loaded = load_model(MINI)
    assert facts.weight_bytes == weight_bytes(loaded)  # what the runtime allocates
    assert facts.kv_dtype_bytes == loaded.model.norm.weight.dtype.size
    env = {"KVCHAT_CONFIG_DIR": str(tmp_path / "c"), "HF_HUB_CACHE": str(tmp_path / "hf"),
           "HOME": str(tmp_path)}
    listed = json.loads(kvchat("models", "--json", env=env).stdout)["models"]
    mini = next(m for m in listed if m["source"] == "assets")
    inspected = json.loads(kvchat("inspect", "--model", str(MINI), "--json", env=env).stdout)
    assert mini["weight_bytes"] == inspected["weights_bytes"] == facts.weight_bytes
    # KV bytes per token from what the cache allocates (float32 on the CPU), not the file
    assert inspected["dtype_bytes"] == facts.kv_dtype_bytes
    live = json.loads(kvchat("inspect", "--model", str(MINI), "--live", "--json",
                             env=env).stdout)
    assert live["live"]["dtype_bytes"] == live["dtype_bytes"]  # --live agrees with its headline
    text = kvchat("inspect", "--model", str(MINI), env=env).stdout
    if facts.dtype_differs:
        assert (f"note: the files' float tensors (scales, norms) are {facts.file_dtype};"
                " kvchat computes and caches in") in text
    check_model_folder(MINI)


def test_engine_reports_prefill_progress_and_overflow() -> None:
    from kvchat.model.runtime.engine import Engine
    from kvchat.model.runtime.events import Done, GenParams, Overflow, PrefillProgress, Started

    events: list[object] = []
    done = threading.Event()

    def on_event(ev: object) -> None:
        events.append(ev)
        if isinstance(ev, Done):
            done.set()

    eng = Engine(on_event, STORIES260K, prefill_chunk=32)
    try:
        ids = [1] + [300 + (i % 50) for i in range(150)]
        eng.submit(ids, GenParams(max_tokens=20, max_kv_size=64, keep=4, temp=0.0))
        assert done.wait(120)
    finally:
        eng.close()
    prog = [e for e in events if isinstance(e, PrefillProgress)]
    assert [p.done for p in prog] == [32, 64, 96, 128, 151] and prog[-1].total == 151
    started = next(e for e in events if isinstance(e, Started))
    assert started.prompt_tokens == 151 and started.cached_tokens == 0
    over = [e for e in events if isinstance(e, Overflow)]
    # 151 prompt tokens through a 64-slot window: 151 - 64 evicted; then the reply's own
    assert over[0].during == "prompt" and over[0].dropped == 151 - 64 and over[0].capacity == 64
    assert over[1].during == "reply" and over[1].dropped == 19  # 19 of 20 replies fed back
    final = next(e for e in events if isinstance(e, Done))
    assert final.stats.evicted_tokens == over[0].dropped + over[1].dropped


# ---- 7. --version, and the README and docs matching --help and the app ---------------


def test_version() -> None:
    r = kvchat("--version")
    # the version first, then the diagnostics (MLX, its device, the BLAS in use)
    first = r.stdout.split("\n")[0]
    assert r.returncode == 0 and re.fullmatch(r"kvchat \d+\.\d+\.\d+\S*", first)
    assert "\nBLAS: " in r.stdout


def _readme() -> str:
    return (REPO_ROOT / "README.md").read_text(encoding="utf-8")


def _section(text: str, heading: str) -> str:
    """The body of the Markdown section under `heading` (up to the next heading of any
    level)."""
    body = text.split(f"\n{heading}\n", 1)[1]
    return re.split(r"^#{1,6} ", body, maxsplit=1, flags=re.M)[0]


def _commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._subparsers._group_actions)  # type: ignore[union-attr]
    return dict(sub.choices)  # type: ignore[union-attr]


def test_design_command_synopsis_matches_help() -> None:
    """docs/design.md's synopsis (the CLI contract) names every command and every option of
    each, with the metavar --help shows."""
    design = (REPO_ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    block = _section(design, "## Command line").split("```", 2)[1]
    for name, p in _commands().items():
        assert f"kvchat {name}" in block, name
        # the command's own entry: its line and the indented lines under it (two commands
        # may give one flag different values: inspect --hosts N, serve --hosts HOSTFILE)
        entry = re.search(rf"^kvchat {name}\b.*(?:\n[ \t]+.*)*", block, re.M)
        assert entry is not None, name
        for action in p._actions:
            if action.dest == "help":
                continue
            for opt in action.option_strings:
                if opt.startswith("--"):
                    assert opt in block, f"{name} {opt} missing from docs/design.md"
            if action.option_strings and action.metavar:
                opt = action.option_strings[-1]
                shown = re.search(re.escape(opt) + r" ([A-Z_.|]+)", entry.group())
                assert shown is None or shown.group(1) == action.metavar, (opt, shown)
    for opt in ("--model", "--version"):
        assert opt in block


def test_readme_command_table_matches_help() -> None:
    """The README's command table has a row for every command, and every option a row
    names is one that command (or, for `kvchat` itself, the top level) accepts."""
    table = _section(_readme(), "## Commands")
    rows = []  # (command, its row); "" for `kvchat` itself
    for line in table.splitlines():
        m = re.match(r"\| `kvchat(?: ([a-z]+))?[^`]*` \|", line)
        if m:
            rows.append((m.group(1) or "", line))
    commands = _commands()
    named = {name for name, _ in rows}
    assert set(commands) <= named, set(commands) - named
    assert named <= {"", *commands}, named - {"", *commands}
    top = {o for a in build_parser()._actions for o in a.option_strings}
    for name, line in rows:
        known = top if not name else {o for a in commands[name]._actions
                                      for o in a.option_strings}
        for opt in re.findall(r"(?<![\w-])--[a-z][a-z-]*", line):
            assert opt in known, f"README: kvchat {name} {opt} is not an option"


def test_readme_key_table_matches_the_app() -> None:
    """Every key the chat binds (app/tui/actions.py: the chat screen's and the app's, which
    the help screen lists) is in the README's key table, and every key the table names is
    bound or is one of the input box's keys the help lists."""
    from kvchat.app.tui.actions import ACTIONS, bindings

    table = _section(_readme(), "## Keys in the chat").strip().split("\n\n", 1)[0]
    readme_keys = {
        k.strip().lower()
        for row in table.splitlines()[2:]
        for k in row.split("|")[1].split(" / ")
    }
    app = KVChatApp(None)
    bound = set()
    for b in [*bindings("chat"), *bindings("app")]:
        key = re.sub(r"^\^", "ctrl+", app.get_key_display(b).lower())  # type: ignore[arg-type]
        bound.add(key)
        assert key in readme_keys, f"{key} is not in the README's key table"
    labels = {k.strip() for a in ACTIONS if a.key_label for k in a.key_label.split(" / ")}
    for key in readme_keys:
        if re.fullmatch(r"ctrl\+\w|f\d+|esc", key):
            assert key in bound | labels, f"the README's {key} is bound to nothing"
    assert "ctrl+h" not in readme_keys


def test_relative_paths_become_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvchat.app.core.settings import Settings
    from kvchat.app.tui.app import default_model_path, validate_model_path

    shutil.copytree(MINI, tmp_path / "m")
    monkeypatch.chdir(tmp_path)
    assert validate_model_path("m") == (tmp_path / "m").resolve()
    # an old relative last_model is not trusted: it depends on where kvchat starts
    assert default_model_path(Settings(last_model="m")) == str(MINI.resolve())
    assert default_model_path(Settings(last_model=str(tmp_path / "m"))) == str(tmp_path / "m")
