"""What the engine says to its client (the UI, the CLI), and what a client asks of it.

Events are plain dataclasses delivered by a callback on the engine thread; a Textual
client hops to its own thread with `App.call_from_thread`. `EngineLike` is the engine as
its clients see it (the UI and the CLI depend on this, not on `model.engine`). No MLX here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from kvchat.model.cache.stats import CacheStats
from kvchat.model.errors import KVChatError
from kvchat.model.text.tool_calls import ToolCall

if TYPE_CHECKING:
    from kvchat.model.decoder.kv_format import KVQuant

    from .sampling import SamplingParams

OVERFLOW_MODES = ("rotate", "refuse")
MAX_KV_SIZE = 2**31 - 1  # cache positions and masks are int32
SPECULATION = ("off", "lookup", "draft")  # model/runtime/speculative.py
MAX_DRAFT_TOKENS = 16
MAX_NGRAM = 8


def _same_fields(cls: Any, source: Any) -> dict[str, Any]:
    """The attributes of `source` named like the fields of dataclass `cls`."""
    names = (f.name for f in dataclasses.fields(cls))
    return {n: getattr(source, n) for n in names if hasattr(source, n)}


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
    # K/V stored in 4 or 8 bits (None: the compute dtype), group size (None: 64 where
    # head_dim allows, else 32), and after how many tokens quantization starts
    kv_bits: int | None = None
    kv_group_size: int | None = None
    quantized_kv_start: int = 0
    # whose cached prompts this turn may continue: a server's client (docs/serve.md, Who
    # can reach the server); None = the one shared partition (the chat, a single user)
    cache_partition: str | None = None
    # structured output and tools, in OpenAI's shapes (docs/serve.md): `response_format`
    # ({"type": "json_object"} or "json_schema") constrains the reply to a grammar
    # (model/runtime/constrained.py); `tools` go to the chat template and calls come back
    # as Done.tool_calls; `tool_choice` "required" or a named function forces a call;
    # `parallel_tool_calls` False: one call at most (the reply ends once it is complete)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    # speculative decoding (model/runtime/speculative.py): "off", "lookup" (n-gram match
    # against the conversation, n = lookup_ngram down to 1) or "draft" (the model in the
    # draft_model folder); at most draft_tokens drafted per step, adapted to acceptance
    speculation: str = "off"
    draft_model: str | None = None
    draft_tokens: int = 4
    lookup_ngram: int = 3

    def kv_quant(self) -> KVQuant | None:
        from kvchat.model.decoder.kv_format import kv_quant

        return kv_quant(self.kv_bits, self.kv_group_size, self.quantized_kv_start)

    @classmethod
    def from_fields(cls, source: Any, **overrides: Any) -> GenParams:
        """GenParams from any object with attributes of the same names (settings, parsed
        command-line arguments); missing ones keep their defaults."""
        return cls(**{**_same_fields(cls, source), **overrides})

    def sampling(self) -> SamplingParams:
        from .sampling import SamplingParams  # imports MLX; keep this module light

        return SamplingParams(**_same_fields(SamplingParams, self))

    def validate(self) -> GenParams:
        """Raise KVChatError (one line, naming the field) on the first bad value."""
        self.sampling().validate()
        if self.max_tokens < 1:
            raise KVChatError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.keep < 0:
            raise KVChatError(f"keep must be >= 0, got {self.keep}")
        if self.max_kv_size is not None and self.max_kv_size > MAX_KV_SIZE:
            raise KVChatError(f"max_kv_size must be at most {MAX_KV_SIZE:,} (positions are"
                              f" int32), got {self.max_kv_size:,}")
        if self.max_kv_size is not None and self.max_kv_size <= self.keep:
            raise KVChatError(
                f"max_kv_size ({self.max_kv_size}) must be at least keep + 1"
                f" ({self.keep + 1}): the window needs room beyond the kept tokens"
            )
        if self.overflow not in OVERFLOW_MODES:
            raise KVChatError(f"overflow must be 'rotate' or 'refuse', got {self.overflow!r}")
        if self.kv_bits is None and (self.kv_group_size is not None or self.quantized_kv_start):
            raise KVChatError("kv_group_size and quantized_kv_start need kv_bits (4 or 8)")
        self.kv_quant()  # KVQuantError on bits / group size / start it cannot do
        if self.speculation not in SPECULATION:
            raise KVChatError(f"speculation must be off, lookup or draft, got {self.speculation!r}")
        if self.speculation == "draft" and not self.draft_model:
            raise KVChatError("speculation with a draft model needs a draft model folder")
        for name, most in (("draft_tokens", MAX_DRAFT_TOKENS), ("lookup_ngram", MAX_NGRAM)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= most:
                raise KVChatError(f"{name} must be an integer in 1..{most}, got {v!r}")
        return self


@dataclass
class TurnStats(CacheStats):
    """A turn's and the cache's statistics, named and defined in docs/design.md.

    None means "not measured yet" (no turn has run, or the cache is empty); every field the
    engine can know is set on the stats of `Done`. Cache numbers come from metadata only.
    """

    # this turn
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    prefill_tps: float | None = None
    ttft_s: float | None = None
    generated_tokens: int | None = None
    decode_tps: float | None = None
    # how this turn used the cached prompts: reused and prefilled tokens, and why no more
    # were reused (model/cache/misses.py's CacheUse.to_json)
    cache: dict[str, Any] | None = None
    # a model split across machines (model/distributed/pipeline.py): per-rank bytes and time split
    pipeline: dict[str, Any] | None = None
    # a server's pool of idle caches (model/cache/prefix_pool.py): entries, bytes, budget, hits
    prefix_pool: dict[str, Any] | None = None
    # speculative decoding: what drafted ("prompt lookup", the draft model's name), the
    # tokens drafted and accepted, accepted ÷ drafted, generated tokens per decode forward
    # pass ((generated − 1) ÷ passes), or why speculation asked for did not run
    speculation: str | None = None
    drafted: int | None = None
    accepted: int | None = None
    acceptance: float | None = None
    tokens_per_forward: float | None = None
    speculation_note: str | None = None
    # the runtime
    compiled_step: bool | None = None  # the compiled single-token step served the decode
    peak_memory: int | None = None
    active_memory: int | None = None
    kernels_backend: str | None = None
    device: str | None = None

    def with_(self, **changes: Any) -> TurnStats:
        return dataclasses.replace(self, **changes)

    def merged(self, newer: CacheStats) -> TurnStats:
        """These stats updated by every field `newer` knows."""
        # shallow: asdict() deep-copies every field, ~6 ms per Stats event in the UI
        known = {f.name: v for f in dataclasses.fields(newer)
                 if (v := getattr(newer, f.name)) is not None}
        return dataclasses.replace(self, **known)


TURN_FIELDS = ("prompt_tokens", "cached_tokens", "prefill_tps", "ttft_s", "generated_tokens",
               "decode_tps")
SPECULATION_FIELDS = ("speculation", "drafted", "accepted", "acceptance", "tokens_per_forward",
                      "speculation_note")
CACHE_FIELDS = ("cache_offset", "cache_tokens", "cache_capacity", "cache_bytes", "mha_bytes",
                "gqa_saving", "evicted_tokens", "keep", "wrapped", "sliding_layers",
                "sliding_bytes", "window_saving", "kv_bits", "kv_group_size", "float_bytes",
                "kv_saving", "state_bytes", "state_layers", "checkpoints", "checkpoint_bytes")


# the annotations of TurnStats' numeric fields (strings: `from __future__ import annotations`)
_NUMBER_TYPES = ("int | None", "float | None")


def stats_json(stats: TurnStats) -> dict[str, Any]:
    """The one serialisation of statistics (`generate --json`, bench): every field by its
    docs/design.md name, numbers never absent (0 when not measured), non-finite floats as null."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(stats):
        v = getattr(stats, f.name)
        if v is None and f.type in _NUMBER_TYPES:  # a flag, a name or a table stays null
            v = 0
        out[f.name] = None if isinstance(v, float) and not math.isfinite(v) else v
    return out


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
    # tokens the cache held that match this prompt but run through the model again (the
    # prompt's last token when the whole prompt was cached; all of them after an eviction)
    reprefilled_tokens: int = 0


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
class ToolCallDelta:
    """A tool call the reply made, sent once the call is complete (the `index`-th of the
    turn); its text is never sent as TextDelta."""

    index: int
    call: ToolCall


