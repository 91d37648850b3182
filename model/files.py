"""Pure file helpers for model folders: which safetensors files hold the weights and what
their headers say. No MLX: `kvchat inspect`, `kvchat models` and discovery stay light.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import ModelLoadError

PICKLE_PATTERNS = ("pytorch_model*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")


def safetensors_header(f: Path) -> dict[str, Any]:
    """Parse a safetensors header and check the file holds every tensor's bytes."""
    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise ModelLoadError(f"truncated safetensors file {f.name}: no header")
            n = int.from_bytes(head, "little")
            if n > size - 8:
                raise ModelLoadError(f"truncated safetensors file {f.name}: header cut short")
            header = json.loads(fh.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"unreadable safetensors file {f.name}: {e}") from None
    data_size = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        end = info.get("data_offsets", [0, 0])[1]
        if end > data_size:
            raise ModelLoadError(
                f"truncated safetensors file {f.name}: tensor {name!r} needs {end} data bytes,"
                f" the file holds {data_size}"
            )
    return header


def weight_files(folder: Path) -> list[Path]:
    """The folder's safetensors files (sharded via the index, or all of them)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, json.JSONDecodeError, KeyError, AttributeError) as e:
            raise ModelLoadError(f"bad {index.name}: {e}") from None
        files = [folder / s for s in shards]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index.name} lists missing shard {missing[0]}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    pickles = [p.name for pat in PICKLE_PATTERNS for p in folder.glob(pat)]
    if pickles:
        raise ModelLoadError(
            f"refusing pickle checkpoint {pickles[0]} in {folder}: kvchat never unpickles;"
            " convert it to safetensors"
        )
    raise ModelLoadError(f"no *.safetensors weights in {folder}")
