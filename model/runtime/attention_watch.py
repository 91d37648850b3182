"""The attention view a client watches: which layer (and KV group), and its views.

Computed on the engine thread, where the model and its cache live, from the function the
engine was handed (`Views.attention`, model/explain's): the runtime never imports the
explain views. While nothing is watched nothing is computed; while a reply streams a view
follows the newest token a few times a second.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvchat.model.errors import error_line

from .events import AttentionView

ATTENTION_INTERVAL_S = 0.25  # the attention view's refresh while a reply streams

# (model, caches, layer, group, token id) -> AttentionView
ComputeView = Callable[..., AttentionView]


class AttentionWatch:
    """The watched (layer, KV group or None for all heads), or None: closed."""

    interval_s = ATTENTION_INTERVAL_S

    def __init__(self, compute: ComputeView | None) -> None:
        self.compute = compute
        # set from a client's thread, read on the engine thread: one reference, swapped whole
        self.target: tuple[int, int | None] | None = None

    def watch(self, layer: int | None, group: int | None = None) -> None:
        self.target = None if layer is None else (layer, group)

    def view(self, model: Any, caches: list[Any] | None, token: int | None
             ) -> AttentionView | None:
        """The view of the newest cached token (id `token`) at the watched layer, None
        while nothing is watched. A failure is the view's note: it must never cost the
        cache or the reply."""
        target = self.target
        if target is None or model is None:
            return None
        layer, group = target
        view = AttentionView(layer, group, model.config.num_hidden_layers,
                             model.config.num_key_value_heads)
        if hasattr(model, "pipeline_stats"):
            view.note = "not available for a model split across hosts"
        elif not caches or token is None:
            view.note = "the cache is empty: send a message"
        elif self.compute is None:
            view.note = "this engine was built without the attention view"
        else:
            try:
                view = self.compute(model, caches, layer, group, token)
            except Exception as e:
                view.note = f"cannot compute the attention view: {error_line(e)}"
        return view
