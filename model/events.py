"""What the engine says to its client (the UI, the CLI), and what a client asks of it.

Events are plain dataclasses delivered by a callback on the engine thread; a Textual
client hops to its own thread with `App.call_from_thread`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import KVChatError

if TYPE_CHECKING:
    from .sampling import SamplingParams

OVERFLOW_MODES = ("rotate", "refuse")


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
    # that does not fit is an error; generation stops with "context_full" when the cache is full)
    overflow: str = "rotate"

    def sampling(self) -> SamplingParams:
        from .sampling import SamplingParams  # imports MLX; keep this module light

        return SamplingParams(
            temp=self.temp,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            repetition_context_size=self.repetition_context_size,
            seed=self.seed,
        )

    def validate(self) -> GenParams:
        """Raise KVChatError (one line, naming the field) on the first bad value."""
        self.sampling().validate()
        if self.max_tokens < 1:
            raise KVChatError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.keep < 0:
            raise KVChatError(f"keep must be >= 0, got {self.keep}")
        if self.max_kv_size is not None and self.max_kv_size <= self.keep:
            raise KVChatError(
                f"max_kv_size ({self.max_kv_size}) must be at least keep + 1"
                f" ({self.keep + 1}): the window needs room beyond the kept tokens"
            )
        if self.overflow not in OVERFLOW_MODES:
            raise KVChatError(f"overflow must be 'rotate' or 'refuse', got {self.overflow!r}")
        return self


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
class PrefillProgress:
    """After each prefill chunk: `done` of `total` new prompt tokens, at `tps` so far."""

    done: int
    total: int
    elapsed_s: float

    @property
    def tps(self) -> float:
        return self.done / self.elapsed_s if self.elapsed_s > 0 else 0.0


@dataclass
class Overflow:
    """The conversation no longer fits the cache: `dropped` tokens were evicted (rotation)
    while the prompt ("prompt") or the reply ("reply") ran; `capacity` is the window."""

    dropped: int
    capacity: int
    during: str


@dataclass
class TextDelta:
    text: str
    token: int


@dataclass
class Stats:
    stats: dict[str, Any]


@dataclass
class Done:
    # eos | stop | length | context_full (--overflow refuse hit the window) | cancelled | error
    finish_reason: str
    text: str
    ids: list[int]
    prompt_ids: list[int]
    stats: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


Event = (
    Loading | Loaded | LoadFailed | Started | PrefillProgress | Overflow | TextDelta | Stats
    | Done
)
