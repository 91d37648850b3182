"""Whether a saved K/V cache may be used: it must be provably this model's and intact.

Three checks, each one line when it fails (the caller then prefills the history again):

- a fingerprint of the model (folder or GGUF file): a sha256 of every byte of each weight, config,
  tokenizer and template file, streamed in 1 MiB reads; each file's digest is kept in
  memory by (real path, size, mtime, ctime, inode), so opening the same files again costs
  a stat each, and any change to a byte of them (a tensor negated in place) gives another
  fingerprint. The first computation reads the weights once (seconds for gigabytes: the
  engine starts it in the background as a model loads, `warm_fingerprint`);
- a sha256 over the file's arrays (name, dtype, shape, bytes) and its string metadata
  (token ids, offsets, bound), stored in the metadata: a flipped bit, a NaN, zeros, an
  int32 copy or a moved offset no longer match;
- the layers against the model: count, kind, every part of K and V (shape and dtype; a
  quantized layer's packed rows, scales and biases, its bits and group), offsets against
  the token ids, ring bounds (size, sinks, one slot per resident token, a lowest valid
  position kvchat could have written), ids inside the vocabulary, finite values; a
  recurrent layer's conv and recurrent state (shape and dtype from the model's mixer; a
  layer that keeps both, hybrid.py, each part as its own kind), and each saved
  checkpoint of them (its token inside the chat, in order, every recurrent layer once,
  the same shapes, finite).

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

from kvchat.model.decoder.kv_format import KVQuant
from kvchat.model.decoder.kv_quant import Packed
from kvchat.model.errors import KVChatError
from kvchat.model.files import open_regular

from .checkpoints import stateful
from .hybrid import HybridCache
from .kv import QUANTIZED, CacheError, parts
from .kv_math import KVWidths
from .state import PassCache, StateCache

CHECKSUM_KEY = "kvchat_checksum"
READ_CHUNK = 1 << 20
# what a model folder holds besides weights that changes what the cache means
TEXT_FILES = ("config.json", "tokenizer.json", "tokenizer.model", "tokenizer_config.json",
              "special_tokens_map.json", "generation_config.json", "chat_template.jinja",
              "chat_template.json", "vocab.json", "merges.txt", "tokenizer.tiktoken")

# real path -> ((size, mtime_ns, ctime_ns, inode), sha256 hex) of a file hashed whole
_digests: dict[str, tuple[tuple[int, ...], str]] = {}
_hashing: dict[str, threading.Lock] = {}  # one reader per file; others wait for its digest
_lock = threading.Lock()


def _identity(st: os.stat_result) -> tuple[int, ...]:
    # ctime too: a write in place that sets mtime back still moves it
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


def file_digest(path: str | os.PathLike[str]) -> str:
    """sha256 of every byte of a regular file, read in 1 MiB chunks; cached by (real path,
    size, mtime, ctime, inode). OSError / NotRegularFile pass through."""
    real = os.path.realpath(path)
    with _lock:
        gate = _hashing.setdefault(real, threading.Lock())
    with gate:  # a second caller (the engine, while the warm-up reads) waits for the first
        with open_regular(real) as f:
            before = _identity(os.fstat(f.fileno()))
            with _lock:
                hit = _digests.get(real)
            if hit is not None and hit[0] == before:
                return hit[1]
            h = hashlib.sha256()
            buf = bytearray(READ_CHUNK)
            view = memoryview(buf)
            while n := f.readinto(buf):
                h.update(view[:n])
            after = _identity(os.fstat(f.fileno()))
        digest = h.hexdigest()
        if after == before:  # a file written while it was read is hashed again next time
            with _lock:
                _digests[real] = (before, digest)
        return digest


def model_fingerprint(folder: str | os.PathLike[str]) -> str:
    """A hex digest that changes whenever a byte of the model's weights, config or
    tokenizer does; "" for a folder with none of them (a scripted model in tests)."""
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
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode("utf-8", "surrogateescape") + b"\0")
        try:
            h.update(file_digest(f).encode())
        except OSError as e:
            h.update(f"unreadable {e.errno}".encode())
        except KVChatError:  # not a regular file
            h.update(b"not a regular file")
    return h.hexdigest()


def warm_fingerprint(folder: str | os.PathLike[str]) -> threading.Thread:
    """Compute `model_fingerprint(folder)` on a background thread (file reads and sha256
    let the GIL go), so the first save or restore of a chat's cache finds it done."""
    t = threading.Thread(target=model_fingerprint, args=(folder,), daemon=True,
                         name="kvchat-fingerprint")
    t.start()
    return t


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


