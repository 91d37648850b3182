"""The kvchat Textual app: chat on the left, live engine stats on the right.

Threading (DESIGN.md): every MLX call happens on the engine's own thread. The engine
reports through a callback *on that thread*; `_Bridge` hops to the UI with the
thread-safe `post_message`, which never waits for the UI, so a slow repaint cannot slow
decoding. Text deltas are batched: the first delta of a batch posts one `TextReady`,
later ones only append to a buffer until the UI drains it. The UI never runs MLX in a
Textual worker; the only worker thread (model discovery in the picker) reads files.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.reactive import reactive
from textual.screen import Screen
from textual.widgets import Footer, Header, LoadingIndicator, Static

from model.discovery import DEFAULT_MODEL
from model.errors import KVChatError
from model.events import (
    Done,
    Event,
    Loaded,
    LoadFailed,
    Loading,
    Overflow,
    PrefillProgress,
    Started,
    Stats,
    TextDelta,
)

from .screens import (
    HelpScreen,
    HistoryScreen,
    LayerCacheScreen,
    ModelPickerScreen,
    SettingsScreen,
)
from .session import apply_theme, remember_session, restore_session, retitle_after_edit
from .settings import Settings, load_settings, save_settings
from .store import Conversation, ConversationStore, StoreError, export_markdown
from .turn_notices import on_turn_event
from .widgets import ChatInput, ChatMessage, StatsPanel, Transcript
from .widgets.format import fmt_bytes

EngineFactory = Callable[[Callable[[Event], None], str | None], Any]

# keys of the input box (not bindings; listed in the help screen)
INPUT_KEYS: tuple[tuple[str, str], ...] = (
    ("enter", "send the message"),
    ("ctrl+j / shift+enter", "new line in the message"),
    ("↑ / ↓", "input history (cursor on the first / last line)"),
    ("click / enter on a message", "your message: edit and resend from there"),
    ("ctrl+p", "command palette: every action by name"),
)

TEXT_FLUSH_HZ = 15  # streamed text reaches the transcript at most this often

FINISH_NOTES = {"length": "max tokens reached", "stop": "stop string", "eos": ""}


def validate_model_path(path: str | Path) -> Path:
    """Check a model folder before the UI starts; raises ModelLoadError/ConfigError
    (one line) so the CLI can print it and exit 1."""
    from model.facts import check_model_folder

    check_model_folder(path)  # config, weights' headers, tokenizer
    return Path(path).expanduser().resolve()  # saved as last_model: must work from any cwd


def _default_engine(on_event: Callable[[Event], None], model_path: str | None) -> Any:
    from model.engine import Engine  # imports MLX; kept out of module import time

    return Engine(on_event, model_path)


class EngineEvent(Message):
    """An engine event, hopped to the UI thread. `gen` counts turns (Started events)."""

    def __init__(self, event: Event, gen: int) -> None:
        super().__init__()
        self.event = event
        self.gen = gen


class TextReady(Message):
    """Streamed text is waiting in the bridge's buffer."""


class _Bridge:
    """Engine thread -> UI thread. Called on the engine thread; never blocks it."""

    def __init__(self, app: App[Any]) -> None:
        self.app = app
        self.closed = False
        self._lock = threading.Lock()
        self._gen = 0
        self._buf: list[tuple[int, str]] = []  # (turn, text) in arrival order
        self._posted = False

    def __call__(self, event: Event) -> None:
        if self.closed:
            return
        if isinstance(event, TextDelta):
            with self._lock:
                self._buf.append((self._gen, event.text))
                post, self._posted = not self._posted, True
            if post:
                self._post(TextReady())
            return
        with self._lock:
            if isinstance(event, Started):
                self._gen += 1
            gen = self._gen
        self._post(EngineEvent(event, gen))

    def _post(self, message: Message) -> None:
        try:
            self.app.post_message(message)
        except RuntimeError:  # the loop closed while the engine was still talking
            self.closed = True

    def take(self, gen: int) -> str:
        """(UI thread) the buffered text of turn `gen`; older leftovers are dropped and a
        newer turn's text stays for that turn (its Started may not be handled yet)."""
        with self._lock:
            out = "".join(t for g, t in self._buf if g == gen)
            self._buf = [(g, t) for g, t in self._buf if g > gen]
            self._posted = False
        return out


