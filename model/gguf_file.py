"""The GGUF container (llama.cpp's single-file format), read defensively; no MLX.

A GGUF file is a header (magic, version, counts), typed key/value metadata, a table of
tensors (name, dims, ggml type, offset) and the aligned tensor data. Everything in it
is untrusted: this parser (not `gguf.GGUFReader`, which believes the counts it reads)
checks, before any tensor is read, that

- the counts are bounded (tensors, key/value pairs, array items, dims) and every string,
  array and table entry claimed fits in the bytes the file has left, so a header that
  claims a terabyte is refused without allocating it;
- every tensor has a known type, a shape that type can hold (whole blocks per row), an
  aligned offset, and exactly `type_size × blocks` bytes inside the data section.

Values come back as Python objects (numeric arrays as numpy arrays). Parsed files are
cached by path and (size, mtime, inode), so the config, the tokenizer and the weights
read one parse. Tensor bytes are read later, by `tensor_bytes`, from a fresh map of the
file that must still be the one parsed.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ModelLoadError
from .files import NotRegularFile, open_regular, shown_path

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # version 1 used 32-bit counts; llama.cpp dropped it long ago
DEFAULT_ALIGNMENT = 32

# Far above any real file (the largest MoE files hold a few thousand tensors, fifty-odd
# keys, a 262k-token vocabulary, templates of tens of kB), far below what would hang.
MAX_TENSORS = 65_536
MAX_KV = 16_384
MAX_ARRAY = 1 << 22  # items in one metadata array
MAX_STRING = 16 << 20  # bytes of one metadata string
MAX_NAME = 256  # bytes of a key or a tensor name (ggml's own limit is 64)
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 2  # arrays of arrays: at most this deep
MAX_ALIGNMENT = 1 << 16

_CACHED = 4  # parsed files kept (each holds its vocabulary as Python strings)

# ggml tensor types this code names (ggml.h's `enum ggml_type`, fixed by the file format);
# the rest are looked up in the gguf package, imported when a file is parsed
F32, F16, Q4_0, Q4_1, Q8_0, I8, I16, I32, I64, F64, BF16 = 0, 1, 2, 3, 8, 24, 25, 26, 27, 28, 30


class GGUFError(ModelLoadError):
    """A GGUF file that is not one, or that claims what it does not hold; one line."""


# metadata value types (gguf's GGUFValueType): struct format and item size
_SCALARS: dict[int, tuple[str, int]] = {
    0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
    6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8),
}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
          10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class GGUFTensor:
    """One entry of the tensor table. `shape` is numpy's order (ggml's `ne` reversed:
    rows first), so a Linear weight reads (out, in) as in a Hugging Face checkpoint."""

    name: str
    shape: tuple[int, ...]
    type: int  # a GGMLQuantizationType value
    offset: int  # absolute, in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        from gguf.constants import GGMLQuantizationType

        return GGMLQuantizationType(self.type).name

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (the last axis), whole blocks."""
        return self.nbytes // (self.n_elements // self.shape[-1])


