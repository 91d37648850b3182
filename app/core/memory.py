"""Will a model fit this machine's memory? Asked before anything is loaded.

A model whose weights plus its configured K/V cache do not fit the memory the machine
can give now is refused with the numbers, before a byte is allocated (loading one
anyway ends in the kernel's OOM killer, or in swap); `--ignore-memory-check` loads it
all the same. `models` and `inspect` show the same verdict.

- Weights: as this backend allocates them (`model_facts`: the CPU computes in float32,
  a quantized checkpoint may be dequantized on load), from safetensors headers.
- K/V: at the cache's bound (`max_kv_size`, else the model's context; sliding layers at
  most their window; quantized K/V at their stored size), plus what a face adds (a
  server's prefix pool).
- Available: Linux's MemAvailable (what can be had without swapping), else the physical
  memory (macOS: hw.memsize through sysconf). Unknown: no verdict, nothing refused.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvchat.model.cache.kv_math import context_that_fits, human_bytes, kv_bytes_at
from kvchat.model.decoder.kv_format import KVQuant
from kvchat.model.errors import KVChatError, ModelLoadError
from kvchat.model.files import model_name

MEMINFO = Path("/proc/meminfo")
FLAG = "--ignore-memory-check"
_MEM_AVAILABLE = re.compile(r"^MemAvailable:\s+(\d+)\s*kB", re.MULTILINE)


@dataclass(frozen=True)
class Available:
    bytes: int
    source: str  # "MemAvailable" or "physical memory"


def available_memory() -> Available | None:
    """What this machine can give a model now, or None when it cannot tell."""
    try:
        m = _MEM_AVAILABLE.search(MEMINFO.read_text(encoding="ascii", errors="replace"))
    except OSError:
        m = None
    if m:
        return Available(int(m.group(1)) * 1024, "MemAvailable")
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return Available(pages * size, "physical memory") if pages > 0 and size > 0 else None


@dataclass(frozen=True)
class Fit:
    """The verdict for one model folder and cache bound."""

    name: str
    weight_bytes: int
    kv_bytes: int
    kv_tokens: int
    extra_bytes: int  # what the face adds (a server's prefix pool)
    available: Available | None
    tokens_that_fit: int | None  # the longest cache bound that fits (None: any, or unknown)

    @property
    def need(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.extra_bytes

    @property
    def fits(self) -> bool:
        return self.available is None or self.need <= self.available.bytes

    def line(self) -> str:
        """One line with the numbers: what is needed, of what, and what is available."""
        parts = [f"{human_bytes(self.weight_bytes)} of weights"]
        if self.kv_tokens:
            parts.append(f"{human_bytes(self.kv_bytes)} of K/V at {self.kv_tokens:,} tokens")
        if self.extra_bytes:
            parts.append(f"{human_bytes(self.extra_bytes)} of prefix pool")
        have = ("unknown" if self.available is None else
                f"{human_bytes(self.available.bytes)} is available ({self.available.source})")
        return f"{self.name} needs {human_bytes(self.need)} ({', '.join(parts)}); {have}"

    def refusal(self) -> str:
        if self.available is not None and self.weight_bytes > self.available.bytes:
            fix = "not even the weights fit"
        elif self.tokens_that_fit and self.kv_tokens:
            fix = f"--max-kv-size {self.tokens_that_fit:,} would fit"
        else:
            fix = "a smaller cache bound would not be enough"
        return f"{self.line()}: {fix}; {FLAG} loads it anyway"

    def to_dict(self) -> dict[str, Any]:
        return {"fits": self.fits, "line": self.line(), "need_bytes": self.need,
                "weight_bytes": self.weight_bytes, "kv_bytes": self.kv_bytes,
                "kv_tokens": self.kv_tokens, "extra_bytes": self.extra_bytes,
                "available_bytes": None if self.available is None else self.available.bytes,
                "available_source": None if self.available is None else self.available.source,
                "max_kv_size_that_fits": self.tokens_that_fit}


def model_fit(folder: str | Path, max_kv_size: int | None = None, kv: KVQuant | None = None,
              extra_bytes: int = 0, kv_tokens: int | None = None, facts: Any = None) -> Fit:
    """The verdict for `folder` with its cache bound (`max_kv_size`, else the model's
    context; `kv_tokens` says how many tokens the run holds at most when that is fewer,
    as bench knows; `facts`: its ModelFacts when the caller has them). ModelLoadError
    (one line) for a folder that cannot load at all."""
    from kvchat.model.decoder.config import load_config
    from kvchat.model.explain.facts import model_facts

    folder = Path(folder).expanduser()
    facts = facts or model_facts(folder)
    cfg = load_config(folder)
    tokens = max_kv_size or cfg.max_position_embeddings
    if kv_tokens is not None:
        tokens = min(tokens, kv_tokens)
    kv_bytes = kv_bytes_at(cfg, tokens, facts.kv_dtype_bytes, q=kv)
    have = available_memory()
    room = None
    if have is not None:
        room = context_that_fits(cfg, have.bytes, facts.kv_dtype_bytes,
                                 facts.weight_bytes + extra_bytes, q=kv)
    return Fit(model_name(folder), facts.weight_bytes, kv_bytes, tokens, extra_bytes, have,
               room)


def require_fit(folder: str | Path, max_kv_size: int | None = None, kv: KVQuant | None = None,
                *, extra_bytes: int = 0, kv_tokens: int | None = None,
                ignore: bool = False) -> Fit | None:
    """`model_fit`, refused (ModelLoadError, one line with the numbers) when it does not
    fit, unless `ignore`. None for a folder that cannot be sized: the loader says why,
    in its own words."""
    from kvchat.model.distributed import link

    if ignore or link.launched():  # a split model: each rank holds its share (hosts.py)
        return None
    try:
        fit = model_fit(folder, max_kv_size, kv, extra_bytes, kv_tokens)
    except (KVChatError, OSError, ValueError):
        return None
    if not fit.fits:
        raise ModelLoadError(fit.refusal())
    return fit


def add_argument(p: Any) -> None:
    p.add_argument(FLAG, action="store_true",
                   help="load the model even when its weights plus its K/V cache need more"
                   " memory than the machine has available")


def refusal(folder: str | Path, params: Any, ignore: bool = False) -> str | None:
    """For a face holding GenParams (the chat's settings): the refusal line when the
    model does not fit with that cache bound, else None."""
    try:
        require_fit(folder, params.max_kv_size, params.kv_quant(), ignore=ignore)
    except ModelLoadError as e:
        return str(e)
    return None
