"""The command-line contract under hostile input and interruption:

- one stderr line and exit 2 for every usage error, argparse's own included;
- `--json` prints exactly one object in every outcome, counts agreeing with the ids;
- non-UTF-8 input is decoded with replacement, never a library's raw error;
- model text reaches the terminal with control characters made visible; --json keeps it;
- Ctrl+C once cancels (finish_reason "cancelled", exit 130), twice quits; no traceback at
  any moment of start-up; leaving while the engine is busy never aborts, within 2 s.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvchat.app.core.engine_service import EngineService
from kvchat.app.main import main
from kvchat.model.runtime.events import Done, TurnStats
from tests.helpers import processes
from tests.helpers.paths import REPO_ROOT, STORIES260K

RAW_CONTROL = "".join(map(chr, [*range(0, 9), *range(11, 32), *range(0x7F, 0xA0)]))
ENV = {**os.environ, "KVCHAT_NO_OPENBLAS": "1", "PYTHONPATH": str(REPO_ROOT)}


def kvchat(*args: str, stdin: bytes | None = None, timeout: float = 120
           ) -> subprocess.CompletedProcess[bytes]:
    return processes.run([sys.executable, "-m", "kvchat.app", *args], input=stdin,
                         capture_output=True, cwd=REPO_ROOT, env=ENV, timeout=timeout)


def one_line(stderr: bytes) -> str:
    lines = stderr.decode().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("kvchat: error: "), lines
    return lines[0]


def one_object(stdout: bytes) -> dict[str, Any]:
    text = stdout.decode()
    obj, end = json.JSONDecoder().raw_decode(text)
    assert text[end:].strip() == "", f"more than one object: {text!r}"
    return obj


# ---- usage errors ----------------------------------------------------------------------


@pytest.mark.parametrize("argv", [
    ["--bogus"],
    ["generate", "--bogus"],
    ["generate", "--max-tokens", "many"],
    ["generate", "--overflow", "sideways"],
    ["inspect", "--context", "x"],
    ["nosuchcommand"],
])
def test_argparse_errors_are_one_line_exit_2(argv: list[str], capsys: Any) -> None:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    line = one_line(err.encode())
    assert "usage:" not in line


def test_keep_without_max_kv_size_is_a_usage_error(capsys: Any) -> None:
    assert main(["generate", "--prompt", "hi", "--keep", "600"]) == 2
    assert "--max-kv-size" in one_line(capsys.readouterr().err.encode())


@pytest.mark.parametrize("argv", [
    ["generate", "--json", "--bogus"],
    ["generate", "--json", "--prompt", "hi", "--keep", "600"],
    ["generate", "--json", "--prompt", "hi", "--temp", "-1"],
])
def test_json_usage_errors_print_one_object(argv: list[str], capsys: Any) -> None:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    obj = one_object(out.encode())
    assert obj["finish_reason"] == "error" and obj["error"]
    assert obj["prompt_tokens"] == 0 and obj["ids"] == [] and obj["text"] == ""
    one_line(err.encode())


def test_json_load_error_prints_one_object(tmp_path: Path, capsys: Any) -> None:
    assert main(["generate", "--json", "--model", str(tmp_path / "none"), "--prompt", "x"]) == 1
    out, err = capsys.readouterr()
    obj = one_object(out.encode())
    assert obj["finish_reason"] == "error" and "not found" in obj["error"]
    one_line(err.encode())


def test_zero_context_config_names_the_key_not_keep(tmp_path: Path) -> None:
    folder = Path(shutil.copytree(STORIES260K, tmp_path / "m"))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["max_position_embeddings"] = 0
    (folder / "config.json").write_text(json.dumps(cfg))
    r = kvchat("generate", "--model", str(folder), "--prompt", "hi", "--json")
    assert r.returncode == 1
    assert "max_position_embeddings" in one_line(r.stderr) and "keep" not in r.stderr.decode()
    assert "max_position_embeddings" in one_object(r.stdout)["error"]


# ---- --json counts, text fidelity, control characters ----------------------------------


def test_turn_error_counts_agree_with_prompt_ids() -> None:
    r = kvchat("generate", "--model", str(STORIES260K), "--prompt", "Once upon a time " * 20,
               "--overflow", "refuse", "--max-kv-size", "16", "--json")
    assert r.returncode == 1, r.stderr
    obj = one_object(r.stdout)
    assert obj["finish_reason"] == "error" and obj["prompt_ids"]
    assert obj["prompt_tokens"] == len(obj["prompt_ids"])
    assert obj["generated_tokens"] == len(obj["ids"]) == 0


def test_non_utf8_stdin_is_decoded_with_replacement() -> None:
    r = kvchat("generate", "--model", str(STORIES260K), "--raw", "--max-tokens", "3",
               "--temp", "0", "--json", stdin=b"Once upon a caf\xe9 \xff\xfe time")
    assert r.returncode == 0, r.stderr
    obj = one_object(r.stdout)
    assert obj["prompt_tokens"] == len(obj["prompt_ids"]) > 3
    assert r.stderr == b""


HOSTILE = ["Hello ", "\x1b]52;c;aGVsbG8=\x07", "\x1b]0;pwned\x07", "\x1b[2J", "\x9b31m",
           "line\r", "\nend\x7f\r"]


class FakeRunner:
    """EngineClient's shape; streams a reply full of terminal escapes."""

    def __init__(self, model_path: str, on_delta: Any = None, timeout: float | None = None):
        self.on_delta = on_delta
        self.info = {"chat_template": True}  # the loaded model's (Loaded.info)

    def run(self, prompt: Any, params: Any) -> Done:
        for piece in HOSTILE:
            if self.on_delta:
                self.on_delta(piece)
        text = "".join(HOSTILE)
        return Done("eos", text, list(range(len(HOSTILE))), [1, 2, 3],
                    TurnStats(prompt_tokens=3))

    def close(self, timeout: float = 10.0) -> None:
        pass


