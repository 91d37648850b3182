"""Nothing the user wrote is lost:

- a settings file with bad values is used leniently and never rewritten until the user
  saves settings; then the original is kept as a numbered backup (an older backup stays)
  and keys kvchat does not know survive;
- the user's message is on disk before the reply starts;
- a temp file a killed save left behind, newer than its chat, is recovered at start-up;
- a FIFO among the chats never freezes the history.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvchat.app.core.settings import load_settings, remember_model, save_settings
from kvchat.app.core.store import Conversation, ConversationStore
from kvchat.app.tui.app import KVChatApp
from tests.helpers.scripted_engine import ScriptedEngine, async_test, wait_for


@pytest.fixture
def config_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "config"
    monkeypatch.setenv("KVCHAT_CONFIG_DIR", str(d))
    monkeypatch.setenv("KVCHAT_DATA_DIR", str(tmp_path / "data"))
    d.mkdir()
    return d


ORIGINAL = {"temp": "hot", "top_k": 40, "system_prompt": "Be brief.", "my_note": "keep me"}


def test_bad_settings_are_lenient_and_never_rewritten_until_saved(config_dir: Path) -> None:
    f = config_dir / "settings.json"
    raw = json.dumps(ORIGINAL, indent=3)
    f.write_text(raw)
    (config_dir / "settings.json.bak").write_text("an older backup")
    s = load_settings()
    assert s.top_k == 40 and s.system_prompt == "Be brief." and s.temp == 0.7
    assert s.warnings and "temp" in s.warnings[0]

    # the app remembers the model it loaded: not at the cost of the user's file
    s.last_model = "/models/x"
    assert remember_model(s) is False
    assert f.read_text() == raw

    # the user saves settings: the original is kept, numbered; the older backup too
    s.temp = 0.5
    save_settings(s)
    assert (config_dir / "settings.json.1.bak").read_text() == raw
    assert (config_dir / "settings.json.bak").read_text() == "an older backup"
    saved = json.loads(f.read_text())
    assert saved["temp"] == 0.5 and saved["top_k"] == 40 and saved["my_note"] == "keep me"
    assert load_settings().warnings == []

    # a clean file is updated in place by remember_model, keeping unknown keys
    assert remember_model(s) is True
    saved = json.loads(f.read_text())
    assert saved["last_model"] == "/models/x" and saved["my_note"] == "keep me"


def test_each_save_over_a_bad_file_gets_its_own_backup(config_dir: Path) -> None:
    f = config_dir / "settings.json"
    for i, content in enumerate([b"{not json", b'{"temp": -3}'], start=1):
        f.write_bytes(content)
        s = load_settings()
        assert s.warnings
        assert f.read_bytes() == content  # loading never touches it
        save_settings(s)
        assert (config_dir / f"settings.json.{i}.bak").read_bytes() == content
    assert sorted(p.name for p in config_dir.glob("*.bak")) == [
        "settings.json.1.bak", "settings.json.2.bak"]


def test_a_clean_file_is_not_backed_up(config_dir: Path) -> None:
    f = config_dir / "settings.json"
    f.write_text(json.dumps({"temp": 0.3}))
    s = load_settings()
    s.top_p = 0.9
    save_settings(s)
    assert not list(config_dir.glob("*.bak"))


# ---- chats -----------------------------------------------------------------------------


@async_test
async def test_user_message_is_saved_before_the_reply_starts(config_dir: Path) -> None:
    engines: list[ScriptedEngine] = []

    def factory(on_event: Any, p: str | None) -> ScriptedEngine:
        engines.append(ScriptedEngine(on_event, p, pause_after=0))
        return engines[-1]

    from kvchat.app.core.settings import Settings

    app = KVChatApp("/models/m", Settings(), engine_factory=factory)
    async with app.run_test() as pilot:
        await wait_for(pilot, lambda: bool(app.chat.model_info))
        await app.chat.send("my precious words")
        await wait_for(pilot, lambda: engines[0].paused.is_set())
        on_disk = ConversationStore().load(app.chat.conversation.id)
        assert [m["content"] for m in on_disk.messages] == ["my precious words"]
        engines[0].resume()
        await wait_for(pilot, lambda: not app.chat.generating)


def write_tmp(root: Path, conv: Conversation, mtime: float) -> Path:
    tmp = root / f".{conv.id}.json.abc123.tmp"
    tmp.write_text(json.dumps(conv.to_dict()))
    os.utime(tmp, (mtime, mtime))
    return tmp


def saved_chat(root: Path, text: str) -> tuple[Conversation, Path]:
    conv = Conversation()
    conv.add_message("user", text)
    return conv, ConversationStore(root).save(conv)


def test_newer_temp_file_is_recovered_at_start_up(tmp_path: Path) -> None:
    root = tmp_path / "chats"
    conv, path = saved_chat(root, "first")
    old = time.time() - 100
    os.utime(path, (old, old))
    conv.add_message("assistant", "reply")
    conv.add_message("user", "second, not yet renamed when the process died")
    tmp = write_tmp(root, conv, old + 50)

    store = ConversationStore(root)  # start-up
    assert [m["content"] for m in store.load(conv.id).messages][-1].startswith("second")
    assert not tmp.exists()
    assert store.recovered == [conv.id]


def test_older_or_torn_temp_files_never_replace_the_chat(tmp_path: Path) -> None:
    root = tmp_path / "chats"
    conv, path = saved_chat(root, "current")
    stale = Conversation(id=conv.id)
    stale.add_message("user", "older")
    older = write_tmp(root, stale, path.stat().st_mtime - 100)
    torn = root / f".{conv.id}.json.torn.tmp"
    torn.write_text('{"version": 1, "id": "')
    store = ConversationStore(root)
    assert store.load(conv.id).messages[0]["content"] == "current"
    assert store.recovered == []
    assert not older.exists()  # an older save's leftover is of no use
    assert torn.exists()  # a young torn file may still be a live save's: left alone


def test_temp_file_without_its_chat_is_recovered(tmp_path: Path) -> None:
    root = tmp_path / "chats"
    root.mkdir()
    conv = Conversation()
    conv.add_message("user", "only in the temp file")
    write_tmp(root, conv, time.time())
    store = ConversationStore(root)
    assert store.load(conv.id).messages[0]["content"] == "only in the temp file"


def test_fifo_in_the_chats_folder_never_freezes_the_history(tmp_path: Path) -> None:
    root = tmp_path / "chats"
    conv, _ = saved_chat(root, "hello")
    os.mkfifo(root / "20990101-000000-aaaaaa.json")
    os.mkfifo(root / ".20990101-000000-bbbbbb.json.x.tmp")
    result: list[Any] = []
    t = threading.Thread(target=lambda: result.append(ConversationStore(root).list()),
                         daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():  # unblock the reader so the test run can end, then fail
        fd = os.open(root / "20990101-000000-aaaaaa.json", os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        pytest.fail("listing chats blocked on a FIFO")
    convs = result[0]
    assert [c.id for c in convs] == [conv.id]


@async_test
async def test_quit_asks_when_the_chat_could_not_be_saved(
        config_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk: the turn's save fails (one toast), and Ctrl+Q does not quit silently:
    it tries again, says the turns would be lost, and only a second Ctrl+Q leaves. Once
    the disk has room, one Ctrl+Q saves the chat and quits."""
    import errno

    from kvchat.app.core import store as store_mod
    from kvchat.app.core.settings import Settings
    from tests.helpers.scripted_engine import record_notifications

    real_write = store_mod.atomic_write_text

    def disk_full(*a: Any, **kw: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    def factory(on_event: Any, p: str | None) -> ScriptedEngine:
        return ScriptedEngine(on_event, p)

    monkeypatch.setattr(store_mod, "atomic_write_text", disk_full)
    app = KVChatApp("/models/m", Settings(), engine_factory=factory)
    async with app.run_test() as pilot:
        seen = record_notifications(app)
        await wait_for(pilot, lambda: bool(app.chat.model_info))
        await app.chat.send("words I typed")
        await wait_for(pilot, lambda: not app.chat.generating and len(
            app.chat.conversation.messages) == 2)
        assert any("No space left on device" in m for m, _ in seen)
        await pilot.press("ctrl+q")
        await pilot.pause()
        assert app.is_running
        assert "Press Ctrl+Q again to quit without them" in seen[-1][0]
        await pilot.press("ctrl+q")
        await wait_for(pilot, lambda: not app.is_running)
    assert not list((config_dir.parent / "data").rglob("*.json"))  # really lost, as warned

    app = KVChatApp("/models/m", Settings(), engine_factory=factory)
    async with app.run_test() as pilot:
        await wait_for(pilot, lambda: bool(app.chat.model_info))
        await app.chat.send("words I typed")
        await wait_for(pilot, lambda: not app.chat.generating and len(
            app.chat.conversation.messages) == 2)
        assert app.chat.unsaved
        monkeypatch.setattr(store_mod, "atomic_write_text", real_write)  # room again
        await pilot.press("ctrl+q")
        await wait_for(pilot, lambda: not app.is_running)
        conv_id = app.chat.conversation.id
    saved = ConversationStore().load(conv_id)
    assert [m["role"] for m in saved.messages] == ["user", "assistant"]
