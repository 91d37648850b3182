"""A K/V cache on disk: one safetensors file in mlx-lm's prompt-cache layout.

The file is what `mlx_lm.models.cache.save_prompt_cache` writes (arrays "<layer>.<i>" from
each cache's `state`, then its integers as scalar arrays listed in the metadata, plus the
class names, and a checksum: see cache_integrity.py), so
`mlx_lm.models.cache.load_prompt_cache` reads it back into mlx-lm's own
classes. Our loader reads the same file into ours through `from_state(state, meta_state)`,
with each layer's full `meta_state` (strings) kept in the metadata. Writes are atomic: a
temporary file in the same folder, renamed over the old one.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from .cache import CacheError, KVCache, RotatingKVCache
from .cache_integrity import CHECKSUM_KEY, seal, verify
from .errors import one_line

CLASSES: dict[str, type] = {"KVCache": KVCache, "RotatingKVCache": RotatingKVCache}
# how many leading meta_state integers mlx-lm keeps in the state of its class of that name
MLX_LM_SCALARS = {"KVCache": 1, "RotatingKVCache": 4}
META_KEY = "kvchat_meta_state"  # no dots: tree_unflatten splits keys at dots


def savable(caches: list[Any]) -> bool:
    """Whether save_cache can write these layers (our two classes, none empty)."""
    return bool(caches) and all(
        type(c).__name__ in CLASSES and type(c) is CLASSES[type(c).__name__] and not c.empty()
        for c in caches
    )


def save_cache(path: str | Path, caches: list[Any], metadata: dict[str, str]) -> int:
    """Write `caches` (+ string `metadata`) to `path` atomically; returns bytes written."""
    path = Path(path)
    names = [type(c).__name__ for c in caches]
    if not savable(caches):
        raise CacheError("only non-empty KVCache / RotatingKVCache layers can be saved")
    layers: list[list[Any]] = []
    for c, name in zip(caches, names, strict=True):
        ints = [int(x) for x in c.meta_state[: MLX_LM_SCALARS[name]]]
        layers.append([*c.state, *ints])
    scalars: list[Any] = [""]  # as mlx-lm: non-empty, else tree_flatten drops it
    arrays: dict[str, mx.array] = {}
    for key, value in tree_flatten(layers):
        if isinstance(value, int):
            scalars.append((key, "scalar"))
            value = mx.array(value)
        arrays[key] = value
    meta = {**metadata, META_KEY: json.dumps([list(c.meta_state) for c in caches])}
    header = seal(arrays, dict(tree_flatten([meta, names, scalars])), f"0.{CHECKSUM_KEY}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{secrets.token_hex(3)}.tmp.safetensors")
    try:
        mx.save_safetensors(str(tmp), arrays, header)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return path.stat().st_size


def load_cache(path: str | Path) -> tuple[list[Any], dict[str, str]]:
    """Our caches and the metadata from a file save_cache wrote. CacheError (one line)
    on anything else."""
    path = Path(path)
    try:
        arrays, header = mx.load(str(path), return_metadata=True)
        verify(arrays, header)  # before any of it is trusted (cache_integrity.py)
        meta, names, _scalars = tree_unflatten(list(header.items()))
        metas = json.loads(meta.pop(META_KEY))
        meta.pop(CHECKSUM_KEY, None)
        layers = tree_unflatten(list(arrays.items()))
        caches = []
        for name, layer, meta_state in zip(names, layers, metas, strict=True):
            cls = CLASSES[name]
            n = len(layer) - MLX_LM_SCALARS[name]
            caches.append(cls.from_state(tuple(layer[:n]), tuple(meta_state)))
    except CacheError as e:
        raise CacheError(f"K/V cache file {path.name}: {e}") from None
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, IndexError) as e:
        raise CacheError(f"unreadable K/V cache file {path.name}: {one_line(e)}") from None
    return caches, meta
