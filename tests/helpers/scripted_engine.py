"""The real `model.engine.Engine` with a scripted model, for UI tests.

Only model execution is replaced (`Engine._open`, its clock and its allocator counters):
queueing, cancel, prefix reuse, cache trimming, sampling, stop strings, detokenizing and
every statistic are the production code. The scripted model has stories260K's geometry
(5 layers, 8 heads, 4 KV heads, head_dim 8, float32, context 512) and writes zero K/V into
the engine's real caches; its logits make the sampler pick the next piece of a fixed
reply, then EOS. Each model step advances a simulated clock by a pinned time, so speeds,
TTFT and the sparkline are byte-stable in snapshots.

Knobs: `token_delay` (real seconds per step), `pause_after` (the model blocks after that
many pieces have been emitted until `resume()` or `cancel()`; the engine still emits the
piece it holds before it sees the cancel), `fail_paths` / a path containing "broken"
(load fails), `load_delay`. The test side records `submitted`, `loads`, `resets` and every
event the app was sent (`events`).
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Callable, Container, Mapping, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx

from kvchat.model.cache.kv import make_cache
from kvchat.model.decoder.config import ModelConfig
from kvchat.model.errors import KVChatError
from kvchat.model.explain.views import VIEWS
from kvchat.model.runtime.engine import Engine
from kvchat.model.runtime.events import Event, GenParams, Prompt, TurnStats
from kvchat.model.text.tokenizer import StreamDetokenizer

REPLY = (
    "Once upon a time, a little **robot** named Kiv lived in a *cache*. "
    "Every day it kept the keys and values of the words it had seen.\n\n"
    "```python\ndef remember(token):\n    cache.append(token)\n```\n\n"
    "Kiv was happy, because nothing had to be computed twice. The end."
)

GEOMETRY = {"n_layers": 5, "n_heads": 8, "n_kv_heads": 4, "head_dim": 8, "context": 512}
VOCAB = 4096
EOS = 2
# per-token decode times (s), cycled: gives a deterministic, non-flat sparkline
STEP_TIMES = (0.010, 0.0125, 0.008, 0.011, 0.009, 0.014, 0.0095)
PREFILL_S = 0.02  # simulated seconds per prefill chunk
ACTIVE_MEMORY = 2_621_440
PEAK_MEMORY = 3_407_872
WEIGHT_BYTES = 1_040_128  # the scripted model holds this many bytes of "weights"


def split_reply(text: str) -> list[str]:
    """Word-ish pieces that keep every character (so joined pieces == text)."""
    pieces: list[str] = []
    cur = ""
    for ch in text:
        cur += ch
        if ch in " \n":
            pieces.append(cur)
            cur = ""
    if cur:
        pieces.append(cur)
    return pieces


def model_info_for(path: str) -> dict[str, Any]:
    p = Path(path)
    return {
        "name": p.name,
        "path": str(p),
        "architecture": "llama",
        "parameters": WEIGHT_BYTES // 4,
        "bits": None,
        "dtype": "float32",
        "weight_bytes": WEIGHT_BYTES,
        "n_layers": GEOMETRY["n_layers"],
        "n_heads": GEOMETRY["n_heads"],
        "n_kv_heads": GEOMETRY["n_kv_heads"],
        "head_dim": GEOMETRY["head_dim"],
        "context": GEOMETRY["context"],
        "vocab_size": VOCAB,
        "tokenizer": "scripted",
        "chat_template": False,
    }


def kv_bytes(tokens: int, kv_heads: int | None = None) -> int:
    """docs/design.md, by hand: 2 × layers × kv_heads × cache_tokens × head_dim × dtype_bytes."""
    g = GEOMETRY
    heads = g["n_kv_heads"] if kv_heads is None else kv_heads
    return 2 * g["n_layers"] * heads * tokens * g["head_dim"] * 4


class WordTokenizer:
    """One id per word-ish piece (split_reply) and per role tag; ids are handed out on
    first sight, so a reply the model generated re-encodes to the same ids."""

    kind = "scripted"
    chat_template = None
    vocab_size = VOCAB
    eos_ids = [EOS]
    end_ids = [EOS]  # no BOS: nothing else ends a reply

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._pieces: dict[int, str] = {}
        self._tags: set[int] = set()

    def id(self, piece: str) -> int:
        if piece not in self._ids:
            i = 3 + len(self._ids)
            if i >= VOCAB:
                raise KVChatError("scripted vocabulary full")
            self._ids[piece], self._pieces[i] = i, piece
        return self._ids[piece]

    def encode(self, text: str) -> list[int]:
        return [self.id(p) for p in split_reply(text)]

    def encode_chat(self, messages: Sequence[Mapping[str, str]], **_render: Any) -> list[int]:
        """Like Tokenizer.encode_chat; render options (should_stop) have nothing to bound."""
        out: list[int] = []
        for m in messages:
            out.append(self._tag(m["role"]))
            out += self.encode(m["content"])
        return out + [self._tag("assistant")]

    def _tag(self, role: str) -> int:
        i = self.id(f"<{role}>")
        self._tags.add(i)
        return i

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self._pieces.get(int(i), "") for i in ids if int(i) not in self._tags)

    def detokenizer(self, skip_special_tokens: bool = False,
                    keep: Container[int] = frozenset()) -> StreamDetokenizer:
        # role tags are the only special pieces, and decode() always drops them (no tool
        # marker is among them, so `keep` has nothing to keep)
        return StreamDetokenizer(self.decode)


class ScriptedModel:
    """Stands in for the Transformer (same call signature, real caches)."""

    def __init__(self, engine: ScriptedEngine, path: str, reply_ids: list[int]) -> None:
        g = GEOMETRY
        self.engine = engine
        self.path = path
        self.reply_ids = reply_ids
        self.config = ModelConfig.from_dict({
            "model_type": "llama", "hidden_size": g["n_heads"] * g["head_dim"],
            "num_hidden_layers": g["n_layers"], "num_attention_heads": g["n_heads"],
            "num_key_value_heads": g["n_kv_heads"], "head_dim": g["head_dim"],
            "intermediate_size": 64, "vocab_size": VOCAB,
            "max_position_embeddings": g["context"],
        })
        self.weights = mx.zeros((WEIGHT_BYTES // 4,), mx.float32)
        mx.eval(self.weights)
        self.step = 0

    def make_cache(self, max_kv_size: int | None = None, keep: int = 4,
                   kv: Any = None) -> list[Any]:
        return make_cache(self.config, max_kv_size=max_kv_size, keep=keep, kv=kv)

    def __call__(self, tokens: mx.array, cache: list[Any], logits_to_keep: int = 0) -> mx.array:
        g = GEOMETRY
        n = tokens.shape[1]
        kv = mx.zeros((1, g["n_kv_heads"], n, g["head_dim"]), mx.float32)
        keys = [c.update_and_fetch(kv, kv)[0] for c in cache]
        if logits_to_keep:  # a prefill chunk: the next token is the reply's first
            self.step = 0
            self.engine.advance(PREFILL_S)
        else:
            self.step += 1
            self.engine.decode_step(self.step)
        token = self.reply_ids[self.step] if self.step < len(self.reply_ids) else EOS
        logits = mx.zeros((1, 1 if logits_to_keep else n, VOCAB), mx.float32)
        logits[..., token] = 60.0
        # depend on the cache writes so they are evaluated with the logits, step by step
        return logits + 0 * sum(k[..., -1:, :1].sum() for k in keys)


class ScriptedEngine(Engine):
    def __init__(
        self,
        on_event: Callable[[Event], None],
        model_path: str | Path | None = None,
        *,
        reply: str = REPLY,
        token_delay: float = 0.0,
        pause_after: int | None = None,
        stats_interval_s: float | None = None,
        load_delay: float = 0.0,
        fail_paths: Sequence[str] = (),
        fail_after: int | None = None,
    ):
        self.reply = reply
        self.token_delay = token_delay
        self.pause_after = pause_after
        if stats_interval_s is not None:
            self.stats_interval_s = stats_interval_s
        self.load_delay = load_delay
        self.fail_paths = {str(p) for p in fail_paths}
        self.fail_after = fail_after  # decode steps before the model fails (a rank dies)
        self.submitted: list[tuple[Any, GenParams]] = []
        self.loads: list[str] = []
        self.resets = 0
        self.events: list[Event] = []
        self.paused = threading.Event()  # set while a turn waits at `pause_after`
        self._resume = threading.Event()
        self._now = 0.0

        def record(ev: Event) -> None:
            self.events.append(ev)
            on_event(ev)

        # the plain step: a compiled trace would replay the script's Python side effects
        # (its clock, its pauses) only once; the explain views the app's engines get
        super().__init__(record, model_path, compiled=False, views=VIEWS)

    # ---- model execution (the only overrides of Engine) -------------------------------
    def _open(self, path: str) -> tuple[Any, Any, dict[str, Any]]:
        if self.load_delay:
            time.sleep(self.load_delay)
        if path in self.fail_paths or "broken" in path:
            raise KVChatError(f"no config.json in {path}")
        tok = WordTokenizer()
        reply_ids = tok.encode(self.reply)
        return ScriptedModel(self, path, reply_ids), tok, model_info_for(path)  # type: ignore[return-value]

    def clock(self) -> float:  # type: ignore[override]
        return self._now

    def _runtime_stats(self) -> TurnStats:
        return TurnStats(peak_memory=PEAK_MEMORY, active_memory=ACTIVE_MEMORY,
                         kernels_backend="fast", device="Device(cpu, 0)")

    # ---- the script's time and pauses (called by ScriptedModel on the engine thread) ------
    def advance(self, seconds: float) -> None:
        self._now += seconds

    def decode_step(self, step: int) -> None:
        self.advance(STEP_TIMES[(step - 1) % len(STEP_TIMES)])
        if self.fail_after is not None and step > self.fail_after:
            raise KVChatError("rank 1 (127.0.0.1) stopped responding")
        if self.pause_after is not None and step == self.pause_after + 1:
            self._resume.clear()
            self.paused.set()
            self._resume.wait()
            self.paused.clear()
        if self.token_delay:
            time.sleep(self.token_delay)

    def resume(self) -> None:
        """Let a turn paused at `pause_after` run to its end."""
        self.pause_after = None
        self._resume.set()

    # ---- recording (test side; the Engine's behaviour is unchanged) -------------------------
    def load(self, path: str | Path) -> None:
        self.loads.append(str(path))
        super().load(path)

    def submit(self, prompt: Prompt, params: GenParams | None = None) -> int:
        self.submitted.append((prompt, params or GenParams()))
        return super().submit(prompt, params)

    def cancel(self, turn: int | None = None) -> None:
        super().cancel(turn)
        self._resume.set()  # a paused scripted step returns, as a real one would end

    def reset(self) -> None:
        self.resets += 1
        super().reset()


def record_notifications(app: Any) -> list[tuple[str, str]]:
    """(message, severity) of every notification from now on (App.notify is public)."""
    seen: list[tuple[str, str]] = []
    notify = app.notify

    def recording(message: str, *, severity: str = "information", **kw: Any) -> None:
        seen.append((str(message), severity))
        notify(message, severity=severity, **kw)

    app.notify = recording
    return seen


async def wait_for(pilot: Any, predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    """Let the app run until predicate() holds (polling every 10 ms), else fail."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {predicate}")
        await pilot.pause(0.01)


def async_test(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run an async test function with asyncio.run (no pytest async plugin needed)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return asyncio.run(fn(*args, **kwargs))

    return wrapper
