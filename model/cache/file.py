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

A hybrid model's recurrent layers save their state (`StateCache`: conv, recurrent,
offset; a mixer-less `PassCache` its offset), and a layer that keeps K/V beside a state
(`HybridCache`, hybrid.py) its parts' states, each part's class and extras in the
metadata (`members`), so such a file is for kvchat's loader only;
its checkpoints (checkpoints.py) ride beside the layers as arrays named
`kvchat_ckpt_<j>_<layer>_<part>`, listed in the metadata, all under the same checksum.
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

from .checkpoints import Checkpoint
from .hybrid import HybridCache
from .integrity import CHECKSUM_KEY, seal, verify
from .kv import (
    CacheError,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    QuantizedRotatingKVCache,
    RotatingKVCache,
)
from .state import PassCache, StateCache

# ChunkedKVCache (Llama 4's chunked layers) is kvchat's ring of one chunk: mlx-lm's class
# of that name keeps another state, so such a file is for kvchat's loader only
CLASSES: dict[str, type] = {
    c.__name__: c
    for c in (KVCache, RotatingKVCache, QuantizedKVCache, QuantizedRotatingKVCache,
              ChunkedKVCache, StateCache, PassCache, HybridCache)
}
MEMBERS_KEY = "members"  # a composite layer's extra: [class name, extras] of each part
EXTRAS_KEY = "kvchat_extras"  # no dots: tree_unflatten splits keys at dots
CHECKPOINTS_KEY = "kvchat_checkpoints"
CHECKPOINT_PREFIX = "kvchat_ckpt_"
STATE_PARTS = ("conv", "recurrent")
LEGACY_KEY = "kvchat_meta_state"  # files before the mlx-lm 0.32 protocol
FILE_MODE = 0o600


def savable(caches: list[Any]) -> bool:
    """Whether save_cache can write these layers (our classes, none empty; a composite
    layer's parts each)."""
    return bool(caches) and all(_savable(c) for c in caches)


def _savable(c: Any) -> bool:
    if type(c).__name__ not in CLASSES or type(c) is not CLASSES[type(c).__name__]:
        return False
    if hasattr(c, "members"):
        return all(_savable(m) and not hasattr(m, "members") for m in c.members)
    return not c.empty() or isinstance(c, PassCache)  # a PassCache holds no array


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


def _checkpoint_arrays(checkpoints: list[Checkpoint]) -> tuple[dict[str, mx.array], str]:
    """The checkpoints' arrays by name, and their listing for the metadata: per
    checkpoint its token and, per recurrent layer, which parts it holds."""
    arrays: dict[str, mx.array] = {}
    listing = []
    for j, cp in enumerate(checkpoints):
        layers = []
        for layer, snap in cp.states:
            held = [name for name, a in zip(STATE_PARTS, snap[:2], strict=True) if a is not None]
            for name, a in zip(STATE_PARTS, snap[:2], strict=True):
                if a is not None:
                    arrays[f"{CHECKPOINT_PREFIX}{j}_{layer}_{name}"] = a
            layers.append([layer, held])
        listing.append({"at": cp.at, "layers": layers})
    return arrays, json.dumps(listing)


def _read_checkpoints(arrays: dict[str, Any], listing: str | None) -> list[Checkpoint]:
    """The checkpoints `_checkpoint_arrays` wrote (their arrays leave `arrays`)."""
    mine = {k: arrays.pop(k) for k in [k for k in arrays if k.startswith(CHECKPOINT_PREFIX)]}
    out = []
    for j, entry in enumerate(json.loads(listing) if listing is not None else []):
        at = entry["at"]
        if not isinstance(at, int) or isinstance(at, bool):
            raise ValueError(f"checkpoint {j} has no token position")
        states = []
        for layer, held in entry["layers"]:
            if not isinstance(layer, int) or not set(held) <= set(STATE_PARTS):
                raise ValueError(f"checkpoint {j} lists an unknown layer or part")
            conv, rec = (mine.pop(f"{CHECKPOINT_PREFIX}{j}_{layer}_{name}") if name in held
                         else None for name in STATE_PARTS)
            states.append((layer, (conv, rec, at)))
        out.append(Checkpoint(at, tuple(states)))
    if mine:
        raise ValueError(f"{len(mine)} checkpoint arrays no checkpoint lists")
    return out


