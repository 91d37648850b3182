"""Modal screens of the chat app: help, model picker, settings, history, layer view."""

from .help import HelpScreen
from .history import HistoryScreen
from .layers import LayerCacheScreen
from .picker import ModelPickerScreen
from .settings_form import SettingsScreen

__all__ = [
    "HelpScreen",
    "HistoryScreen",
    "LayerCacheScreen",
    "ModelPickerScreen",
    "SettingsScreen",
]
