"""Measured K/V quantization quality per model: what `kvchat bench --kv-bits` (and the
quality script) found, kept so the settings screen can show it for the loaded model.

One JSON file beside the settings (kv_quality.json): {resolved model path: {bits:
record}}, each record model/kv_quality.Agreement's fields plus when and how it was
measured. Reading is lenient (a missing or bad file means "not measured"); writes are
atomic.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from kvchat.app.core.settings import config_dir
from kvchat.app.core.store import atomic_write_text

QUALITY_FILE = "kv_quality.json"


def quality_path() -> Path:
    return config_dir() / QUALITY_FILE


def _key(model_path: str | Path) -> str:
    return str(Path(model_path).expanduser().resolve())


def _load() -> dict[str, Any]:
    try:
        data = json.loads(quality_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def record(model_path: str | Path, result: dict[str, Any], how: str) -> None:
    """Keep `result` (an Agreement's dict) as this model's figure for its bits."""
    data = _load()
    per_model = data.get(_key(model_path))
    if not isinstance(per_model, dict):
        per_model = {}
    per_model[str(result["bits"])] = {**result, "how": how,
                                      "when": time.strftime("%Y-%m-%d %H:%M")}
    data[_key(model_path)] = per_model
    quality_path().parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(quality_path(), json.dumps(data, indent=2) + "\n")


def measured(model_path: str | Path | None) -> dict[int, dict[str, Any]]:
    """{bits: record} for this model; {} when never measured (or unreadable)."""
    if not model_path:
        return {}
    per_model = _load().get(_key(model_path))
    if not isinstance(per_model, dict):
        return {}
    out = {}
    for bits, rec in per_model.items():
        if isinstance(rec, dict) and str(bits).isdigit() and "forced_match" in rec:
            out[int(bits)] = rec
    return out


def agreement_line(model_path: str | Path | None) -> str:
    """One line for the settings screen: the measured agreement per bits, or how to
    measure it."""
    recs = measured(model_path)
    if not recs:
        return ("quantized K/V agreement: not measured for this model"
                " (kvchat bench --kv-bits 8 measures it)")
    parts = []
    for bits in sorted(recs, reverse=True):
        r = recs[bits]
        first = r.get("first_divergence")
        div = "no divergence" if first is None else f"first divergence at token {first}"
        parts.append(f"{bits}-bit {r['forced_match']:.1%} of {r['tokens']} tokens ({div},"
                     f" KL {r['mean_kl']:.2g})")
    last = recs[max(recs)]
    return f"measured K/V agreement: {'; '.join(parts)} — {last['how']}, {last['when']}"
