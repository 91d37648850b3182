"""Ctrl+O: swap the local weights. Lists app.discovery.find_models() with sizes, plus a
free path. Returns the chosen folder; loading itself happens on the engine thread."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, DataTable, Input, Static

from ..discovery import ModelEntry, find_models
from ..text import literal
from ..widgets.format import fmt_bytes


class ModelPickerScreen(ModalScreen[str | None]):
    BINDINGS = [Binding("escape", "dismiss", "Cancel", id="picker.cancel")]

    def __init__(
        self,
        extra_dirs: Sequence[str] = (),
        current: str | None = None,
        *,
        include_defaults: bool = True,
    ) -> None:
        super().__init__()
        self.extra_dirs = list(extra_dirs)
        self.current = str(Path(current).resolve()) if current else None
        self.include_defaults = include_defaults
        self.entries: list[ModelEntry] = []
        self.scanned = False

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog", classes="dialog -picker"):
            yield Static("Swap model", classes="dialog-title")
            table: DataTable[str] = DataTable(id="models", cursor_type="row", zebra_stripes=True)
            table.add_columns("", "name", "arch", "bits", "size", "source")
            yield table
            yield Static("Looking for local models…", id="picker-status", classes="dialog-hint")
            yield Input(placeholder="…or type a model folder path and press Enter", id="path")
            with Horizontal(classes="buttons"):
                yield Button("Load", id="load", variant="primary")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        self.query_one("#models", DataTable).focus()
        self._scan()

    @work(thread=True, exclusive=True)
    def _scan(self) -> None:
        # Plain file-system reads (no MLX), so a worker thread is fine here; a big HF
        # cache must not freeze the UI while it is walked.
        entries = find_models(self.extra_dirs, include_defaults=self.include_defaults)
        self.app.call_from_thread(self._fill, entries)

    def _fill(self, entries: list[ModelEntry]) -> None:
        self.entries = entries
        self.scanned = True
        table = self.query_one("#models", DataTable)
        table.clear()
        for e in entries:
            mark = "●" if self.current and str(e.path) == self.current else ""
            if not e.supported:
                mark = "✗"
            table.add_row(
                mark,
                literal(e.name),
                literal(e.architecture),
                str(e.bits) if e.bits else "–",
                fmt_bytes(e.size_bytes),
                literal(e.source),
                key=str(e.path),
            )
        status = self.query_one("#picker-status", Static)
        if entries:
            status.update(
                f"{len(entries)} found · Enter loads · ● current · ✗ unsupported architecture"
            )
        else:
            status.update("No local models found; type a folder path below.")

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        if event.row_key.value:
            self.dismiss(event.row_key.value)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self._choose_path(event.value)

    def _choose_path(self, value: str) -> None:
        value = value.strip()
        if not value:
            self.notify("Type a model folder path first.", severity="warning")
            return
        self.dismiss(str(Path(value).expanduser()))

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "cancel":
            self.dismiss(None)
            return
        path = self.query_one("#path", Input).value
        if path.strip():
            self._choose_path(path)
            return
        table = self.query_one("#models", DataTable)
        if table.row_count:
            row_key, _ = table.coordinate_to_cell_key(table.cursor_coordinate)
            if row_key.value:
                self.dismiss(row_key.value)
                return
        self.notify("Pick a model or type a folder path.", severity="warning")
