"""Ctrl+H / F2: past chats, newest first. Enter reopens one, Delete removes it."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Static

from ..store import ConversationStore, StoreError
from ..text import literal
from ..widgets.format import fmt_bytes


def _when(ts: float) -> str:
    try:
        return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M")
    except (OverflowError, OSError, ValueError):
        return "?"


class HistoryScreen(ModalScreen[str | None]):
    BINDINGS = [
        Binding("escape", "dismiss", "Close", id="history.close"),
        Binding("delete", "delete", "Delete chat", id="history.delete"),
    ]

    def __init__(self, store: ConversationStore, current_id: str | None = None) -> None:
        super().__init__()
        self.store = store
        self.current_id = current_id

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog", classes="dialog -history"):
            yield Static("Chats", classes="dialog-title")
            yield DataTable(id="chats", cursor_type="row", zebra_stripes=True)
            yield Static(id="history-status", classes="dialog-hint")

    def on_mount(self) -> None:
        self._fill()
        self.query_one("#chats", DataTable).focus()

    def _fill(self) -> None:
        table = self.query_one("#chats", DataTable)
        table.clear(columns=True)
        table.add_columns("", "title", "updated", "msgs", "K/V", "model")
        convs = self.store.list()
        for c in convs:
            table.add_row(
                "●" if c.id == self.current_id else "",
                literal(c.title or "New chat"),
                _when(c.updated),
                str(len(c.messages)),
                fmt_bytes(self.store.cache_bytes(c.id)),  # the saved cache: reopens warm
                literal(Path(c.model).name) if c.model else "–",
                key=c.id,
            )
        note = f"{len(convs)} chats · Enter opens · Delete removes · Esc closes"
        if self.store.skipped:
            note += f" · {len(self.store.skipped)} unreadable file(s) skipped"
        self.query_one("#history-status", Static).update(
            literal(note if convs else "No saved chats yet. Esc closes.")
        )

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        if event.row_key.value:
            self.dismiss(event.row_key.value)

    def action_delete(self) -> None:
        table = self.query_one("#chats", DataTable)
        if not table.row_count:
            return
        row_key, _ = table.coordinate_to_cell_key(table.cursor_coordinate)
        conv_id = row_key.value
        if not conv_id:
            return
        if conv_id == self.current_id:
            self.notify("That chat is open; start a new chat (Ctrl+N) to delete it.",
                        severity="warning")
            return
        try:
            self.store.delete(conv_id)
        except StoreError as e:
            self.notify(str(e), severity="error")
            return
        self._fill()
