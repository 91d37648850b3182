"""Pure file helpers for model folders, no MLX (`kvchat inspect`, `kvchat models` and
discovery stay light): opening files from folders we do not control (regular files only,
sizes bounded), which safetensors files hold the weights and what their headers say.

A FIFO named ``model.safetensors`` or ``chat.json`` blocks a plain ``open()`` forever, a
device never ends, a directory fails with an obscure error. `open_regular` opens without
blocking (O_NONBLOCK), checks the opened descriptor is a regular file (no race between a
check and the open), then hands back an ordinary blocking file object.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from pathlib import Path
from typing import Any, BinaryIO

from .errors import KVChatError, ModelLoadError, one_line

PICKLE_PATTERNS = ("pytorch_model*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")

# text files a model folder or the app reads whole (configs, templates, chats): far above
# any real one (the biggest tokenizer.json files are tens of MB)
MAX_TEXT_BYTES = 256 * 1024 * 1024


class NotRegularFile(KVChatError):
    """A path that exists but is a FIFO, device, socket or directory."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """Open `path` for binary reading; NotRegularFile (one line) unless it is a regular
    file. OSError (FileNotFoundError, PermissionError) passes through for the caller."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(
                f"{Path(path).name} is not a regular file ({_kind(st.st_mode)});"
                " refusing to read it"
            )
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular_text(path: str | os.PathLike[str], limit: int = MAX_TEXT_BYTES) -> str:
    """The UTF-8 text of a regular file of at most `limit` bytes (NotRegularFile or
    KVChatError otherwise; OSError and UnicodeDecodeError pass through)."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise KVChatError(
                f"{Path(path).name} is {size:,} bytes, over the {limit:,}-byte limit"
            )
        return f.read(limit + 1).decode("utf-8")


# lone surrogates: valid in JSON escapes and in Python (bytes of a file name that are not
# UTF-8), never encodable as UTF-8
_SURROGATE = re.compile("[\ud800-\udfff]")


def replace_surrogates(text: str) -> str:
    """`text` with every lone surrogate as U+FFFD: printable and writable as UTF-8."""
    return _SURROGATE.sub("\ufffd", text)

def shown_path(path: str | os.PathLike[str]) -> str:
    """A path as text: bytes that are not UTF-8 (kept by Python as lone surrogates)
    become U+FFFD, so printing or rendering it never fails."""
    return os.fsencode(path).decode("utf-8", "replace")


def mlx_path(path: str | os.PathLike[str]) -> str:
    """`path` for MLX, which takes UTF-8 strings only (a name that is not valid UTF-8
    failed with "std::bad_cast"): ModelLoadError naming it instead."""
    s = str(path)
    if _SURROGATE.search(s):
        raise ModelLoadError(f"{shown_path(s)}: the path is not valid UTF-8, which MLX cannot"
                             " open; rename the folder (or link to it under a UTF-8 name)")
    return s


# the safetensors format's own limit on the JSON header
MAX_HEADER_BYTES = 100 * 1024 * 1024
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2,
    "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8, "C64": 8,
}


def safetensors_header(f: Path) -> dict[str, Any]:
    """Parse a safetensors header and check, before any tensor is read, that the header
    fits the file and every tensor's bytes (dtype x shape) are exactly its offsets' span
    inside the file: a hostile header cannot make a reader allocate what is not there."""
    try:
        with open_regular(f) as fh:
            size = os.fstat(fh.fileno()).st_size
            head = fh.read(8)
            if len(head) < 8:
                raise ModelLoadError(f"truncated safetensors file {f.name}: no header")
            n = int.from_bytes(head, "little")
            if n > MAX_HEADER_BYTES:
                raise ModelLoadError(
                    f"bad safetensors file {f.name}: header of {n} bytes is over the"
                    f" {MAX_HEADER_BYTES}-byte limit"
                )
            if n > size - 8:
                raise ModelLoadError(f"truncated safetensors file {f.name}: header cut short")
            header = json.loads(fh.read(n))
    except NotRegularFile as e:
        raise ModelLoadError(str(e)) from None
    except (OSError, ValueError) as e:  # ValueError: bad UTF-8 or JSON
        raise ModelLoadError(f"unreadable safetensors file {f.name}: {one_line(e)}") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"bad safetensors file {f.name}: the header is not a JSON object")
    data_size = size - 8 - n
    for name, info in header.items():
        if name != "__metadata__":
            _check_entry(f, name, info, data_size)
    return header


def _check_entry(f: Path, name: str, info: Any, data_size: int) -> None:
    def bad(why: str) -> ModelLoadError:
        return ModelLoadError(f"bad safetensors file {f.name}: tensor {name!r} {why}")

    if not isinstance(info, dict):
        raise bad("has no dtype/shape/data_offsets entry")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise bad(f"has unknown dtype {dtype!r:.40}")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise bad(f"has a malformed shape {shape!r:.60}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise bad(f"has malformed data_offsets {offsets!r:.60}")
    begin, end = offsets
    if end > data_size:
        raise ModelLoadError(
            f"truncated safetensors file {f.name}: tensor {name!r} needs {end} data bytes,"
            f" the file holds {data_size}"
        )
    need = math.prod(shape) * DTYPE_BYTES[dtype]
    if need != end - begin:
        raise bad(f"({dtype} {shape}) needs {need} bytes, its offsets hold {end - begin}")


def weight_files(folder: Path) -> list[Path]:
    """The folder's safetensors files (sharded via the index, or all of them)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(read_regular_text(index))["weight_map"].values()))
        except KVChatError as e:
            raise ModelLoadError(str(e)) from None
        except (OSError, ValueError, KeyError, AttributeError, TypeError) as e:
            raise ModelLoadError(f"bad {index.name}: {one_line(e)}") from None
        odd = [s for s in shards if not isinstance(s, str) or Path(s).name != s]
        if odd:  # a shard is a file next to the index, never a path elsewhere
            raise ModelLoadError(f"bad {index.name}: shard name {odd[0]!r:.80} is not a file name")
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


