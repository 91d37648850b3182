"""One writer per chat: two kvchat processes on one data folder never lose a
turn. A store holds an advisory lock per chat it saves or opens; the lock dies with its
process; a second window opens a copy and says so; a save of a chat another window holds
is refused in one line, never merged or overwritten."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvchat.app.core.store import ChatBusy, Conversation, ConversationStore
from kvchat.app.tui.session import SessionState, save_session
from tests.helpers import processes
from tests.helpers.app import folder_app, ready, turn
from tests.helpers.paths import REPO_ROOT
from tests.helpers.scripted_engine import async_test, record_notifications, wait_for

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="flock is POSIX")


def _chat(text: str) -> Conversation:
    c = Conversation()
    c.add_message("user", text)
    c.add_message("assistant", "ok")
    return c


def test_a_second_store_cannot_save_or_delete_a_held_chat(tmp_path: Path) -> None:
    a, b = ConversationStore(tmp_path), ConversationStore(tmp_path)
    conv = _chat("mine")
    a.save(conv)
    assert not b.busy(conv.id)  # a plain save holds the lock only while it writes
    assert a.claim(conv.id)  # a window claims the chat it shows
    assert b.busy(conv.id) and not b.claim(conv.id)
    theirs = b.load(conv.id)
    theirs.add_message("user", "from the other window")
    with pytest.raises(ChatBusy, match="is open in another kvchat window; not saved"):
        b.save(theirs)
    with pytest.raises(ChatBusy, match="not deleted"):
        b.delete(conv.id)
    assert [m["content"] for m in a.load(conv.id).messages] == ["mine", "ok"]
    a.release(conv.id)  # the first window moved on
    b.save(theirs)
    assert not a.busy(conv.id)
    assert a.load(conv.id).messages[-1]["content"] == "from the other window"


def test_the_lock_dies_with_its_process(tmp_path: Path) -> None:
    conv = _chat("x")
    ConversationStore(tmp_path).save(conv)
    code = ("import sys, time; from kvchat.app.core.store import ConversationStore as S;"
            f"s = S({str(tmp_path)!r}); assert s.claim({conv.id!r}); print('held', flush=True);"
            " time.sleep(60)")
    # its own process group, killed when the test ends if it is still running
    p = processes.popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                        cwd=REPO_ROOT)
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    store = ConversationStore(tmp_path)
    assert store.busy(conv.id)
    os.kill(p.pid, signal.SIGKILL)
    p.wait(10)
    assert store.claim(conv.id)  # no stale lock after a crash


@async_test
async def test_second_window_opens_a_copy_and_no_turn_is_lost(models_env: Path) -> None:
    root = models_env / "data" / "chats"
    other = ConversationStore(root)  # the first window, holding its chat
    conv = _chat("first window's words")
    other.claim(conv.id)
    other.save(conv)
    save_session(root.parent / "session.json", SessionState(last_chat=conv.id))

    app = folder_app(models_env)
    seen = record_notifications(app)
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await wait_for(pilot, lambda: bool(app.chat.conversation.messages))
        mine = app.chat.conversation
        assert mine.id != conv.id and mine.title.endswith("(copy)")
        assert [m["content"] for m in mine.messages] == ["first window's words", "ok"]
        assert any("open in another kvchat window; this is a copy" in m for m, _ in seen)
        await turn(pilot, "second window's words")
    # the first window goes on with its own chat meanwhile
    conv.add_message("user", "first window again")
    other.save(conv)
    on_disk = json.loads((root / f"{conv.id}.json").read_text())
    assert [m["content"] for m in on_disk["messages"]] == [
        "first window's words", "ok", "first window again"]
    copy = ConversationStore(root).load(mine.id)
    assert [m["content"] for m in copy.messages][:3] == [
        "first window's words", "ok", "second window's words"]



def _locks(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob(".*.lock"))


def test_lock_files_go_when_the_chats_are_let_go(tmp_path: Path) -> None:
    """A lock file exists only while a store holds its chat: saves, busy checks, release,
    close and delete leave none behind."""
    store = ConversationStore(tmp_path)
    convs = [_chat(f"chat {i}") for i in range(3)]
    for c in convs:
        store.save(c)  # a plain save locks while it writes
    assert _locks(tmp_path) == []
    assert not store.busy(convs[0].id) and _locks(tmp_path) == []
    assert store.claim(convs[0].id) and store.claim(convs[1].id)
    assert _locks(tmp_path) == sorted(f".{c.id}.lock" for c in convs[:2])
    other = ConversationStore(tmp_path)
    assert other.busy(convs[0].id)  # held, and the file stays while it is
    store.release(convs[0].id)
    assert _locks(tmp_path) == [f".{convs[1].id}.lock"]
    assert other.claim(convs[0].id)  # free again: a fresh file under the same name
    other.close()
    store.delete(convs[1].id)
    store.claim(convs[2].id)
    store.close()
    assert _locks(tmp_path) == []


def test_a_killed_holders_lock_file_is_removed_when_listing(tmp_path: Path) -> None:
    conv = _chat("x")
    ConversationStore(tmp_path).save(conv)
    code = ("import time; from kvchat.app.core.store import ConversationStore as S;"
            f"s = S({str(tmp_path)!r}); assert s.claim({conv.id!r}); print('held', flush=True);"
            " time.sleep(60)")
    p = processes.popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                        cwd=REPO_ROOT)
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    store = ConversationStore(tmp_path)
    store.list()  # a live holder's file is kept
    assert _locks(tmp_path) == [f".{conv.id}.lock"] and store.busy(conv.id)
    os.kill(p.pid, signal.SIGKILL)
    p.wait(10)
    assert _locks(tmp_path) == [f".{conv.id}.lock"]  # the kernel dropped the lock, not the file
    store.list()
    assert _locks(tmp_path) == []
    assert store.claim(conv.id)


def test_a_claim_never_holds_a_file_removed_under_it(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The race the removal opens: a claim opens the file, its holder removes it and lets
    go, the claim locks the removed file. It must try again on the name, or two windows
    would each hold a lock (on two different files) for one chat."""
    from kvchat.app.core import store as store_mod

    conv = _chat("x")
    a, b = ConversationStore(tmp_path), ConversationStore(tmp_path)
    a.save(conv)
    assert a.claim(conv.id)
    real_flock = store_mod.fcntl.flock
    raced = []

    def flock(fd: int, op: int) -> None:
        if not raced:  # b has opened a's file; a lets go (removing it) before b locks
            raced.append(True)
            a.release(conv.id)
        real_flock(fd, op)

    monkeypatch.setattr(store_mod.fcntl, "flock", flock)
    assert b.claim(conv.id) and raced
    monkeypatch.undo()
    assert _locks(tmp_path) == [f".{conv.id}.lock"]
    assert not a.claim(conv.id)  # b holds the file under the name, so a cannot
    b.close()
