"""Every JSON file the app reads goes through one defensive loader (model/files.load_json):
valid-but-unusual JSON (a lone surrogate, 100,000 levels of nesting, wrong types), bytes
that are not UTF-8, and a FIFO or folder where a file should be, in settings.json,
session.json, a chat file or a killed save's leftover, each give a one-line notice naming
the file and defaults / a skipped entry; nothing raises, nothing blocks, and a write
never fails on text the app read."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvchat.app.core.settings import Settings, load_settings, remember_model, save_settings
from kvchat.app.core.store import Conversation, ConversationStore, atomic_write_text
from kvchat.app.tui.session import SessionState, load_session, save_session
from kvchat.model.files import BadJSONFile, load_json
from tests.helpers import processes

CHAT = Conversation(id="20260101-000000-abcdef").to_dict()


def _surrogate(doc: dict[str, Any]) -> str:
    return json.dumps({**doc, "title": "x\udfff"}, ensure_ascii=True)  # "\udfff": valid JSON


BAD: dict[str, Callable[[Path, dict[str, Any]], None]] = {
    "lone surrogate": lambda p, doc: p.write_text(_surrogate(doc)),
    "deep nesting": lambda p, doc: p.write_text("[" * 100_000 + "]" * 100_000),
    "deep in a field": lambda p, doc: p.write_text(
        json.dumps({**doc, "x": 1})[:-1] + ', "y": ' + "[" * 5000 + "]" * 5000 + "}"),
    "a list, not an object": lambda p, doc: p.write_text("[1, 2]"),
    "not UTF-8": lambda p, doc: p.write_bytes(b'{"title": "\xff\xfe"}'),
    "a FIFO": lambda p, doc: os.mkfifo(p),
    "a folder": lambda p, doc: p.mkdir(),
}


def _no_block(fn: Callable[[], Any], path: Path) -> Any:
    """Run fn in a thread; a FIFO that blocks it fails the test instead of hanging it."""
    out: list[Any] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the test
            err.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"blocked reading {path.name}")
    if err:
        raise err[0]
    return out[0]


@pytest.mark.parametrize("kind", BAD)
def test_bad_settings_file_gives_defaults_and_names_the_file(tmp_path: Path, kind: str) -> None:
    p = tmp_path / "settings.json"
    BAD[kind](p, {"temp": 0.5})
    s = _no_block(lambda: load_settings(p), p)
    assert s.temp == Settings().temp
    assert len(s.warnings) == 1 and str(p) in s.warnings[0] and "\n" not in s.warnings[0]
    # the app's own bookkeeping leaves a bad file alone; it is never a traceback
    s.last_model = "/m"
    assert _no_block(lambda: remember_model(s, p), p) is False


def test_settings_with_a_surrogate_save_cleanly_after_the_user_saves(tmp_path: Path) -> None:
    p = tmp_path / "settings.json"
    p.write_text(json.dumps({"system_prompt": "Be \udfff brief."}))
    s = load_settings(p)
    assert s.warnings and "lone surrogate" in s.warnings[0]
    s.system_prompt = "Be brief."
    save_settings(s, p)  # the bad file is kept as a backup, the new one written
    assert json.loads(p.read_text())["system_prompt"] == "Be brief."
    assert (tmp_path / "settings.json.1.bak").exists()


@pytest.mark.parametrize("kind", BAD)
def test_bad_session_file_is_a_fresh_start_with_a_notice(tmp_path: Path, kind: str) -> None:
    p = tmp_path / "session.json"
    BAD[kind](p, {"last_chat": "x", "input_history": ["a"]})
    state = _no_block(lambda: load_session(p), p)
    assert state.last_chat is None and state.input_history == []
    assert state.problem and str(p) in state.problem and "\n" not in state.problem


@pytest.mark.parametrize("kind", BAD)
def test_bad_chat_file_is_skipped_naming_it(tmp_path: Path, kind: str) -> None:
    root = tmp_path / "chats"
    store = ConversationStore(root)
    good = Conversation()
    good.add_message("user", "hello")
    store.save(good)
    bad = root / f"{CHAT['id']}.json"
    BAD[kind](bad, CHAT)
    convs = _no_block(store.list, bad)
    assert [c.id for c in convs] == [good.id]
    assert [(f.name, "\n" in why) for f, why in store.skipped] == [(bad.name, False)]
    assert bad.name in store.skipped[0][1]


@pytest.mark.parametrize("kind", BAD)
def test_bad_leftover_temp_file_never_stops_start_up(tmp_path: Path, kind: str) -> None:
    root = tmp_path / "chats"
    conv = Conversation(id=CHAT["id"])
    conv.add_message("user", "mine")
    ConversationStore(root).save(conv)
    leftover = root / f".{conv.id}.json.abc123.tmp"
    BAD[kind](leftover, CHAT)
    store = _no_block(lambda: ConversationStore(root), leftover)
    assert store.recovered == []
    assert store.load(conv.id).messages[0]["content"] == "mine"


def test_writes_replace_lone_surrogates_instead_of_failing(tmp_path: Path) -> None:
    p = tmp_path / "x.txt"
    atomic_write_text(p, "a\udfffb\ud800")
    assert p.read_text(encoding="utf-8") == "a\ufffdb\ufffd"
    # a chat and the session holding one (e.g. pasted from a broken source) still save
    store = ConversationStore(tmp_path / "chats")
    conv = Conversation()
    conv.add_message("user", "typed \udfff words")
    store.save(conv)
    assert store.load(conv.id).messages[0]["content"] == "typed \ufffd words"
    save_session(tmp_path / "session.json", SessionState("x", ["h\udfff"]))
    assert load_session(tmp_path / "session.json").input_history == ["h\ufffd"]


def test_loader_contract(tmp_path: Path) -> None:
    p = tmp_path / "a.json"
    with pytest.raises(FileNotFoundError):
        load_json(p)
    p.write_text('{"a": [1, {"b": "c"}]}')
    assert load_json(p) == {"a": [1, {"b": "c"}]}
    p.write_text("[1]")
    assert load_json(p, list) == [1]
    p.write_text('"x"')
    with pytest.raises(BadJSONFile, match=r"a\.json: holds a JSON string, not an object"):
        load_json(p)
    p.write_text("[" * 64 + "]" * 64)
    assert load_json(p, list)
    p.write_text("[" * 65 + "]" * 65)
    with pytest.raises(BadJSONFile, match="nested deeper than 64 levels"):
        load_json(p, list)
    p.write_text("x" * 100)
    with pytest.raises(BadJSONFile, match="over the 10-byte limit"):
        load_json(p, limit=10)


def test_history_names_a_skipped_chat_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    import asyncio

    from kvchat.app.tui.app import KVChatApp
    from kvchat.app.tui.screens import HistoryScreen
    from tests.helpers.scripted_engine import ScriptedEngine, record_notifications, wait_for

    monkeypatch.setenv("KVCHAT_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("KVCHAT_DATA_DIR", str(tmp_path / "data"))
    root = tmp_path / "data" / "chats"
    root.mkdir(parents=True)
    (root / "20260101-000000-abcdef.json").write_text("[" * 100_000)

    async def run() -> None:
        app = KVChatApp("/models/m", Settings(),
                        engine_factory=lambda cb, p: ScriptedEngine(cb, p))
        seen = record_notifications(app)
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: bool(app.chat.model_info))
            await pilot.press("f2")
            await wait_for(pilot, lambda: isinstance(app.screen, HistoryScreen))
            await pilot.pause()
        msgs = [m for m, sev in seen if sev == "warning"]
        assert any("20260101-000000-abcdef.json: nested deeper than 64 levels" in m
                   for m in msgs), msgs

    asyncio.run(run())


@pytest.mark.parametrize("kind", ["a FIFO", "deep nesting", "lone surrogate"])
def test_every_command_starts_with_a_bad_settings_file(tmp_path: Path, kind: str) -> None:
    """A FIFO (it used to hang every command), 100,000 levels (a RecursionError before
    anything started) or a lone surrogate: one warning naming the file, exit 0."""
    import sys

    from tests.helpers.paths import REPO_ROOT

    cfg = tmp_path / "config"
    cfg.mkdir()
    BAD[kind](cfg / "settings.json", {"temp": 0.5})
    r = processes.run([sys.executable, "-m", "kvchat.app", "models"], capture_output=True,
                      text=True, cwd=REPO_ROOT, timeout=60,
                      env={**os.environ, "KVCHAT_CONFIG_DIR": str(cfg),
                            "KVCHAT_DATA_DIR": str(tmp_path / "data")})
    assert r.returncode == 0, r.stderr
    warn = [ln for ln in r.stderr.splitlines() if "settings.json" in ln]
    assert len(warn) == 1 and "using default settings" in warn[0], r.stderr
    assert "Traceback" not in r.stderr
