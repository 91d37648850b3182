"""The one-line summary under the transcript, shown while the side panel is hidden (narrow
terminals, or hidden with its key): decode speed, context used / bound, cache bytes and the
GQA saving, read from the panel, which keeps receiving every update while hidden."""

from __future__ import annotations

from textual.widgets import Static

from kvchat.app.tui.widgets.format import fmt_bytes, fmt_count, fmt_rate, fmt_saving
from kvchat.app.tui.widgets.stats_panel import REFRESH_S, StatsPanel
from kvchat.model.runtime.events import TurnStats


def status_text(stats: TurnStats, bound: int | None, full: bool = False) -> str:
    """e.g. "41.3 tok/s · ctx 52/64 · KV 20.0 KiB · GQA 2× smaller" (55 columns); "full"
    after the context once the chat has outgrown the window."""
    return " · ".join((
        fmt_rate(stats.decode_tps) if stats.decode_tps is not None else "– tok/s",
        f"ctx {fmt_count(stats.cache_tokens or 0)}/{fmt_count(bound)}{' full' if full else ''}",
        f"KV {fmt_bytes(stats.cache_bytes or 0)}",
        f"GQA {fmt_saving(stats.gqa_saving)} smaller" if stats.gqa_saving else "GQA –",
    ))


class StatusLine(Static):
    """Follows `panel` at the panel's own refresh rate, only while it is displayed."""

    def __init__(self, panel: StatsPanel, *, id: str | None = None) -> None:
        super().__init__("", id=id, markup=False)
        self.panel = panel
        self._shown = ""

    def on_mount(self) -> None:
        self.set_interval(REFRESH_S, self.follow)
        self.follow()

    def follow(self) -> None:
        if not self.display:
            return
        panel = self.panel
        text = status_text(panel.stats, panel.capacity(), panel.overflowed)
        if text != self._shown:
            self._shown = text
            self.update(text)
