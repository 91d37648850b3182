"""Small, pure formatters for the UI (numbers in, short strings out).

Kept free of Textual so tests can check the exact strings the panel shows.
"""

from __future__ import annotations

import re
from typing import Any

from kvchat.model.cache.kv_math import human_bytes

__all__ = [
    "context_level",
    "fmt_count",
    "fmt_device",
    "fmt_params",
    "fmt_rate",
    "fmt_seconds",
    "human_bytes",
]

# context gauge thresholds (fraction of cache_capacity): yellow from 75 %, red from 90 %
WARN_AT = 0.75
DANGER_AT = 0.90


def fmt_rate(tps: float | None) -> str:
    """Tokens per second, e.g. 1234.5 -> "1,234.5 tok/s"; None -> "–"."""
    if tps is None:
        return "–"
    return f"{tps:,.1f} tok/s"


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "–"
    if s < 1:
        return f"{s * 1000:.0f} ms"
    return f"{s:.2f} s"


def fmt_count(n: int | None) -> str:
    return "–" if n is None else f"{n:,}"


def fmt_params(n: int | None) -> str:
    """Parameter counts the way model cards say them: 260K, 1.2M, 7.0B."""
    if n is None:
        return "–"
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(n)


def fmt_bytes(n: int | float | None) -> str:
    return "–" if n is None else human_bytes(n)


def context_level(tokens: int, capacity: int) -> str:
    """"ok" | "warn" | "danger" for the context gauge."""
    if capacity <= 0:
        return "ok"
    frac = tokens / capacity
    if frac >= DANGER_AT:
        return "danger"
    if frac >= WARN_AT:
        return "warn"
    return "ok"


def fmt_saving(x: Any) -> str:
    """GQA saving factor: 2.0 -> "2×", 1.5 -> "1.5×"."""
    try:
        f = float(x)
    except (TypeError, ValueError):
        return "–"
    return f"{f:.0f}×" if f == int(f) else f"{f:.1f}×"


_DEVICE = re.compile(r"Device\((\w+), (\d+)\)")


def fmt_device(device: str | None) -> str:
    """MLX's device as a user says it: "Device(cpu, 0)" -> "CPU", "Device(gpu, 1)" ->
    "GPU 1" (the index only where there is more than one); anything else as it is."""
    if not device:
        return "–"
    m = _DEVICE.fullmatch(device.strip())
    if m is None:
        return device
    kind, index = m.group(1).upper(), int(m.group(2))
    return kind if index == 0 else f"{kind} {index}"
