"""The model the chat talks to: a swap asked for (the picker's choice), the engine's
Loading / Loaded / LoadFailed answers, and the kernels switch. A failed swap keeps the
old model; the open conversation continues on a new one. The chat that was open last
comes back once the first model is in (a chat cannot open mid-load).
"""

from __future__ import annotations

from typing import Any, Protocol

from textual.widgets import Static

from kvchat.app.core import memory
from kvchat.app.core.settings import Settings, remember_model
from kvchat.app.core.text import literal
from kvchat.app.tui.session import restore_session
from kvchat.app.tui.turn import Phase, busy_reason
from kvchat.app.tui.widgets import StatsPanel
from kvchat.app.tui.widgets.format import fmt_bytes
from kvchat.model.errors import KVChatError
from kvchat.model.runtime.events import (
    EngineLike,
    KernelsSwitched,
    Loaded,
    LoadFailed,
    Loading,
    TurnStats,
)


class ModelView(Protocol):
    """What the swap uses of the chat screen."""

    settings: Settings
    engine: EngineLike | None
    model_info: dict[str, Any]
    model_path: str | None
    phase: Phase
    sub_title: str
    ignore_memory_check: bool

    @property
    def panel(self) -> StatsPanel: ...

    @property
    def loading_label(self) -> Static: ...

    def go(self, new: Phase) -> None: ...

    def notify(self, message: str, *, title: str = "", severity: Any = "information",
               timeout: float | None = None) -> None: ...

    def call_after_refresh(self, callback: Any, *args: Any) -> Any: ...


class ModelSwap:
    def __init__(self, view: ModelView) -> None:
        self.view = view
        self.restore_pending = False  # the last chat reopens once the model has loaded

    def load(self, path: str | None) -> None:
        """Swap weights in the engine; the conversation continues on the new model."""
        view = self.view
        if not path:
            return
        why = busy_reason(view.phase)
        if why:
            view.notify(why, severity="warning")
            return
        if view.engine is None:
            return
        if why := memory.refusal(path, view.settings.gen_params(), view.ignore_memory_check):
            view.notify(why, severity="error", title="Model not loaded")  # the old one stays
            return
        view.go(Phase.LOADING)  # the label comes with the engine's Loading event
        view.engine.load(path)

    def switch_kernels(self, backend: str) -> None:
        """The palette's "Kernels: use …": the engine switches where the model runs."""
        if self.view.engine is not None:
            self.view.engine.set_kernels(backend)

    # ---- engine events ---------------------------------------------------------------------
    def on_loading(self, ev: Loading) -> None:
        self.view.loading_label.update(literal(f"Loading {ev.path} …"))
        if self.view.phase is not Phase.LOADING:
            self.view.go(Phase.LOADING)

    def on_loaded(self, ev: Loaded) -> None:
        view = self.view
        swapped = bool(view.model_info)
        view.go(Phase.IDLE)
        if self.restore_pending:
            self.restore_pending = False
            view.call_after_refresh(restore_session, view)
        view.model_info = dict(ev.info)
        view.model_path = str(ev.info.get("path") or "") or None
        view.sub_title = str(ev.info.get("name") or "")
        panel = view.panel
        panel.freed_bytes = ev.freed_bytes if swapped else None
        panel.clear_cache_stats()
        panel.set_model(ev.info)
        # memory, kernels and device before the first turn: metadata and allocator
        # counters only (no arrays; from the engine process, its last snapshot)
        if view.engine is not None:
            panel.update_stats(view.engine.cache_stats())
        if swapped:
            view.notify(
                f"Loaded {ev.info.get('name')} · freed {fmt_bytes(ev.freed_bytes)}",
                title="Model swapped",
            )
        settings = view.settings
        if view.model_path and settings.last_model != view.model_path:
            settings.last_model = view.model_path
            try:
                remember_model(settings)
            except KVChatError:
                pass  # remembering the last model is best-effort

    def on_load_failed(self, ev: LoadFailed) -> None:
        view = self.view
        if view.phase is Phase.LOADING:
            view.go(Phase.ERROR)
            keep = f" (still on {view.model_info.get('name')})" if view.model_info else ""
            view.notify(f"{ev.message}{keep}", severity="error", title="Model not loaded")
        else:  # the engine process died between turns: the phase stays at rest
            view.notify(ev.message, severity="error", title="Engine stopped")

    def on_kernels_switched(self, ev: KernelsSwitched) -> None:
        self.view.notify(ev.message, title="Kernels")
        self.view.panel.update_stats(TurnStats(kernels_backend=ev.backend))
