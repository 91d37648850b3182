"""Screens of the app: the chat, and the modal ones (help, model picker, settings, history,
layer view)."""

from kvchat.app.tui.screens.anatomy import AnatomyScreen
from kvchat.app.tui.screens.attention import AttentionScreen
from kvchat.app.tui.screens.chat import ChatScreen
from kvchat.app.tui.screens.help import HelpScreen
from kvchat.app.tui.screens.history import HistoryScreen
from kvchat.app.tui.screens.layers import LayerCacheScreen
from kvchat.app.tui.screens.picker import ModelPickerScreen
from kvchat.app.tui.screens.settings_form import SettingsScreen

__all__ = [
    "AnatomyScreen",
    "AttentionScreen",
    "ChatScreen",
    "HelpScreen",
    "HistoryScreen",
    "LayerCacheScreen",
    "ModelPickerScreen",
    "SettingsScreen",
]
