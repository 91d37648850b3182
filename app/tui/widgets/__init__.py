"""Widgets of the chat app: messages, transcript, input box, stats panel."""

from kvchat.app.tui.widgets.chat import ChatInput, ChatMessage, Transcript
from kvchat.app.tui.widgets.footer import ActionFooter
from kvchat.app.tui.widgets.stats_panel import ContextGauge, StatsPanel
from kvchat.app.tui.widgets.status_line import StatusLine

__all__ = ["ActionFooter", "ChatInput", "ChatMessage", "ContextGauge", "StatsPanel",
           "StatusLine", "Transcript"]
