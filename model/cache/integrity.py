"""Whether a saved K/V cache may be used: it must be provably this model's and intact.

Three checks, each one line when it fails (the caller then prefills the history again):

- a fingerprint of the model folder (each weight file's name, size, mtime, safetensors
  header and three 4 KiB samples of its data; config, tokenizer and template files
  whole; a GGUF file's first 64 MiB and two samples), computed in milliseconds and
  cached per folder until a file's size or mtime changes: weights replaced in place give
  another fingerprint;
- a sha256 over the file's arrays (name, dtype, shape, bytes) and its string metadata
  (token ids, offsets, bound), stored in the metadata: a flipped bit, a NaN, zeros, an
  int32 copy or a moved offset no longer match;
- the layers against the model: count, dtype, K/V shapes (heads, head size), offsets
  against the token ids, ids inside the vocabulary, finite values.

Self-contained (save_cache/load_cache call `seal` and `verify`; the engine calls
`model_fingerprint` and `check_layers`), so the file's layout can change around it.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from typing import Any

import mlx.core as mx

from .kv import QUANTIZED, CacheError, parts

CHECKSUM_KEY = "kvchat_checksum"
SAMPLE = 4096
WHOLE = 64 * 1024 * 1024  # bytes of a file hashed from its start (text files: all)
# what a model folder holds besides weights that changes what the cache means
TEXT_FILES = ("config.json", "tokenizer.json", "tokenizer.model", "tokenizer_config.json",
              "special_tokens_map.json", "generation_config.json", "chat_template.jinja",
              "chat_template.json", "vocab.json", "merges.txt", "tokenizer.tiktoken")

_fingerprints: dict[str, tuple[tuple[Any, ...], str]] = {}
_lock = threading.Lock()


def _stat_key(files: list[Path]) -> tuple[Any, ...]:
    out = []
    for f in files:
        try:
            st = f.stat()
            out.append((f.name, st.st_size, st.st_mtime_ns, st.st_ino))
        except OSError:
            out.append((f.name, None))
    return tuple(out)


def model_fingerprint(folder: str | os.PathLike[str]) -> str:
    """A hex digest that changes whenever the model's weights, config or tokenizer do;
    "" for a folder with none of them (a scripted model in tests)."""
    folder = Path(folder)
    if folder.is_file():  # a GGUF file: weights, config and tokenizer in one
        files = [folder]
    else:
        try:
            weights = sorted(folder.glob("*.safetensors"))
        except OSError:
            weights = []
        files = weights + [folder / n for n in TEXT_FILES if (folder / n).is_file()]
    if not files:
        return ""
    key = _stat_key(files)
    with _lock:
        hit = _fingerprints.get(str(folder.resolve()))
    if hit and hit[0] == key:
        return hit[1]
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode("utf-8", "surrogateescape") + b"\0")
        try:
            with open(f, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                h.update(str(size).encode() + b"\0")
                if f.suffix == ".safetensors":
                    head = fh.read(8)
                    # a header length past the file's end (a file changed since it
                    # loaded) must not reach seek(), which overflows past 2**63
                    n = min(int.from_bytes(head, "little"), size) if len(head) == 8 else 0
                    h.update(head + fh.read(min(n, 100 * 1024 * 1024)))
                    for at in (8 + n, (8 + n + size) // 2, max(8 + n, size - SAMPLE)):
                        fh.seek(at)
                        h.update(fh.read(SAMPLE))
                else:  # text files whole; a GGUF file's metadata, then samples
                    h.update(fh.read(WHOLE))
                    for at in (size // 2, size - SAMPLE) if size > WHOLE else ():
                        fh.seek(at)
                        h.update(fh.read(SAMPLE))
        except OSError as e:
            h.update(f"unreadable {e.errno}".encode())
    digest = h.hexdigest()
    with _lock:
        _fingerprints[str(folder.resolve())] = (key, digest)
    return digest


def checksum(arrays: dict[str, mx.array], header: dict[str, str]) -> str:
    """sha256 over every array (name, dtype, shape, bytes) and every header string but
    the checksum itself, in name order."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = mx.contiguous(arrays[name])
        mx.eval(a)
        h.update(f"{name}\0{a.dtype}\0{tuple(a.shape)}\0".encode())
        h.update(memoryview(a).cast("B"))
    for name in sorted(header):
        if not name.endswith(CHECKSUM_KEY):
            h.update(f"{name}\0{header[name]}\0".encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def seal(arrays: dict[str, mx.array], header: dict[str, str], key: str = CHECKSUM_KEY
         ) -> dict[str, str]:
    """`header` with the checksum of the arrays and header added under `key`."""
    return {**header, key: checksum(arrays, header)}


def verify(arrays: dict[str, mx.array], header: dict[str, str]) -> None:
    """CacheError (one line) unless the header's checksum matches the arrays and header."""
    stored = [v for k, v in header.items() if k.endswith(CHECKSUM_KEY)]
    if len(stored) != 1:
        raise CacheError("it has no checksum (saved by an older kvchat)")
    if stored[0] != checksum(arrays, header):
        raise CacheError("its checksum does not match: the file is damaged")


def check_layers(caches: list[Any], ids: list[int], expected: list[Any], *, n_kv_heads: int,
                 head_dim: int | None, dtype: str | None, vocab_size: int) -> None:
    """CacheError (one line) unless every layer fits the model and the token ids;
    `expected` is the model's own fresh cache for the chat's bound (kinds and rings)."""
    if len(caches) != len(expected):
        raise CacheError(f"it has {len(caches)} layers, the model {len(expected)}")
    if not all(isinstance(i, int) and 0 <= i < vocab_size for i in ids):
        raise CacheError("its token ids are outside the model's vocabulary")
    for i, (c, e) in enumerate(zip(caches, expected, strict=True)):
        if c.keys is None or c.values is None:
            raise CacheError(f"layer {i} holds no 4-D keys and values")
        # a quantized layer's parts: packed rows, then scales and biases in the float dtype
        kp, vp = parts(c.keys), parts(c.values)
        k, v = kp[0], vp[0]
        if any(p.ndim != 4 for p in (*kp, *vp)):
            raise CacheError(f"layer {i} holds no 4-D keys and values")
        width = c.head_dim if getattr(c, "quant", None) is not None else k.shape[3]
        if k.shape[:3] != v.shape[:3] or k.shape[0] != 1 or k.shape[1] != n_kv_heads or (
                head_dim is not None and width != head_dim):
            raise CacheError(f"layer {i} has keys {tuple(k.shape)} / values {tuple(v.shape)},"
                             f" not (1, {n_kv_heads}, tokens, {head_dim})")
        floats = (kp[1:], vp[1:]) if len(kp) > 1 else (kp, vp)
        got = str(floats[0][0].dtype).removeprefix("mlx.core.")
        if dtype is not None and (got != dtype or floats[1][0].dtype != floats[0][0].dtype):
            raise CacheError(f"layer {i} is {got}, the model computes in {dtype}")
        if c.offset != len(ids):
            raise CacheError(f"layer {i} says {c.offset} tokens, the chat has {len(ids)}")
        # --quantized-kv-start: a float layer may have become its quantized twin
        if type(c) is not type(e) and QUANTIZED.get(type(e)) is not type(c):
            raise CacheError(f"layer {i} is a {type(c).__name__}, the model makes a"
                             f" {type(e).__name__}")
        rotating = hasattr(e, "max_size")
        if not rotating and k.shape[2] != c.offset:
            raise CacheError(f"layer {i} holds {k.shape[2]} tokens at offset {c.offset}")
        if rotating and ((c.max_size, c.keep) != (e.max_size, e.keep)
                         or k.shape[2] > min(c.max_size, c.offset)):
            raise CacheError(f"layer {i}'s ring does not match the cache bound")
        if not all(mx.all(mx.isfinite(p)).item() for p in (*floats[0], *floats[1])):
            raise CacheError(f"layer {i} holds values that are not finite")
