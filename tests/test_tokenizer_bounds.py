"""Encoding untrusted text is bounded: a tokenizer.json whose pre-tokenizer regex makes the
Rust library panic fails one turn in one line and the engine answers the next; a text past
`MAX_ENCODE_CHARS` is refused before any work; a slow regex meets the deadline, Esc stops
the wait, and a worker still stuck refuses the next text rather than piling up."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from kvchat.model.runtime.client import EngineClient
from kvchat.model.runtime.events import GenParams
from kvchat.model.text import tokenizer as tokmod
from kvchat.model.text.tokenizer import (
    MAX_ENCODE_CHARS,
    TokenizeCancelled,
    TokenizerError,
    load_tokenizer,
)
from tests.helpers.paths import STORIES260K

# Catastrophic backtracking: Oniguruma gives up past its retry limit, and the library
# unwraps that error into a panic (pyo3_runtime.PanicException, a BaseException).
PATHOLOGICAL = "(x+x+)+y"
PANICS = "y" + "x" * 30  # past the retry limit: a panic within about a second
SLOW = "y" + "x" * 22  # under the limit: a fraction of a second, no panic
# forty runs that each backtrack under the limit: seconds of work, never a panic
SLOWER = "y" + ("x" * 20 + " ") * 40
PARAMS = GenParams(max_tokens=8, temp=0.0, ignore_eos=True)


def _hostile_copy(root: Path) -> Path:
    """stories260K with a regex Split before its Metaspace pre-tokenizer (text without an
    'x' tokenizes exactly as before)."""
    folder = root / "stories-hostile"
    shutil.copytree(STORIES260K, folder)
    path = folder / "tokenizer.json"
    path.chmod(0o644)
    data = json.loads(path.read_text())
    data["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": PATHOLOGICAL}, "behavior": "Isolated",
         "invert": False},
        data["pre_tokenizer"]]}
    path.write_text(json.dumps(data))
    return folder


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _hostile_copy(tmp_path_factory.mktemp("tok"))


def test_the_library_really_panics_on_this_file(hostile: Path) -> None:
    """The premise: the raw library call raises a BaseException that is no Exception."""
    from tokenizers import Tokenizer as RustTokenizer

    raw = RustTokenizer.from_file(str(hostile / "tokenizer.json"))
    with pytest.raises(BaseException) as info:
        raw.encode(PANICS)
    assert not isinstance(info.value, Exception)
    assert type(info.value).__name__ == "PanicException"


def test_a_panic_is_one_tokenizer_error_line(hostile: Path) -> None:
    tok = load_tokenizer(hostile)
    with pytest.raises(TokenizerError) as info:
        tok.encode(PANICS)
    line = str(info.value)
    assert line.startswith("the tokenizer failed on 31 characters: ") and "\n" not in line
    assert "retry-limit-in-match" in line
    # ordinary text is unaffected and matches the untouched model's tokenizer
    plain = load_tokenizer(STORIES260K)
    assert tok.encode("Once upon a time") == plain.encode("Once upon a time") == [
        1, 403, 407, 261, 378]


def test_the_engine_fails_that_turn_and_answers_the_next(hostile: Path) -> None:
    """Through the real engine: the panic ends its turn with one line; the next turn's
    reply equals the untouched model's (the engine thread lives on)."""
    with EngineClient(STORIES260K, timeout=120) as c:
        want = c.run("Once upon a time", PARAMS)
    with EngineClient(hostile, timeout=120) as c:
        bad = c.run(PANICS, PARAMS)
        chat = c.run([{"role": "user", "content": PANICS}], PARAMS)
        good = c.run("Once upon a time", PARAMS)
    for done in (bad, chat):
        assert done.finish_reason == "error" and done.ids == []
        assert done.error is not None and "\n" not in done.error
        assert done.error.startswith("the tokenizer failed on ")
    assert good.finish_reason == "length" and good.error is None
    assert good.ids == want.ids and len(want.ids) == 8


@pytest.mark.parametrize("kind", ["hf", "sentencepiece"])
def test_text_past_the_cap_is_refused_before_any_work(monkeypatch: pytest.MonkeyPatch,
                                                       kind: str) -> None:
    tok = load_tokenizer(STORIES260K, prefer=kind)  # type: ignore[arg-type]
    called: list[tuple[object, ...]] = []
    monkeypatch.setattr(tok._backend, "encode", lambda *a: called.append(a) or [])
    with pytest.raises(TokenizerError, match=f"longer than the {MAX_ENCODE_CHARS:,}"):
        tok.encode("a" * (MAX_ENCODE_CHARS + 1))
    assert called == []
    assert tok.encode("a" * MAX_ENCODE_CHARS, add_special_tokens=False) == []
    assert len(called) == 1


def _wait_idle(tok, limit_s: float = 60.0) -> None:
    stuck = tok._backend._stuck
    if stuck is not None:
        stuck.join(limit_s)
        assert not stuck.is_alive()


def test_a_slow_regex_meets_the_deadline_and_a_stuck_worker_refuses_more(
        hostile: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = load_tokenizer(hostile)
    monkeypatch.setattr(tokmod, "ENCODE_BASE_S", 0.0)
    monkeypatch.setattr(tokmod, "ENCODE_CHARS_PER_S", 10**9)
    with pytest.raises(TokenizerError, match=f"took longer than 0 s on {len(SLOWER):,} char"):
        tok.encode(SLOWER)
    with pytest.raises(TokenizerError, match="still working on an earlier text"):
        tok.encode("Once upon a time")
    _wait_idle(tok)
    monkeypatch.undo()
    assert tok.encode("Once upon a time") == [1, 403, 407, 261, 378]
    assert tok.encode(SLOW, add_special_tokens=False)  # it finishes, given the time


def test_cancel_stops_the_wait(hostile: Path) -> None:
    tok = load_tokenizer(hostile)
    t0 = time.monotonic()
    with pytest.raises(TokenizeCancelled):
        tok.encode(SLOWER, should_stop=lambda: time.monotonic() - t0 > 0.05)
    _wait_idle(tok)


def test_serve_refuses_the_text_and_stays_healthy(hostile: Path) -> None:
    """The server tokenizes before it queues: the panic is a 400 naming the tokenizer,
    /health stays ok and idle (no job left running), and the next request is answered."""
    try:
        import httpx
    except ImportError:
        import httpx2 as httpx
    from tests.helpers.server_process import ServerProcess

    s = ServerProcess(str(hostile), timeout_s=120)
    try:
        base = s.url.removesuffix("/v1")
        post = {"model": "stories-hostile", "max_tokens": 4, "temperature": 0}
        r = httpx.post(s.url + "/completions", json={**post, "prompt": PANICS}, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"].startswith("the tokenizer failed on ")
        assert httpx.get(base + "/health", timeout=10).json() == {
            "status": "ok", "engine": "idle", "running_s": None, "waiting": 0}
        r = httpx.post(s.url + "/completions", json={**post, "prompt": "Once upon a time"},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        assert s.stop() == 0, "\n".join(s.lines[-5:])
    assert all("Traceback" not in x for x in s.lines)
