"""Issue 19: a file that opens but whose read fails ("[Errno 22] Invalid argument", the
one-liner that named nothing) is reported in one line that names the file, wherever the
app reads it: a model folder's files, settings, the session, a chat, a hostfile.

The failing read is real, not mocked: Linux's /proc/self/attr/current opens and then
fails every read() with EINVAL; each file is a symlink to it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvchat.app.core.hosts import HostsError, read_hostfile
from kvchat.app.core.settings import load_settings
from kvchat.app.core.store import ConversationStore, StoreError, new_id
from kvchat.app.main import main
from kvchat.app.tui.session import load_session
from kvchat.model.cache.integrity import model_fingerprint
from kvchat.model.distributed.link import folder_fingerprint
from tests.helpers.paths import STORIES260K

EINVAL_FILE = Path("/proc/self/attr/current")


def _reads_einval() -> bool:
    try:
        with open(EINVAL_FILE, "rb") as f:
            f.read(8)
    except OSError as e:
        return e.errno == 22
    return False


needs_einval = pytest.mark.skipif(not _reads_einval(),
                                  reason=f"no {EINVAL_FILE} whose read fails with EINVAL")


def _unreadable(path: Path) -> Path:
    path.unlink(missing_ok=True)
    path.symlink_to(EINVAL_FILE)
    return path


@needs_einval
@pytest.mark.parametrize("name", [
    "config.json", "model.safetensors", "model.safetensors.index.json",
    "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
])
def test_model_file_that_cannot_be_read_is_named(name: str, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "m"
    shutil.copytree(STORIES260K, folder)
    _unreadable(folder / name)
    code = main(["generate", "--model", str(folder), "--prompt", "hi", "--max-tokens", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith("kvchat: error: ") and name in err[0], err


@needs_einval
def test_settings_that_cannot_be_read_are_named_and_defaults_used(tmp_path: Path) -> None:
    s = load_settings(_unreadable(tmp_path / "settings.json"))
    assert len(s.warnings) == 1 and "settings.json" in s.warnings[0], s.warnings
    assert s.temp == type(s)().temp  # the defaults


@needs_einval
def test_session_that_cannot_be_read_is_named(tmp_path: Path) -> None:
    state = load_session(_unreadable(tmp_path / "session.json"))
    assert state.last_chat is None and state.problem and "session.json" in state.problem


@needs_einval
def test_chat_that_cannot_be_read_is_named_and_skipped(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path / "chats")
    store.root.mkdir(parents=True, exist_ok=True)
    bad = _unreadable(store.root / f"{new_id()}.json")
    with pytest.raises(StoreError, match=bad.name):
        store.load(bad.stem)
    assert store.list() == [] and [str(p) for p, _ in store.skipped] == [str(bad)]
    assert bad.name in store.skipped[0][1]


@needs_einval
def test_hostfile_that_cannot_be_read_is_named(tmp_path: Path) -> None:
    with pytest.raises(HostsError, match="hosts.json"):
        read_hostfile(_unreadable(tmp_path / "hosts.json"))


@pytest.mark.parametrize("length", [2**63 + 5, 2**64 - 1, 10**12])
def test_fingerprints_of_a_weights_file_with_an_absurd_header_length(
        length: int, tmp_path: Path) -> None:
    """The K/V cache's and the split model's fingerprints read the header length from the
    file: one past its end (or past 2**63, where seek() overflows) is hashed, not a crash."""
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(length.to_bytes(8, "little") + b"{}" * 10)
    first = model_fingerprint(folder)
    assert len(first) == 64
    status, _, weights = folder_fingerprint(folder)
    assert status == 0 and len(weights) == 32
    (folder / "model.safetensors").write_bytes((length - 1).to_bytes(8, "little") + b"{}" * 11)
    assert model_fingerprint(folder) != first  # still tells the files apart
