"""A fake engine with the real `model.engine.Engine` API and events, for UI tests.

It runs on its own thread (as the real one does, so the app's thread hop is exercised),
replays a fixed reply piece by piece and reports *pinned* statistics computed from a
fixed geometry (stories260K's: 5 layers, 8 heads, 4 KV heads, head_dim 8, float32), so
snapshots are byte-stable and tests can check the panel against the DESIGN.md formulas.

Knobs: `token_delay` (seconds between pieces), `pause_after` (stop after N pieces until
`resume()` or `cancel()`), `fail_paths` / a path containing "broken" (load fails),
`load_delay`. Everything the app asked for is recorded (`submitted`, `loads`, `resets`).
"""

from __future__ import annotations

import asyncio
import functools
import queue
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from model.events import (
    Done,
    Event,
    GenParams,
    Loaded,
    LoadFailed,
    Loading,
    Started,
    Stats,
    TextDelta,
)

REPLY = (
    "Once upon a time, a little **robot** named Kiv lived in a *cache*. "
    "Every day it kept the keys and values of the words it had seen.\n\n"
    "```python\ndef remember(token):\n    cache.append(token)\n```\n\n"
    "Kiv was happy, because nothing had to be computed twice. The end."
)

GEOMETRY = {"n_layers": 5, "n_heads": 8, "n_kv_heads": 4, "head_dim": 8, "context": 512}
DTYPE_BYTES = 4
# per-token decode times (s), cycled: gives a deterministic, non-flat sparkline
STEP_TIMES = (0.010, 0.0125, 0.008, 0.011, 0.009, 0.014, 0.0095)
TTFT_S = 0.042
PREFILL_S = 0.02
ACTIVE_MEMORY = 2_621_440
PEAK_MEMORY = 3_407_872


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
        "parameters": 260_032,
        "bits": None,
        "dtype": "float32",
        "weight_bytes": 1_040_128,
        "n_layers": GEOMETRY["n_layers"],
        "n_heads": GEOMETRY["n_heads"],
        "n_kv_heads": GEOMETRY["n_kv_heads"],
        "head_dim": GEOMETRY["head_dim"],
        "context": GEOMETRY["context"],
        "vocab_size": 512,
        "tokenizer": "sentencepiece",
        "chat_template": False,
    }


def kv_bytes(tokens: int, kv_heads: int | None = None) -> int:
    """DESIGN.md: 2 × layers × kv_heads × cache_tokens × head_dim × dtype_bytes."""
    g = GEOMETRY
    heads = g["n_kv_heads"] if kv_heads is None else kv_heads
    return 2 * g["n_layers"] * heads * tokens * g["head_dim"] * DTYPE_BYTES


def pseudo_tokens(messages: Sequence[dict[str, str]] | Sequence[int] | str) -> list[str]:
    """A stand-in tokenizer: one token per role tag and per word."""
    if isinstance(messages, str):
        return messages.split()
    out: list[str] = []
    for m in messages:
        if isinstance(m, int):
            out.append(str(m))
            continue
        out.append(f"<{m['role']}>")
        out.extend(m["content"].split())
    out.append("<assistant>")
    return out