class KVChatApp(App[int]):
    """Chat with a local model and watch the engine work."""

    CSS_PATH = "kvchat.tcss"
    TITLE = "kvchat"

    # priority: these reach the app even while the input box (a TextArea) has focus
    BINDINGS = [
        Binding("escape", "stop", "Stop", id="stop"),
        Binding("ctrl+r", "regenerate", "Retry", id="regenerate", priority=True),
        Binding("ctrl+n", "new_chat", "New", id="new_chat", priority=True),
        Binding("ctrl+o", "pick_model", "Model", id="pick_model", priority=True),
        Binding("ctrl+s", "settings", "Settings", id="settings", priority=True),
        # most terminals send ctrl+h as Backspace: F2 and Ctrl+T open the history
        Binding("f2", "history", "History", id="history", priority=True),
        Binding("ctrl+t", "history", "History", id="history_ctrl_t", show=False,
                priority=True),
        # Ctrl+C stops a reply (as in Ollama / llama.cpp); otherwise it copies as usual
        Binding("ctrl+c", "interrupt", "Stop", id="interrupt", show=False, priority=True),
        Binding("ctrl+e", "export", "Export", id="export", priority=True),
        Binding("ctrl+y", "copy_reply", "Copy", id="copy_reply", priority=True),
        Binding("ctrl+l", "layers", "Layers", id="layers", priority=True),
        Binding("f1", "help", "Help", id="help", priority=True),
        Binding("ctrl+q", "quit", "Quit", id="quit", priority=True),
    ]

    # actions that only make sense on the chat screen (not while a modal is open)
    CHAT_ACTIONS = frozenset(
        {
            "stop",
            "regenerate",
            "new_chat",
            "pick_model",
            "settings",
            "history",
            "export",
            "layers",
            "copy_reply",
        }
    )

    generating: reactive[bool] = reactive(False, bindings=True)

    def __init__(
        self,
        model_path: str | None = None,
        settings: Settings | None = None,
        *,
        engine_factory: EngineFactory | None = None,
        store: ConversationStore | None = None,
    ) -> None:
        super().__init__()
        self.settings = settings if settings is not None else load_settings()
        self.store = store if store is not None else ConversationStore()
        self.initial_model = model_path
        self._engine_factory = engine_factory or _default_engine
        self.engine: Any = None
        self.bridge = _Bridge(self)
        self.conversation = Conversation(system_prompt=self.settings.system_prompt)
        self.model_info: dict[str, Any] = {}
        self.model_path: str | None = None
        self.loading_path: str | None = None
        self.last_freed_bytes: int | None = None
        self.last_export: Path | None = None
        self.last_done: Done | None = None
        self.edit_index: int | None = None
        self._reply: ChatMessage | None = None
        self._ui_gen = 0
        self._last_flush = 0.0
        self._flush_timer_armed = False

    # ---- layout -------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="main"):
            with Vertical(id="chat"):
                yield Transcript(id="transcript")
                with Horizontal(id="loading"):
                    yield LoadingIndicator()
                    yield Static("", id="loading-label")
                yield ChatInput(id="input")
            yield StatsPanel(id="stats")
        yield Footer(compact=True)

    @property
    def transcript(self) -> Transcript:
        return self.query_one("#transcript", Transcript)

    @property
    def input(self) -> ChatInput:
        return self.query_one("#input", ChatInput)

    @property
    def panel(self) -> StatsPanel:
        return self.query_one("#stats", StatsPanel)

    def on_mount(self) -> None:
        self.sub_title = "no model"
        self.input.focus()
        for w in self.settings.warnings:
            self.notify(w, severity="warning", title="Settings")
        self.engine = self._engine_factory(self.bridge, self.initial_model)
        if self.initial_model is None:
            self.notify("No model loaded: press Ctrl+O to pick one.", severity="warning")
        apply_theme(self)
        self.call_after_refresh(restore_session, self)

    def on_unmount(self) -> None:
        self.bridge.closed = True
        if self.engine is not None:
            self.engine.close()

    # ---- engine events (UI thread) --------------------------------------------------------
    async def on_text_ready(self, _message: TextReady) -> None:
        # At most TEXT_FLUSH_HZ transcript updates a second, however fast tokens come:
        # each update re-lays out the screen, and keys must stay snappy while decoding.
        wait = self._last_flush + 1 / TEXT_FLUSH_HZ - time.monotonic()
        if wait <= 0:
            await self._drain_text()
        elif not self._flush_timer_armed:
            self._flush_timer_armed = True
            self.set_timer(wait, self._timed_flush)

    async def _timed_flush(self) -> None:
        self._flush_timer_armed = False
        await self._drain_text()

    async def _drain_text(self) -> None:
        self._last_flush = time.monotonic()
        text = self.bridge.take(self._ui_gen)
        if text and self._reply is not None:
            await self._reply.append(text)

    async def on_engine_event(self, message: EngineEvent) -> None:
        ev = message.event
        if isinstance(ev, Stats):
            self.panel.update_stats(ev.stats)
        elif isinstance(ev, Started):
            self._ui_gen = message.gen
            self.panel.start_turn(ev.prompt_tokens, ev.cached_tokens)
            if ev.reprefill_reason:
                self.notify(ev.reprefill_reason, title="Cache")
            await self._drain_text()
        elif isinstance(ev, Done):
            await self._on_done(ev)
        elif isinstance(ev, (PrefillProgress, Overflow)):
            on_turn_event(ev, self.panel, self._reply, self.notify)
        elif isinstance(ev, Loading):
            self._show_loading(f"Loading {ev.path} …")
        elif isinstance(ev, Loaded):
            self._on_loaded(ev)
        elif isinstance(ev, LoadFailed):
            self._on_load_failed(ev)

    def _show_loading(self, label: str | None) -> None:
        box = self.query_one("#loading")
        box.set_class(label is not None, "-visible")
        self.query_one("#loading-label", Static).update(label or "")

    def _on_loaded(self, ev: Loaded) -> None:
        swapped = bool(self.model_info)
        self.loading_path = None
        self._show_loading(None)
        self.model_info = dict(ev.info)
        self.model_path = str(ev.info.get("path") or "") or None
        self.last_freed_bytes = ev.freed_bytes
        self.sub_title = str(ev.info.get("name") or "")
        self.panel.freed_bytes = ev.freed_bytes if swapped else None
        self.panel.clear_cache_stats()
        self.panel.set_model(ev.info)
        # memory, kernels and device before the first turn: metadata and allocator
        # counters only (no arrays), so this is safe off the engine thread
        cache_stats = getattr(self.engine, "cache_stats", None)
        if cache_stats is not None:
            try:
                self.panel.update_stats(cache_stats())
            except Exception:  # a nicety; never fail a load over it
                pass
        if swapped:
            self.notify(
                f"Loaded {ev.info.get('name')} · freed {fmt_bytes(ev.freed_bytes)}",
                title="Model swapped",
            )
        if self.model_path and self.settings.last_model != self.model_path:
            self.settings.last_model = self.model_path
            try:
                save_settings(self.settings)
            except KVChatError:
                pass  # remembering the last model is best-effort

    def _on_load_failed(self, ev: LoadFailed) -> None:
        self.loading_path = None
        self._show_loading(None)
        keep = f" (still on {self.model_info.get('name')})" if self.model_info else ""
        self.notify(f"{ev.message}{keep}", severity="error", title="Model not loaded")

    async def _on_done(self, ev: Done) -> None:
        await self._drain_text()
        self.last_done = ev
        reply, self._reply = self._reply, None
        try:
            self.panel.end_turn(ev.stats)
            if reply is not None:
                await self._finish_reply(reply, ev)
        finally:
            # only now: the conversation and the file are up to date when keys are
            # accepted again
            self.generating = False

    async def _finish_reply(self, reply: ChatMessage, ev: Done) -> None:
        conv = self.conversation
        if ev.finish_reason == "error":
            self.notify(ev.error or "generation failed", severity="error", title="Error")
            if ev.text:
                await reply.finish(ev.text, stopped=True, note="error")
                conv.add_message("assistant", ev.text, stopped=True)
            else:
                await reply.remove()
            return
        stopped = ev.finish_reason == "cancelled"
        await reply.finish(ev.text, stopped=stopped, note=FINISH_NOTES.get(ev.finish_reason, ""))
        conv.add_message("assistant", ev.text, stopped=stopped)
        self._autosave()

    def _autosave(self) -> None:
        try:
            self.store.save(self.conversation)
        except StoreError as e:
            self.notify(str(e), severity="error", title="Chat not saved")
        remember_session(self)

    # ---- sending ------------------------------------------------------------------------
    def _refuse_busy(self) -> bool:
        """True (and says why) when a turn or a load is running."""
        if self.generating:
            self.notify("Still generating: press Esc to stop first.", severity="warning")
            return True
        if self.loading_path is not None:
            self.notify("A model is loading; one moment.", severity="warning")
            return True
        return False

    async def on_chat_input_submitted(self, message: ChatInput.Submitted) -> None:
        await self.send(message.text)

    async def send(self, text: str) -> bool:
        """Send a user message (truncating first when editing). False when refused."""
        if self._refuse_busy():
            return False
        if not self.model_info:
            self.notify("No model loaded: press Ctrl+O to pick one.", severity="warning")
            return False
        inp = self.input
        inp.remember(text)
        inp.clear()
        edited = self.edit_index
        if self.edit_index is not None:
            await self._truncate(self.edit_index)
            self._end_edit()
        conv = self.conversation
        index = len(conv.messages)
        conv.add_message("user", text)
        if edited is not None:
            retitle_after_edit(conv, edited)
        await self.transcript.add(ChatMessage("user", text, index=index))
        await self._start_reply()
        return True

    async def _truncate(self, index: int) -> None:
        del self.conversation.messages[index:]
        self.conversation.updated = time.time()
        await self.transcript.truncate(index)

    async def _start_reply(self) -> None:
        conv = self.conversation
        conv.model = self.model_path
        self._reply = ChatMessage(
            "assistant", "", index=len(conv.messages), streaming=True
        )
        await self.transcript.add(self._reply)
        self.transcript.follow()
        self.generating = True
        self.engine.submit(conv.chat_messages(), self.settings.gen_params())

    # ---- editing --------------------------------------------------------------------------
    def on_chat_message_selected(self, message: ChatMessage.Selected) -> None:
        if message.widget.role == "user":
            self.begin_edit(message.widget.index)

    def begin_edit(self, index: int) -> bool:
        """Put user message `index` into the input; the next send resends from there."""
        if self.generating:
            self.notify("Stop the reply (Esc) before editing.", severity="warning")
            return False
        msgs = self.conversation.messages
        if not 0 <= index < len(msgs) or msgs[index]["role"] != "user":
            return False
        self._end_edit()
        self.edit_index = index
        inp = self.input
        inp.load_text(msgs[index]["content"])
        inp.move_cursor(inp.document.end)
        inp.border_title = "editing: Enter resends from here · Esc cancels"
        inp.add_class("-editing")
        for w in self.transcript.messages:
            w.set_class(w.index == index, "-editing")
        inp.focus()
        self.refresh_bindings()  # Esc now cancels the edit
        return True

    def _end_edit(self) -> None:
        self.edit_index = None
        inp = self.input
        inp.border_title = None
        inp.remove_class("-editing")
        for w in self.transcript.messages:
            w.remove_class("-editing")
        self.refresh_bindings()

    # ---- actions --------------------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in self.CHAT_ACTIONS and len(self.screen_stack) > 1:
            return False  # a modal is open: let its own keys through
        if action == "interrupt":
            return self.generating  # not generating: Ctrl+C goes to the focused widget
        if action == "stop" and not (self.generating or self.edit_index is not None):
            return None  # shown, greyed out
        return True

    def action_stop(self) -> None:
        """Esc: stop generating (the partial reply stays, marked stopped), or cancel an edit."""
        if self.generating:
            self.engine.cancel()
            if self._reply is not None:
                self._reply.border_subtitle = "stopping…"
        elif self.edit_index is not None:
            self._end_edit()
            self.input.clear()

    def action_interrupt(self) -> None:
        self.action_stop()

    async def action_regenerate(self) -> None:
        if self._refuse_busy():
            return
        msgs = self.conversation.messages
        if not any(m["role"] == "user" for m in msgs):
            self.notify("Nothing to regenerate yet.", severity="warning")
            return
        if not self.model_info:
            self.notify("No model loaded: press Ctrl+O to pick one.", severity="warning")
            return
        if msgs[-1]["role"] == "assistant":
            await self._truncate(len(msgs) - 1)
        self._end_edit()
        await self._start_reply()

    async def action_edit_last(self) -> None:
        msgs = self.conversation.messages
        for i in range(len(msgs) - 1, -1, -1):
            if msgs[i]["role"] == "user":
                self.begin_edit(i)
                return
        self.notify("No message of yours to edit yet.", severity="warning")

    async def action_new_chat(self) -> None:
        if self._refuse_busy():
            return
        self._end_edit()
        self.conversation = Conversation(
            system_prompt=self.settings.system_prompt, model=self.model_path
        )
        await self.transcript.remove_children()
        self.input.clear()
        if self.engine is not None:
            self.engine.reset()
        self.panel.clear_cache_stats()
        remember_session(self)

    def action_pick_model(self) -> None:
        if self._refuse_busy():
            return
        self.push_screen(
            ModelPickerScreen(self.settings.model_dirs, self.model_path), self.load_model
        )

    def load_model(self, path: str | None) -> None:
        """Swap weights on the engine thread; the conversation continues on the new model."""
        if not path or self._refuse_busy():
            return
        self.loading_path = path
        self._show_loading(f"Loading {path} …")
        self.engine.load(path)

    def action_settings(self) -> None:
        self.push_screen(SettingsScreen(self.settings), self._apply_settings)

    def _apply_settings(self, new: Settings | None) -> None:
        if new is None:
            return
        self.settings = new
        # the open chat follows the new system prompt from its next turn
        self.conversation.system_prompt = new.system_prompt
        self.notify("Saved; applied from the next turn.", title="Settings")

    def action_history(self) -> None:
        if self._refuse_busy():
            return
        self.push_screen(HistoryScreen(self.store, self.conversation.id), self._open_chosen)

    async def _open_chosen(self, conv_id: str | None) -> None:
        if conv_id:
            await self.open_conversation(conv_id)

    async def open_conversation(self, conv_id: str) -> bool:
        if self._refuse_busy():
            return False
        try:
            conv = self.store.load(conv_id)
        except StoreError as e:
            self.notify(str(e), severity="error")
            return False
        self._end_edit()
        self.conversation = conv
        self.panel.clear_cache_stats()  # the figures were the previous chat's
        await self.transcript.remove_children()
        widgets = [
            ChatMessage(m["role"], m["content"], index=i, stopped=bool(m.get("stopped")))
            for i, m in enumerate(conv.messages)
        ]
        if widgets:
            await self.transcript.mount_all(widgets)
        self.transcript.follow()
        self.input.sent_history.extend(m["content"] for m in conv.messages if m["role"] == "user")
        self.notify(f"Opened “{conv.title or 'New chat'}”", title="History")
        return True

    def action_export(self) -> Path | None:
        conv = self.conversation
        if not conv.messages:
            self.notify("Nothing to export yet.", severity="warning")
            return None
        name = f"{_slug(conv.title) or 'chat'}-{conv.id}.md"
        folders = [self.store.root.parent / "exports", Path.cwd()]
        for folder in folders:
            try:
                folder.mkdir(parents=True, exist_ok=True)
                path = export_markdown(conv, folder / name)
            except (OSError, StoreError):
                continue
            self.last_export = path
            self.notify(str(path), title="Exported")
            return path
        self.notify(f"Cannot write {name} to the data folder or here.", severity="error")
        return None

    def action_layers(self) -> None:
        self.push_screen(LayerCacheScreen(self._layer_rows))

    def _layer_rows(self) -> list[dict[str, Any]]:
        return list(self.engine.layer_stats()) if self.engine is not None else []

    def action_copy_reply(self) -> None:
        focused = self.focused
        target: ChatMessage | None = None
        if isinstance(focused, ChatMessage) and focused.role == "assistant":
            target = focused
        else:
            replies = [w for w in self.transcript.messages if w.role == "assistant"]
            target = replies[-1] if replies else None
        if target is None or not target.content:
            self.notify("No reply to copy yet.", severity="warning")
            return
        self.copy_to_clipboard(target.content)
        self.notify(f"Copied the reply ({len(target.content)} characters).", title="Clipboard")

    def action_help(self) -> None:
        if isinstance(self.screen, HelpScreen):
            self.screen.dismiss()
            return
        self.push_screen(HelpScreen(self.help_rows()))

    def help_rows(self) -> list[tuple[str, str]]:
        seen: dict[str, list[str]] = {}
        titles: dict[str, str] = {}
        for b in self.BINDINGS:
            assert isinstance(b, Binding)
            seen.setdefault(b.action, []).append(self.get_key_display(b))
            titles[b.action] = ACTION_HELP.get(b.action, b.description)
        rows = [(" / ".join(keys), titles[action]) for action, keys in seen.items()]
        return rows + list(INPUT_KEYS)

    def get_system_commands(self, screen: Screen[Any]) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        for title, action, callback in self._palette_actions():
            yield SystemCommand(title, ACTION_HELP.get(action, title), callback)

    def _palette_actions(self) -> list[tuple[str, str, Callable[[], Any]]]:
        return [
            ("Stop generation", "stop", self.action_stop),
            ("Regenerate last reply", "regenerate", self.action_regenerate),
            ("Edit last message", "edit_last", self.action_edit_last),
            ("New chat", "new_chat", self.action_new_chat),
            ("Swap model", "pick_model", self.action_pick_model),
            ("Settings", "settings", self.action_settings),
            ("History", "history", self.action_history),
            ("Export chat to Markdown", "export", self.action_export),
            ("Layer cache view", "layers", self.action_layers),
            ("Copy last reply", "copy_reply", self.action_copy_reply),
            ("Keys (help)", "help", self.action_help),
        ]


