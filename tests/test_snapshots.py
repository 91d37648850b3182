"""SVG snapshots of the main screen, the stats panel, the model picker, help, settings and
the per-layer cache view.

Every number on screen is pinned by the scripted engine (tests/helpers/scripted_engine.py):
its statistics are functions of the token count, never of the clock. Regenerate baselines
with `pytest tests/test_snapshots.py --snapshot-update` and review the SVGs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from textual.app import App, ComposeResult

from kvchat.app.core import discovery
from kvchat.app.core.discovery import ModelEntry, ModelRow
from kvchat.app.core.settings import Settings
from kvchat.app.tui.app import KVChatApp
from kvchat.app.tui.widgets import StatsPanel
from kvchat.model.explain.facts import ModelFacts
from kvchat.model.runtime.events import TurnStats
from tests.helpers.app import MODEL, make_app
from tests.helpers.scripted_engine import (
    REPLY,
    ScriptedEngine,
    model_info_for,
    split_reply,
    wait_for,
)
from tests.helpers.snapshots import no_blink, settle

APP_CSS = Path(__file__).resolve().parents[1] / "app" / "tui" / "kvchat.tcss"
pytestmark = pytest.mark.usefixtures("env", "pinned_machine")


def streaming_text(app: KVChatApp) -> str | None:
    replies = [m for m in app.chat.transcript.messages if m.streaming]
    return replies[-1].content if replies else None


def test_main_screen_mid_generation(snap_compare: Any) -> None:
    app = make_app(pause_after=40)
    first = "".join(split_reply(REPLY)[:40])

    async def run_before(pilot: Any) -> None:
        await settle(pilot)
        app.chat.input.load_text("Tell me a story about a robot who keeps a cache.")
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.chat.engine.paused.is_set())
        await wait_for(pilot, lambda: streaming_text(app) == first)
        await pilot.pause(0.25)  # the panel's 10 Hz refresh

    assert snap_compare(app, terminal_size=(120, 36), run_before=run_before)


@pytest.mark.slow
def test_main_screen_after_stop(snap_compare: Any) -> None:
    app = make_app(pause_after=25)

    async def run_before(pilot: Any) -> None:
        await settle(pilot)
        app.chat.input.load_text("Once upon a time")
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.chat.engine.paused.is_set())
        await pilot.press("escape")
        await wait_for(pilot, lambda: not app.chat.phase.generating)
        app.chat.input.load_text("and then?")
        await pilot.pause(0.25)

    assert snap_compare(app, terminal_size=(120, 36), run_before=run_before)


# A parametrized snapshot test sits in one tier whole: syrupy matches snapshot names
# without their parameters, so a size left out of the run would count as an unused
# snapshot and fail it. The fast tier has the main screen at 120×36 (mid-generation).
@pytest.mark.slow
@pytest.mark.parametrize("size", [(50, 15), (60, 20), (80, 24), (120, 40), (200, 60)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_main_screen_at_every_size(snap_compare: Any, size: tuple[int, int]) -> None:
    """A finished reply with a 64-token bound: below 100 columns the panel is hidden and
    the status line under the transcript carries its numbers; Help and Quit always show,
    and the footer shows whole keys only (50 columns: four of them)."""
    def factory(on_event: Any, path: str | None) -> ScriptedEngine:
        return ScriptedEngine(on_event, path)

    app = KVChatApp(MODEL, Settings(max_kv_size=64), engine_factory=factory)

    async def run_before(pilot: Any) -> None:
        await settle(pilot)
        app.chat.input.load_text("Tell me a story")
        await pilot.press("enter")
        await wait_for(pilot, lambda: not app.chat.phase.generating)
        await pilot.pause(0.25)  # the panel's and the status line's 10 Hz refresh

    assert snap_compare(app, terminal_size=size, run_before=run_before)


def test_main_screen_before_the_first_turn(snap_compare: Any,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Loaded, nothing sent, the slow reference BLAS: the panel's window row says the
    settings' keep (4) for the model's own 512-token context, the device is "CPU", and
    the BLAS hint goes on under its value."""
    monkeypatch.setattr("kvchat.app.core.blas.active_blas",
                        lambda: {"name": "reference BLAS", "path": None, "fast": False,
                                 "fix": "sudo apt-get install libopenblas0-pthread"})
    app = make_app()

    async def run_before(pilot: Any) -> None:
        await settle(pilot)
        await pilot.pause(0.25)  # the panel's 10 Hz refresh

    assert snap_compare(app, terminal_size=(120, 40), run_before=run_before)


