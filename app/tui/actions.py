"""Every action of the chat in one table: its keys, its footer label, its help text and its
command-palette title. BINDINGS, the help screen (F1) and the palette (Ctrl+P) are all
generated from it, so they cannot drift apart."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from textual.binding import Binding


@dataclass(frozen=True)
class Action:
    name: str  # action_<name> on the chat screen (scope "chat") or the app ("app"); "" = none
    keys: str  # Textual key names, comma-separated; the first is the one the footer shows
    footer: str  # footer label ("" = not in the footer)
    help: str  # the help screen's text
    palette: str = ""  # command palette title ("" = not in the palette)
    scope: str = "chat"  # "chat": bound on the chat screen, so modal screens shadow it
    # priority: reaches the screen even while the input box (a TextArea) has focus
    priority: bool = True
    key_label: str = ""  # how help shows keys that are not bindings (the input box's own)


ACTIONS: tuple[Action, ...] = (
    # priority: a stop is handled when the key arrives, not after the streamed text and
    # engine events already queued on the chat screen (the reply may end meanwhile)
    Action("stop", "escape", "Stop", "stop the reply (partial text kept); cancel an edit",
           "Stop generation"),
    Action("regenerate", "ctrl+r", "Retry", "regenerate the last reply", "Regenerate last reply"),
    Action("edit_last", "", "", "put your last message in the input to edit and resend",
           "Edit last message"),
    Action("new_chat", "ctrl+n", "New", "start a new chat (clears the cache)", "New chat"),
    Action("pick_model", "ctrl+o", "Model",
           "swap the model: a local folder or a Hub download",
           "Swap model"),
    Action("settings", "ctrl+s", "Settings", "system prompt, sampling, limits, cache bound",
           "Settings"),
    # most terminals send ctrl+h as Backspace: F2 and Ctrl+T open the history
    Action("history", "f2,ctrl+t", "History", "past chats: reopen or delete", "History"),
    Action("export", "ctrl+e", "Export", "export this chat to Markdown",
           "Export chat to Markdown"),
    Action("copy_reply", "ctrl+y", "Copy", "copy the selected (or last) reply",
           "Copy last reply"),
    Action("interrupt", "ctrl+c", "", "stop the reply; twice: quit",
           "Stop the reply, or quit when pressed twice"),
    Action("layers", "ctrl+l", "Layers", "per-layer KV cache view", "Layer cache view"),
    # below PANEL_MIN_COLUMNS the panel starts hidden and a status line replaces it
    Action("toggle_panel", "f3,ctrl+g", "Panel",
           "hide / show the stats panel (a status line instead)",
           "Hide or show the stats panel"),
    Action("anatomy", "f4", "", "anatomy: the model's block with its own numbers",
           "Model anatomy (explain)"),
    Action("attention", "f5", "", "where the newest token's attention goes in the cache",
           "Attention view"),
    Action("help", "f1", "Help", "this help", "Keys (help)", scope="app"),
    # the palette already has Textual's own "Quit"
    Action("quit", "ctrl+q", "Quit", "quit kvchat", scope="app"),
    # a priority binding, like Esc and Ctrl+C: the keys that start and stop a turn are
    # handled in the order they were pressed, however far behind the UI is
    Action("send", "enter", "", "send the message", "Send message", key_label="enter"),
    # keys of the input box itself (no binding: listed in the help only)
    Action("", "", "", "new line in the message", key_label="ctrl+j / shift+enter"),
    Action("", "", "", "input history (cursor on the first / last line)", key_label="↑ / ↓"),
    Action("", "", "", "your message: edit and resend from there",
           key_label="click / enter on a message"),
    Action("", "", "", "command palette: every action by name", key_label="ctrl+p"),
)


def bindings(scope: str) -> list[Binding]:
    """The Textual bindings of one scope ("chat" or "app")."""
    out = []
    for a in ACTIONS:
        if a.scope != scope or not a.name or not a.keys:
            continue
        for i, key in enumerate(a.keys.split(",")):
            out.append(Binding(key, a.name, a.footer, show=i == 0 and bool(a.footer),
                               key_display=a.key_label or None, priority=a.priority,
                               id=a.name if i == 0 else f"{a.name}.{i}"))
    return out


def help_rows(key_display: Callable[[Binding], str]) -> list[tuple[str, str]]:
    """(keys, what they do) for every action with keys, then the input box's keys."""
    rows = []
    for a in ACTIONS:
        if a.key_label:
            rows.append((a.key_label, a.help))
        elif a.keys:
            keys = [key_display(Binding(k, a.name)) for k in a.keys.split(",")]
            rows.append((" / ".join(keys), a.help))
    return rows


# first in the footer whatever has focus: a narrow terminal has room for the first keys
# only (widgets/footer.py hides, from the end, those that do not fit whole)
FOOTER_FIRST = ("help", "quit", "toggle_panel")
_FOOTER_ORDER = {name: i for i, name in enumerate(
    [*FOOTER_FIRST, *(a.name for a in ACTIONS if a.footer and a.name not in FOOTER_FIRST)])}



def footer_rank(action: str) -> int:
    """Where a key goes in the footer: Help and Quit, then the table's order; keys that
    are not in the table (a widget's own) after them."""
    return _FOOTER_ORDER.get(action, len(_FOOTER_ORDER))


def palette(scope: str) -> list[Action]:
    return [a for a in ACTIONS if a.scope == scope and a.palette]
