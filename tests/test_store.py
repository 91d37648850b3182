"""Conversation store: round trip, listing, corrupt files, atomic saves, Markdown export."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from kvchat.app.core import store as store_mod
from kvchat.app.core.store import (
    SCHEMA_VERSION,
    Conversation,
    ConversationStore,
    StoreError,
    atomic_write_text,
    derive_title,
    export_markdown,
    new_id,
    to_markdown,
)
from kvchat.model.errors import KVChatError
from tests.helpers import processes

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "data"
    monkeypatch.setenv("KVCHAT_DATA_DIR", str(d))
    return d


def sample(**kw: Any) -> Conversation:
    c = Conversation(model="/models/tiny", system_prompt="You are terse.", **kw)
    c.add_message("user", "  Hello there,\n how are   you today?  ")
    c.add_message("assistant", "Fine, thanks.")
    c.add_message("user", "Tell me a story")
    c.add_message("assistant", "Once upon a", stopped=True)
    return c


# --- model ---------------------------------------------------------------------------


def test_new_id_shape_and_uniqueness() -> None:
    ids = {new_id() for _ in range(200)}
    assert len(ids) == 200
    stamp, rand = next(iter(ids)).rsplit("-", 1)
    assert len(rand) == 6 and time.strptime(stamp, "%Y%m%d-%H%M%S")


def test_title_from_first_user_message() -> None:
    c = sample()
    assert c.title == "Hello there, how are you today?"
    long = "word " * 40
    t = derive_title([{"role": "system", "content": "x"}, {"role": "user", "content": long}])
    assert len(t) <= 50 and t.endswith("…") and not t[:-1].endswith(" ")
    assert derive_title([]) == "New chat"
    assert derive_title([{"role": "user", "content": "   "}]) == "New chat"
    assert len(derive_title([{"role": "user", "content": "x" * 200}])) == 50


def test_add_message_rejects_unknown_role() -> None:
    with pytest.raises(StoreError):
        Conversation().add_message("tool", "x")


def test_chat_messages_for_engine() -> None:
    msgs = sample().chat_messages()
    assert msgs[0] == {"role": "system", "content": "You are terse."}
    assert msgs[-1] == {"role": "assistant", "content": "Once upon a"}
    assert all(set(m) == {"role", "content"} for m in msgs)
    assert Conversation().chat_messages() == []


def test_dict_round_trip() -> None:
    c = sample()
    d = c.to_dict()
    assert d["version"] == SCHEMA_VERSION
    assert d["messages"][-1] == {"role": "assistant", "content": "Once upon a", "stopped": True}
    assert Conversation.from_dict(json.loads(json.dumps(d))) == c


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.update(version=SCHEMA_VERSION + 1),
        lambda d: d.update(version="1"),
        lambda d: d.update(id="../../etc/passwd"),
        lambda d: d.update(messages={"role": "user"}),
        lambda d: d["messages"].append({"role": "wizard", "content": "x"}),
        lambda d: d["messages"].append({"role": "user", "content": 5}),
        lambda d: d.update(created="yesterday"),
        lambda d: d.update(model=7),
    ],
)
def test_from_dict_rejects_malformed(mutate: Any) -> None:
    d = sample().to_dict()
    mutate(d)
    with pytest.raises(StoreError) as ei:
        Conversation.from_dict(d)
    assert "\n" not in str(ei.value) and isinstance(ei.value, KVChatError)


# --- store ---------------------------------------------------------------------------


def test_root_from_env_and_default(data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert ConversationStore().root == data_dir / "chats"
    monkeypatch.delenv("KVCHAT_DATA_DIR")
    monkeypatch.setattr(store_mod.platformdirs, "user_data_dir", lambda app: f"/d/{app}")
    assert ConversationStore().root == Path("/d/kvchat/chats")


def test_save_load_list_delete(tmp_path: Path) -> None:
    st = ConversationStore(tmp_path / "chats")
    a = sample(updated=100.0)
    b = Conversation(updated=200.0)
    b.add_message("user", "second chat")
    b.updated = 200.0
    a.updated = 100.0
    pa, pb = st.save(a), st.save(b)
    assert pa == tmp_path / "chats" / f"{a.id}.json"
    assert pb.is_file()
    assert st.load(a.id) == a
    assert [c.id for c in st.list()] == [b.id, a.id]  # newest first
    assert st.delete(a.id) is True
    assert st.delete(a.id) is False
    assert [c.id for c in st.list()] == [b.id]
    with pytest.raises(StoreError, match="no saved conversation"):
        st.load(a.id)


def test_save_fills_empty_title(tmp_path: Path) -> None:
    st = ConversationStore(tmp_path)
    c = Conversation(messages=[{"role": "user", "content": "hi there"}])
    st.save(c)
    assert c.title == "hi there" and st.load(c.id).title == "hi there"


def test_list_on_missing_root(tmp_path: Path) -> None:
    st = ConversationStore(tmp_path / "nothing")
    assert st.list() == [] and st.skipped == []


def test_bad_ids_refused(tmp_path: Path) -> None:
    st = ConversationStore(tmp_path / "chats")
    for bad in ("../x", "a/b", "", ".hidden", "x" * 200):
        with pytest.raises(StoreError):
            st.load(bad)
        with pytest.raises(StoreError):
            st.delete(bad)
    with pytest.raises(StoreError):
        st.save(Conversation(id="../escape"))


def test_corrupt_files_skipped_and_reported(tmp_path: Path) -> None:
    root = tmp_path / "chats"
    st = ConversationStore(root)
    good = sample()
    st.save(good)
    (root / "torn.json").write_text('{"version": 1, "id": "torn", "mess')
    (root / "binary.json").write_bytes(b"\xff\x00\xfe")
    (root / "list.json").write_text("[]")
    (root / "newer.json").write_text(json.dumps({**good.to_dict(), "version": 99}))
    (root / "notes.txt").write_text("ignored")
    convs = st.list()
    assert [c.id for c in convs] == [good.id]
    assert sorted(p.name for p, _ in st.skipped) == [
        "binary.json",
        "list.json",
        "newer.json",
        "torn.json",
    ]
    assert all("\n" not in why for _, why in st.skipped)
    with pytest.raises(StoreError, match="torn.json"):
        st.load("torn")


def test_renamed_file_follows_its_name(tmp_path: Path) -> None:
    st = ConversationStore(tmp_path)
    c = sample()
    st.save(c)
    (tmp_path / f"{c.id}.json").rename(tmp_path / "copy-1.json")
    assert st.load("copy-1").id == "copy-1"


def test_stale_temp_files_cleaned(tmp_path: Path) -> None:
    st = ConversationStore(tmp_path)
    st.save(sample())
    old = tmp_path / ".x.json.abc.tmp"
    fresh = tmp_path / ".y.json.def.tmp"
    old.write_text("partial")
    fresh.write_text("partial")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    assert len(st.list()) == 1
    assert not old.exists() and fresh.exists()  # a fresh one may be a live save's


# --- atomicity -----------------------------------------------------------------------


class _PartialWriter:
    """Wraps a real file: writes half the data, flushes it to disk, then fails."""

    def __init__(self, f: Any, exc: BaseException) -> None:
        self.f, self.exc = f, exc

    def __enter__(self) -> _PartialWriter:
        return self

    def __exit__(self, *a: Any) -> None:
        self.f.close()

    def fileno(self) -> int:
        return self.f.fileno()

    def write(self, text: str) -> int:
        self.f.write(text[: len(text) // 2])
        self.f.flush()
        raise self.exc


@pytest.mark.parametrize(
    ("exc", "raised"),
    [
        (OSError(28, "No space left on device"), StoreError),  # reported as one line
        (KeyboardInterrupt(), KeyboardInterrupt),
        (RuntimeError("boom"), RuntimeError),
    ],
)
def test_failed_write_keeps_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exc: BaseException, raised: type
) -> None:
    st = ConversationStore(tmp_path)
    c = sample()
    st.save(c)
    before = (tmp_path / f"{c.id}.json").read_bytes()

    real_fdopen = os.fdopen
    monkeypatch.setattr(
        os, "fdopen", lambda fd, *a, **k: _PartialWriter(real_fdopen(fd, *a, **k), exc)
    )
    c.add_message("user", "this save will fail " * 100)
    with pytest.raises(raised):
        st.save(c)
    monkeypatch.undo()

    assert (tmp_path / f"{c.id}.json").read_bytes() == before
    # the temp file removed, and no lock file left behind (none is held after a save)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{c.id}.json"]
    assert len(st.load(c.id).messages) == 4


def test_failed_replace_keeps_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "f.json"
    atomic_write_text(target, "old")

    def fail(src: str, dst: str) -> None:
        raise OSError(5, "I/O error")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        atomic_write_text(target, "new")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]


def test_store_save_error_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    st = ConversationStore(blocker / "chats")  # parent is a file: cannot mkdir
    with pytest.raises(StoreError) as ei:
        st.save(sample())
    assert "\n" not in str(ei.value)


_SAVER = textwrap.dedent(
    """
    import sys
    from kvchat.app.core.store import Conversation, ConversationStore
    st = ConversationStore(sys.argv[1])
    conv = Conversation(id="victim")
    pad = "x" * 200_000  # big saves widen the window a kill can land in
    n = 0
    while True:
        n += 1
        conv.add_message("user", f"turn {n} " + pad)
        st.save(conv)
        print(n, flush=True)
    """
)


def test_sigkill_during_saves_never_corrupts(tmp_path: Path) -> None:
    """A process killed with SIGKILL while saving in a loop leaves a loadable, complete
    conversation: the last save it finished or the one it was writing, never a torn file.
    Rounds repeat until a kill has landed mid-save (a temp file left behind) a few times,
    so the test provably exercised the dangerous moment."""
    rng = random.Random(1234)
    root = tmp_path / "chats"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    rounds = mid_save = 0
    while rounds < 40 and not (rounds >= 6 and mid_save >= 2):
        rounds += 1
        proc = processes.popen(
            [sys.executable, "-c", _SAVER, str(root)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=REPO,
        )
        try:
            assert proc.stdout is not None
            first = proc.stdout.readline()  # at least one complete save exists
            assert first.strip() == "1", first
            time.sleep(rng.random() * 0.1)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            printed = [int(x) for x in (first + proc.stdout.read()).split()]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        assert proc.returncode == -signal.SIGKILL
        conv = ConversationStore(root).load("victim")  # parses and validates
        n = len(conv.messages)
        # every finished save is on disk; at most the one in flight also made it
        assert printed[-1] <= n <= printed[-1] + 1
        for k, m in enumerate(conv.messages, 1):
            assert m["content"] == f"turn {k} " + "x" * 200_000
        # next round restarts from an empty conversation with the same id
        (root / "victim.json").unlink()
        tmps = list(root.glob(".*.tmp"))
        mid_save += bool(tmps)
        for tmp in tmps:  # left by a killed save; the store cleans old ones itself
            tmp.unlink()
    assert mid_save >= 1, f"no kill landed mid-save in {rounds} rounds"


# --- Markdown ------------------------------------------------------------------------


def test_to_markdown() -> None:
    md = to_markdown(sample(created=0.0))
    lines = md.splitlines()
    assert lines[0] == "# Hello there, how are you today?"
    assert "- Model: `/models/tiny`" in lines
    assert any(line.startswith("- Created: ") for line in lines)
    body = md[md.index("**System**") :]
    assert body.split("\n\n") == [
        "**System**",
        "You are terse.",
        "**User**",
        "Hello there,\n how are   you today?",
        "**Assistant**",
        "Fine, thanks.",
        "**User**",
        "Tell me a story",
        "**Assistant** (stopped)",
        "Once upon a\n",
    ]


def test_to_markdown_without_system_or_model() -> None:
    c = Conversation()
    c.add_message("user", "q")
    md = to_markdown(c)
    assert "**System**" not in md and "Model:" not in md
    assert md.startswith("# q\n")


def test_export_markdown(tmp_path: Path) -> None:
    c = sample()
    out = export_markdown(c, tmp_path / "sub" / "chat.md")
    assert out == tmp_path / "sub" / "chat.md"
    assert out.read_text() == to_markdown(c)
    assert out.stat().st_mode & 0o777 == 0o644
    into_dir = export_markdown(c, tmp_path)
    assert into_dir == tmp_path / f"{c.id}.md" and into_dir.is_file()


# --- the chat's K/V cache beside it ----------------------------------------------------


def test_cache_file_sits_beside_the_chat_and_goes_with_it(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path / "chats")
    conv = Conversation()
    conv.add_message("user", "hi")
    chat = store.save(conv)
    kv = store.cache_path(conv.id)
    assert kv == chat.with_name(f"{conv.id}.kv.safetensors")
    assert store.cache_bytes(conv.id) is None
    kv.write_bytes(b"x" * 1234)
    assert store.cache_bytes(conv.id) == 1234
    assert [c.id for c in store.list()] == [conv.id]  # the cache is not a chat
    assert store.delete(conv.id)
    assert not kv.exists() and not chat.exists()


def test_cache_settings_are_validated() -> None:
    from kvchat.app.core.settings import Settings, SettingsError

    s = Settings.from_dict({"save_kv_cache": "yes", "kv_cache_max_mib": -1})
    assert (s.save_kv_cache, s.kv_cache_max_mib) == (True, 256)  # defaults kept
    assert len(s.warnings) == 2 and "save_kv_cache must be true or false" in s.warnings[0]
    s = Settings.from_dict({"save_kv_cache": False, "kv_cache_max_mib": 64.0})
    assert (s.save_kv_cache, s.kv_cache_max_mib, s.warnings) == (False, 64, [])
    with pytest.raises(SettingsError, match="kv_cache_max_mib"):
        Settings(kv_cache_max_mib=-5).validate()