def use_runner(monkeypatch: pytest.MonkeyPatch, runner: type[FakeRunner]) -> None:
    """`generate` gets `runner` from the engine service in place of a real client."""
    monkeypatch.setattr(EngineService, "client",
                        lambda self, model_path, **kw: runner(model_path, **kw))


def test_plain_output_makes_controls_visible_json_keeps_them(
    monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    use_runner(monkeypatch, FakeRunner)
    assert main(["generate", "--prompt", "hi"]) == 0
    out = capsys.readouterr().out
    assert not any(c in RAW_CONTROL for c in out), repr(out)
    assert out == "Hello ␛]52;c;aGVsbG8=␇␛]0;pwned␇␛[2J<9B>31mline\nend␡␍\n"

    assert main(["generate", "--prompt", "hi", "--json"]) == 0
    obj = one_object(capsys.readouterr().out.encode())
    assert obj["text"] == "".join(HOSTILE)  # exact; JSON escapes the controls itself


def test_error_line_from_a_template_makes_controls_visible(
    monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    class Failing(FakeRunner):
        def run(self, prompt: Any, params: Any) -> Done:
            return Done("error", "", [], [], TurnStats(), error="chat template error: \x1b]0;x\x07")

    use_runner(monkeypatch, Failing)
    assert main(["generate", "--prompt", "hi"]) == 1
    line = one_line(capsys.readouterr().err.encode())
    assert line.endswith("␛]0;x␇")


# ---- Ctrl+C and exits ------------------------------------------------------------------


def spawn(*args: str) -> subprocess.Popen[bytes]:
    return processes.popen([sys.executable, "-m", "kvchat.app", *args], cwd=REPO_ROOT, env=ENV,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def wait_for_output(p: subprocess.Popen[bytes], timeout: float = 60) -> bytes:
    assert p.stdout is not None
    os.set_blocking(p.stdout.fileno(), False)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        chunk = p.stdout.read(64)
        if chunk:
            return chunk
        time.sleep(0.02)
    p.kill()
    raise AssertionError("no output")


# past the story's end: stories260K writes BOS after a story, which ends a reply
ENDLESS = ["--model", str(STORIES260K), "--prompt", "Once upon a time", "--max-tokens",
           "1000000", "--max-kv-size", "64", "--temp", "0.8", "--ignore-eos"]


def test_ctrl_c_once_cancels_with_130_and_one_object() -> None:
    p = spawn("generate", *ENDLESS, "--json")
    time.sleep(3)  # loaded and generating (or still loading: the same contract holds)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 130, err
    obj = one_object(out)
    assert obj["finish_reason"] == "cancelled"
    assert obj["generated_tokens"] == len(obj["ids"])
    assert b"Traceback" not in err and err == b"", err


def test_ctrl_c_in_plain_mode_keeps_text_and_exits_130() -> None:
    p = spawn("generate", *ENDLESS)
    wait_for_output(p)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 130 and b"Traceback" not in err, err


def test_ctrl_c_twice_quits_within_2_s() -> None:
    p = spawn("generate", *ENDLESS)
    wait_for_output(p)
    p.send_signal(signal.SIGINT)
    p.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    _, err = p.communicate(timeout=30)
    assert time.monotonic() - t0 < 2.0
    assert p.returncode == 130 and b"Traceback" not in err and b"terminate" not in err, err


def started_native_imports(pid: int) -> bool:
    """kvchat's own imports are under way once MLX's library is mapped: from then on
    Ctrl+C is kvchat's to handle (before, Python itself is still initialising and prints
    its own "Fatal Python error"; no program can change that)."""
    try:
        return "libmlx" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc")
@pytest.mark.parametrize("delay", [0.0, 0.02, 0.05, 0.1, 0.2, 0.35, 0.6, 1.0])
def test_ctrl_c_during_start_up_never_prints_a_traceback(delay: float) -> None:
    p = spawn("generate", "--model", str(REPO_ROOT / "assets" / "kvchat-mini"), "--prompt",
              "hi", "--max-tokens", "200")
    deadline = time.monotonic() + 60
    while not started_native_imports(p.pid) and p.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.002)
    time.sleep(delay)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert b"Traceback" not in err and b"KeyboardInterrupt" not in err, err.decode()
    assert b"terminate called" not in err, err.decode()
    # interrupted (130), or already done when the signal came (0)
    assert p.returncode in (130, 0), (p.returncode, err)


def test_leaving_while_the_engine_is_busy_never_aborts() -> None:
    code = """
import time
import kvchat.model.runtime.engine as engine_mod
engine_mod.load_model = lambda path: time.sleep(30)
eng = engine_mod.Engine(lambda ev: None)
eng.load("slow")
time.sleep(0.5)
from kvchat.app.main import finish
t0 = time.monotonic()
finish(0)
"""
    t0 = time.monotonic()
    r = processes.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=ENV,
                      capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert b"terminate called" not in r.stderr and b"Traceback" not in r.stderr
    assert time.monotonic() - t0 < 0.5 + 2.0 + 5.0  # start-up (imports) + the 2 s bound


def test_models_listing_shows_hostile_folder_names_visibly(tmp_path: Path, capsys: Any) -> None:
    name = "evil\x1b]0;pwned\x07[bold]"
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / "model.safetensors").write_bytes(b"\0" * 16)
    assert main(["models", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "evil␛]0;pwned␇[bold]" in out
    assert not any(c in RAW_CONTROL for c in out)
    assert main(["models", "--dir", str(tmp_path), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["models"]
    assert name in {e["name"] for e in listed}  # --json keeps the exact name


def test_inspect_refuses_negative_sizes_naming_the_key(tmp_path: Path, capsys: Any) -> None:
    cfg = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": -2, "num_hidden_layers": 2, "intermediate_size": 128,
           "vocab_size": 100}
    f = tmp_path / "config.json"
    f.write_text(json.dumps(cfg))
    assert main(["inspect", "--config", str(f)]) == 1
    out, err = capsys.readouterr()
    assert "num_key_value_heads" in one_line(err.encode()) and "-" not in out


def test_an_error_caused_by_ctrl_c_counts_as_ctrl_c() -> None:
    """nanobind turns a Ctrl+C during MLX's module init into ImportError("Encountered an
    error while initializing the extension.") raised from the KeyboardInterrupt: exit 130,
    not an error line (seen once in CI at a 0.02 s interrupt)."""
    from kvchat.app.core.errors import interrupted

    def init() -> None:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as k:
            raise ImportError("Encountered an error while initializing the extension.") from k

    with pytest.raises(ImportError) as caught:
        init()
    assert interrupted(caught.value)
    assert not interrupted(ImportError("no module named x"))
    assert not interrupted(ValueError("x"))
