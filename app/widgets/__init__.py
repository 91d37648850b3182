"""Widgets of the chat app: messages, transcript, input box, stats panel."""

from .chat import ChatInput, ChatMessage, Transcript
from .stats_panel import ContextGauge, StatsPanel

__all__ = ["ChatInput", "ChatMessage", "ContextGauge", "StatsPanel", "Transcript"]
