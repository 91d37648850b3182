"""Saved conversations: one JSON file per chat, written atomically.

Layout: <data dir>/chats/<id>.json, plus <id>.kv.safetensors (the chat's K/V cache, so a
reopened chat continues without prefilling its history again), where the data dir is
platformdirs.user_data_dir("kvchat"), or $KVCHAT_DATA_DIR when set (tests).
A save writes a temp file in the same folder, fsyncs it and renames it over the old
file, so a crash at any point leaves either the old or the new conversation on disk,
never a torn one. A corrupt file is skipped when listing
(reported in `ConversationStore.skipped`), never fatal.

One writer per chat: a window claims the chat it shows (an advisory flock on
`.<id>.lock`, which the kernel drops when the process ends, however it ends); any other
save takes the lock only while it writes. The lock file is removed when the chat is let
go (and a stale one, left by a killed process, when the folder is listed): removed while
still locked, and a claim that locked a file since removed from its name tries again, so
two processes never hold two different files of one name. A second kvchat on the same
folder cannot claim an open chat: it opens a copy (and says so), and a save of the
original is refused in one line rather than overwriting turns.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import platformdirs

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; one window per data folder
    fcntl = None  # type: ignore[assignment]

from kvchat.model.errors import KVChatError
from kvchat.model.files import BadJSONFile, load_json, replace_surrogates

SCHEMA_VERSION = 1
TITLE_MAX = 50
ROLES = ("system", "user", "assistant")
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
CACHE_SUFFIX = ".kv.safetensors"
_STALE_TMP_S = 3600.0  # leftover temp files older than this came from a crashed save


class StoreError(KVChatError):
    """A conversation that cannot be read, written or found."""


class ChatBusy(StoreError):
    """Another kvchat process has this chat open (holds its lock)."""


def atomic_write_text(path: Path, text: str, mode: int | None = None) -> None:
    """Replace `path` with `text` so that readers see the old or the new content, never
    a mix: temp file in the same folder (same filesystem, so the rename is atomic),
    flush + fsync, os.replace, then fsync the folder so the rename itself is durable.
    The file is private (0600, as mkstemp makes it) unless `mode` says otherwise."""
    path = Path(path)
    # text the app read may hold lone surrogates (valid JSON escapes, not UTF-8): a save
    # replaces them rather than failing, so nothing else in the file is lost
    text = replace_surrogates(text)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            if mode is not None and hasattr(os, "fchmod"):  # POSIX only
                os.fchmod(f.fileno(), mode)
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        # the partial temp file never replaces the good one; clean it up
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if hasattr(os, "O_DIRECTORY"):
        with contextlib.suppress(OSError):
            dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)


def new_id(now: float | None = None) -> str:
    """Sortable and unique enough: local timestamp + 6 random hex digits."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now if now is not None else time.time()))
    return f"{stamp}-{secrets.token_hex(3)}"


