"""Ctrl+L: what each layer is and what its cache holds (engine.layer_stats(), metadata
only): K/V for attention layers, a fixed-size state for recurrent ones."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Static

from kvchat.app.core.text import literal
from kvchat.app.tui.widgets.format import fmt_bytes

# (key in layer_stats, column title), in the order a reader asks: what the layer is, what
# it holds and what that costs (against float and MHA) first, so an 80-column terminal
# shows them; the ring's bookkeeping after. Bytes columns are shown in human units.
COLUMNS = (
    ("layer", "layer"),
    ("layer_kind", "kind"),
    ("window", "window"),
    ("cache_tokens", "tokens"),
    ("cache_capacity", "capacity"),
    ("cache_bytes", "bytes"),
    ("state_bytes", "state"),
    ("float_bytes", "as float"),
    ("mha_bytes", "as MHA"),
    ("allocated_tokens", "alloc"),
    ("allocated_bytes", "alloc B"),
    ("kv_bits", "bits"),
    ("kv_group_size", "group"),
    ("keep", "keep"),
    ("evicted_tokens", "evicted"),
    ("wrapped", "wrap"),
    ("cache_offset", "offset"),
    ("kind", "cache"),
)
# a column that only says something where it differs from another: a float cache's
# "as float" is its "bytes"
TWINS = {"float_bytes": "cache_bytes"}
# keys the table never shows: "attention" is the machine name "kind" spells out
# (model/cache/layer_kinds.py)
HIDDEN = {"attention"}
# columns that say nothing while every row is 0: no layer keeps a recurrent state
ZERO_IS_NOTHING = {"state_bytes"}


def shown_columns(rows: list[dict[str, Any]]) -> list[str]:
    """The keys to show, in order: COLUMNS' that some row has a value for (and that
    differ from their twin somewhere), then any other key the rows carry."""
    def says_something(k: str) -> bool:
        if all(r.get(k) is None for r in rows):
            return False
        if k in ZERO_IS_NOTHING and not any(r.get(k) for r in rows):
            return False
        twin = TWINS.get(k)
        return twin is None or any(r.get(k) != r.get(twin) for r in rows)

    keys = [k for k, _ in COLUMNS if any(k in r for r in rows) and says_something(k)]
    return keys + sorted({k for r in rows for k in r} - {k for k, _ in COLUMNS} - HIDDEN)


def _cell(key: str, value: Any) -> str | Text:
    if value is None:
        return "–"
    if key.endswith("bytes"):
        return fmt_bytes(value)
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    return literal(value)  # text (a layer kind): never markup


class ColumnTable(DataTable[Any]):
    """A row-cursor table whose ←/→ scroll by whole columns (DataTable's scroll one
    cell, so a wide table took a key press per character)."""

    def _column_starts(self) -> list[int]:
        starts, x = [], 0
        for column in self.ordered_columns:
            starts.append(x)
            x += column.get_render_width(self)
        return starts

    def action_cursor_right(self) -> None:
        x = next((s for s in self._column_starts() if s > self.scroll_x), self.max_scroll_x)
        self.scroll_to(x=min(x, self.max_scroll_x), animate=False)

    def action_cursor_left(self) -> None:
        x = max((s for s in self._column_starts() if s < self.scroll_x), default=0)
        self.scroll_to(x=x, animate=False)


class LayerCacheScreen(ModalScreen[None]):
    BINDINGS = [
        Binding("escape,q", "dismiss", "Close", id="layers.close"),
        Binding("r", "refresh_rows", "Refresh", id="layers.refresh"),
        Binding("a", "attention", "Attention", id="layers.attention"),
    ]

    def __init__(self, source: Callable[[], list[dict[str, Any]]],
                 open_attention: Callable[[int], None] | None = None) -> None:
        super().__init__()
        self.source = source
        self.open_attention = open_attention  # the attention view of a layer

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog", classes="dialog -layers"):
            yield Static("KV cache per layer", classes="dialog-title")
            yield ColumnTable(id="layers", cursor_type="row", zebra_stripes=True)
            yield Static(id="summary", classes="dialog-hint")

    def on_mount(self) -> None:
        self.action_refresh_rows()

    def action_refresh_rows(self) -> None:
        rows = self.source()
        table = self.query_one(DataTable)
        table.clear(columns=True)
        keys = shown_columns(rows)
        titles = dict(COLUMNS)
        table.add_columns(*(titles.get(k, k) for k in keys))
        for r in rows:
            table.add_row(*(_cell(k, r.get(k)) for k in keys))
        self.query_one("#summary", Static).update(
            f"{summary(rows)} · ←/→ more columns · r refresh · a attention of the selected"
            " layer · Esc close"
            if rows
            else "The cache is empty (no turn yet, or no model loaded). Esc closes."
        )

    def action_attention(self) -> None:
        if self.open_attention is not None:
            layer = self.query_one(DataTable).cursor_row
            self.dismiss()
            self.open_attention(max(0, layer))


def summary(rows: list[dict[str, Any]]) -> str:
    """Layers by kind, bytes resident, and what sliding windows and GQA each save:
    windows against every layer holding as many tokens as the fullest one, GQA against
    the same tokens with one K/V head per query head. Recurrent layers: their states'
    bytes, the same at every token."""
    total = sum(int(r.get("cache_bytes") or 0) for r in rows)
    text = f"{len(rows)} layers · {fmt_bytes(total)} of K/V resident"
    recurrent = [r for r in rows if r.get("kind") == "state"]
    if recurrent:
        held = sum(int(r.get("state_bytes") or 0) for r in recurrent)
        text += (f" · {len(recurrent)} recurrent layers hold a {fmt_bytes(held)} state"
                 " (fixed, whatever the context)")
    sliding = [r for r in rows if str(r.get("attention", "")).startswith("sliding")]
    if sliding and total:
        most = max(int(r.get("cache_tokens") or 0) for r in rows)
        unwindowed = sum(
            r["cache_bytes"] / r["cache_tokens"] * most for r in rows if r.get("cache_tokens")
        )
        held = sum(int(r.get("cache_bytes") or 0) for r in sliding)
        text += (
            f" · {len(sliding)} sliding layers hold {fmt_bytes(held)},"
            f" windows save {unwindowed / total:.2f}x"
        )
    mha = sum(int(r.get("mha_bytes") or 0) for r in rows)
    if total and mha:
        latent = any(str(r.get("attention", "")).startswith("latent") for r in rows)
        text += f" · {'MLA' if latent else 'GQA'} saves {mha / total:.2f}x"
    return text
