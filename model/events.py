"""What the engine says to its client (the UI, the CLI), and what a client asks of it.

Events are plain dataclasses delivered by a callback on the engine thread; a Textual
client hops to its own thread with `App.call_from_thread`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class GenParams:
    """One turn's generation settings (sampling + limits + cache bound)."""

    max_tokens: int = 512
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context_size: int = 64
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # benchmarks: always generate max_tokens
    # cache bound: None = the model's context length, then rotation with `keep` sinks
    max_kv_size: int | None = None
    keep: int = 4
    # past the cache capacity: "rotate" (evict, keep `keep` sinks) or "refuse" (a prompt
    # that does not fit is an error; generation stops with "length" when the cache is full)
    overflow: str = "rotate"


@dataclass
class Loading:
    path: str


@dataclass
class Loaded:
    info: dict[str, Any]
    freed_bytes: int = 0  # active memory released by dropping the previous model


@dataclass
class LoadFailed:
    path: str
    message: str


@dataclass
class Started:
    """Prompt rendered and matched against the cache; prefill begins."""

    prompt_tokens: int
    cached_tokens: int
    reprefill_reason: str | None = None  # set when the shared prefix could not be reused


@dataclass
class TextDelta:
    text: str
    token: int


@dataclass
class Stats:
    stats: dict[str, Any]


@dataclass
class Done:
    finish_reason: str  # eos | stop | length | cancelled | error
    text: str
    ids: list[int]
    prompt_ids: list[int]
    stats: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


Event = Loading | Loaded | LoadFailed | Started | TextDelta | Stats | Done
