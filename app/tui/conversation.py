"""The chat's conversation commands: send a message, retry the last reply, edit and resend
from a message, a new chat, a saved chat reopened, export, copy, and new settings. Each
keeps three things in step: the conversation, its file in the store (one writer per chat:
a lock per open chat) and the transcript. Turns themselves run in the turn controller
(app/tui/turn_controller.py); the modal screens these commands answer (history, settings)
are pushed by the chat screen.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any, Protocol

from kvchat.app.core.settings import Settings
from kvchat.app.core.store import (
    Conversation,
    ConversationStore,
    StoreError,
    derive_title,
    export_markdown,
    write_near_data,
)
from kvchat.app.core.text import clipboard_text
from kvchat.app.tui.session import model_of_chat, remember_session, use_saved_theme
from kvchat.app.tui.turn import Phase, busy_reason
from kvchat.app.tui.turn_controller import TurnController
from kvchat.app.tui.widgets import ChatInput, ChatMessage, Entry, StatsPanel, Transcript
from kvchat.model.runtime.events import CacheRestored, CacheSaved, EngineLike

EDIT_TITLE = "editing: Enter resends from here · Esc cancels"


class ChatView(Protocol):
    """What the commands use of the chat screen."""

    settings: Settings
    store: ConversationStore
    engine: EngineLike | None
    model_info: dict[str, Any]
    model_path: str | None
    phase: Phase
    app: Any
    focused: Any
    unsaved: bool

    @property
    def transcript(self) -> Transcript: ...

    @property
    def input(self) -> ChatInput: ...

    @property
    def panel(self) -> StatsPanel: ...

    def notify(self, message: str, *, title: str = "", severity: Any = "information",
               timeout: float | None = None) -> None: ...

    def refresh_bindings(self) -> None: ...

    def load_model(self, path: str | None) -> None: ...


class ConversationCommands:
    """The open conversation of one chat screen and what can be done to it."""

    def __init__(self, view: ChatView, turns: TurnController) -> None:
        self.view = view
        self.turns = turns
        self.conversation = Conversation(system_prompt=view.settings.system_prompt)
        self.edit_index: int | None = None  # the user message being edited, if any

    # ---- guards ------------------------------------------------------------------------------
    def refuse_busy(self) -> bool:
        """True (and says why) when a turn or a load is running."""
        why = busy_reason(self.view.phase)
        if why:
            self.view.notify(why, severity="warning")
        return why is not None

    def refuse_no_model(self) -> bool:
        if not self.view.model_info:
            self.view.notify("No model loaded: press Ctrl+O to pick one.", severity="warning")
            return True
        return False

    # ---- sending, retry, edit ----------------------------------------------------------------
    async def send(self, text: str) -> bool:
        """Send a user message (truncating first when editing). False when refused."""
        if self.refuse_busy() or self.refuse_no_model():
            return False
        view = self.view
        view.input.remember(text)
        view.input.clear()
        edited = self.edit_index
        if edited is not None:
            await self._truncate(edited)
            self.end_edit()
        conv = self.conversation
        index = len(conv.messages)
        conv.add_message("user", text)
        if edited is not None:
            _retitle_after_edit(conv, edited)
        self.save_chat()  # on disk before the reply starts: a crash mid-reply loses nothing
        await view.transcript.add(ChatMessage("user", text, index=index))
        await self._start_reply()
        return True

    async def regenerate(self) -> None:
        if self.refuse_busy():
            return
        msgs = self.conversation.messages
        if not any(m["role"] == "user" for m in msgs):
            self.view.notify("Nothing to regenerate yet.", severity="warning")
            return
        if self.refuse_no_model():
            return
        if msgs[-1]["role"] == "assistant":
            await self._truncate(len(msgs) - 1)
        self.end_edit()
        await self._start_reply()

    async def _start_reply(self) -> None:
        conv = self.conversation
        conv.model = self.view.model_path
        await self.turns.start(conv.chat_messages(), self.view.settings.gen_params(),
                               len(conv.messages))

    def keep_reply(self, text: str, stopped: bool) -> None:
        """A finished reply joins the conversation, which is saved (with its cache)."""
        self.conversation.add_message("assistant", text, stopped=stopped)
        self.autosave()

    async def _truncate(self, index: int) -> None:
        del self.conversation.messages[index:]
        self.conversation.updated = time.time()
        await self.view.transcript.truncate(index)

    def begin_edit(self, index: int) -> bool:
        """Put user message `index` into the input; the next send resends from there."""
        view = self.view
        if view.phase.generating:
            view.notify("Stop the reply (Esc) before editing.", severity="warning")
            return False
        msgs = self.conversation.messages
        if not 0 <= index < len(msgs) or msgs[index]["role"] != "user":
            return False
        self.end_edit()
        self.edit_index = index
        inp = view.input
        inp.load_text(msgs[index]["content"])
        inp.move_cursor(inp.document.end)
        inp.border_title = EDIT_TITLE
        inp.add_class("-editing")
        view.transcript.mark_editing(index)
        inp.focus()
        view.refresh_bindings()  # Esc now cancels the edit
        return True

    def end_edit(self) -> None:
        self.edit_index = None
        inp = self.view.input
        inp.border_title = None
        inp.remove_class("-editing")
        self.view.transcript.mark_editing(None)
        self.view.refresh_bindings()

    def cancel_edit(self) -> bool:
        """Esc while editing: the edit ends and its text goes; False when not editing."""
        if self.edit_index is None:
            return False
        self.end_edit()
        self.view.input.clear()
        return True

    def edit_last(self) -> None:
        msgs = self.conversation.messages
        for i in range(len(msgs) - 1, -1, -1):
            if msgs[i]["role"] == "user":
                self.begin_edit(i)
                return
        self.view.notify("No message of yours to edit yet.", severity="warning")

    # ---- which chat is open ------------------------------------------------------------------
    async def new_chat(self) -> None:
        if self.refuse_busy():
            return
        view = self.view
        self.end_edit()
        self.turns.restored_tokens = 0
        view.store.release(self.conversation.id)
        self.conversation = Conversation(
            system_prompt=view.settings.system_prompt, model=view.model_path
        )
        await view.transcript.clear()
        view.input.clear()
        if view.engine is not None:
            view.engine.reset()
        view.panel.clear_cache_stats()
        remember_session(view)

    async def open_chosen(self, conv_id: str | None) -> None:
        """The history screen's answer: a chat to open, or None."""
        if conv_id:
            await self.open_conversation(conv_id)

    async def open_conversation(self, conv_id: str) -> bool:
        """Show a saved chat; its K/V cache (when saved) is restored so the next turn
        prefills only the new message."""
        if self.refuse_busy():
            return False
        try:
            conv = self.view.store.load(conv_id)
        except StoreError as e:
            self.view.notify(str(e), severity="error")
            return False
        await self.show_conversation(conv, follow_model=True)
        return True

    async def show_conversation(self, conv: Conversation, follow_model: bool = False) -> None:
        """Make `conv` (already read from the store) the open chat; `follow_model`: on the
        model it was held with, when that is another folder here (its cache is that
        model's; at start-up app.default_model_path chose it already)."""
        view = self.view
        conv_id = conv.id
        self.end_edit()
        self.turns.restored_tokens = 0  # set again if this chat's cache comes back
        opened = self._claim(conv)
        self.conversation = opened
        view.panel.clear_cache_stats()  # the figures were the previous chat's
        # only the messages on screen become widgets (widgets/transcript.py)
        await view.transcript.show([
            Entry(m["role"], m["content"], index=i, stopped=bool(m.get("stopped")))
            for i, m in enumerate(conv.messages)
        ])
        # its messages become the newest history, never twice
        view.input.remember_all([m["content"] for m in conv.messages if m["role"] == "user"])
        cache = view.store.cache_path(conv_id)
        if follow_model and (held_with := model_of_chat(conv.model, view.model_path)):
            view.load_model(held_with)  # the engine restores the cache after the load
        if view.engine is not None and view.settings.save_kv_cache and cache.is_file():
            view.engine.restore_cache(cache)
        if opened is conv:
            view.notify(f"Opened “{conv.title or 'New chat'}”", title="History")

    def _claim(self, conv: Conversation) -> Conversation:
        """One writer per chat: this window holds `conv`, or gets a copy of it (and says
        so) when another kvchat window has it open."""
        store = self.view.store
        previous = self.conversation.id
        if previous != conv.id:
            store.release(previous)
        if store.claim(conv.id):
            return conv
        self.view.notify(f"“{conv.title or 'New chat'}” is open in another kvchat window; this"
                         " is a copy, saved as a chat of its own", severity="warning",
                         title="History")
        return conv.copy()

    # ---- saving --------------------------------------------------------------------------------
    def save_chat(self) -> bool:
        try:
            self.view.store.claim(self.conversation.id)  # this window's: held until it moves on
            self.view.store.save(self.conversation)
        except StoreError as e:
            self.view.notify(str(e), severity="error", title="Chat not saved")
            self.view.unsaved = True
            return False
        self.view.unsaved = False
        return True

    def autosave(self) -> None:
        if not self.save_chat():
            return
        view = self.view
        remember_session(view)
        if view.engine is not None:
            path = view.store.cache_path(self.conversation.id)
            if view.settings.save_kv_cache:
                view.engine.save_cache(path, view.settings.kv_cache_max_mib * 2**20)
            else:
                path.unlink(missing_ok=True)

    def on_cache_saved(self, ev: CacheSaved) -> None:
        # success is silent (History shows the file's size); a failure is one line
        if ev.error:
            self.view.notify(ev.error, severity="warning", title="Cache")

    def on_cache_restored(self, ev: CacheRestored) -> None:
        if ev.error:
            self.view.notify(ev.error, severity="warning", title="Cache")
        self.turns.restored_tokens = ev.tokens

    # ---- out of the chat -----------------------------------------------------------------------
    def export(self) -> Path | None:
        conv = self.conversation
        if not conv.messages:
            self.view.notify("Nothing to export yet.", severity="warning")
            return None
        name = f"{_slug(conv.title) or 'chat'}-{conv.id}.md"
        try:
            path = write_near_data(self.view.store, "exports",
                                   lambda folder: export_markdown(conv, folder / name))
        except StoreError as e:
            self.view.notify(f"{name}: {e}", severity="error", title="Not exported")
            return None
        self.view.notify(str(path), title="Exported")
        return path

    def copy_reply(self) -> None:
        view = self.view
        focused = view.focused
        if isinstance(focused, ChatMessage) and focused.role == "assistant":
            content = focused.content
        else:  # the newest reply, mounted or not
            content = view.transcript.last_reply()
        if not content:
            view.notify("No reply to copy yet.", severity="warning")
            return
        text = clipboard_text(content)  # never a terminal sequence on the clipboard
        view.app.copy_to_clipboard(text)
        # OSC 52 is write-only: whether the terminal took it cannot be known, so say how
        view.notify(f"Sent the reply ({len(text):,} characters) to the terminal's"
                    " clipboard (OSC 52). In tmux: set -g set-clipboard on.", title="Copy")

    def apply_settings(self, new: Settings | None) -> None:
        """The settings screen's answer: new settings (already saved), or None."""
        if new is None:
            return
        view = self.view
        view.settings = new
        view.panel.set_bound(new.max_kv_size, new.keep)
        use_saved_theme(view)  # after the swap: the theme hook saves into these settings
        # the open chat follows the new system prompt from its next turn
        self.conversation.system_prompt = new.system_prompt
        view.notify("Saved; applied from the next turn.", title="Settings")


def _retitle_after_edit(conv: Conversation, edited_index: int) -> None:
    """An edit of the first user message renames the chat after the new text."""
    first_user = next((i for i, m in enumerate(conv.messages) if m["role"] == "user"), None)
    if first_user is not None and edited_index <= first_user:
        conv.title = derive_title(conv.messages)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()[:40]
