"""What the chat shows while a turn reads a long prompt, and when the conversation stops
fitting the cache. The chat screen hands these engine events here in one call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvchat.app.tui.widgets import ChatMessage, StatsPanel
from kvchat.model.cache.layer_kinds import FOLDING_MIXERS
from kvchat.model.runtime.events import Overflow, PrefillProgress

# a prompt read faster than this shows no progress (it would only flicker)
PREFILL_SHOW_AFTER_S = 0.5


def prefill_label(ev: PrefillProgress) -> str:
    return f"reading the prompt: {ev.done:,}/{ev.total:,} tokens · {ev.tps:,.0f} tok/s"


def overflow_message(ev: Overflow, mixer: str | None = None) -> str:
    """`mixer`: the model's recurrent mixer (model_info's), whose state may still carry
    what the attention window dropped."""
    where = "the prompt" if ev.during == "prompt" else "the reply"
    lost = ("The model no longer sees the start of the conversation, so replies can lose"
            " the thread.")
    if mixer in FOLDING_MIXERS:  # docs/kv-cache.md, "An endless chat on a model with ..."
        lost = ("Its attention layers no longer see the start of the conversation; its"
                " recurrent layers still carry it, folded into their state, not word for"
                " word.")
    return (f"The chat outgrew the {ev.capacity:,}-token window: {ev.dropped:,} oldest tokens"
            f" dropped during {where}. {lost} Settings (Ctrl+S) › max KV size sets the"
            " window, up to the model's own context.")


def on_turn_event(
    ev: PrefillProgress | Overflow,
    panel: StatsPanel,
    reply: ChatMessage | None,
    notify: Callable[..., Any],
) -> None:
    """Prefill progress in the panel and the reply's header. Overflow: one lasting line in
    the panel for the chat, a warning toast the first time only (a small window overflows
    every turn, and stacked toasts covered the replies), and a note on the reply."""
    if isinstance(ev, PrefillProgress):
        if ev.done >= ev.total:
            if reply is not None:
                reply.note_progress("generating…")
            return
        if ev.elapsed_s < PREFILL_SHOW_AFTER_S:
            return
        panel.show_prefill(ev.done, ev.total, ev.tps)
        if reply is not None:
            reply.note_progress(prefill_label(ev))
    else:
        if panel.note_overflow():
            notify(overflow_message(ev, panel.info.get("mixer")), severity="warning",
                   title="Context full", timeout=15)
        if reply is not None:
            reply.tooltip = overflow_message(ev, panel.info.get("mixer"))
            reply.add_class("-overflow")