def _layout(width: int, heads: int, tokens: int, dtype: str, q: KVQuant | None
            ) -> list[tuple[tuple[int, ...], str]]:
    """The (shape, dtype) of each part of one K or V buffer the model would write: the
    floats, or the packed rows (uint32) with a scale and a bias per group (the dtype)."""
    if q is None:
        return [((1, heads, tokens, width), dtype)]
    p = Packed.of(q, width)
    groups = (1, heads, tokens, p.dim // p.group_size)
    return [((1, heads, tokens, p.dim * p.bits // 32), "uint32"), (groups, dtype),
            (groups, dtype)]


def _dtype(a: mx.array) -> str:
    return str(a.dtype).removeprefix("mlx.core.")


def _check_ring(i: int, c: Any, e: Any, tokens: int) -> None:
    """A rotating layer's bounds as kvchat writes them: the model's size and sinks, every
    resident slot present, and a lowest valid position between the sinks and the newest
    token that leaves the window at most one token short (an exact trim's only trace)."""
    if (c.max_size, c.keep) != (e.max_size, e.keep):
        raise CacheError(f"layer {i}'s ring ({c.max_size} slots, keep {c.keep}) is not the"
                         f" cache bound's ({e.max_size}, keep {e.keep})")
    if tokens != min(c.offset, c.max_size):
        raise CacheError(f"layer {i}'s ring holds {tokens} slots for {c.offset} tokens"
                         f" (it needs {min(c.offset, c.max_size)})")
    lo = c._lo
    if not (isinstance(lo, int) and not isinstance(lo, bool) and c.keep <= lo <= c.offset
            and c._ring_lo(c.offset) <= max(c.keep, c.offset - c._ring + 1)):
        raise CacheError(f"layer {i}'s lowest ring position {lo!r} is impossible for"
                         f" {c.offset} tokens in a ring of {c.max_size} (keep {c.keep})")


def state_layout(mixer: Any, dtype: str) -> list[tuple[tuple[int, ...], str] | None]:
    """The (shape, dtype) of a recurrent layer's conv and recurrent state for one
    sequence: the conv state at the compute dtype, the recurrent one in float32 (None:
    the mixer has no recurrent state, LFM2's short convolution)."""
    conv, *recurrent = mixer.state_shapes()
    return [((1, *conv), dtype), *(((1, *r), "float32") for r in recurrent),
            *([None] if not recurrent else [])]


def _check_state(where: str, arrays: tuple[Any, ...], offset: Any, tokens: int, mixer: Any,
                 dtype: str | None) -> None:
    """One recurrent layer's state (or a checkpoint of it) as the model writes it after
    `tokens` tokens: each part's shape and dtype, finite, its offset."""
    if not isinstance(offset, int) or isinstance(offset, bool) or offset != tokens:
        raise CacheError(f"{where} says {offset!r} tokens, it should hold {tokens}")
    if mixer is None:
        raise CacheError(f"{where} holds a recurrent state; the model has no recurrent layer")
    conv_dtype = dtype or (_dtype(arrays[0]) if arrays[0] is not None else "float32")
    want = state_layout(mixer, conv_dtype)
    have = [None if a is None else (tuple(a.shape), _dtype(a)) for a in arrays]
    if have != want:
        raise CacheError(f"{where}'s state is {_describe_state(have)}, the model's"
                         f" {_describe_state(want)}")
    if not all(mx.all(mx.isfinite(a)).item() for a in arrays if a is not None):
        raise CacheError(f"{where} holds values that are not finite")


def _describe_state(layout: list[tuple[tuple[int, ...], str] | None]) -> str:
    return " + ".join(f"{x[1]} {x[0]}" for x in layout if x is not None) or "nothing"


def check_layers(caches: list[Any], ids: list[int], expected: list[Any], *,
                 widths: KVWidths, dtype: str | None, vocab_size: int,
                 mixer: Any = None) -> None:
    """CacheError (one line) unless every layer is what the model would have written for
    these token ids: `expected` is the model's own fresh cache for the chat's bound (kinds,
    rings, quantization), `widths` its K/V heads and features, `dtype` its compute dtype,
    `mixer` its recurrent layers' sizes (decoder/state_config.py). Every part of K and V
    is checked (shape and dtype, a quantized layer's scales and biases too), the offsets,
    the ring bounds, a recurrent layer's state, and that the floats are finite."""
    if len(caches) != len(expected):
        raise CacheError(f"it has {len(caches)} layers, the model {len(expected)}")
    if not all(isinstance(i, int) and 0 <= i < vocab_size for i in ids):
        raise CacheError("its token ids are outside the model's vocabulary")
    for i, (layer, model_layer) in enumerate(zip(caches, expected, strict=True)):
        # a layer of K/V beside a state (hybrid.py): each part checked as its own kind
        both = isinstance(layer, HybridCache) and isinstance(model_layer, HybridCache)
        for c, e in zip(layer.members, model_layer.members, strict=True) if both else [
                (layer, model_layer)]:
            _check_layer(i, c, e, ids, widths, dtype, mixer)


def _check_layer(i: int, c: Any, e: Any, ids: list[int], widths: KVWidths, dtype: str | None,
                 mixer: Any) -> None:
    """`check_layers` for one cache of layer `i` (`e`: the model's fresh one)."""
    # --quantized-kv-start: a float layer may have become its quantized twin
    if type(c) is not type(e) and QUANTIZED.get(type(e)) is not type(c):
        raise CacheError(f"layer {i} is a {type(c).__name__}, the model makes a"
                         f" {type(e).__name__}")
    if isinstance(c, PassCache):  # no mixer: only its count of tokens
        if c.conv is not None or c.recurrent is not None or c.offset != len(ids):
            raise CacheError(f"layer {i} (no token mixer) holds a state or says"
                             f" {c.offset!r} tokens for {len(ids)}")
        return
    if isinstance(c, StateCache):
        _check_state(f"layer {i}", (c.conv, c.recurrent), c.offset, len(ids), mixer,
                     dtype)
        return
    if c.keys is None or c.values is None:
        raise CacheError(f"layer {i} holds no keys and values")
    if c.offset != len(ids):
        raise CacheError(f"layer {i} says {c.offset} tokens, the chat has {len(ids)}")
    q = None
    if getattr(c, "quant", None) is not None:
        q = getattr(e, "quant", None) or getattr(e, "pending_quant", None)
        if q is None or (c.bits, c.group_size, c.head_dim) != (
                q.bits, q.group_for(widths.k), widths.k):
            want = "float" if q is None else \
                f"{q.bits}-bit in groups of {q.group_for(widths.k)}, head_dim {widths.k}"
            raise CacheError(f"layer {i} is {c.bits}-bit in groups of {c.group_size},"
                             f" head_dim {c.head_dim}; the cache bound makes {want}")
    kp, vp = parts(c.keys), parts(c.values)
    tokens = kp[0].shape[2] if kp[0].ndim == 4 else -1
    for name, got, width in (("keys", kp, widths.k), ("values", vp, widths.v)):
        want = _layout(width, widths.heads, tokens, dtype or _dtype(got[-1]), q)
        have = [(tuple(a.shape), _dtype(a)) for a in got]
        if have != want:
            raise CacheError(f"layer {i}'s {name} are {_describe(have)}, the model's"
                             f" {_describe(want)}")
    if hasattr(e, "max_size"):
        _check_ring(i, c, e, tokens)
    elif tokens != c.offset:
        raise CacheError(f"layer {i} holds {tokens} tokens at offset {c.offset}")
    floats = (*kp[1:], *vp[1:]) if q is not None else (*kp, *vp)
    if not all(mx.all(mx.isfinite(p)).item() for p in floats):
        raise CacheError(f"layer {i} holds values that are not finite")


def _describe(layout: list[tuple[tuple[int, ...], str]]) -> str:
    return " + ".join(f"{dt} {shape}" for shape, dt in layout)


def check_checkpoints(checkpoints: list[Any], caches: list[Any], ids: list[int], *,
                      mixer: Any, dtype: str | None) -> None:
    """CacheError (one line) unless the saved checkpoints are what this model's recurrent
    layers would have held: each at a token inside the chat (after the first, before or
    at the last), in increasing order, with every recurrent layer of `caches` exactly
    once, each state shaped and typed as the model writes it and finite."""
    layers = stateful(caches)
    last = 0
    for j, cp in enumerate(checkpoints):
        where = f"checkpoint {j}"
        if not (isinstance(cp.at, int) and last < cp.at <= len(ids)):
            raise CacheError(f"{where} is at token {cp.at!r}, outside the chat's"
                             f" {len(ids)} tokens or out of order")
        last = cp.at
        if sorted(layer for layer, _ in cp.states) != layers or len(cp.states) != len(layers):
            raise CacheError(f"{where} holds other layers than the model's recurrent ones")
        for layer, snap in cp.states:
            _check_state(f"{where}'s layer {layer}", snap[:2], snap[2], cp.at, mixer, dtype)