def derive_title(messages: list[dict[str, Any]], limit: int = TITLE_MAX) -> str:
    """The first user message, whitespace collapsed, cut to `limit` chars at a word."""
    for m in messages:
        if m.get("role") == "user":
            text = " ".join(str(m.get("content", "")).split())
            if not text:
                continue
            if len(text) <= limit:
                return text
            cut = text[: limit - 1]
            if " " in cut[limit // 2 :]:
                cut = cut[: cut.rfind(" ")]
            return cut.rstrip() + "…"
    return "New chat"


@dataclass
class Conversation:
    id: str = field(default_factory=new_id)
    title: str = ""
    created: float = field(default_factory=time.time)  # epoch seconds
    updated: float = field(default_factory=time.time)
    model: str | None = None  # model path (or name) the chat was held with
    system_prompt: str = ""
    # {"role": "user"|"assistant"|"system", "content": str} (+ "stopped": True on a
    # reply the user cancelled)
    messages: list[dict[str, Any]] = field(default_factory=list)

    def add_message(self, role: str, content: str, *, stopped: bool = False) -> dict[str, Any]:
        """Append a message, keep `updated` and an empty title current; returns it."""
        if role not in ROLES:
            raise StoreError(f"unknown message role {role!r}; expected one of {', '.join(ROLES)}")
        msg: dict[str, Any] = {"role": role, "content": content}
        if stopped:
            msg["stopped"] = True
        self.messages.append(msg)
        self.updated = time.time()
        if not self.title and role == "user":
            self.title = derive_title(self.messages)
        return msg

    def copy(self) -> Conversation:
        """The same chat under a new id (for a window that cannot have the original)."""
        title = self.title or derive_title(self.messages)
        return Conversation(title=f"{title} (copy)", model=self.model,
                            system_prompt=self.system_prompt,
                            messages=[dict(m) for m in self.messages])

    def chat_messages(self) -> list[dict[str, str]]:
        """What Engine.submit wants: system prompt first (when set), role/content only."""
        out = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        out.extend({"role": m["role"], "content": m["content"]} for m in self.messages)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": SCHEMA_VERSION,
            "id": self.id,
            "title": self.title or derive_title(self.messages),
            "created": self.created,
            "updated": self.updated,
            "model": self.model,
            "system_prompt": self.system_prompt,
            "messages": [dict(m) for m in self.messages],
        }

    @classmethod
    def from_dict(cls, d: Any) -> Conversation:
        """Strict: raises StoreError (one line) on anything but a well-formed chat."""
        if not isinstance(d, dict):
            raise StoreError("conversation file is not a JSON object")
        version = d.get("version", 1)
        if not isinstance(version, int) or version < 1:
            raise StoreError(f"bad conversation schema version {version!r}")
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"conversation written by a newer kvchat (schema {version} > {SCHEMA_VERSION})"
            )
        cid = d.get("id")
        if not isinstance(cid, str) or not _ID_RE.match(cid):
            raise StoreError(f"bad conversation id {cid!r}")
        messages = d.get("messages", [])
        if not isinstance(messages, list):
            raise StoreError("conversation 'messages' is not a list")
        clean = []
        for i, m in enumerate(messages):
            if (
                not isinstance(m, dict)
                or m.get("role") not in ROLES
                or not isinstance(m.get("content"), str)
            ):
                raise StoreError(f"conversation message {i} is malformed")
            clean.append(dict(m))

        def num(key: str) -> float:
            v = d.get(key)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise StoreError(f"conversation {key!r} is not a timestamp")
            return float(v)

        def opt_str(key: str, default: str | None) -> str | None:
            v = d.get(key, default)
            if v is not None and not isinstance(v, str):
                raise StoreError(f"conversation {key!r} is not a string")
            return v

        return cls(
            id=cid,
            title=opt_str("title", "") or derive_title(clean),
            created=num("created"),
            updated=num("updated"),
            model=opt_str("model", None),
            system_prompt=opt_str("system_prompt", "") or "",
            messages=clean,
        )


def default_root() -> Path:
    base = os.environ.get("KVCHAT_DATA_DIR")
    data = Path(base).expanduser() if base else Path(platformdirs.user_data_dir("kvchat"))
    return data / "chats"


