"""F2 / Ctrl+T: past chats, newest first, the cursor on the open one. Enter reopens a
chat; Delete asks first (press it again), and Ctrl+Z brings a deleted chat back.

Chats started with the same words get the same title, so each row has a second line: the
opening of the chat's last reply; and today's chats show the time to the second."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Static

from kvchat.app.core.store import Conversation, ConversationStore, StoreError
from kvchat.app.core.text import literal
from kvchat.app.tui.widgets.format import fmt_bytes
from kvchat.model.files import model_name

PREVIEW_W = 28  # characters of the last reply under a title, where the terminal has room
# what the rest of a row takes beside the preview on a narrow terminal: the dialog's frame,
# the ● column and the time, which stay in view
BESIDE_PREVIEW = 28


def _when(ts: float, now: float | None = None) -> str:
    """Today's chats to the second ("today 14:05:09"), older ones to the minute."""
    try:
        when = datetime.fromtimestamp(ts)
        today = datetime.fromtimestamp(now) if now is not None else datetime.now()
    except (OverflowError, OSError, ValueError):
        return "?"
    if when.date() == today.date():
        return when.strftime("today %H:%M:%S")
    return when.strftime("%Y-%m-%d %H:%M")


def preview(messages: list[dict[str, Any]], width: int = PREVIEW_W) -> str:
    """The opening of the last reply (else of the last message), whitespace collapsed,
    cut at a word to `width` characters; "" for an empty chat."""
    last = next((m for m in reversed(messages) if m.get("role") == "assistant"),
                messages[-1] if messages else None)
    text = " ".join(str(last.get("content", "")).split()) if last else ""
    if len(text) <= width:
        return text
    cut = text[: width - 1]
    if text[width - 1] != " " and " " in cut[width // 2 :]:  # not mid-word
        cut = cut[: cut.rfind(" ")]
    return cut.rstrip() + "…"


def _title_cell(conv: Conversation, width: int) -> Text:
    """The title, and under it (in italics) the opening of the last reply."""
    cell = literal(conv.title or "New chat")
    line = preview(conv.messages, width)
    if line:
        cell.append("\n")
        cell.append_text(literal(line, style="italic"))  # dim would fall below 4.5:1
    return cell


class HistoryScreen(ModalScreen[str | None]):
    BINDINGS = [
        Binding("escape", "dismiss", "Close", id="history.close"),
        Binding("delete", "delete", "Delete chat", id="history.delete"),
        Binding("ctrl+z", "undo", "Undo delete", id="history.undo"),
    ]

    def __init__(self, store: ConversationStore, current_id: str | None = None) -> None:
        super().__init__()
        self.store = store
        self.current_id = current_id
        self.armed: str | None = None  # the chat a first Delete asked about
        # Ctrl+Z restores the last one (its file and K/V cache wait in the store's trash,
        # emptied when this screen closes)
        self.deleted: list[Conversation] = []

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog", classes="dialog -history"):
            yield Static("Chats", classes="dialog-title")
            yield DataTable(id="chats", cursor_type="row", zebra_stripes=True)
            yield Static(id="history-status", classes="dialog-hint")

    def on_mount(self) -> None:
        self._fill(select=self.current_id)
        self.query_one("#chats", DataTable).focus()
        if self.store.skipped:  # one line naming the first file, and why; it stays on disk
            _, why = self.store.skipped[0]
            more = len(self.store.skipped) - 1
            self.notify(why + (f" (and {more} more)" if more else ""), severity="warning",
                        title="Chat file skipped")

    def on_unmount(self) -> None:
        self.store.empty_trash()

    def _fill(self, select: str | None = None) -> None:
        table = self.query_one("#chats", DataTable)
        table.clear(columns=True)
        table.add_columns("", "title", "updated", "msgs", "K/V", "model")
        convs = self.store.list()
        width = max(12, min(PREVIEW_W, self.app.size.width - BESIDE_PREVIEW))
        for c in convs:
            table.add_row(
                "●" if c.id == self.current_id else "",
                _title_cell(c, width),
                _when(c.updated),
                str(len(c.messages)),
                fmt_bytes(self.store.cache_bytes(c.id)),  # the saved cache: reopens warm
                literal(model_name(c.model)) if c.model else "–",
                key=c.id,
                height=2 if c.messages else 1,
            )
        ids = [c.id for c in convs]
        if select in ids:
            table.move_cursor(row=ids.index(select))
        self._status(self._hint(len(convs)) if convs else "No saved chats yet. Esc closes.")

    def _hint(self, n: int) -> str:
        note = f"{n} chats · Enter opens · Delete removes · Esc closes"
        if self.deleted:
            note += " · Ctrl+Z undoes the delete"
        if self.store.skipped:
            note += f" · {len(self.store.skipped)} unreadable file(s) skipped"
        return note

    def _status(self, text: str) -> None:
        self.query_one("#history-status", Static).update(literal(text))

    def on_data_table_row_highlighted(self, _event: DataTable.RowHighlighted) -> None:
        if self.armed is not None:  # moving away cancels a pending delete
            self.armed = None
            self._status(self._hint(self.query_one("#chats", DataTable).row_count))

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
        if self.armed != conv_id:
            self.armed = conv_id
            title = str(table.get_row(row_key)[1]).split("\n")[0]
            self._status(f"Delete “{title}”? Press Delete again to delete it · any other row"
                         " keeps it")
            return
        self.armed = None
        try:
            conv = self.store.trash(conv_id)
        except StoreError as e:
            self.notify(str(e), severity="error")
            return
        self.deleted.append(conv)
        row = table.cursor_row
        self._fill()
        if table.row_count:
            table.move_cursor(row=min(row, table.row_count - 1))
        self.notify(f"Deleted “{conv.title or 'New chat'}” · Ctrl+Z brings it back",
                    title="History")

    def action_undo(self) -> None:
        if not self.deleted:
            self.notify("Nothing to undo.", severity="warning")
            return
        conv = self.deleted.pop()
        try:
            self.store.untrash(conv.id)
        except StoreError as e:
            self.deleted.append(conv)
            self.notify(str(e), severity="error")
            return
        self._fill(select=conv.id)
        self.notify(f"Restored “{conv.title or 'New chat'}”", title="History")
