"""Ctrl+S: system prompt, sampling, limits, the cache bound and its K/V bits (with the
loaded model's measured agreement), speculative decoding, model folders, theme and whether
the last chat comes back at start.

Save parses every field, validates with Settings.validate() and writes with
save_settings(). A bad value shows one line naming the field as the form labels it (not
the setting's internal name) and keeps the form as typed; a good one returns the new
Settings, which the app applies from the next turn.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, OptionList, Select, Static, Switch, TextArea

from kvchat.app.core.settings import Settings, save_settings
from kvchat.app.core.text import literal, visible
from kvchat.model.errors import KVChatError

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
    ("kv_bits", "KV bits (blank = float, 4 or 8)", "opt_int"),
    ("kv_group_size", "KV group size (blank = auto)", "opt_int"),
    ("quantized_kv_start", "quantize K/V after N tokens", "int"),
    ("draft_tokens", "draft tokens (at most, per step)", "int"),
    ("lookup_ngram", "lookup n-gram (longest match)", "int"),
)
# speculative decoding: (label, setting value)
SPECULATION_CHOICES = (("off", "off"), ("prompt lookup", "lookup"), ("draft model", "draft"))
# how an error names a field: the label without its hint
LABELS = {name: label.split(" (")[0] for name, label, _ in FIELDS} | {
    "speculation": "speculative decoding", "draft_model": "draft model folder"}
_NAME_RE = re.compile(r"\b(" + "|".join(sorted(LABELS, key=len, reverse=True)) + r")\b")


class FormError(KVChatError):
    """A field that does not parse; one line naming it, `field` the field."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def _shown(value: Any) -> str:
    return "" if value is None else str(value)


def in_form_words(message: str) -> str:
    """'top_p must be in (0, 1]' -> 'top-p must be in (0, 1]': the form's labels."""
    return _NAME_RE.sub(lambda m: LABELS[m.group(1)], message)


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
        raise FormError(f"{LABELS[name]} must be {want} (got {raw!r})", name) from None


def draft_folder(raw: str) -> str | None:
    """The draft model folder as typed: blank is none; else it must be a folder (kept
    absolute, so it means the same from any working directory)."""
    raw = raw.strip()
    if not raw:
        return None
    folder = Path(raw).expanduser()
    if not folder.is_dir():
        raise FormError(f"draft model folder: not a folder: {folder}", "draft_model")
    return str(folder.resolve())


class SettingsScreen(ModalScreen[Settings | None]):
    BINDINGS = [
        Binding("escape", "dismiss", "Cancel", id="settings.cancel"),
        Binding("ctrl+s", "save", "Save", id="settings.save", priority=True),
    ]

    def __init__(self, settings: Settings, kv_agreement: str = "") -> None:
        super().__init__()
        self.settings = settings
        self.kv_agreement = kv_agreement  # the loaded model's measured K/V quality
        self.model_dirs = list(settings.model_dirs)

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
                if self.kv_agreement:
                    yield Static(literal(self.kv_agreement), id="kv_agreement",
                                 classes="field-label -wide")
                with Horizontal(classes="field"):
                    yield Label("speculative decoding (same reply, maybe faster)",
                                classes="field-label")
                    yield Select(SPECULATION_CHOICES, value=s.speculation, allow_blank=False,
                                 id="speculation", classes="field-input")
                with Horizontal(classes="field"):
                    yield Label("draft model folder (same tokenizer)", classes="field-label")
                    yield Input(_shown(s.draft_model), id="draft_model", classes="field-input")
                yield Label("model folders (searched by the picker and `kvchat models`)",
                            classes="field-label -wide")
                yield OptionList(*map(literal, self.model_dirs), id="model_dirs")
                with Horizontal(classes="field"):
                    yield Input(placeholder="a folder to add", id="new_dir",
                                classes="field-input")
                    yield Button("Add", id="add_dir")
                    yield Button("Remove", id="remove_dir")
                with Horizontal(classes="field"):
                    yield Label("theme", classes="field-label")
                    themes = sorted(self.app.available_themes)
                    yield Select([(t, t) for t in themes], value=self.app.theme,
                                 allow_blank=False, id="theme", classes="field-input")
                with Horizontal(classes="field"):
                    yield Label("reopen the last chat and input history at start",
                                classes="field-label")
                    yield Switch(s.restore_session, id="restore_session")
            yield Static("", id="settings-error", classes="error-line")
            yield Static(
                "Applied from the next turn. Ctrl+S saves · Esc cancels.", classes="dialog-hint"
            )
            with Horizontal(classes="buttons"):
                yield Button("Save", id="save", variant="primary")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        # the first field: a system prompt typed at once must land in the system prompt
        self.query_one("#system_prompt", TextArea).focus()

    def collect(self) -> Settings:
        """The form's values as Settings (raises FormError / SettingsError, one line)."""
        values: dict[str, Any] = {
            "system_prompt": self.query_one("#system_prompt", TextArea).text,
            "model_dirs": list(self.model_dirs),
            "theme": str(self.query_one("#theme", Select).value),
            "restore_session": self.query_one("#restore_session", Switch).value,
        }
        for name, _label, kind in FIELDS:
            values[name] = parse_field(name, kind, self.query_one(f"#{name}", Input).value)
        values["speculation"] = str(self.query_one("#speculation", Select).value)
        values["draft_model"] = draft_folder(self.query_one("#draft_model", Input).value)
        new = dataclasses.replace(self.settings, **values)
        return new.validate()

    def action_save(self) -> None:
        error = self.query_one("#settings-error", Static)
        try:
            new = self.collect()
            save_settings(new)
        except KVChatError as e:
            # one line in the form's words; the form keeps what was typed
            text = in_form_words(str(e))
            error.update(literal(text))
            name = getattr(e, "field", None)  # FormError and SettingsError carry it
            if name in LABELS:
                self.query_one(f"#{name}").focus()
            self.notify(text, severity="error", title="Settings not saved")
            return
        error.update("")
        self.dismiss(new)  # the chat screen applies it (theme included)

    # ---- model folders -----------------------------------------------------------------
    def _add_dir(self) -> None:
        box = self.query_one("#new_dir", Input)
        raw = box.value.strip()
        if not raw:
            return
        folder = Path(raw).expanduser()
        if not folder.is_dir():
            self.query_one("#settings-error", Static).update(literal(f"not a folder: {folder}"))
            return
        path = str(folder.resolve())  # absolute: it must mean the same from any cwd
        if path not in self.model_dirs:
            self.model_dirs.append(path)
            self.query_one("#model_dirs", OptionList).add_option(literal(path))
        box.value = ""
        self.query_one("#settings-error", Static).update("")

    def _remove_dir(self) -> None:
        options = self.query_one("#model_dirs", OptionList)
        i = options.highlighted
        if i is None or not 0 <= i < len(self.model_dirs):
            self.notify("Highlight a folder in the list first.", severity="warning")
            return
        del self.model_dirs[i]
        options.remove_option_at_index(i)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        if event.input.id == "new_dir":
            self._add_dir()
        else:
            self.action_save()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        bid = event.button.id
        if bid == "save":
            self.action_save()
        elif bid == "add_dir":
            self._add_dir()
        elif bid == "remove_dir":
            self._remove_dir()
        else:
            self.dismiss(None)

