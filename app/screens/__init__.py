"""Screens of the app: the chat, and the modal ones (help, model picker, settings, history,
layer view)."""

from .chat import ChatScreen
from .help import HelpScreen
from .history import HistoryScreen
from .layers import LayerCacheScreen
from .picker import ModelPickerScreen
from .settings_form import SettingsScreen

__all__ = [
    "ChatScreen",
    "HelpScreen",
    "HistoryScreen",
    "LayerCacheScreen",
    "ModelPickerScreen",
    "SettingsScreen",
]
