"""F1: every key of the app and of the input box, in one table."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Static


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,f1,q", "dismiss", "Close", id="help.close")]

    def __init__(self, rows: list[tuple[str, str]]) -> None:
        super().__init__()
        self.rows = rows

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog", classes="dialog -help"):
            yield Static("Keys", classes="dialog-title")
            table: DataTable[str] = DataTable(id="keys", cursor_type="row", zebra_stripes=True)
            table.add_columns("key", "what it does")
            for key, what in self.rows:
                table.add_row(key, what)
            yield table
            yield Static(
                "Every action is also in the command palette (Ctrl+P). Esc closes.",
                classes="dialog-hint",
            )
