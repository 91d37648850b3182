"""The chat: transcript and input on the left, live engine stats on the right, the turn
state machine (app/tui/turn.py) they render from, and the keys that act on them.

Engine events arrive through a `Bridge` (app/tui/bridge.py) as messages; each kind has its own
method (`on_started`, `on_text`, `on_stats`, `on_done`, `on_loading`, `on_loaded`,
`on_load_failed`, `on_cache_saved`, `on_cache_restored`, `on_kernels_switched`,
`on_turn_notice`), the place to hook into. The screen never runs MLX: the engine does
all of it, in its own process (model/runtime/engine_process.py) or, for a pipeline's rank 0, on
its own thread.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.reactive import reactive
from textual.screen import Screen
from textual.widgets import Header, LoadingIndicator, Static

from kvchat.app.core import memory
from kvchat.app.core.kv_quality import agreement_line
from kvchat.app.core.settings import Settings, remember_model
from kvchat.app.core.store import (
    Conversation,
    ConversationStore,
    StoreError,
    export_markdown,
    write_near_data,
)
from kvchat.app.core.text import clipboard_text, literal
from kvchat.app.tui.actions import bindings
from kvchat.app.tui.bridge import Bridge, EngineEvent, TextReady
from kvchat.app.tui.interrupt import InterruptKey
from kvchat.app.tui.screens.anatomy import AnatomyScreen
from kvchat.app.tui.screens.attention import AttentionScreen
from kvchat.app.tui.screens.history import HistoryScreen
from kvchat.app.tui.screens.layers import LayerCacheScreen
from kvchat.app.tui.screens.picker import ModelPickerScreen
from kvchat.app.tui.screens.settings_form import SettingsScreen
from kvchat.app.tui.session import (
    apply_theme,
    model_of_chat,
    remember_session,
    restore_session,
    retitle_after_edit,
    use_saved_theme,
)
from kvchat.app.tui.turn import FINISH_PHASE, Phase, step
from kvchat.app.tui.turn_notices import on_turn_event
from kvchat.app.tui.widgets import (
    ActionFooter,
    ChatInput,
    ChatMessage,
    StatsPanel,
    StatusLine,
    Transcript,
)
from kvchat.app.tui.widgets.format import fmt_bytes
from kvchat.model.errors import KVChatError
from kvchat.model.runtime.events import (
    AttentionView,
    CacheRestored,
    CacheSaved,
    Done,
    EngineFactory,
    EngineLike,
    Explained,
    KernelsSwitched,
    Loaded,
    LoadFailed,
    Loading,
    Overflow,
    PrefillProgress,
    Started,
    Stats,
    TurnStats,
)

TEXT_FLUSH_HZ = 15  # streamed text reaches the transcript at most this often
FINISH_NOTES = {"length": "max tokens reached", "stop": "stop string", "eos": ""}
# what the input box's border says in each phase
PHASE_LABELS = {
    Phase.IDLE: "",
    Phase.LOADING: "loading a model…",
    Phase.PREFILLING: "reading the prompt…",
    Phase.DECODING: "generating… (Esc stops)",
    Phase.STOPPED: "stopped",
    Phase.ERROR: "error",
}


class ChatScreen(InterruptKey, Screen[None]):
    """One chat with the loaded model. The app gives it the engine factory, the settings
    and the store; everything about the chat flow lives here."""

    BINDINGS = bindings("chat")

    phase: reactive[Phase] = reactive(Phase.IDLE, bindings=True, init=False)
    ignore_memory_check = False  # kvchat --ignore-memory-check: loads skip app/core/memory.py
    unsaved = False  # the last save of this chat failed: quitting asks first (app.py)

    def __init__(
        self,
        settings: Settings,
        store: ConversationStore,
        engine_factory: EngineFactory,
        model_path: str | None,
    ) -> None:
        super().__init__()
        self.settings = settings
        self.store = store
        self.bridge = Bridge(self)
        self._engine_factory = engine_factory
        self._initial_model = model_path
        self._restore_pending = False  # the last chat reopens once the model has loaded
        self.engine: EngineLike | None = None
        self.conversation = Conversation(system_prompt=settings.system_prompt)
        self.model_info: dict[str, Any] = {}
        self.model_path: str | None = None
        self.edit_index: int | None = None  # the user message being edited, if any
        self._reply: ChatMessage | None = None  # the reply streaming now
        self._ui_gen = 0  # the turn whose text the transcript shows
        self._restored_tokens = 0  # tokens of a reopened chat's cache, until its next turn
        self._last_flush = 0.0
        self._flush_timer_armed = False
        self._handlers: dict[type, Callable[[Any], Any]] = {
            Started: self.on_started,
            Stats: self.on_stats,
            Done: self.on_done,
            Loading: self.on_loading,
            Loaded: self.on_loaded,
            LoadFailed: self.on_load_failed,
            CacheSaved: self.on_cache_saved,
            CacheRestored: self.on_cache_restored,
            KernelsSwitched: self.on_kernels_switched,
            PrefillProgress: self.on_turn_notice,
            Overflow: self.on_turn_notice,
            Explained: self.on_view_data,
            AttentionView: self.on_view_data,
        }

    # ---- layout ---------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Header()
        panel = StatsPanel(id="stats")
        with Horizontal(id="main"):
            with Vertical(id="chat"):
                yield Transcript(id="transcript")
                yield StatusLine(panel, id="status-line")
                with Horizontal(id="loading"):
                    yield LoadingIndicator()
                    yield Static("", id="loading-label", markup=False)
                yield ChatInput(id="input")
            yield panel
        yield ActionFooter(compact=True)

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
        self.panel.set_bound(self.settings.max_kv_size, self.settings.keep)
        self.input.focus()
        for w in self.settings.warnings:
            self.notify(w, severity="warning", title="Settings")
        self.engine = self._engine_factory(self.bridge, self._initial_model)
        if self._initial_model is None:
            self.notify("No model loaded: press Ctrl+O to pick one.", severity="warning")
        apply_theme(self)
        # the last chat comes back once its model is in (a chat cannot open mid-load)
        self._restore_pending = self._initial_model is not None
        if not self._restore_pending:
            self.call_after_refresh(restore_session, self)

    def on_unmount(self) -> None:
        self.close_engine()
        self.store.close()  # the chat is free for another window (process exit does it too)

    def close_engine(self) -> None:
        self.bridge.closed = True
        if self.engine is not None:
            # a busy engine: its process is killed, or (in-process) its thread is left
            # to app.main.finish
            self.engine.close(timeout=1.0)

    # ---- the turn state machine -----------------------------------------------------------
    @property
    def generating(self) -> bool:
        return self.phase.generating

    def go(self, new: Phase) -> None:
        self.phase = step(self.phase, new)

    def watch_phase(self, phase: Phase) -> None:
        box = self.query_one("#loading")
        box.set_class(phase is Phase.LOADING, "-visible")
        inp = self.input
        if self.edit_index is None:
            inp.border_subtitle = PHASE_LABELS[phase] or None

    # ---- engine events (UI thread) --------------------------------------------------------
    async def on_engine_event(self, message: EngineEvent) -> None:
        handler = self._handlers.get(type(message.event))
        if handler is None:
            return
        if isinstance(message.event, Started):
            self._ui_gen = message.gen
        result = handler(message.event)
        if result is not None:
            await result

    async def on_text_ready(self, _message: TextReady) -> None:
        # At most TEXT_FLUSH_HZ transcript updates a second, however fast tokens come:
        # each update re-lays out the screen, and keys must stay snappy while decoding.
        wait = self._last_flush + 1 / TEXT_FLUSH_HZ - time.monotonic()
        if wait <= 0:
            await self.on_text()
        elif not self._flush_timer_armed:
            self._flush_timer_armed = True
            self.set_timer(wait, self._timed_flush)

    async def _timed_flush(self) -> None:
        self._flush_timer_armed = False
        await self.on_text()

    async def on_text(self) -> None:
        """Move the streamed text of this turn into the reply."""
        self._last_flush = time.monotonic()
        text = self.bridge.take(self._ui_gen)
        if text and self._reply is not None:
            if self.phase is Phase.PREFILLING:
                self.go(Phase.DECODING)
            await self._reply.append(text)

    async def on_started(self, ev: Started) -> None:
        self.panel.start_turn(ev.prompt_tokens, ev.cached_tokens)
        if ev.reprefill_reason:
            self.notify(ev.reprefill_reason, title="Cache")
        if self._restored_tokens:  # the first turn of a chat reopened with its cache
            self.notify(
                f"{self.panel.held(ev.cached_tokens):,} tokens from the saved cache;"
                f" {ev.reprefilled_tokens:,} re-prefilled.",
                title="Reopened warm",
            )
            self._restored_tokens = 0
        await self.on_text()

    def on_stats(self, ev: Stats) -> None:
        self.panel.update_stats(ev.stats)
        if self.phase is Phase.PREFILLING and ev.stats.generated_tokens:
            self.go(Phase.DECODING)

    async def on_done(self, ev: Done) -> None:
        await self.on_text()
        reply, self._reply = self._reply, None
        try:
            self.panel.end_turn(ev.stats)
            if reply is not None:
                await self._finish_reply(reply, ev)
        finally:
            # only now: the conversation and the file are up to date when keys are
            # accepted again
            if self.phase.generating:
                self.go(FINISH_PHASE.get(ev.finish_reason, Phase.ERROR))

    def on_loading(self, ev: Loading) -> None:
        self.query_one("#loading-label", Static).update(literal(f"Loading {ev.path} …"))
        if self.phase is not Phase.LOADING:
            self.go(Phase.LOADING)

    def on_loaded(self, ev: Loaded) -> None:
        swapped = bool(self.model_info)
        self.go(Phase.IDLE)
        if self._restore_pending:
            self._restore_pending = False
            self.call_after_refresh(restore_session, self)
        self.model_info = dict(ev.info)
        self.model_path = str(ev.info.get("path") or "") or None
        self.sub_title = str(ev.info.get("name") or "")
        self.panel.freed_bytes = ev.freed_bytes if swapped else None
        self.panel.clear_cache_stats()
        self.panel.set_model(ev.info)
        # memory, kernels and device before the first turn: metadata and allocator
        # counters only (no arrays; from the engine process, its last snapshot)
        if self.engine is not None:
            self.panel.update_stats(self.engine.cache_stats())
        if swapped:
            self.notify(
                f"Loaded {ev.info.get('name')} · freed {fmt_bytes(ev.freed_bytes)}",
                title="Model swapped",
            )
        if self.model_path and self.settings.last_model != self.model_path:
            self.settings.last_model = self.model_path
            try:
                remember_model(self.settings)
            except KVChatError:
                pass  # remembering the last model is best-effort

    def switch_kernels(self, backend: str) -> None:
        """The palette's "Kernels: use …": the engine switches where the model runs."""
        if self.engine is not None:
            self.engine.set_kernels(backend)

    def on_kernels_switched(self, ev: KernelsSwitched) -> None:
        self.notify(ev.message, title="Kernels")
        self.panel.update_stats(TurnStats(kernels_backend=ev.backend))

    def on_turn_notice(self, ev: PrefillProgress | Overflow) -> None:
        on_turn_event(ev, self.panel, self._reply, self.notify)

    def on_load_failed(self, ev: LoadFailed) -> None:
        self.go(Phase.ERROR)
        keep = f" (still on {self.model_info.get('name')})" if self.model_info else ""
        self.notify(f"{ev.message}{keep}", severity="error", title="Model not loaded")

    def on_cache_saved(self, ev: CacheSaved) -> None:
        # success is silent (History shows the file's size); a failure is one line
        if ev.error:
            self.notify(ev.error, severity="warning", title="Cache")

    def on_cache_restored(self, ev: CacheRestored) -> None:
        if ev.error:
            self.notify(ev.error, severity="warning", title="Cache")
        self._restored_tokens = ev.tokens

    async def _finish_reply(self, reply: ChatMessage, ev: Done) -> None:
        conv = self.conversation
        if ev.finish_reason == "error":
            self.notify(ev.error or "generation failed", severity="error", title="Error")
            if ev.text:  # the reply so far (a rank died mid-reply): kept, marked, saved
                await reply.finish(ev.text, stopped=True, note="error")
                conv.add_message("assistant", ev.text, stopped=True)
                self._autosave()
            else:
                await reply.remove()
            return
        stopped = ev.finish_reason == "cancelled"
        await reply.finish(ev.text, stopped=stopped, note=FINISH_NOTES.get(ev.finish_reason, ""))
        conv.add_message("assistant", ev.text, stopped=stopped)
        self._autosave()

    def _save_chat(self) -> bool:
        try:
            self.store.claim(self.conversation.id)  # this window's chat: held until it moves on
            self.store.save(self.conversation)
        except StoreError as e:
            self.notify(str(e), severity="error", title="Chat not saved")
            self.unsaved = True
            return False
        self.unsaved = False
        return True

    def retry_save(self) -> bool:
        """Save again (before quitting); True when the chat is on disk."""
        return self._save_chat()

    def _autosave(self) -> None:
        if not self._save_chat():
            return
        remember_session(self)
        if self.engine is not None:
            path = self.store.cache_path(self.conversation.id)
            if self.settings.save_kv_cache:
                self.engine.save_cache(path, self.settings.kv_cache_max_mib * 2**20)
            else:
                path.unlink(missing_ok=True)

    # ---- sending ----------------------------------------------------------------------------
    def _refuse_busy(self) -> bool:
        """True (and says why) when a turn or a load is running."""
        if self.phase.generating:
            self.notify("Still generating: press Esc to stop first.", severity="warning")
            return True
        if self.phase is Phase.LOADING:
            self.notify("A model is loading; one moment.", severity="warning")
            return True
        return False

    def _refuse_no_model(self) -> bool:
        if not self.model_info:
            self.notify("No model loaded: press Ctrl+O to pick one.", severity="warning")
            return True
        return False

    async def on_chat_input_submitted(self, message: ChatInput.Submitted) -> None:
        await self.send(message.text)

    async def send(self, text: str) -> bool:
        """Send a user message (truncating first when editing). False when refused."""
        if self._refuse_busy() or self._refuse_no_model():
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
        self._save_chat()  # on disk before the reply starts: a crash mid-reply loses nothing
        await self.transcript.add(ChatMessage("user", text, index=index))
        await self._start_reply()
        return True

    async def _truncate(self, index: int) -> None:
        del self.conversation.messages[index:]
        self.conversation.updated = time.time()
        await self.transcript.truncate(index)

    async def _start_reply(self) -> None:
        assert self.engine is not None
        conv = self.conversation
        conv.model = self.model_path
        self._reply = ChatMessage("assistant", "", index=len(conv.messages), streaming=True)
        await self.transcript.add(self._reply)
        self.transcript.follow()
        self.go(Phase.PREFILLING)
        self.engine.submit(conv.chat_messages(), self.settings.gen_params())

    # ---- editing ----------------------------------------------------------------------------
    def on_chat_message_selected(self, message: ChatMessage.Selected) -> None:
        if message.widget.role == "user":
            self.begin_edit(message.widget.index)

    def begin_edit(self, index: int) -> bool:
        """Put user message `index` into the input; the next send resends from there."""
        if self.phase.generating:
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

    # ---- actions ----------------------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "stop" and not (self.phase.generating or self.edit_index is not None):
            return None  # shown, greyed out
        return True

    def action_stop(self) -> None:
        """Esc: stop generating (the partial reply stays, marked stopped), or cancel an edit."""
        if self.phase.generating and self.engine is not None:
            self.engine.cancel()
            if self._reply is not None:
                self._reply.border_subtitle = "stopping…"
        elif self.edit_index is not None:
            self._end_edit()
            self.input.clear()

    async def action_regenerate(self) -> None:
        if self._refuse_busy():
            return
        msgs = self.conversation.messages
        if not any(m["role"] == "user" for m in msgs):
            self.notify("Nothing to regenerate yet.", severity="warning")
            return
        if self._refuse_no_model():
            return
        if msgs[-1]["role"] == "assistant":
            await self._truncate(len(msgs) - 1)
        self._end_edit()
        await self._start_reply()

    def action_edit_last(self) -> None:
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
        self._restored_tokens = 0
        self.store.release(self.conversation.id)
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
        self.app.push_screen(
            ModelPickerScreen(self.settings.model_dirs, self.model_path), self.load_model
        )

    def load_model(self, path: str | None) -> None:
        """Swap weights on the engine thread; the conversation continues on the new model."""
        if not path or self._refuse_busy() or self.engine is None:
            return
        if why := memory.refusal(path, self.settings.gen_params(), self.ignore_memory_check):
            self.notify(why, severity="error", title="Model not loaded")  # the old one stays
            return
        self.go(Phase.LOADING)  # the label comes with the engine's Loading event
        self.engine.load(path)

    def action_settings(self) -> None:
        self.app.push_screen(SettingsScreen(self.settings, agreement_line(self.model_path)),
                             self._apply_settings)

    def _apply_settings(self, new: Settings | None) -> None:
        if new is None:
            return
        self.settings = new
        self.panel.set_bound(new.max_kv_size, new.keep)
        use_saved_theme(self)  # after the swap: the theme hook saves into these settings
        # the open chat follows the new system prompt from its next turn
        self.conversation.system_prompt = new.system_prompt
        self.notify("Saved; applied from the next turn.", title="Settings")

    def action_history(self) -> None:
        if self._refuse_busy():
            return
        self.app.push_screen(
            HistoryScreen(self.store, self.conversation.id), self._open_chosen
        )

    async def _open_chosen(self, conv_id: str | None) -> None:
        if conv_id:
            await self.open_conversation(conv_id)

    async def open_conversation(self, conv_id: str) -> bool:
        """Show a saved chat; its K/V cache (when saved) is restored so the next turn
        prefills only the new message."""
        if self._refuse_busy():
            return False
        try:
            conv = self.store.load(conv_id)
        except StoreError as e:
            self.notify(str(e), severity="error")
            return False
        await self.show_conversation(conv, follow_model=True)
        return True

    async def show_conversation(self, conv: Conversation, follow_model: bool = False) -> None:
        """Make `conv` (already read from the store) the open chat; `follow_model`: on the
        model it was held with, when that is another folder here (its cache is that
        model's; at start-up app.default_model_path chose it already)."""
        conv_id = conv.id
        self._end_edit()
        self._restored_tokens = 0  # set again if this chat's cache comes back
        opened = self._claim(conv)
        self.conversation = opened
        self.panel.clear_cache_stats()  # the figures were the previous chat's
        await self.transcript.remove_children()
        widgets = [
            ChatMessage(m["role"], m["content"], index=i, stopped=bool(m.get("stopped")))
            for i, m in enumerate(conv.messages)
        ]
        if widgets:
            await self.transcript.mount_all(widgets)
        self.transcript.follow()
        for m in conv.messages:  # its messages become the newest history, never twice
            if m["role"] == "user":
                self.input.remember(m["content"])
        cache = self.store.cache_path(conv_id)
        if follow_model and (held_with := model_of_chat(conv.model, self.model_path)):
            self.load_model(held_with)  # the engine restores the cache after the load
        if self.engine is not None and self.settings.save_kv_cache and cache.is_file():
            self.engine.restore_cache(cache)
        if opened is conv:
            self.notify(f"Opened “{conv.title or 'New chat'}”", title="History")

    def _claim(self, conv: Conversation) -> Conversation:
        """One writer per chat: this window holds `conv`, or gets a copy of it (and says
        so) when another kvchat window has it open."""
        previous = self.conversation.id
        if previous != conv.id:
            self.store.release(previous)
        if self.store.claim(conv.id):
            return conv
        self.notify(f"“{conv.title or 'New chat'}” is open in another kvchat window; this is"
                    " a copy, saved as a chat of its own", severity="warning", title="History")
        return conv.copy()

    def action_export(self) -> Path | None:
        conv = self.conversation
        if not conv.messages:
            self.notify("Nothing to export yet.", severity="warning")
            return None
        name = f"{_slug(conv.title) or 'chat'}-{conv.id}.md"
        try:
            path = write_near_data(self.store, "exports",
                                   lambda folder: export_markdown(conv, folder / name))
        except StoreError as e:
            self.notify(f"{name}: {e}", severity="error", title="Not exported")
            return None
        self.notify(str(path), title="Exported")
        return path

    def action_toggle_panel(self) -> None:
        """Hide or show the stats panel; the choice holds until the next press, whatever
        the width does meanwhile."""
        shown = not self.panel.display
        self.set_class(shown, "-panel-shown")
        self.set_class(not shown, "-panel-hidden")

    def action_layers(self) -> None:
        self.app.push_screen(LayerCacheScreen(self._layer_rows, self.open_attention))

    def action_anatomy(self) -> None:
        if self.engine is None or not self.model_info:
            self.notify("No model loaded yet.", severity="warning")
            return
        self.app.push_screen(AnatomyScreen(self.engine.explain, self.open_attention))

    def action_attention(self) -> None:
        self.open_attention()

    def open_attention(self, layer: int = 0) -> None:
        """The attention view (beside the layer view): the engine computes it only while
        the screen is open."""
        if self.engine is None or not self.model_info:
            self.notify("No model loaded yet.", severity="warning")
            return
        info = self.model_info
        self.app.push_screen(AttentionScreen(
            self.engine.watch_attention, int(info.get("n_layers") or 1),
            int(info.get("n_kv_heads") or 1), layer))

    def on_view_data(self, ev: Explained | AttentionView) -> None:
        """Engine data for the Anatomy or attention screen, if it is the one showing."""
        screen = self.app.screen
        if isinstance(ev, Explained) and isinstance(screen, AnatomyScreen):
            screen.show(ev)
        elif isinstance(ev, AttentionView) and isinstance(screen, AttentionScreen):
            screen.show(ev)

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
        text = clipboard_text(target.content)  # never a terminal sequence on the clipboard
        self.app.copy_to_clipboard(text)
        # OSC 52 is write-only: whether the terminal took it cannot be known, so say how
        self.notify(f"Sent the reply ({len(text):,} characters) to the terminal's"
                    " clipboard (OSC 52). In tmux: set -g set-clipboard on.", title="Copy")


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()[:40]