@dataclass
class Stats:
    stats: TurnStats


@dataclass
class Done:
    # eos | stop | length | context_full (--overflow refuse hit the window) | cancelled | error
    # | tool_calls (GenParams.tools: the reply made calls)
    finish_reason: str
    text: str
    ids: list[int]
    prompt_ids: list[int]
    stats: TurnStats = field(default_factory=TurnStats)
    error: str | None = None
    # with GenParams.tools: the calls the reply made (`text` is then the rest of the
    # reply, and finish_reason "tool_calls" when there are any), and where in `text` each
    # was made (an API whose answer keeps the reply's order: Anthropic's content blocks)
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_offsets: list[int] = field(default_factory=list)


@dataclass
class CacheSaved:
    """The K/V cache was written to `path` (`nbytes` on disk) for `tokens` tokens, or
    could not be (`error` says why; the chat itself is saved regardless)."""

    path: str
    tokens: int = 0
    nbytes: int = 0
    error: str | None = None


@dataclass
class CacheRestored:
    """A saved K/V cache was loaded (`tokens` > 0), or could not be (`error` says why; the
    next turn then prefills as usual)."""

    path: str
    tokens: int = 0
    error: str | None = None


@dataclass
class KernelsSwitched:
    """The engine now runs RMSNorm and RoPE on `backend`; `message` is the one line to show
    (it names the reason when the switch was refused)."""

    backend: str
    message: str