# the app's own JSON files (settings, session, chats): far above a real one, far below
# what would take long to parse; and nesting no real one comes near (a chat is 4 deep)
MAX_JSON_BYTES = 64 * 1024 * 1024
MAX_JSON_DEPTH = 64


_JSON_NAMES = {dict: "object", list: "list", str: "string", int: "number", float: "number",
               bool: "boolean", type(None): "null"}


class BadJSONFile(KVChatError):
    """A JSON file that cannot be used as it is; the message names the file."""


def _problem(data: Any, max_depth: int, surrogates: bool) -> str | None:
    """Why a parsed document is unusable (too deep, a lone surrogate), walked without
    recursion; None when it is fine."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            if depth > max_depth:
                return f"nested deeper than {max_depth} levels"
            if isinstance(node, dict):
                stack.extend((k, depth) for k in node)
                stack.extend((v, depth + 1) for v in node.values())
            else:
                stack.extend((v, depth + 1) for v in node)
        elif not surrogates and isinstance(node, str) and _SURROGATE.search(node):
            return "holds a lone surrogate (\\udXXX), which is not text"
    return None


def load_json(path: str | os.PathLike[str], expect: type = dict, *,
              limit: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH,
              surrogates: bool = False) -> Any:
    """The one defensive JSON reader for files the app did not write this run (settings,
    session, chats, leftover temp files, hostfiles): a regular file only (a FIFO would
    block), at most `limit` bytes, UTF-8, at most `max_depth` levels deep, no lone
    surrogates, and a top level of type `expect`. Anything else raises BadJSONFile with
    one line naming the file; FileNotFoundError passes through (absent is not bad)."""
    name = str(path)
    try:
        text = read_regular_text(path, limit)
        data = json.loads(text)
    except FileNotFoundError:
        raise
    except KVChatError as e:  # a FIFO, a device, a directory, an absurd size
        raise BadJSONFile(f"{name}: {e}") from None
    except OSError as e:
        raise BadJSONFile(f"{name}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise BadJSONFile(f"{name}: not UTF-8 text (byte {e.start})") from None
    except RecursionError:
        raise BadJSONFile(f"{name}: nested deeper than {max_depth} levels") from None
    except ValueError as e:  # JSONDecodeError, an integer too long to convert
        raise BadJSONFile(f"{name}: not valid JSON ({one_line(e)})") from None
    why = _problem(data, max_depth, surrogates)
    if why is None and not isinstance(data, expect):
        want = {dict: "an object", list: "a list"}.get(expect, expect.__name__)
        why = f"holds a JSON {_JSON_NAMES.get(type(data), 'value')}, not {want}"
    if why is not None:
        raise BadJSONFile(f"{name}: {why}")
    return data


def tensor_headers(folder: Path) -> dict[str, dict[str, Any]]:
    """Every tensor's header entry (dtype, shape, data_offsets) across the folder's weight
    files, checked by `safetensors_header`; the one walk over headers (nothing is read)."""
    return {
        name: info
        for f in weight_files(Path(folder))
        for name, info in safetensors_header(f).items()
        if name != "__metadata__"
    }


def tensor_bytes(folder: str | os.PathLike[str]) -> dict[str, int]:
    """Bytes of every tensor as stored, from the headers."""
    return {name: info["data_offsets"][1] - info["data_offsets"][0]
            for name, info in tensor_headers(Path(folder)).items()}


def read_json_object(path: Path, error: type[KVChatError]) -> dict[str, Any]:
    """A JSON object from `path`; {} when the file is absent or not an object,
    `error` (one line) when it cannot be read or parsed."""
    try:
        # a model folder's files: vocabularies may hold escaped surrogate halves
        data = load_json(path, object, limit=MAX_TEXT_BYTES, surrogates=True)
    except FileNotFoundError:
        return {}
    except BadJSONFile as e:
        raise error(str(e)) from None
    return data if isinstance(data, dict) else {}


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def model_name(folder: str | Path) -> str:
    """What to call a model folder: org/name for a Hugging Face cache snapshot
    (models--org--name/snapshots/<commit>), else the folder's name (a GGUF file's,
    without .gguf)."""
    p = Path(folder)
    if p.parent.name == "snapshots" and p.parent.parent.name.startswith("models--"):
        return p.parent.parent.name[len("models--"):].replace("--", "/")
    return p.name.removesuffix(".gguf")


def has_tokenizer(folder: str | Path) -> bool:
    return any((Path(folder) / n).is_file() for n in TOKENIZER_FILES)