@pytest.mark.parametrize("size", [(80, 24), (120, 40)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_layer_view(snap_compare: Any, size: tuple[int, int]) -> None:
    """Ctrl+L after a turn: layer, attention, tokens, capacity, bytes and as-MHA in view
    at 80 columns; the rest one ←/→ per column away."""
    app = make_app()

    async def run_before(pilot: Any) -> None:
        await settle(pilot)
        app.chat.input.load_text("Tell me a story")
        await pilot.press("enter")
        await wait_for(pilot, lambda: not app.chat.phase.generating)
        await pilot.press("ctrl+l")
        await pilot.pause(0.25)

    assert snap_compare(app, terminal_size=size, run_before=run_before)


def test_model_picker_lists_the_model_opened_by_path(
        snap_compare: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """stories260K opened by a path no searched folder holds: listed "by path", with its
    ● and the cursor; a configured folder's model above it (real discovery over tmp
    folders, the facts pinned)."""
    def fake_model(folder: Path, size: int) -> Path:
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
        (folder / "model.safetensors").write_bytes(b"\0" * size)
        return folder

    opened = fake_model(tmp_path / "elsewhere" / "stories260K", 1_040_128)
    fake_model(tmp_path / "models" / "SmolLM2-135M", 269_060_096 // 1024)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setattr(discovery, "DEFAULT_MODEL", tmp_path / "no-assets")
    monkeypatch.setattr(discovery, "folder_status", lambda folder: (ModelFacts(
        "float32", 1_040_128, "float32", 4, 1_040_128 if "stories" in str(folder)
        else 269_060_096, "cpu"), None))
    app = KVChatApp(str(opened), Settings(model_dirs=[str(tmp_path / "models")]),
                    engine_factory=lambda on_event, path: ScriptedEngine(on_event, path))

    async def run_before(pilot: Any) -> None:
        await settle(pilot)
        await pilot.press("ctrl+o")
        await wait_for(pilot, lambda: getattr(app.screen, "scanned", False))
        no_blink(app)
        await pilot.pause()

    assert snap_compare(app, terminal_size=(110, 30), run_before=run_before)


class PanelApp(App[None]):
    """The stats panel alone, fed pinned numbers (rotation wrapped, context in the red)."""

    CSS_PATH = str(APP_CSS)

    def compose(self) -> ComposeResult:
        yield StatsPanel(id="stats")

    def on_mount(self) -> None:
        panel = self.query_one(StatsPanel)
        panel.set_model({**model_info_for(MODEL), "bits": 4, "weight_bytes": 180_224})
        panel.start_turn(prompt_tokens=300, cached_tokens=212)
        for n in (10, 20, 31, 40, 52, 60, 71, 80):
            span = sum(0.004 + 0.002 * (i % 3) for i in range(n - 1))
            panel.update_stats(
                TurnStats(
                    prompt_tokens=300,
                    cached_tokens=212,
                    prefill_tps=5123.4,
                    ttft_s=0.0213,
                    generated_tokens=n,
                    decode_tps=(n - 1) / span,
                    cache_offset=300 + n,
                    cache_tokens=256,
                    cache_capacity=256,
                    cache_bytes=2 * 5 * 4 * 256 * 8 * 4,
                    mha_bytes=2 * 5 * 8 * 256 * 8 * 4,
                    gqa_saving=2.0,
                    evicted_tokens=44 + n,
                    keep=4,
                    wrapped=True,
                    peak_memory=5_242_880,
                    active_memory=4_718_592,
                    kernels_backend="metal",
                    device="Device(gpu, 0)",
                )
            )
        panel.end_turn()


def test_stats_panel(snap_compare: Any) -> None:
    assert snap_compare(PanelApp(), terminal_size=(40, 40))


@pytest.mark.slow
def test_model_picker(snap_compare: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    entries = [
        ModelEntry("stories260K", Path(MODEL), "llama", 1_044_992, None, "configured"),
        ModelEntry("Qwen/Qwen2.5-0.5B-Instruct-4bit", Path("/hf/qwen"), "qwen2", 278_000_000,
                   4, "hf-cache"),
        ModelEntry("SmolLM2-135M-Instruct", Path("/lms/smol"), "llama", 269_060_096, None,
                   "lm-studio"),
        ModelEntry("mamba-2.8b", Path("/lms/mamba"), "mamba", 5_228_683_776, None,
                   "lm-studio"),
    ]
    facts = [ModelFacts("float32", e.size_bytes, "float32", 4, e.size_bytes, "cpu")
             for e in entries]
    rows = [ModelRow(e, f, None) for e, f in zip(entries, facts, strict=True)]
    rows[-1] = ModelRow(entries[-1], None, "unknown architecture 'gemma2'")
    monkeypatch.setattr("kvchat.app.tui.screens.picker.model_rows", lambda *a, **k: rows)
    app = make_app()

    async def run_before(pilot: Any) -> None:
        await settle(pilot)
        await pilot.press("ctrl+o")
        await wait_for(pilot, lambda: getattr(app.screen, "scanned", False))
        no_blink(app)
        await pilot.pause()

    assert snap_compare(app, terminal_size=(110, 30), run_before=run_before)


def test_help_screen(snap_compare: Any) -> None:
    app = make_app()

    async def run_before(pilot: Any) -> None:
        await settle(pilot)
        await pilot.press("f1")
        await pilot.pause()

    assert snap_compare(app, terminal_size=(100, 34), run_before=run_before)


@pytest.mark.slow
def test_settings_screen_with_error(snap_compare: Any) -> None:
    app = make_app()

    async def run_before(pilot: Any) -> None:
        await settle(pilot)
        await pilot.press("ctrl+s")
        no_blink(app)
        app.screen.query_one("#top_p").value = "1.5"
        await pilot.press("ctrl+s")
        await pilot.pause()
        app.clear_notifications()
        await pilot.pause()

    assert snap_compare(app, terminal_size=(100, 40), run_before=run_before)