@dataclass
class Explained:
    """The loaded model's anatomy (model/explain/anatomy.py's `explain()` dict), computed where
    the model runs: its kernels backend, its own q and k, the cache's current context."""

    data: dict[str, Any]


@dataclass
class AttentionView:
    """Where the newest cached token's attention goes at one layer
    (model/explain/attention_view.py), sent while a client watches
    (`EngineLike.watch_attention`). `bins` are the weights summed over `slots_per_bin`
    cache slots each, across the whole capacity; `bin_kinds` says what each bin holds
    ("sink", "held" or "empty"). The three shares add up to 1."""

    layer: int
    group: int | None  # the KV head group whose query heads are averaged; None: all heads
    n_layers: int
    n_groups: int
    heads: list[int] = field(default_factory=list)
    position: int = 0  # the newest token's absolute position (the query)
    tokens: int = 0  # keys it sees
    capacity: int = 0
    keep: int = 0
    evicted: int = 0
    window: int | None = None
    write_slot: int = 0  # where the next token will be written
    slots_per_bin: int = 1
    bins: list[float] = field(default_factory=list)
    bin_kinds: list[str] = field(default_factory=list)
    sink_share: float = 0.0
    recent_share: float = 0.0
    rest_share: float = 0.0
    recent: int = 64
    top: list[tuple[int, float]] = field(default_factory=list)  # (position, weight), top 5
    note: str | None = None  # why there is nothing to show (empty cache, split model)


Event = (
    Loading | Loaded | LoadFailed | Started | PrefillProgress | Overflow | TextDelta
    | ToolCallDelta | Stats | Done | CacheSaved | CacheRestored | KernelsSwitched | Explained
    | AttentionView
)

Prompt = Sequence[Mapping[str, str]] | Sequence[int] | str


@dataclass
class TurnEvent:
    """An event of turn `turn` (the id `submit` returned), from an engine that runs turns
    side by side (`max_batch` > 1, a server's): their events interleave."""

    turn: int
    event: Event


class EngineLike(Protocol):
    """What the UI and the CLI need of an engine (model.engine.Engine implements it).
    Every method returns at once; results arrive as events through the callback given
    at construction, on the engine's thread."""

    def load(self, path: str | Path) -> None: ...
    def submit(self, prompt: Prompt, params: GenParams | None = None) -> int: ...
    def cancel(self, turn: int | None = None) -> None: ...
    def reset(self) -> None: ...
    def close(self, timeout: float = 10.0) -> None: ...
    def save_cache(self, path: str | Path, max_bytes: int | None = None) -> None: ...
    def restore_cache(self, path: str | Path) -> None: ...
    def set_kernels(self, backend: str) -> None: ...
    def explain(self, gap: int = 3, block: str = "model") -> None: ...
    def watch_attention(self, layer: int | None, group: int | None = None) -> None: ...
    def cache_stats(self) -> TurnStats: ...
    def layer_stats(self) -> list[dict[str, Any]]: ...


EngineFactory = Callable[[Callable[[Event], None], "str | None"], EngineLike]
