"""SVG snapshots of the Anatomy screen (F4) and the attention view (F5) at 80×24 and
160×48, reached the way a user does (keys, the palette), data through the engine.

The Anatomy data is the scripted engine's real `explain()` of its config (kernels pinned to
`fast`). The scripted model has no weights to attend with, so its engine answers
`watch_attention` with a fixed view of a 64-slot rotating cache (the numbers are checked
against transformers in tests/test_attention_view.py; here only the drawing is).
"""

from __future__ import annotations

from typing import Any

import pytest

from kvchat.app.core.settings import Settings
from kvchat.app.tui.app import KVChatApp
from kvchat.app.tui.screens import AnatomyScreen, AttentionScreen, HelpScreen
from kvchat.model.runtime.attention_watch import AttentionWatch
from kvchat.model.runtime.events import AttentionView, Done
from tests.helpers.app import MODEL
from tests.helpers.scripted_engine import ScriptedEngine, wait_for
from tests.helpers.snapshots import settle

SIZES = [(80, 24), (160, 48)]
pytestmark = pytest.mark.usefixtures("env", "pinned_machine")


def fixed_view(layer: int, group: int | None, n_layers: int, n_groups: int) -> AttentionView:
    """Slots 0-3 sinks, 60 ring slots full after 50 evictions, next write at slot 54."""
    per = 8 // n_groups  # the scripted model's 8 query heads
    weights = [0.09, 0.05, 0.03, 0.02] + [0.0] * 60
    for s in range(4, 64):
        weights[s] = 0.004 + (0.02 if s in (52, 53) else 0.0) + (s % 7) * 0.001
    total = sum(weights)
    weights = [w / total for w in weights]
    return AttentionView(
        layer=layer, group=group, n_layers=n_layers, n_groups=n_groups,
        heads=list(range(8)) if group is None else [group * per + i for i in range(per)],
        position=113, tokens=64, capacity=64, keep=4, evicted=50, write_slot=54,
        slots_per_bin=1, bins=weights, bin_kinds=["sink"] * 4 + ["held"] * 60,
        sink_share=sum(weights[:4]), recent_share=sum(weights[4:]), rest_share=0.0,
        top=[(0, weights[0]), (1, weights[1]), (112, weights[52])],
    )


class FixedWatch(AttentionWatch):
    """Every view is fixed_view, the cache empty or not (nothing to compute it from)."""

    def view(self, model: Any, caches: list[Any] | None, token: int | None
             ) -> AttentionView | None:
        if self.target is None or model is None:
            return None
        cfg = model.config
        return fixed_view(*self.target, cfg.num_hidden_layers, cfg.num_key_value_heads)


class ViewEngine(ScriptedEngine):
    def __init__(self, on_event: Any, model_path: str) -> None:
        super().__init__(on_event, model_path)
        self._watch = FixedWatch(None)  # before any client can watch


def app_with_views() -> KVChatApp:
    return KVChatApp(MODEL, Settings(),
                     engine_factory=lambda on_event, path: ViewEngine(on_event, path))


@pytest.fixture(autouse=True)
def fast_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Anatomy screen names the kernels backend: pin it, as the stats panel's is."""
    monkeypatch.setattr("kvchat.metal_kernels.backend", lambda: "fast")


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_anatomy_screen(snap_compare: Any, size: tuple[int, int]) -> None:
    app = app_with_views()

    async def run_before(pilot: Any) -> None:
        await settle(pilot)
        await pilot.press("f4")
        await wait_for(pilot, lambda: isinstance(app.screen, AnatomyScreen)
                       and app.screen.data is not None)
        await pilot.pause()

    assert snap_compare(app, terminal_size=size, run_before=run_before)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_attention_view(snap_compare: Any, size: tuple[int, int]) -> None:
    app = app_with_views()

    async def run_before(pilot: Any) -> None:
        await settle(pilot)
        await pilot.press("f5")
        await wait_for(pilot, lambda: isinstance(app.screen, AttentionScreen))
        await pilot.press("right", "g", "g")  # layer 2, KV group 2
        screen = app.screen

        def shown() -> bool:
            strip = screen.query_one("#strip")
            v = strip.view  # type: ignore[attr-defined]
            return v is not None and (v.layer, v.group) == (1, 1)

        await wait_for(pilot, shown)
        await pilot.pause()

    assert snap_compare(app, terminal_size=size, run_before=run_before)


@pytest.mark.slow
def test_reachable_from_palette_help_and_layer_view() -> None:
    """Both screens are in the palette and Help; `a` in the layer view opens the
    attention view on the selected layer; closing it stops the engine's watching."""
    from tests.helpers.scripted_engine import async_test

    @async_test
    async def run() -> None:
        app = app_with_views()
        async with app.run_test(size=(120, 40)) as pilot:
            await settle(pilot)
            engine = app.chat.engine
            assert isinstance(engine, ViewEngine)
            titles = {c.title for c in app.get_system_commands(app.screen)}
            assert {"Model anatomy (explain)", "Attention view"} <= titles
            await pilot.press("f1")
            assert isinstance(app.screen, HelpScreen)
            helps = [what for _, what in app.screen.rows]
            assert any("anatomy" in h for h in helps) and any("attention" in h for h in helps)
            await pilot.press("escape", "f4")  # Anatomy: → asks for the dials at gap 4
            await wait_for(pilot, lambda: isinstance(app.screen, AnatomyScreen)
                           and app.screen.data is not None)
            await pilot.press("right")
            await wait_for(pilot, lambda: app.screen.data["worked"]["rope_seed"]["gap"] == 4)  # type: ignore[attr-defined]
            await pilot.press("t")  # the same model as a 2017 block: MHA, post-LN
            await wait_for(pilot, lambda: app.screen.data["block"]["norm"]["kind"] == "LayerNorm")  # type: ignore[attr-defined]
            assert app.screen.data["block"]["attention"]["kind"] == "MHA"  # type: ignore[attr-defined]
            await pilot.press("escape")
            app.chat.input.load_text("Tell me about caches.")
            await pilot.press("enter")  # a turn fills the cache: the layer view has rows
            await wait_for(pilot, lambda: any(isinstance(e, Done) for e in engine.events))
            await pilot.press("ctrl+l")
            await pilot.pause()
            await pilot.press("down", "a")
            await wait_for(pilot, lambda: isinstance(app.screen, AttentionScreen))
            assert app.screen.layer_index == 1  # type: ignore[attr-defined]
            await wait_for(pilot, lambda: engine._watch.target == (1, None))
            await pilot.press("escape")
            await wait_for(pilot, lambda: engine._watch.target is None)

    run()