@dataclass
class GGUFFile:
    """A parsed, checked GGUF file: metadata and tensor table (no tensor data)."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]
    data_offset: int
    size: int
    stamp: tuple[int, int, int] = field(repr=False)  # (size, mtime_ns, inode) when parsed

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        return arch if isinstance(arch, str) and arch else "unknown"

    @property
    def file_type(self) -> str:
        """llama.cpp's name for the file's quantization mix: "Q4_K_M", "Q8_0", "F16"
        (from `general.file_type`, else the type most of the matrices' bytes have)."""
        from gguf.constants import LlamaFileType

        ftype = self.metadata.get("general.file_type")
        if isinstance(ftype, int) and not isinstance(ftype, bool):
            try:
                label = LlamaFileType(ftype).name.partition("_")[2]  # MOSTLY_Q4_K_M
            except ValueError:
                label = ""
            if label:
                return label
        by_type: dict[str, int] = {}
        for t in self.tensors.values():
            if len(t.shape) >= 2:
                by_type[t.type_name] = by_type.get(t.type_name, 0) + t.nbytes
        return max(by_type, key=lambda k: by_type[k]) if by_type else "F32"


def is_gguf(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a regular file that starts with the GGUF magic (an Ollama blob
    has no .gguf suffix). Never raises, never blocks on a FIFO."""
    try:
        if not os.path.isfile(path):
            return False
        with open_regular(path) as f:
            return f.read(4) == MAGIC
    except (OSError, NotRegularFile, ValueError):
        return False


class _Reader:
    """Bounded little-endian reads from the mapped file: every claim is checked against
    the bytes left before anything is allocated."""

    def __init__(self, buf: mmap.mmap | bytes, name: str) -> None:
        self.buf, self.pos, self.end, self.name = buf, 0, len(buf), name

    def fail(self, why: str) -> GGUFError:
        return GGUFError(f"bad GGUF file {self.name}: {why}")

    def need(self, n: int, what: str) -> None:
        if n < 0 or n > self.end - self.pos:
            raise self.fail(f"{what} needs {n:,} bytes, the file has {self.end - self.pos:,}"
                            " left (truncated or corrupt)")

    def scalar(self, vtype: int, what: str) -> Any:
        fmt, size = _SCALARS[vtype]
        self.need(size, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def u32(self, what: str) -> int:
        return int(self.scalar(4, what))

    def u64(self, what: str) -> int:
        return int(self.scalar(10, what))

    def string(self, what: str, limit: int = MAX_STRING) -> str:
        n = self.u64(what)
        if n > limit:
            raise self.fail(f"{what} claims {n:,} bytes, over the {limit:,}-byte limit")
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return raw.decode("utf-8", "replace")

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            return self.scalar(vtype, what)
        if vtype == _STRING:
            return self.string(what)
        if vtype != _ARRAY:
            raise self.fail(f"{what} has unknown value type {vtype}")
        if depth >= MAX_ARRAY_DEPTH:
            raise self.fail(f"{what} nests arrays deeper than {MAX_ARRAY_DEPTH}")
        itype = self.u32(what)
        count = self.u64(what)
        if count > MAX_ARRAY:
            raise self.fail(f"{what} claims {count:,} items, over the {MAX_ARRAY:,} limit")
        if itype in _SCALARS:
            size = _SCALARS[itype][1]
            self.need(count * size, what)
            arr = np.frombuffer(self.buf, dtype=_NUMPY[itype], count=count,
                                offset=self.pos).copy()
            self.pos += count * size
            return arr
        if itype not in (_STRING, _ARRAY):
            raise self.fail(f"{what} has an array of unknown value type {itype}")
        # each item takes at least 8 bytes (its length): a claim the file cannot hold
        # is refused before the loop
        self.need(count * 8, what)
        if itype == _STRING:
            return self.strings(count, what)
        return [self.value(itype, what, depth + 1) for _ in range(count)]

    def strings(self, count: int, what: str) -> list[str]:
        """`count` strings (a vocabulary: hundreds of thousands), in one tight loop."""
        buf, pos, end = self.buf, self.pos, self.end
        length = _U64.unpack_from
        out = []
        append = out.append
        for _ in range(count):
            if end - pos < 8:
                raise self.fail(f"{what} is cut short (truncated)")
            (n,) = length(buf, pos)
            pos += 8
            if n > MAX_STRING or n > end - pos:
                raise self.fail(f"{what} claims a string of {n:,} bytes; the file has"
                                f" {end - pos:,} left")
            append(buf[pos:pos + n].decode("utf-8", "replace"))
            pos += n
        self.pos = pos
        return out


def _parse(buf: mmap.mmap | bytes, path: Path, stamp: tuple[int, int, int]) -> GGUFFile:
    name = shown_path(path.name)
    r = _Reader(buf, name)
    r.need(4, "the magic")
    if bytes(buf[:4]) != MAGIC:
        raise GGUFError(f"{name} is not a GGUF file (it does not start with 'GGUF')")
    r.pos = 4
    version = r.u32("the version")
    if version not in VERSIONS:
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        if swapped in VERSIONS:
            raise GGUFError(f"{name} is a big-endian GGUF file; kvchat reads little-endian"
                            " ones (convert it with llama.cpp's gguf tools)")
        raise GGUFError(f"{name}: GGUF version {version} is not supported (2 and 3 are)")
    n_tensors = r.u64("the tensor count")
    n_kv = r.u64("the metadata count")
    if n_tensors > MAX_TENSORS:
        raise r.fail(f"it claims {n_tensors:,} tensors, over the {MAX_TENSORS:,} limit")
    if n_kv > MAX_KV:
        raise r.fail(f"it claims {n_kv:,} metadata entries, over the {MAX_KV:,} limit")

    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = r.string(f"metadata key {i}", MAX_NAME)
        vtype = r.u32(f"metadata {key!r}")
        if key in metadata:
            raise r.fail(f"metadata key {key!r} appears twice")
        metadata[key] = r.value(vtype, f"metadata {key!r}")

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if (not isinstance(alignment, int) or isinstance(alignment, bool) or alignment < 1
            or alignment > MAX_ALIGNMENT or alignment & (alignment - 1)):
        raise r.fail(f"general.alignment {alignment!r:.20} is not a power of two up to"
                     f" {MAX_ALIGNMENT}")

    table: list[tuple[str, tuple[int, ...], int, int]] = []
    names: set[str] = set()
    for i in range(n_tensors):
        tname = r.string(f"tensor {i}'s name", MAX_NAME)
        what = f"tensor {tname!r}"
        if tname in names:
            raise r.fail(f"{what} appears twice")
        names.add(tname)
        n_dims = r.u32(what)
        if not 1 <= n_dims <= MAX_DIMS:
            raise r.fail(f"{what} has {n_dims} dimensions (1 to {MAX_DIMS} are possible)")
        ne = [r.u64(what) for _ in range(n_dims)]
        ttype = r.u32(what)
        offset = r.u64(what)
        table.append((tname, tuple(ne), ttype, offset))

    data_offset = -(-r.pos // alignment) * alignment
    data_size = r.end - data_offset
    if data_size < 0:
        raise r.fail("the tensor data section is missing (truncated)")
    tensors: dict[str, GGUFTensor] = {}
    for tname, ne, ttype, offset in table:
        tensors[tname] = _check_tensor(r, tname, ne, ttype, offset, alignment, data_size,
                                       data_offset)
    return GGUFFile(path=path, version=version, metadata=metadata, tensors=tensors,
                    data_offset=data_offset, size=r.end, stamp=stamp)


def _check_tensor(r: _Reader, name: str, ne: tuple[int, ...], ttype: int, offset: int,
                  alignment: int, data_size: int, data_offset: int) -> GGUFTensor:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    what = f"tensor {name!r}"
    try:
        qtype = GGMLQuantizationType(ttype)
    except ValueError:
        raise r.fail(f"{what} has unknown tensor type {ttype}") from None
    if qtype not in GGML_QUANT_SIZES:
        raise r.fail(f"{what} has tensor type {qtype.name}, whose block size is unknown")
    block, type_size = GGML_QUANT_SIZES[qtype]
    if any(d < 1 for d in ne):
        raise r.fail(f"{what} has an empty dimension {list(ne)}")
    n = 1
    for d in ne:
        n *= d
    if ne[0] % block:
        raise r.fail(f"{what}: a {qtype.name} row holds whole blocks of {block}, and"
                     f" {ne[0]:,} is not a multiple of it")
    nbytes = n // block * type_size
    if offset % alignment:
        raise r.fail(f"{what} starts at offset {offset:,}, not a multiple of the"
                     f" alignment {alignment}")
    if offset > data_size or nbytes > data_size - offset:
        raise r.fail(f"{what} ({qtype.name} {list(reversed(ne))}) claims {nbytes:,} bytes at"
                     f" offset {offset:,}; the data section holds {data_size:,}"
                     " (truncated or corrupt)")
    return GGUFTensor(name, tuple(reversed(ne)), int(qtype), data_offset + offset, nbytes)


_cache: OrderedDict[str, GGUFFile] = OrderedDict()
_lock = threading.Lock()


def _stamp(st: os.stat_result) -> tuple[int, int, int]:
    return (st.st_size, st.st_mtime_ns, st.st_ino)


@contextmanager
def _mapped(path: Path) -> Iterator[tuple[mmap.mmap | bytes, tuple[int, int, int]]]:
    """The file mapped read-only (a regular file only), with its stamp."""
    try:
        f = open_regular(path)
    except NotRegularFile as e:
        raise GGUFError(str(e)) from None
    except OSError as e:
        raise GGUFError(f"cannot read {shown_path(path)}: {e.strerror or e}") from None
    with f:
        st = os.fstat(f.fileno())
        if st.st_size == 0:
            yield b"", _stamp(st)
            return
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise GGUFError(f"cannot map {shown_path(path.name)}: {e}") from None
    try:
        yield buf, _stamp(st)
    finally:
        try:
            buf.close()
        except BufferError:  # an array still views it: the map goes with the last one
            pass


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Parse and check `path` (GGUFError, one line, when it is not a sound GGUF file)."""
    p = Path(path).expanduser()
    key = str(p.resolve())
    try:
        stamp = _stamp(p.stat())
    except OSError as e:
        raise GGUFError(f"cannot read {shown_path(p)}: {e.strerror or e}") from None
    with _lock:
        hit = _cache.get(key)
        if hit is not None and hit.stamp == stamp:
            _cache.move_to_end(key)
            return hit
    with _mapped(p) as (buf, stamp):
        parsed = _parse(buf, p, stamp)
    with _lock:
        _cache[key] = parsed
        while len(_cache) > _CACHED:
            _cache.popitem(last=False)
    return parsed


@contextmanager
def tensor_data(gf: GGUFFile) -> Iterator[Any]:
    """`get(tensor) -> np.ndarray` of its raw bytes, (*shape[:-1], row_bytes) uint8,
    from the file as parsed (GGUFError if it changed since). The arrays view the map:
    copy what must outlive the block."""
    with _mapped(gf.path) as (buf, stamp):
        if stamp != gf.stamp:
            raise GGUFError(f"{shown_path(gf.path.name)} changed while it was being read;"
                            " load it again")

        def get(t: GGUFTensor) -> np.ndarray:
            raw = np.frombuffer(buf, dtype=np.uint8, count=t.nbytes, offset=t.offset)
            return raw.reshape(*t.shape[:-1], t.row_bytes)

        yield get


__all__ = ["BF16", "F16", "F32", "F64", "I8", "I16", "I32", "I64", "Q4_0", "Q4_1", "Q8_0",
           "GGUFError", "GGUFFile", "GGUFTensor", "MAX_ARRAY", "MAX_KV", "MAX_STRING",
           "MAX_TENSORS", "is_gguf", "read_gguf", "tensor_data"]
