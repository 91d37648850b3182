"""Ctrl+S: system prompt, sampling, limits and the cache bound.

Save parses every field, validates with Settings.validate() and writes with
save_settings(). A bad value shows one line and keeps the form as typed (nothing is
lost); a good one returns the new Settings, which the app applies from the next turn.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static, TextArea

from model.errors import KVChatError

from ..settings import Settings, save_settings
from ..text import literal, visible

# (field, label, kind): kind float | int | opt_int (blank = None)
FIELDS: tuple[tuple[str, str, str], ...] = (
    ("temp", "temperature (0 = greedy)", "float"),
    ("top_p", "top-p (1 = off)", "float"),
    ("top_k", "top-k (0 = off)", "int"),
    ("min_p", "min-p (0 = off)", "float"),
    ("repetition_penalty", "repetition penalty (1 = off)", "float"),
    ("max_tokens", "max tokens per reply", "int"),
    ("seed", "seed (blank = random)", "opt_int"),
    ("max_kv_size", "max KV size (blank = model context)", "opt_int"),
    ("keep", "keep (sink tokens on rotation)", "int"),
)


class FormError(KVChatError):
    """A field that does not parse; one line naming it."""


def _shown(value: Any) -> str:
    return "" if value is None else str(value)


def parse_field(name: str, kind: str, raw: str) -> Any:
    raw = raw.strip()
    if kind == "opt_int" and raw == "":
        return None
    try:
        if kind == "float":
            return float(raw)
        return int(raw)
    except ValueError:
        want = "a number" if kind == "float" else "a whole number"
        raise FormError(f"{name} must be {want} (got {raw!r})") from None


class SettingsScreen(ModalScreen[Settings | None]):
    BINDINGS = [
        Binding("escape", "dismiss", "Cancel", id="settings.cancel"),
        Binding("ctrl+s", "save", "Save", id="settings.save", priority=True),
    ]

    def __init__(self, settings: Settings) -> None:
        super().__init__()
        self.settings = settings

    def compose(self) -> ComposeResult:
        s = self.settings
        with Vertical(id="dialog", classes="dialog -settings"):
            yield Static("Settings", classes="dialog-title")
            with VerticalScroll(id="form"):
                yield Label("system prompt", classes="field-label")
                yield TextArea(visible(s.system_prompt), id="system_prompt", soft_wrap=True)
                for name, label, _kind in FIELDS:
                    with Horizontal(classes="field"):
                        yield Label(label, classes="field-label")
                        yield Input(_shown(getattr(s, name)), id=name, classes="field-input")
            yield Static("", id="settings-error", classes="error-line")
            yield Static(
                "Applied from the next turn. Ctrl+S saves · Esc cancels.", classes="dialog-hint"
            )
            with Horizontal(classes="buttons"):
                yield Button("Save", id="save", variant="primary")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        self.query_one("#temp", Input).focus()

    def collect(self) -> Settings:
        """The form's values as Settings (raises FormError / SettingsError, one line)."""
        values: dict[str, Any] = {
            "system_prompt": self.query_one("#system_prompt", TextArea).text
        }
        for name, _label, kind in FIELDS:
            values[name] = parse_field(name, kind, self.query_one(f"#{name}", Input).value)
        new = dataclasses.replace(self.settings, **values)
        return new.validate()

    def action_save(self) -> None:
        error = self.query_one("#settings-error", Static)
        try:
            new = self.collect()
            save_settings(new)
        except KVChatError as e:
            # one line; the form keeps what was typed
            error.update(literal(e))
            self.notify(str(e), severity="error", title="Settings not saved")
            return
        error.update("")
        self.dismiss(new)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.action_save()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "save":
            self.action_save()
        else:
            self.dismiss(None)
