"""What carries over between runs besides settings: the input history, the chat that was
open, and the theme. <data dir>/session.json, written atomically after every turn; read
leniently (a damaged file means a fresh start, never a crash). The `restore_session`
setting turns both the saving and the restoring off.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvchat.app.core.settings import save_settings
from kvchat.app.core.store import ConversationStore, StoreError, atomic_write_text
from kvchat.model.errors import KVChatError
from kvchat.model.files import BadJSONFile, load_json

SESSION_FILE = "session.json"
HISTORY_MAX = 200  # input history entries kept across runs


@dataclass
class SessionState:
    last_chat: str | None = None
    input_history: list[str] = field(default_factory=list)
    problem: str | None = None  # why the file on disk was not used (one line)


def session_path(store: ConversationStore) -> Path:
    return store.root.parent / SESSION_FILE


def load_session(path: Path) -> SessionState:
    try:
        data = load_json(path)
    except FileNotFoundError:
        return SessionState()
    except BadJSONFile as e:
        return SessionState(problem=f"{e}; starting a fresh session")
    chat = data.get("last_chat")
    hist = data.get("input_history")
    return SessionState(
        last_chat=chat if isinstance(chat, str) and chat else None,
        input_history=[h for h in hist if isinstance(h, str)][-HISTORY_MAX:]
        if isinstance(hist, list) else [],
    )


def save_session(path: Path, state: SessionState) -> None:
    data = {"last_chat": state.last_chat, "input_history": state.input_history[-HISTORY_MAX:]}
    atomic_write_text(path, json.dumps(data, ensure_ascii=False, indent=1) + "\n")


def model_of_chat(chat_model: str | None, loaded: str | None) -> str | None:
    """The model folder a chat was held with (`Conversation.model`) when it is not the
    loaded one and is still a model folder here; None otherwise. A chat's saved K/V cache
    is that model's, so the chat continues warm only on it."""
    if not chat_model or not Path(chat_model).is_absolute():
        return None
    folder = Path(chat_model)
    if not (folder / "config.json").is_file():
        return None
    if loaded and os.path.realpath(folder) == os.path.realpath(loaded):
        return None
    return str(folder)


def reopening_model(store: ConversationStore, settings: Any) -> str | None:
    """At start without --model: the model of the chat `restore_session` will reopen, so
    that chat comes back on its own model (and its cache) with no second load."""
    if not settings.restore_session:
        return None
    state = load_session(session_path(store))
    if state.last_chat is None:
        return None
    try:
        conv = store.load(state.last_chat)
    except StoreError:
        return None
    return model_of_chat(conv.model, None)


# ---- hooks the chat screen calls ---------------------------------------------------------


async def restore_session(app: Any) -> None:  # app: the chat screen
    """At start: the input history, then the chat that was open (if it still exists)."""
    if not app.settings.restore_session:
        return
    state = load_session(session_path(app.store))
    if state.problem:
        app.notify(state.problem, severity="warning", title="Session not restored")
    if state.last_chat and not app.conversation.messages:
        try:
            conv = app.store.load(state.last_chat)
        except StoreError:
            pass  # deleted or unreadable since: start with a new chat
        else:
            await app.show_conversation(conv)
    if state.input_history:  # it holds the reopened chat's messages already: replace
        app.input.sent_history.clear()
        for text in state.input_history:  # an older file may hold duplicates
            app.input.remember(text)


def remember_session(app: Any) -> None:
    """After each turn (and on a new chat): what restore_session() will bring back."""
    if not app.settings.restore_session:
        return
    conv = app.conversation
    state = SessionState(
        last_chat=conv.id if conv.messages else None,
        input_history=list(app.input.sent_history),
    )
    try:
        save_session(session_path(app.store), state)
    except OSError:
        pass  # a convenience; the chat itself is saved by the store


def apply_theme(chat: Any) -> None:
    """Use the saved theme, and save the theme whenever the user changes it (the palette's
    "Change theme" or the settings screen). `chat.settings` is read at each change: the
    settings screen replaces that object."""
    app = chat.app
    use_saved_theme(chat)

    def changed(theme: Any) -> None:
        name = getattr(theme, "name", None)
        settings = chat.settings
        if name and settings.theme != name:
            settings.theme = name
            try:
                save_settings(settings)
            except KVChatError:
                pass  # remembering the theme is best-effort

    app.theme_changed_signal.subscribe(chat, changed)


def use_saved_theme(chat: Any) -> None:
    """Switch to the theme in `chat.settings` (when this Textual has it)."""
    saved = chat.settings.theme
    if saved and saved in chat.app.available_themes:
        chat.app.theme = saved

