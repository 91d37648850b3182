"""A K/V cache on disk: one safetensors file in mlx-lm's prompt-cache layout.

The file is what `mlx_lm.models.cache.save_prompt_cache` writes for these caches (arrays
"<layer>.<i>" from each cache's `state`, its scalars stored as arrays and listed in the
metadata, plus the class names), so `mlx_lm.models.cache.load_prompt_cache` reads it
back into mlx-lm's own classes where it has one of that name (KVCache, RotatingKVCache,
QuantizedKVCache); kvchat's quantized rotating and chunked caches load with our loader
only. Our
loader reads the same file into our classes through `from_state(state)`, then restores
each layer's `extras` (what mlx-lm's state has no place for: a trimmed ring's lowest
valid position, a padded head_dim) from the metadata. Writes are atomic: a temporary
file in the same folder (made 0600 before MLX writes into it), renamed over the old one.
A checksum of the arrays and the header
(cache_integrity.py) is sealed into the header and verified before anything is trusted.
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

from kvchat.model.errors import one_line

from .integrity import CHECKSUM_KEY, seal, verify
from .kv import (
    CacheError,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    QuantizedRotatingKVCache,
    RotatingKVCache,
)

# ChunkedKVCache (Llama 4's chunked layers) is kvchat's ring of one chunk: mlx-lm's class
# of that name keeps another state, so such a file is for kvchat's loader only
CLASSES: dict[str, type] = {
    c.__name__: c
    for c in (KVCache, RotatingKVCache, QuantizedKVCache, QuantizedRotatingKVCache,
              ChunkedKVCache)
}
EXTRAS_KEY = "kvchat_extras"  # no dots: tree_unflatten splits keys at dots
LEGACY_KEY = "kvchat_meta_state"  # files before the mlx-lm 0.32 protocol
FILE_MODE = 0o600


def savable(caches: list[Any]) -> bool:
    """Whether save_cache can write these layers (our classes, none empty)."""
    return bool(caches) and all(
        type(c).__name__ in CLASSES and type(c) is CLASSES[type(c).__name__] and not c.empty()
        for c in caches
    )


def _encode_scalar(key: str, value: Any, scalars: list[Any]) -> mx.array:
    """As save_prompt_cache: a scalar becomes an array listed in the metadata."""
    if isinstance(value, mx.array):
        return value
    if isinstance(value, (bool, int, float)):
        scalars.append((key, "scalar"))
        return mx.array(value)
    if value is None:
        scalars.append((key, "none"))
        return mx.array([])
    raise CacheError(f"cannot save a cache state value of type {type(value).__name__}")


def _decode_scalars(arrays: dict[str, Any], scalars: list[Any]) -> None:
    for key, kind in scalars[1:]:
        if kind == "scalar":
            arrays[key] = arrays[key].item()
        elif kind == "none":
            arrays[key] = None
        elif kind == "string":
            arrays[key] = "".join(chr(i) for i in arrays[key].tolist())
        else:
            raise ValueError(f"unknown scalar kind {kind!r}")


def save_cache(path: str | Path, caches: list[Any], metadata: dict[str, str]) -> int:
    """Write `caches` (+ string `metadata`) to `path` atomically; returns bytes written."""
    path = Path(path)
    names = [type(c).__name__ for c in caches]
    if not savable(caches):
        raise CacheError("only non-empty kvchat K/V cache layers can be saved")
    scalars: list[Any] = [""]  # as mlx-lm: non-empty, else tree_flatten drops it
    arrays = {
        key: _encode_scalar(key, value, scalars)
        for key, value in tree_flatten([c.state for c in caches])
    }
    extras = [{name: getattr(c, name) for name in c.extras} for c in caches]
    meta = {**metadata, EXTRAS_KEY: json.dumps(extras)}
    header = seal(arrays, dict(tree_flatten([meta, names, scalars])), f"0.{CHECKSUM_KEY}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{secrets.token_hex(3)}.tmp.safetensors")
    try:
        # private from its first byte, as the chat it caches (K/V are the conversation in
        # another form): MLX writes into the file made here and keeps its mode
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0),
                         FILE_MODE))
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
        meta, names, scalars = tree_unflatten(list(header.items()))
        meta.pop(CHECKSUM_KEY, None)
        if LEGACY_KEY in meta:  # (offset, keep, max_size, idx, lo): lo was the extra
            legacy = json.loads(meta.pop(LEGACY_KEY))
            extras = [{"_lo": int(m[4])} if len(m) == 5 else {} for m in legacy]
        else:
            extras = json.loads(meta.pop(EXTRAS_KEY))
        _decode_scalars(arrays, scalars)
        layers = tree_unflatten(list(arrays.items()))
        caches = []
        for name, state, extra in zip(names, layers, extras, strict=True):
            cache = CLASSES[name].from_state(tuple(state))
            for attr, value in extra.items():
                if attr not in cache.extras:
                    raise ValueError(f"unexpected {attr!r} for {name}")
                setattr(cache, attr, value)
            caches.append(cache)
    except CacheError as e:
        raise CacheError(f"K/V cache file {path.name}: {e}") from None
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, IndexError,
            AssertionError) as e:
        raise CacheError(f"unreadable K/V cache file {path.name}: {one_line(e)}") from None
    return caches, meta
