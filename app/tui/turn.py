"""The chat's turn state: one small state machine the UI renders from.

    idle ─► loading ─► idle | error            (a model swap; a failed one keeps the old model)
    idle ─► prefilling ─► decoding ─► idle | stopped | error
                 └──────────────────► idle | stopped | error   (stopped or failed in prefill)

`stopped` and `error` rest like `idle` (they only remember how the last turn ended), so
every transition that leaves `idle` also leaves them. No Textual here.
"""

from __future__ import annotations

from enum import Enum


class Phase(str, Enum):
    IDLE = "idle"
    LOADING = "loading"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    STOPPED = "stopped"
    ERROR = "error"

    @property
    def busy(self) -> bool:
        """A load or a turn is running: new turns, swaps and edits must wait."""
        return self in (Phase.LOADING, Phase.PREFILLING, Phase.DECODING)

    @property
    def generating(self) -> bool:
        return self in (Phase.PREFILLING, Phase.DECODING)


_REST = {Phase.LOADING, Phase.PREFILLING}
ALLOWED: dict[Phase, set[Phase]] = {
    Phase.IDLE: _REST,
    Phase.STOPPED: _REST,
    Phase.ERROR: _REST,
    Phase.LOADING: {Phase.IDLE, Phase.ERROR},
    Phase.PREFILLING: {Phase.DECODING, Phase.IDLE, Phase.STOPPED, Phase.ERROR},
    Phase.DECODING: {Phase.IDLE, Phase.STOPPED, Phase.ERROR},
}

# how a turn ended (Done.finish_reason) -> where the machine rests
FINISH_PHASE = {
    "eos": Phase.IDLE,
    "stop": Phase.IDLE,
    "length": Phase.IDLE,
    "cancelled": Phase.STOPPED,
    "error": Phase.ERROR,
}


def step(current: Phase, new: Phase) -> Phase:
    """`new` if the machine may go there from `current`; ValueError otherwise (a bug)."""
    if new != current and new not in ALLOWED[current]:
        raise ValueError(f"turn state cannot go from {current.value} to {new.value}")
    return new


def busy_reason(phase: Phase) -> str | None:
    """Why a new turn, a swap or another chat must wait now (one line); None: it need not."""
    if phase.generating:
        return "Still generating: press Esc to stop first."
    if phase is Phase.LOADING:
        return "A model is loading; one moment."
    return None