class ConversationStore:
    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        self.root = Path(root).expanduser() if root is not None else default_root()
        # (file, reason) for each file the last list() could not read
        self.skipped: list[tuple[Path, str]] = []
        self._held: dict[str, int] = {}  # chat id -> descriptor holding its lock
        # a store that goes away (a temporary one, say) lets its chats go with it
        weakref.finalize(self, _close_all, self._held, self.root)
        # ids whose newer copy was rescued from a killed save's temp file at start-up
        self.recovered: list[str] = self._recover_temps()

    # ---- one writer per chat ---------------------------------------------------------
    def claim(self, conv_id: str) -> bool:
        """Hold the chat's advisory lock for this store (idempotent): True, or False when
        another process (or another store) holds it. Without flock (Windows) always True."""
        if conv_id in self._held:
            return True
        if fcntl is None:
            return True
        lock = self.lock_path(conv_id)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError:
            return True  # a read-only folder: nothing can be saved anyway; saves will say
        while True:
            try:
                fd = _lock_file(lock)
            except BlockingIOError:
                return False
            except OSError:
                return True  # as above: the saves will say
            if fd is not None:
                self._held[conv_id] = fd
                return True

    def lock_path(self, conv_id: str) -> Path:
        return self.path_for(conv_id).with_name(f".{conv_id}.lock")

    def release(self, conv_id: str) -> None:
        """Let another window have the chat (this one moved to another chat); its lock
        file goes."""
        fd = self._held.pop(conv_id, None)
        if fd is not None:
            _unlock(self.lock_path(conv_id), fd)

    def close(self) -> None:
        """Release every chat this store holds."""
        _close_all(self._held, self.root)

    def busy(self, conv_id: str) -> bool:
        """Whether another process holds the chat (without keeping it)."""
        if conv_id in self._held:
            return False
        if not self.claim(conv_id):
            return True
        self.release(conv_id)
        return False

    def path_for(self, conv_id: str) -> Path:
        # ids become file names: refuse anything that could leave the folder
        if not isinstance(conv_id, str) or not _ID_RE.match(conv_id):
            raise StoreError(f"bad conversation id {conv_id!r}")
        return self.root / f"{conv_id}.json"

    def cache_path(self, conv_id: str) -> Path:
        """Where the chat's K/V cache lives (written by the engine, atomically)."""
        return self.path_for(conv_id).with_suffix(CACHE_SUFFIX)

    def cache_bytes(self, conv_id: str) -> int | None:
        """Size of the chat's saved K/V cache, None when there is none."""
        try:
            return self.cache_path(conv_id).stat().st_size
        except (OSError, StoreError):
            return None

    def save(self, conv: Conversation) -> Path:
        """Write atomically; fills an empty title from the first user message."""
        path = self.path_for(conv.id)
        held = conv.id in self._held  # a window's open chat stays held after the save
        if not self.claim(conv.id):
            raise ChatBusy(f"“{conv.title or derive_title(conv.messages)}” is open in another"
                           " kvchat window; not saved here (start a new chat or reopen it)")
        if not conv.title:
            conv.title = derive_title(conv.messages)
        text = json.dumps(conv.to_dict(), ensure_ascii=False, indent=1)
        try:
            atomic_write_text(path, text + "\n")
        except OSError as e:
            raise StoreError(f"cannot save conversation to {path}: {e.strerror or e}") from None
        finally:
            if not held:
                self.release(conv.id)
        return path

    def _read(self, path: Path) -> Conversation:
        try:
            data = load_json(path)
        except FileNotFoundError:
            raise StoreError(f"no saved conversation {path.stem!r}") from None
        except BadJSONFile as e:  # a FIFO, a huge or deep file, bad UTF-8 or JSON
            raise StoreError(f"skipped {e}") from None
        try:
            conv = Conversation.from_dict(data)
        except StoreError as e:
            raise StoreError(f"{path.name}: {e}") from None
        # the file name is the id that load()/delete() use; a renamed copy follows its name
        if _ID_RE.match(path.stem):
            conv.id = path.stem
        return conv

    def load(self, conv_id: str) -> Conversation:
        path = self.path_for(conv_id)
        if not path.is_file():
            raise StoreError(f"no saved conversation {conv_id!r}")
        return self._read(path)

    def list(self) -> list[Conversation]:
        """Every readable conversation, most recently updated first; corrupt files are
        skipped and recorded in self.skipped."""
        self.skipped = []
        convs = []
        try:
            files = sorted(self.root.glob("*.json"))
        except OSError:
            return []
        for f in files:
            if f.name.startswith("."):
                continue
            try:
                convs.append(self._read(f))
            except StoreError as e:
                self.skipped.append((f, str(e)))
        self._clean_stale_temps()
        convs.sort(key=lambda c: (c.updated, c.id), reverse=True)
        return convs

    def delete(self, conv_id: str) -> bool:
        """Remove a conversation (and its K/V cache); False when there was none."""
        if not self.claim(conv_id):
            raise ChatBusy(f"chat {conv_id} is open in another kvchat window; not deleted")
        self.release(conv_id)
        with contextlib.suppress(OSError):
            self.cache_path(conv_id).unlink()
        try:
            self.path_for(conv_id).unlink()
        except FileNotFoundError:
            return False
        except OSError as e:
            raise StoreError(f"cannot delete conversation {conv_id!r}: {e.strerror or e}") from None
        return True

    # ---- undoable delete: the chat and its K/V cache wait in <root>/.deleted ----------
    @property
    def trash_dir(self) -> Path:
        return self.root / ".deleted"

    def trash(self, conv_id: str) -> Conversation:
        """Delete undoably: the chat's file and its K/V cache move (a rename, no copy) to
        trash_dir until untrash() brings both back or empty_trash() removes them."""
        conv = self.load(conv_id)
        files = [self.path_for(conv_id), self.cache_path(conv_id)]
        try:
            self.trash_dir.mkdir(parents=True, exist_ok=True)
            for f in files:
                if f.exists():
                    os.replace(f, self.trash_dir / f.name)
        except OSError as e:
            raise StoreError(f"cannot delete conversation {conv_id!r}: {e.strerror or e}") from None
        return conv

    def untrash(self, conv_id: str) -> None:
        """Undo trash(): the chat and its K/V cache are back where they were."""
        for f in (self.path_for(conv_id), self.cache_path(conv_id)):
            held = self.trash_dir / f.name
            try:
                if held.exists():
                    os.replace(held, f)
            except OSError as e:
                raise StoreError(f"cannot restore {f.name}: {e.strerror or e}") from None

    def empty_trash(self) -> None:
        """Make trashed chats' deletion final."""
        shutil.rmtree(self.trash_dir, ignore_errors=True)

    def _recover_temps(self) -> list[str]:
        """A save killed between writing its temp file and the rename leaves the newer
        conversation in `.<id>.json.*.tmp`: put back every complete one that is newer than
        its chat (or whose chat is gone); drop complete ones that are older."""
        recovered: list[str] = []
        try:
            temps = sorted(self.root.glob(".*.json.*.tmp"), key=lambda p: p.stat().st_mtime)
        except OSError:
            return recovered
        for tmp in temps:
            with contextlib.suppress(OSError, StoreError):
                conv_id = tmp.name[1:].split(".json.", 1)[0]
                target = self.path_for(conv_id)
                conv = self._read(tmp)  # a torn (partial) file raises: left alone
                if conv.id != conv_id or self.busy(conv_id):
                    continue  # a chat open elsewhere: its temp file may be a live save
                if target.exists() and target.stat().st_mtime >= tmp.stat().st_mtime:
                    tmp.unlink()  # an older save's leftover
                    continue
                os.replace(tmp, target)
                recovered.append(conv_id)
        return recovered

    def _clean_stale_temps(self) -> None:
        """Remove temp files a killed save left behind (old enough to be no live save's),
        and lock files no process holds (a killed kvchat's)."""
        now = time.time()
        with contextlib.suppress(OSError):
            stale = [*self.root.glob(".*.json.*.tmp"), *self.root.glob(".*.tmp.safetensors")]
            for tmp in stale:
                with contextlib.suppress(OSError):
                    if now - tmp.stat().st_mtime > _STALE_TMP_S:
                        tmp.unlink()
        if fcntl is None:
            return
        with contextlib.suppress(OSError):
            for lock in self.root.glob(".*.lock"):
                conv_id = lock.name[1:-len(".lock")]
                if conv_id in self._held or not _ID_RE.match(conv_id):
                    continue
                with contextlib.suppress(OSError):
                    fd = _lock_file(lock, create=False)
                    if fd is not None:
                        _unlock(lock, fd)


