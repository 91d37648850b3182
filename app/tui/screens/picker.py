"""Ctrl+O: swap the model. Lists the local models (app.core.discovery.model_rows: what each
costs on this backend, or why it cannot load) and takes typed input:

- a folder path or a GGUF file -> that model is loaded; `ollama:NAME[:TAG]` -> that model
  of Ollama's store (its GGUF blob, read where it is);
- a Hugging Face repo id (org/name) -> pulled into the HF cache with progress (Esc stops;
  the partial files stay for next time), checked, then listed with the cursor on it;
- ↑/↓ move the list while you type; Enter on an empty input loads the highlighted row.

Returns the chosen folder (resolved), or None; the engine thread does the loading.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from pathlib import Path

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, DataTable, Input, Static

from kvchat.app.core.discovery import ModelRow, model_rows, resolve_model
from kvchat.app.core.hub_download import PullProgress, looks_like_repo_id, pull, verify_pulled
from kvchat.app.core.pull_progress import progress_lines
from kvchat.app.core.text import literal
from kvchat.app.tui.widgets.format import fmt_bytes
from kvchat.model.errors import KVChatError
from kvchat.model.explain.facts import check_model_folder


class ModelPickerScreen(ModalScreen[str | None]):
    BINDINGS = [
        Binding("escape", "cancel", "Cancel", id="picker.cancel"),
        Binding("up", "cursor(-1)", "Up", show=False, id="picker.up"),
        Binding("down", "cursor(1)", "Down", show=False, id="picker.down"),
    ]

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
        self.rows: list[ModelRow] = []
        self.scanned = False
        self.pulling: threading.Event | None = None  # set = stop the running pull
        self.pulled: Path | None = None
        self._select_after_scan: str | None = None

    @property
    def entries(self) -> list:  # the ModelEntry of each row, in table order
        return [r.entry for r in self.rows]

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog", classes="dialog -picker"):
            yield Static("Swap model", classes="dialog-title")
            yield DataTable(id="models", cursor_type="row", zebra_stripes=True)
            yield Static("Looking for local models…", id="picker-status", classes="dialog-hint")
            yield Static("", id="pull-progress", classes="dialog-hint")
            yield Input(
                placeholder="type a folder, a GGUF file, ollama:NAME, or a Hugging Face repo"
                " id to download",
                id="path",
            )
            with Horizontal(classes="buttons"):
                yield Button("Load", id="load", variant="primary")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        # typing goes straight to the input; ↑/↓ still move the list
        self.query_one("#path", Input).focus()
        self._scan()

    @work(thread=True, exclusive=True, group="scan")
    def _scan(self) -> None:
        # Plain file-system reads (safetensors headers, no MLX), so a worker thread is
        # fine; a big HF cache must not freeze the UI while it is walked.
        # the model in use is listed (with its ●) even when it was opened by a path that
        # no searched folder holds
        rows = model_rows(self.extra_dirs, include_defaults=self.include_defaults,
                          opened=[self.current] if self.current else [])
        self.app.call_from_thread(self._fill, rows)

    def _fill(self, rows: list[ModelRow]) -> None:
        self.rows = rows
        self.scanned = True
        table = self.query_one("#models", DataTable)
        table.clear(columns=True)  # columns too: their widths follow the new rows
        table.add_columns("", "name", "arch", "bits", "memory", "source")
        for r in rows:
            e = r.entry
            mark = "●" if self.current and str(e.path) == self.current else ""
            if not r.loadable:
                mark = "✗"
            table.add_row(
                mark,
                literal(e.name),
                literal(e.architecture),
                str(e.bits or e.quantization or "–"),  # a GGUF file: its type
                f"{fmt_bytes(r.facts.weight_bytes)} {r.facts.compute_dtype}" if r.facts else "–",
                literal(e.source),
                key=str(e.path),
            )
        # the cursor starts on the model in use (or the one just downloaded)
        want = self._select_after_scan or self.current
        for i, r in enumerate(rows):
            if str(r.entry.path) == want:
                table.move_cursor(row=i)
                break
        self._select_after_scan = None
        self._show_status()

    def _show_status(self) -> None:
        status = self.query_one("#picker-status", Static)
        if self.rows:
            status.update(
                f"{len(self.rows)} found · Enter loads · ● current · ✗ cannot load (highlight"
                " it to see why)"
            )
        else:
            status.update("No local models found; type a folder path or a repo id below.")

    def _row(self, key: str) -> ModelRow | None:
        return next((r for r in self.rows if str(r.entry.path) == key), None)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        row = self._row(str(event.row_key.value))
        if row is not None and row.problem:
            status = self.query_one("#picker-status", Static)
            status.update(literal(f"✗ {row.entry.name}: {row.problem}"))
        elif self.scanned:
            self._show_status()

    def action_cursor(self, step: int) -> None:
        table = self.query_one("#models", DataTable)
        if table.row_count:
            table.move_cursor(row=max(0, min(table.row_count - 1, table.cursor_row + step)))

    def action_cancel(self) -> None:
        if self.pulling is not None:
            # at once, even while a read is stalled: the thread stops at its next chunk or
            # its read timeout, and says nothing more
            self.pulling.set()
            self.pulling = None
            self.query_one("#pull-progress", Static).update(
                literal("■ download stopped; partial files are kept for the next try"))
            return
        self.dismiss(None)

    # ---- choosing ----------------------------------------------------------------------
    def _choose(self, key: str) -> None:
        row = self._row(key)
        if row is not None and row.problem:
            self.notify(f"{row.entry.name}: {row.problem}", severity="error",
                        title="Cannot load")
            return
        if row is not None and row.entry.source == "ollama":
            with contextlib.suppress(KVChatError):  # its notices; loading says what fails
                self._notices(resolve_model(f"ollama:{row.entry.name}").notices)
        if self.current and str(Path(key).resolve()) == self.current:
            self.notify("That model is already loaded.", title="Model")
            self.dismiss(None)
            return
        self.dismiss(str(Path(key).resolve()))

    def _notices(self, notices: Sequence[str]) -> None:
        for notice in notices:
            self.notify(notice, title="Chat template")

    def _refuse(self, why: str) -> None:
        self.query_one("#picker-status", Static).update(literal(f"✗ {why}"))
        self.notify(why, severity="error", title="Cannot load")

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        if event.row_key.value:
            self._choose(event.row_key.value)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self._submit(event.value)

    def _submit(self, value: str) -> None:
        value = value.strip()
        if self.pulling is not None:
            self.notify("A download is running; Esc stops it.", severity="warning")
            return
        if not value:
            self._load_highlighted()
            return
        if value.startswith("ollama:"):  # a model of Ollama's store, by name
            try:
                resolved = resolve_model(value)
            except KVChatError as e:
                self._refuse(str(e))
                return
            self._notices(resolved.notices)
            value = resolved.path
        elif looks_like_repo_id(value):
            self._start_pull(value)
            return
        path = Path(value).expanduser()
        if not path.is_dir() and not path.is_file():
            self._refuse(f"not a folder or GGUF file: {path}")
            return
        # a typed folder gets the checks the list's rows had (config.json, weights,
        # tokenizer): a refusal is said here and the picker stays open (closed, the keys
        # typed next went to the chat as a message)
        try:
            check_model_folder(path)
        except KVChatError as e:
            self._refuse(str(e))
            return
        self._choose(str(path))

    def _load_highlighted(self) -> None:
        table = self.query_one("#models", DataTable)
        if table.row_count:
            row_key, _ = table.coordinate_to_cell_key(table.cursor_coordinate)
            if row_key.value:
                self._choose(row_key.value)
                return
        self.notify("Pick a model, or type a folder path or a repo id.", severity="warning")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "cancel":
            self.action_cancel()
        else:
            self._submit(self.query_one("#path", Input).value)

    # ---- downloading -------------------------------------------------------------------
    def _start_pull(self, repo_id: str) -> None:
        self.pulling = stop = threading.Event()
        box = self.query_one("#pull-progress", Static)
        box.add_class("-active")
        box.update(literal(f"Asking the Hub for {repo_id} …"))
        # a daemon thread, not a Textual worker: those run in an executor that the
        # interpreter joins at exit, so a stalled server would hold quitting
        threading.Thread(target=self._pull, args=(repo_id, stop), daemon=True,
                         name="kvchat-pull").start()

    def _pull(self, repo_id: str, stop: threading.Event) -> None:
        # network and file writes only (no MLX): a thread keeps the UI responsive
        last = [0.0]

        def report(*args: object) -> None:
            if not stop.is_set():  # Esc has already ended this pull on screen
                with contextlib.suppress(Exception):  # the app may be gone (quit)
                    self.app.call_from_thread(*args)

        def on_progress(p: PullProgress) -> None:
            import time

            now = time.monotonic()
            if now - last[0] >= 0.1 or p.files_done == p.files_total:
                last[0] = now
                report(self._show_progress, "\n".join(progress_lines(p, bar_width=12)))

        try:
            folder = pull(repo_id, on_progress=on_progress, cancel=stop)
            verify_pulled(folder)
        except KVChatError as e:
            report(self._pull_done, repo_id, None, str(e))
            return
        report(self._pull_done, repo_id, folder, None)

    def _show_progress(self, text: str) -> None:
        self.query_one("#pull-progress", Static).update(literal(text))

    def _pull_done(self, repo_id: str, folder: Path | None, error: str | None) -> None:
        self.pulling = None
        box = self.query_one("#pull-progress", Static)
        if error is not None:
            box.update(literal(f"✗ {error}"))
            self.notify(error, severity="error", title="Download")
            return
        assert folder is not None
        self.pulled = folder
        box.update(literal(f"✓ {repo_id} downloaded and checked · Enter loads it"))
        self.query_one("#path", Input).value = ""
        self._select_after_scan = str(folder.resolve())
        self._scan()