class ScriptedEngine:
    def __init__(
        self,
        on_event: Callable[[Event], None],
        model_path: str | Path | None = None,
        *,
        reply: str = REPLY,
        token_delay: float = 0.0,
        pause_after: int | None = None,
        stats_every: int = 4,
        load_delay: float = 0.0,
        fail_paths: Sequence[str] = (),
    ):
        self._on_event = on_event
        self.reply = reply
        self.token_delay = token_delay
        self.pause_after = pause_after
        self.stats_every = stats_every
        self.load_delay = load_delay
        self.fail_paths = {str(p) for p in fail_paths}
        self.model_info: dict[str, Any] = {}
        self.submitted: list[tuple[Any, GenParams]] = []
        self.loads: list[str] = []
        self.resets = 0
        self.cancels = 0
        self.paused = threading.Event()  # set while a turn waits at `pause_after`
        self._resume = threading.Event()
        self._jobs: queue.Queue[tuple[str, Any] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._last_turn = 0
        self._cancel_upto = 0
        self._busy = threading.Event()
        self._cache_ids: list[str] = []
        self._last_stats: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run, name="scripted-engine", daemon=True)
        self._thread.start()
        if model_path is not None:
            self.load(model_path)

    # ---- the Engine API ---------------------------------------------------------------
    def load(self, path: str | Path) -> None:
        self.loads.append(str(path))
        self._jobs.put(("load", str(path)))

    def submit(self, prompt: Any, params: GenParams | None = None) -> int:
        params = params or GenParams()
        self.submitted.append((prompt, params))
        with self._lock:
            self._last_turn += 1
            turn = self._last_turn
        self._jobs.put(("turn", (turn, prompt, params)))
        return turn

    def cancel(self) -> None:
        with self._lock:
            self._cancel_upto = self._last_turn
            self.cancels += 1
        self._resume.set()

    def reset(self) -> None:
        self.resets += 1
        self._jobs.put(("reset", None))

    def close(self, timeout: float = 5.0) -> None:
        self.cancel()
        self._jobs.put(None)
        self._thread.join(timeout)

    @property
    def busy(self) -> bool:
        return self._busy.is_set()

    def resume(self) -> None:
        """Let a turn paused at `pause_after` run to its end."""
        self.pause_after = None
        self._resume.set()

    def layer_stats(self) -> list[dict[str, Any]]:
        if not self.model_info:
            return []
        tokens = min(len(self._cache_ids), GEOMETRY["context"])
        g = GEOMETRY
        per_token = 2 * g["n_kv_heads"] * g["head_dim"] * DTYPE_BYTES
        allocated = -(-tokens // 256) * 256  # grown in steps of 256, as the real cache
        return [
            {
                "layer": i,
                "kind": "full",
                "cache_offset": len(self._cache_ids),
                "cache_tokens": tokens,
                "cache_capacity": g["context"],
                "allocated_tokens": allocated,
                "cache_bytes": per_token * tokens,
                "allocated_bytes": per_token * allocated,
                "mha_bytes": per_token * tokens * g["n_heads"] // g["n_kv_heads"],
                "evicted_tokens": 0,
                "keep": 0,
                "wrapped": False,
            }
            for i in range(g["n_layers"])
        ]

    def cache_stats(self) -> dict[str, Any]:
        if not self.model_info:
            return {}
        return dict(self._last_stats) or self._stats(len(self._cache_ids), GEOMETRY["context"])

    # ---- engine thread ----------------------------------------------------------------
    def _emit(self, event: Event) -> None:
        self._on_event(event)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            kind, arg = job
            self._busy.set()
            try:
                if kind == "load":
                    self._load(arg)
                elif kind == "turn":
                    self._turn(*arg)
                elif kind == "reset":
                    self._cache_ids = []
                    self._last_stats = {}
            finally:
                self._busy.clear()

    def _load(self, path: str) -> None:
        self._emit(Loading(path))
        if self.load_delay:
            time.sleep(self.load_delay)
        if path in self.fail_paths or "broken" in path:
            self._emit(LoadFailed(path, f"no config.json in {path}"))
            return
        freed = 1_040_128 if self.model_info else 0
        self.model_info = model_info_for(path)
        self._cache_ids = []
        self._emit(Loaded(dict(self.model_info), freed))

    def _stats(self, cache_tokens: int, capacity: int) -> dict[str, Any]:
        g = GEOMETRY
        resident = min(cache_tokens, capacity)
        return {
            "cache_offset": cache_tokens,
            "cache_tokens": resident,
            "cache_capacity": capacity,
            "cache_bytes": kv_bytes(resident),
            "mha_bytes": kv_bytes(resident, g["n_heads"]),
            "gqa_saving": g["n_heads"] / g["n_kv_heads"],
            "evicted_tokens": max(0, cache_tokens - capacity),
            "keep": 4,
            "wrapped": cache_tokens > capacity,
            "peak_memory": PEAK_MEMORY,
            "active_memory": ACTIVE_MEMORY,
            "kernels_backend": "mx.fast",
            "device": "Device(cpu, 0)",
        }

    def _turn(self, turn: int, prompt: Any, params: GenParams) -> None:
        cancelled = lambda: turn <= self._cancel_upto  # noqa: E731
        if not self.model_info:
            self._emit(Done("error", "", [], [], {}, error="no model loaded"))
            return
        ids = pseudo_tokens(prompt)
        cached = 0
        for a, b in zip(self._cache_ids, ids, strict=False):
            if a != b:
                break
            cached += 1
        cached = min(cached, len(ids) - 1)
        self._cache_ids = list(ids)
        capacity = params.max_kv_size or GEOMETRY["context"]
        self._emit(Started(len(ids), cached, None))
        base = {
            "prompt_tokens": len(ids),
            "cached_tokens": cached,
            "prefill_tps": (len(ids) - cached) / PREFILL_S,
            "ttft_s": TTFT_S,
        }
        pieces = split_reply(self.reply)[: params.max_tokens]
        text = ""
        generated: list[int] = []
        reason = "eos" if len(pieces) < params.max_tokens else "length"
        stats: dict[str, Any] = dict(base)
        for i, piece in enumerate(pieces):
            if cancelled():
                reason = "cancelled"
                break
            if self.pause_after is not None and i == self.pause_after:
                self._resume.clear()
                self.paused.set()
                self._resume.wait()
                self.paused.clear()
                if cancelled():
                    reason = "cancelled"
                    break
            if self.token_delay:
                time.sleep(self.token_delay)
            text += piece
            generated.append(100 + i)
            self._cache_ids.append(piece)
            self._emit(TextDelta(piece, 100 + i))
            n = len(generated)
            if n % self.stats_every == 0:
                stats = {**base, **self._decode(n), **self._stats(len(self._cache_ids), capacity)}
                self._last_stats = stats
                self._emit(Stats(dict(stats)))
        n = len(generated)
        stats = {**base, **self._decode(n), **self._stats(len(self._cache_ids), capacity)}
        self._last_stats = stats
        self._emit(Stats(dict(stats)))
        self._emit(Done(reason, text, generated, list(range(len(ids))), dict(stats)))

    @staticmethod
    def _decode(n: int) -> dict[str, Any]:
        span = sum(STEP_TIMES[i % len(STEP_TIMES)] for i in range(max(0, n - 1)))
        return {
            "generated_tokens": n,
            "decode_tps": (n - 1) / span if n > 1 else 0.0,
        }


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