def _lock_file(lock: Path, create: bool = True) -> int | None:
    """A descriptor holding the flock on `lock` (made 0600 when `create`); None when the
    file it locked was removed from that name meanwhile (the caller tries again).
    BlockingIOError when another process holds it."""
    flags = (os.O_RDWR | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
             | (os.O_CREAT if create else 0))
    fd = os.open(lock, flags, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # the last holder may have removed the file between our open and our flock: a
        # lock on a file no longer under that name guards nothing
        st, now = os.fstat(fd), os.stat(lock, follow_symlinks=False)
        if (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino):
            return fd
    except FileNotFoundError:
        pass
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return None


def _unlock(lock: Path, fd: int) -> None:
    """Remove the lock file while still holding it, then let it go."""
    with contextlib.suppress(OSError):
        lock.unlink()
    with contextlib.suppress(OSError):
        os.close(fd)  # closing the descriptor drops the flock


def _close_all(held: dict[str, int], root: Path) -> None:
    for conv_id, fd in held.items():
        _unlock(root / f".{conv_id}.lock", fd)
    held.clear()
def write_near_data(store: ConversationStore, sub: str, write: Callable[[Path], Path]) -> Path:
    """`write(folder)` into <data dir>/<sub> (exports, screenshots), else into the current
    folder; returns what write() returned. StoreError (one line) when neither works."""
    last = ""
    for folder in (store.root.parent / sub, Path.cwd()):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            return write(folder)
        except OSError as e:
            last = f"{folder}: {e.strerror or e}"
        except StoreError as e:
            last = str(e)
    raise StoreError(f"cannot write to the data folder or the current folder ({last})")


def _fmt_time(ts: float) -> str:
    try:
        return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M")
    except (OverflowError, OSError, ValueError):
        return str(ts)


def to_markdown(conv: Conversation) -> str:
    """Readable export: title, metadata, system prompt, then one section per message."""
    lines = [f"# {conv.title or derive_title(conv.messages)}", ""]
    if conv.model:
        lines.append(f"- Model: `{conv.model}`")
    lines += [
        f"- Created: {_fmt_time(conv.created)}",
        f"- Updated: {_fmt_time(conv.updated)}",
        f"- ID: {conv.id}",
        "",
    ]
    if conv.system_prompt:
        lines += ["**System**", "", conv.system_prompt.strip(), ""]
    names = {"user": "User", "assistant": "Assistant", "system": "System"}
    for m in conv.messages:
        head = f"**{names.get(m['role'], m['role'])}**"
        if m.get("stopped"):
            head += " (stopped)"
        lines += [head, "", m["content"].strip(), ""]
    return "\n".join(lines).rstrip() + "\n"


def export_markdown(conv: Conversation, path: str | os.PathLike[str]) -> Path:
    """Write to_markdown(conv) to `path` (a folder gets <id>.md inside); returns the file."""
    target = Path(path).expanduser()
    if target.is_dir():
        target = target / f"{conv.id}.md"
    try:
        atomic_write_text(target, to_markdown(conv), mode=0o644)  # an export is meant to share
    except OSError as e:
        raise StoreError(f"cannot export to {target}: {e.strerror or e}") from None
    return target
