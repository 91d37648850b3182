"""Widgets of the chat app: messages, transcript, input box, stats panel."""

from kvchat.app.tui.widgets.chat import ChatInput, ChatMessage, Transcript
from kvchat.app.tui.widgets.stats_panel import ContextGauge, StatsPanel

__all__ = ["ChatInput", "ChatMessage", "ContextGauge", "StatsPanel", "Transcript"]