def _extras(c: Any) -> dict[str, Any]:
    """What a layer's state has no place for: its `extras`; a composite layer's parts'
    classes and extras (hybrid.py)."""
    if hasattr(c, "members"):
        return {MEMBERS_KEY: [[type(m).__name__, _extras(m)] for m in c.members]}
    return {name: getattr(c, name) for name in getattr(c, "extras", ())}


def _build(name: str, state: Any, extra: dict[str, Any]) -> Any:
    """One layer's cache from its saved state and extras (a composite's parts each)."""
    cls = CLASSES[name]
    if hasattr(cls, "from_members"):
        parts = extra.get(MEMBERS_KEY)
        if (not isinstance(parts, list) or not isinstance(state, list)
                or len(parts) != len(state)
                or any(hasattr(CLASSES[p[0]], "from_members") for p in parts)):
            raise ValueError(f"a {name} without its parts")
        return cls.from_members([_build(p[0], s, p[1]) for p, s in zip(parts, state,
                                                                        strict=True)])
    cache = cls.from_state(tuple(state))
    for attr, value in extra.items():
        if attr not in getattr(cache, "extras", ()):
            raise ValueError(f"unexpected {attr!r} for {name}")
        setattr(cache, attr, value)
    return cache


def save_cache(path: str | Path, caches: list[Any], metadata: dict[str, str],
               checkpoints: list[Checkpoint] | None = None) -> int:
    """Write `caches` (+ string `metadata`, + a hybrid model's `checkpoints`) to `path`
    atomically; returns bytes written."""
    path = Path(path)
    names = [type(c).__name__ for c in caches]
    if not savable(caches):
        raise CacheError("only non-empty kvchat K/V cache layers can be saved")
    scalars: list[Any] = [""]  # as mlx-lm: non-empty, else tree_flatten drops it
    arrays = {
        key: _encode_scalar(key, value, scalars)
        for key, value in tree_flatten([c.state for c in caches])
    }
    extras = [_extras(c) for c in caches]
    meta = {**metadata, EXTRAS_KEY: json.dumps(extras)}
    if checkpoints:
        more, meta[CHECKPOINTS_KEY] = _checkpoint_arrays(checkpoints)
        arrays.update(more)
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
    caches, meta, _ = load_cache_and_checkpoints(path)
    return caches, meta


def load_cache_and_checkpoints(path: str | Path
                               ) -> tuple[list[Any], dict[str, str], list[Checkpoint]]:
    """`load_cache`, with the checkpoints saved beside the layers (checked for their
    model by integrity.py's `check_checkpoints`, not here)."""
    path = Path(path)
    try:
        arrays, header = mx.load(str(path), return_metadata=True)
        verify(arrays, header)  # before any of it is trusted (cache_integrity.py)
        meta, names, scalars = tree_unflatten(list(header.items()))
        meta.pop(CHECKSUM_KEY, None)
        checkpoints = _read_checkpoints(arrays, meta.pop(CHECKPOINTS_KEY, None))
        if LEGACY_KEY in meta:  # (offset, keep, max_size, idx, lo): lo was the extra
            legacy = json.loads(meta.pop(LEGACY_KEY))
            extras = [{"_lo": int(m[4])} if len(m) == 5 else {} for m in legacy]
        else:
            extras = json.loads(meta.pop(EXTRAS_KEY))
        _decode_scalars(arrays, scalars)
        layers = tree_unflatten(list(arrays.items()))
        caches = []
        caches = [_build(name, state, extra)
                  for name, state, extra in zip(names, layers, extras, strict=True)]
    except CacheError as e:
        raise CacheError(f"K/V cache file {path.name}: {e}") from None
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, IndexError,
            AssertionError) as e:
        raise CacheError(f"unreadable K/V cache file {path.name}: {one_line(e)}") from None
    return caches, meta, checkpoints
