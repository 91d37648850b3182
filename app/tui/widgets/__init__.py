"""Widgets of the chat app: messages, transcript, input box, stats panel."""

from kvchat.app.tui.widgets.chat import ChatInput, ChatMessage
from kvchat.app.tui.widgets.footer import ActionFooter
from kvchat.app.tui.widgets.stats_panel import ContextGauge, StatsPanel
from kvchat.app.tui.widgets.status_line import StatusLine
from kvchat.app.tui.widgets.transcript import Entry, Transcript

__all__ = ["ActionFooter", "ChatInput", "ChatMessage", "ContextGauge", "Entry", "StatsPanel",
           "StatusLine", "Transcript"]