ACTION_HELP = {
    "quit": "quit kvchat",
    "stop": "stop the reply (partial text kept); cancel an edit",
    "regenerate": "regenerate the last reply",
    "edit_last": "put your last message in the input to edit and resend",
    "new_chat": "start a new chat (clears the cache)",
    "pick_model": "swap the model (local weights)",
    "settings": "system prompt, sampling, limits, cache bound",
    "history": "past chats: reopen or delete",
    "interrupt": "stop the reply (while one is generating)",
    "export": "export this chat to Markdown",
    "layers": "per-layer KV cache view",
    "copy_reply": "copy the selected (or last) reply",
    "help": "this help",
}


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()[:40]


def default_model_path(settings: Settings) -> str | None:
    """No --model: the last model used, else the shipped one, else none (pick in the UI)."""
    # absolute only: an old relative entry would depend on where kvchat was started
    if settings.last_model and Path(settings.last_model).is_absolute() and \
            Path(settings.last_model).is_dir():
        return settings.last_model
    if (DEFAULT_MODEL / "config.json").is_file():
        return str(DEFAULT_MODEL)
    return None


def run_tui(model_path: str | None, settings: Settings | None = None) -> int:
    """Entry point for `kvchat [--model DIR]`. A bad --model folder raises a one-line
    KVChatError before the UI starts (app.cli prints it and exits 1)."""
    settings = settings if settings is not None else load_settings()
    if model_path is not None:
        path: str | None = str(validate_model_path(model_path))
    else:
        path = default_model_path(settings)
    app = KVChatApp(path, settings)
    app.run()
    return app.return_code or 0
