"""The kvchat Textual app: it wires the engine, the settings and the store, and pushes
screens. The chat itself is app/tui/screens/chat.py; the keys are app/tui/actions.py's table.

Threading (docs/design.md, "Data flow of one chat turn"): every MLX call happens in the
engine, which app/core/engine_service.py builds (a child process; a pipeline's rank 0
keeps it on a thread of this process); the chat screen hears from it through
app/tui/bridge.py. The UI never runs MLX in a Textual worker; the only worker thread
(model discovery in the picker) reads files. The UI process runs at normal priority.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterable
from functools import partial
from pathlib import Path
from typing import Any

from textual.app import App, SystemCommand
from textual.content import Content
from textual.screen import Screen

from kvchat import metal_kernels
from kvchat.app.core import memory
from kvchat.app.core.discovery import DEFAULT_MODEL
from kvchat.app.core.engine_service import CHAT_OPTIONS, EngineService
from kvchat.app.core.logs import engine_log
from kvchat.app.core.settings import Settings, load_settings
from kvchat.app.core.store import ConversationStore, StoreError, write_near_data
from kvchat.app.core.text import SafeNotify, visible_name
from kvchat.app.tui.actions import bindings, help_rows, palette
from kvchat.app.tui.readable import readable_variables
from kvchat.app.tui.screens import ChatScreen, HelpScreen
from kvchat.app.tui.session import reopening_model
from kvchat.model.gguf_file import is_gguf
from kvchat.model.runtime.events import EngineFactory


def validate_model_path(path: str | Path) -> Path:
    """Check a model folder or GGUF file before the UI starts; raises
    ModelLoadError/ConfigError (one line) so the CLI can print it and exit 1."""
    from kvchat.model.explain.facts import check_model_folder

    check_model_folder(path)  # config, weights' headers, tokenizer
    return Path(path).expanduser().resolve()  # saved as last_model: must work from any cwd


TEXTUAL_COMMANDS_KEPT = ("Theme", "Quit")
# columns: narrower, the side panel would leave the chat about 40 (at 80)
NARROW_BELOW = 100


class KVChatApp(SafeNotify, App[int]):
    """Chat with a local model and watch the engine work."""

    CSS_PATH = "kvchat.tcss"
    TITLE = "kvchat"
    BINDINGS = bindings("app")
    # every screen gets -narrow or -wide from the terminal's width: kvchat.tcss hides the
    # side panel below it (a status line instead, unless the panel key chose) and gives
    # dialogs the whole width
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (NARROW_BELOW, "-wide")]

    def __init__(
        self,
        model_path: str | None = None,
        settings: Settings | None = None,
        *,
        engine_factory: EngineFactory | None = None,
        store: ConversationStore | None = None,
        ignore_memory_check: bool = False,
        notes: Iterable[str] = (),
    ) -> None:
        super().__init__()
        settings = settings if settings is not None else load_settings()
        self.chat = ChatScreen(
            settings,
            store if store is not None else ConversationStore(),
            engine_factory or chat_engine_service(settings).build,
            model_path,
        )
        self.chat.ignore_memory_check = ignore_memory_check  # the picker's loads too
        self._notes = list(notes)  # why the start-up model was not loaded, say

    def on_mount(self) -> None:
        for note in self._notes:
            self.notify(note, severity="warning", title="Model not loaded", timeout=30)

    def get_css_variables(self) -> dict[str, str]:
        # every text colour at 4.5:1 or better, whichever theme is active
        self.theme_variables = readable_variables(super().get_css_variables())
        return self.theme_variables

    def format_title(self, title: str, sub_title: str) -> Content:
        # literal text (as SafeNotify's); the model's name in $text-muted where Textual
        # dims it, which falls below 4.5:1 on a light theme's header
        if not sub_title:
            return Content(visible_name(title))
        return Content.assemble(Content(visible_name(title)), (" — ", "$text-muted"),
                                Content(visible_name(sub_title)).stylize("$text-muted"))

    def get_default_screen(self) -> Screen[Any]:
        return self.chat

    _quit_asked_at = float("-inf")

    def action_quit(self) -> None:  # type: ignore[override]
        """Ctrl+Q (the palette's Quit, Ctrl+C twice): leave, unless the open chat has turns
        a save could not write (a full or read-only disk): then one more try, and when
        that fails too, say so; a second Ctrl+Q within QUIT_CONFIRM_S leaves without them."""
        chat = self.chat
        if chat.unsaved and not chat.retry_save():
            now = time.monotonic()
            if now - self._quit_asked_at > QUIT_CONFIRM_S:
                self._quit_asked_at = now
                self.notify("This chat's last turns are not saved (see above). Press Ctrl+Q"
                            " again to quit without them, or free some space and press it"
                            " once to save and quit.", severity="error",
                            title="Not saved: quit anyway?", timeout=QUIT_CONFIRM_S)
                return
        self.exit()

    def on_unmount(self) -> None:
        self.chat.close_engine()

    def action_help(self) -> None:
        if isinstance(self.screen, HelpScreen):
            self.screen.dismiss()
            return
        self.push_screen(HelpScreen(help_rows(self.get_key_display)))

    def get_system_commands(self, screen: Screen[Any]) -> Iterable[SystemCommand]:
        # of Textual's own: only those that work here (its "Keys" duplicated F1's help,
        # "Maximize" blew the input box up to the whole screen, its "Screenshot" failed
        # without ~/Downloads)
        yield from (c for c in super().get_system_commands(screen)
                    if c.title in TEXTUAL_COMMANDS_KEPT)
        yield SystemCommand("Screenshot", "Save an SVG of the screen in kvchat's data folder",
                            lambda: self.set_timer(0.1, self.take_screenshot))
        scopes = [("app", self)] + ([("chat", self.chat)] if screen is self.chat else [])
        for scope, target in scopes:
            for a in palette(scope):
                yield SystemCommand(a.palette, a.help, partial(self.run_action, a.name, target))
        switch = self.chat.switch_kernels  # the engine switches where the model runs
        yield from (SystemCommand(*c) for c in metal_kernels.switch_commands(switch))

    def take_screenshot(self) -> Path | None:
        """An SVG of the screen in <data dir>/screenshots (else the current folder); the
        path is shown."""
        try:
            path = write_near_data(self.chat.store, "screenshots", lambda folder: Path(
                self.save_screenshot(path=str(folder))))
        except StoreError as e:
            self.notify(str(e), severity="error", title="No screenshot")
            return None
        self.notify(str(path), title="Screenshot saved")
        return path


def default_model_path(settings: Settings, store: ConversationStore | None = None
                       ) -> str | None:
    """No --model: the model of the chat that reopens (its cache is that model's), else
    the last model used, else the shipped one, else none (pick in the UI)."""
    reopening = reopening_model(store or ConversationStore(), settings)
    if reopening is not None:
        return reopening
    # absolute only: an old relative entry would depend on where kvchat was started
    last = settings.last_model
    if last and Path(last).is_absolute() and (Path(last).is_dir() or is_gguf(last)):
        return last
    if (DEFAULT_MODEL / "config.json").is_file():
        return str(DEFAULT_MODEL)
    return None


def startup_model(model_path: str | None, settings: Settings, ignore_memory_check: bool = False
                  ) -> tuple[str | None, list[str]]:
    """The model the chat starts on, and why none when one was meant (notes to show).
    --model that cannot load or fit: one line before the UI starts (KVChatError); the
    remembered model no longer fitting: the chat starts without it and says why."""
    if model_path is not None:
        path = str(validate_model_path(model_path))
        memory.require_fit(path, settings.max_kv_size, settings.gen_params().kv_quant(),
                           ignore=ignore_memory_check)
        return path, []
    default = default_model_path(settings)
    why = default and memory.refusal(default, settings.gen_params(), ignore_memory_check)
    return (None, [why]) if why else (default, [])


def run_tui(
    model_path: str | None,
    settings: Settings | None = None,
    engine_factory: EngineFactory | None = None,
    service: EngineService | None = None,
    ignore_memory_check: bool = False,
) -> int:
    """Entry point for `kvchat [--model DIR]`. A bad --model folder raises a one-line
    KVChatError before the UI starts (app.main prints it and exits 1). The engine comes
    from `engine_factory`, else from `service` (default: an engine process)."""
    settings = settings if settings is not None else load_settings()
    path, notes = startup_model(model_path, settings, ignore_memory_check)
    service = service or chat_engine_service(settings)
    try:
        app = KVChatApp(path, settings, engine_factory=engine_factory or service.build,
                        ignore_memory_check=ignore_memory_check, notes=notes)
        app.run()
    finally:
        # the screen closed the engine on unmount: this ends what is left (ranks)
        service.close(CLOSE_WAIT_S)
    return app.return_code or 0


def chat_engine_service(settings: Settings) -> EngineService:
    """The chat's engine service: the settings' say in its options (engine_nice); the
    engine's stderr goes to its log, not the screen (when the log folder cannot be made,
    to /dev/null: still not the screen)."""
    try:
        log = engine_log()
    except OSError:
        log = Path(os.devnull)
    options = dataclasses.replace(CHAT_OPTIONS, nice=settings.engine_nice)
    return EngineService(options=options, stderr_log=log)


QUIT_CONFIRM_S = 6.0  # a second Ctrl+Q within this leaves a chat that could not be saved
CLOSE_WAIT_S = 1.0  # as the chat screen's own close: app.main.finish waits for the rest


def run_chat(hostfile: str, model: str | None) -> int:
    """`kvchat --hosts hosts.json [--model M]`: the chat on this terminal, the model split
    across the hosts. Errors before the UI starts are one line (exit 1)."""
    from kvchat.app.core.hosts import HostsError, read_hostfile

    read_hostfile(hostfile)  # a bad hostfile: one line, nothing started
    settings = load_settings()
    path = str(validate_model_path(model)) if model else default_model_path(settings)
    if path is None:
        raise HostsError("give --model DIR: no default model to split across hosts")
    service = chat_engine_service(settings)
    try:
        service.split_across(hostfile, path)
        return run_tui(path, settings, service=service)
    finally:
        service.close(CLOSE_WAIT_S)
