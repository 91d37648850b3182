"""F4: the loaded model's anatomy — its decoder block stage by stage, annotated from its
config, with the design's worked numbers computed by the engine's kernels and the cache
it implies against MHA and MQA (model/explain/anatomy.py's data, as `kvchat explain` prints it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from kvchat.app.core.text import literal
from kvchat.model.explain.anatomy import DEFAULT_GAP, text_sections
from kvchat.model.runtime.events import Explained


def sections_text(data: dict[str, Any]) -> Text:
    """Every section: a bold title, then its lines (model-derived text stays literal)."""
    out = Text()
    for i, (title, lines) in enumerate(text_sections(data)):
        if i:
            out.append("\n\n")
        out.append_text(literal(title, "bold"))
        out.append("\n")
        out.append_text(literal("\n".join(lines)))
    return out


class AnatomyScreen(ModalScreen[None]):
    BINDINGS = [
        Binding("escape,q,f4", "dismiss", "Close", id="anatomy.close"),
        Binding("r", "refresh_data", "Refresh", id="anatomy.refresh"),
        Binding("a", "attention", "Attention view", id="anatomy.attention"),
        Binding("plus,right", "gap(1)", "Gap +", id="anatomy.gap_up", priority=True),
        Binding("minus,left", "gap(-1)", "Gap −", id="anatomy.gap_down", priority=True),
        Binding("t", "toggle_block", "2017 / this model", id="anatomy.toggle"),
    ]

    def __init__(self, request: Callable[[int, str], None],
                 open_attention: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.request = request  # asks the engine for an Explained event, at a RoPE gap
        self.open_attention = open_attention
        self.gap = DEFAULT_GAP
        self.block = "model"  # or "2017": the same model with the 2017 block
        self.data: dict[str, Any] | None = None

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog", classes="dialog -anatomy"):
            yield Static("Anatomy of the loaded model", id="anatomy-title",
                         classes="dialog-title")
            with VerticalScroll(id="anatomy-body"):
                yield Static("Asking the engine…", id="anatomy-text")
            yield Static("↑/↓ scroll · t the same model as a 2017 block · ←/→ RoPE gap"
                         " · r refresh (the cache figures follow the chat) · a attention view"
                         " · Esc close", classes="dialog-hint")

    def on_mount(self) -> None:
        self.action_refresh_data()

    def action_refresh_data(self) -> None:
        self.request(self.gap, self.block)

    def action_gap(self, step: int) -> None:
        self.gap = max(0, self.gap + step)
        self.action_refresh_data()

    def action_toggle_block(self) -> None:
        """Morph: the loaded model's block <-> the same sizes with the 2017 block (post-
        LayerNorm, ReLU FFN, sinusoidal positions, MHA), its cache figures beside."""
        self.block = "2017" if self.block == "model" else "model"
        self.query_one("#anatomy-title", Static).update(
            "Anatomy of the loaded model" if self.block == "model"
            else "The loaded model as a 2017 block (t: back)")
        self.action_refresh_data()

    def action_attention(self) -> None:
        if self.open_attention is not None:
            self.dismiss()
            self.open_attention()

    def show(self, event: Explained) -> None:
        self.data = event.data
        self.query_one("#anatomy-text", Static).update(sections_text(event.data))
