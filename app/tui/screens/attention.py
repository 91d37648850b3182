"""F5 (or `a` in the layer view): where the newest token's attention goes in the KV cache.

A strip over the chosen layer's cache slots, left to right in slot order: the sink slots
(kept forever), the rotating window, empty slots, and the slot the next token overwrites;
under it the share of attention on the sinks, on the last 64 tokens and on the rest.
The engine computes it only while this screen is open (`watch_attention`), from the
cache's K and the newest token's query (model/explain/attention_view.py)."""

from __future__ import annotations

from collections.abc import Callable

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.reactive import reactive
from textual.screen import ModalScreen
from textual.widget import Widget
from textual.widgets import Static

from kvchat.model.runtime.events import AttentionView

LEVELS = " ▁▂▃▄▅▆▇█"
KIND_STYLE = {"sink": "bold yellow", "held": "bold cyan", "empty": "grey37"}


def columns(view: AttentionView, width: int) -> list[tuple[float, str, bool]]:
    """The view's bins re-binned to `width` columns: (weight, kind, holds the next write
    slot) each; a column is "sink" if any of its bins is, else "held" if any is."""
    n = len(view.bins)
    if n == 0 or width < 1:
        return []
    write_bin = view.write_slot // max(1, view.slots_per_bin)
    if width >= n:  # fewer bins than columns: each bin `width // n` columns wide
        k = width // n
        return [(w, kind, b == write_bin and i == 0)
                for b, (w, kind) in enumerate(zip(view.bins, view.bin_kinds, strict=False))
                for i in range(k)]
    out = []
    for c in range(width):
        lo, hi = c * n // width, (c + 1) * n // width
        kinds = view.bin_kinds[lo:hi]
        kind = "sink" if "sink" in kinds else "held" if "held" in kinds else "empty"
        out.append((sum(view.bins[lo:hi]), kind, lo <= write_bin < hi))
    return out


class AttentionStrip(Widget):
    """Two rows: bars of attention per column, then what each column holds."""

    DEFAULT_CSS = "AttentionStrip { height: 2; }"
    view: reactive[AttentionView | None] = reactive(None, layout=False)

    def render(self) -> Text:
        view = self.view
        if view is None or not view.bins:
            return Text("")
        cols = columns(view, self.size.width)
        top = max((w for w, _, _ in cols), default=0.0) or 1.0
        bars, marks = Text(), Text()
        for w, kind, write in cols:
            level = 0 if w <= 0 else max(1, round(w / top * (len(LEVELS) - 1)))
            bars.append(LEVELS[level] if kind != "empty" else "·", KIND_STYLE[kind])
            mark = "^" if write else "S" if kind == "sink" else "─" if kind == "held" else " "
            marks.append(mark, "bold red" if write else KIND_STYLE[kind])
        return bars + Text("\n") + marks


def _bar(share: float, width: int = 24) -> str:
    n = round(max(0.0, min(1.0, share)) * width)
    return "█" * n + "░" * (width - n)


def summary(view: AttentionView) -> Text:
    """The header line, the three shares and the strongest positions."""
    heads = "all heads" if view.group is None else (
        f"KV group {view.group + 1}/{view.n_groups} (heads {view.heads[0]}–{view.heads[-1]})")
    out = Text()
    out.append(f"layer {view.layer + 1}/{view.n_layers} · {heads}\n", "bold")
    if view.note:
        out.append(view.note)
        return out
    window = f" · window {view.window}" if view.window else ""
    out.append(f"newest token at position {view.position:,} sees {view.tokens:,} keys of a"
               f" {view.capacity:,}-slot cache · keep {view.keep} · evicted {view.evicted:,}"
               f"{window}\n\n")
    rows = (
        (f"sinks (first {view.keep})", view.sink_share, KIND_STYLE["sink"]),
        (f"last {view.recent} tokens", view.recent_share, KIND_STYLE["held"]),
        ("the rest", view.rest_share, "bold magenta"),
    )
    for label, share, style in rows:
        out.append(f"{label:<18} {share:6.1%} ")
        out.append(_bar(share), style)
        out.append("\n")
    if view.top:
        out.append("\nstrongest: " + ", ".join(f"pos {p:,} ({w:.1%})" for p, w in view.top))
    return out


class AttentionScreen(ModalScreen[None]):
    BINDINGS = [
        Binding("escape,q,f5", "dismiss", "Close", id="attention.close"),
        Binding("left,minus", "layer(-1)", "Layer −", id="attention.prev"),
        Binding("right,plus", "layer(1)", "Layer +", id="attention.next"),
        Binding("g", "group", "Head group", id="attention.group"),
    ]

    def __init__(self, watch: Callable[[int | None, int | None], None], n_layers: int,
                 n_groups: int, layer: int = 0) -> None:
        super().__init__()
        self.send_watch = watch  # the engine's watch_attention
        self.n_layers, self.n_groups = max(1, n_layers), max(1, n_groups)
        self.layer_index = max(0, min(layer, self.n_layers - 1))
        self.group: int | None = None

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog", classes="dialog -attention"):
            yield Static("Where the newest token's attention goes", classes="dialog-title")
            yield AttentionStrip(id="strip")
            yield Static("", id="attention-summary")
            yield Static("←/→ layer · g head group · strip: one column per cache slot"
                         " (or group of slots), S sink (kept), ─ rotating window, · empty,"
                         " ^ next write · Esc close", classes="dialog-hint")

    def on_mount(self) -> None:
        self.query_one("#attention-summary", Static).update(
            f"layer {self.layer_index + 1}/{self.n_layers} · waiting for the engine…")
        self._watch()

    def on_unmount(self) -> None:
        self.send_watch(None, None)  # closed: the engine computes nothing more

    def _watch(self) -> None:
        self.send_watch(self.layer_index, self.group)

    def action_layer(self, step: int) -> None:
        self.layer_index = (self.layer_index + step) % self.n_layers
        self._watch()

    def action_group(self) -> None:
        order: list[int | None] = [None, *range(self.n_groups)]
        self.group = order[(order.index(self.group) + 1) % len(order)]
        self._watch()

    def show(self, view: AttentionView) -> None:
        if (view.layer, view.group) != (self.layer_index, self.group):
            return  # a view of the previous choice, still in flight
        self.query_one(AttentionStrip).view = view
        self.query_one("#attention-summary", Static).update(summary(view))
