"""The chat screen: transcript and input on the left, live engine stats on the right, and
the keys. It composes the widgets and wires keys and engine events to three parts:

- the turn controller (app/tui/turn_controller.py): a turn sent to the engine, its
  text streamed into the reply, its Started / Stats / Done events, stopping it;
- the conversation commands (app/tui/conversation.py): send, retry, edit, a new chat, a
  saved chat reopened, export, copy, settings, saving;
- the model swap (app/tui/model_swap.py): loading a model, the kernels switch.

Engine events arrive through a `Bridge` (app/tui/bridge.py) as messages; `_handlers` says
which part takes each kind. The screen never runs MLX: the engine does all of it, in its
own process (model/runtime/engine_process.py) or, for a pipeline's rank 0, on its own
thread. It renders from the turn state machine (app/tui/turn.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.reactive import reactive
from textual.screen import Screen
from textual.widgets import Header, LoadingIndicator, Static

from kvchat.app.core.kv_quality import agreement_line
from kvchat.app.core.settings import Settings
from kvchat.app.core.store import Conversation, ConversationStore
from kvchat.app.tui.actions import bindings
from kvchat.app.tui.bridge import Bridge, EngineEvent, TextReady
from kvchat.app.tui.conversation import ConversationCommands
from kvchat.app.tui.interrupt import InterruptKey
from kvchat.app.tui.model_swap import ModelSwap
from kvchat.app.tui.screens.anatomy import AnatomyScreen
from kvchat.app.tui.screens.attention import AttentionScreen
from kvchat.app.tui.screens.history import HistoryScreen
from kvchat.app.tui.screens.layers import LayerCacheScreen
from kvchat.app.tui.screens.picker import ModelPickerScreen
from kvchat.app.tui.screens.settings_form import SettingsScreen
from kvchat.app.tui.session import apply_theme, restore_session
from kvchat.app.tui.turn import Phase, step
from kvchat.app.tui.turn_controller import TurnController
from kvchat.app.tui.widgets import (
    ActionFooter,
    ChatInput,
    ChatMessage,
    StatsPanel,
    StatusLine,
    Transcript,
)
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
)

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
    and the store."""

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
        self.engine: EngineLike | None = None
        self.model_info: dict[str, Any] = {}
        self.model_path: str | None = None
        # a finished reply joins the conversation (and its file)
        self.turns = TurnController(
            self, keep=lambda text, stopped: self.commands.keep_reply(text, stopped))
        self.commands = ConversationCommands(self, self.turns)
        self.model_swap = ModelSwap(self)
        self._handlers: dict[type, Callable[[Any], Any]] = {
            Started: self.turns.on_started,
            Stats: self.turns.on_stats,
            Done: self.turns.on_done,
            PrefillProgress: self.turns.on_notice,
            Overflow: self.turns.on_notice,
            Loading: self.model_swap.on_loading,
            Loaded: self.model_swap.on_loaded,
            LoadFailed: self.model_swap.on_load_failed,
            KernelsSwitched: self.model_swap.on_kernels_switched,
            CacheSaved: self.commands.on_cache_saved,
            CacheRestored: self.commands.on_cache_restored,
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

    @property
    def loading_label(self) -> Static:
        return self.query_one("#loading-label", Static)

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
        self.model_swap.restore_pending = self._initial_model is not None
        if not self.model_swap.restore_pending:
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

    # ---- state the parts share ------------------------------------------------------------
    @property
    def conversation(self) -> Conversation:
        return self.commands.conversation

    @property
    def edit_index(self) -> int | None:
        return self.commands.edit_index

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
            self.turns.follow(message.gen)
        result = handler(message.event)
        if result is not None:
            await result

    async def on_text_ready(self, _message: TextReady) -> None:
        await self.turns.text_ready()

    def on_view_data(self, ev: Explained | AttentionView) -> None:
        """Engine data for the Anatomy or attention screen, if it is the one showing."""
        screen = self.app.screen
        if isinstance(ev, Explained) and isinstance(screen, AnatomyScreen):
            screen.show(ev)
        elif isinstance(ev, AttentionView) and isinstance(screen, AttentionScreen):
            screen.show(ev)

    # ---- what the input and the transcript say --------------------------------------------
    def on_chat_message_selected(self, message: ChatMessage.Selected) -> None:
        if message.widget.role == "user":
            self.begin_edit(message.widget.index)

    async def send(self, text: str) -> bool:
        """Send a user message (truncating first when editing). False when refused."""
        return await self.commands.send(text)

    def begin_edit(self, index: int) -> bool:
        """Put user message `index` into the input; the next send resends from there."""
        return self.commands.begin_edit(index)

    async def open_conversation(self, conv_id: str) -> bool:
        """Show a saved chat (and restore its K/V cache when saved)."""
        return await self.commands.open_conversation(conv_id)

    async def show_conversation(self, conv: Conversation, follow_model: bool = False) -> None:
        """Make `conv` (already read from the store) the open chat."""
        await self.commands.show_conversation(conv, follow_model)

    def retry_save(self) -> bool:
        """Save again (before quitting); True when the chat is on disk."""
        return self.commands.save_chat()

    def load_model(self, path: str | None) -> None:
        """Swap weights in the engine; the conversation continues on the new model."""
        self.model_swap.load(path)

    def switch_kernels(self, backend: str) -> None:
        """The palette's "Kernels: use …": the engine switches where the model runs."""
        self.model_swap.switch_kernels(backend)

    # ---- actions (keys: app/tui/actions.py) -----------------------------------------------
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "stop" and not (self.phase.generating or self.edit_index is not None):
            return None  # shown, greyed out
        if action == "send":  # Enter elsewhere (a message) is that widget's
            return isinstance(self.focused, ChatInput)
        return True

    async def action_send(self) -> None:
        """Enter in the input box: send what it holds."""
        inp = self.input
        await inp.settled()
        if inp.text.strip():
            await self.send(inp.text)

    def action_stop(self) -> None:
        """Esc: stop generating (the partial reply stays, marked stopped), or cancel an edit."""
        if self.turns.stop():
            self.input.border_subtitle = "stopping…"  # until the engine's Done: then "stopped"
        else:
            self.commands.cancel_edit()

    async def action_regenerate(self) -> None:
        await self.commands.regenerate()

    def action_edit_last(self) -> None:
        self.commands.edit_last()

    async def action_new_chat(self) -> None:
        await self.commands.new_chat()

    def action_pick_model(self) -> None:
        if self.commands.refuse_busy():
            return
        self.app.push_screen(
            ModelPickerScreen(self.settings.model_dirs, self.model_path), self.load_model
        )

    def action_settings(self) -> None:
        self.app.push_screen(SettingsScreen(self.settings, agreement_line(self.model_path)),
                             self.commands.apply_settings)

    def action_history(self) -> None:
        if self.commands.refuse_busy():
            return
        self.app.push_screen(
            HistoryScreen(self.store, self.conversation.id), self.commands.open_chosen
        )

    def action_export(self) -> Path | None:
        return self.commands.export()

    def action_copy_reply(self) -> None:
        self.commands.copy_reply()

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

    def _layer_rows(self) -> list[dict[str, Any]]:
        return list(self.engine.layer_stats()) if self.engine is not None else []
