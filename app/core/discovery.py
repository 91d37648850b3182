"""Find local models: folders named with --dir, configured dirs, the Hugging Face cache,
LM Studio, Ollama, assets, and a model opened by its path that none of those holds.

A model is a folder holding `config.json` and at least one `*.safetensors` file, or a
GGUF file (LM Studio's `PUBLISHER/REPO/*.gguf`, or one in a configured folder), or a
model in Ollama's store (`manifests/HOST/NAMESPACE/NAME/TAG` names a blob by digest,
`ollama:NAME[:TAG]` on the command line). The stores are read, never written: nothing
here opens a file for writing, and a manifest's digest is checked (sha256, 64 hex) and
its blob must lie inside the store's blobs folder before it is looked at.
Scanning never raises on a bad folder (unreadable, malformed config, incomplete download):
the folder is skipped, because one broken download must not hide every other model.
Walks are bounded in depth (and in folders visited) so pointing at a huge tree cannot hang.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvchat.model.cache.kv_math import (
    human_bytes,  # one formatter for the whole app; re-exported here
)
from kvchat.model.decoder.families import FAMILIES
from kvchat.model.decoder.gguf import ARCHS, model_type_of
from kvchat.model.errors import KVChatError, ModelLoadError
from kvchat.model.explain.facts import ModelFacts, folder_status
from kvchat.model.files import BadJSONFile, load_json
from kvchat.model.gguf_file import is_gguf, read_gguf

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MODEL",
    "SOURCES",
    "ModelEntry",
    "ModelRow",
    "default_model_dirs",
    "find_models",
    "hf_cache_dir",
    "human_bytes",
    "lmstudio_dirs",
    "model_rows",
    "ollama_dir",
    "read_gguf_file",
    "read_model_folder",
    "resolve_model",
    "scan_root",
]

# Order = precedence: when one folder is reachable from several roots, the first wins,
# and listings are grouped in this order. "--dir": named on the command line (`kvchat
# models --dir`); "configured": settings' model_dirs; "by path": a model opened by its
# path (`--model DIR`, typed in the picker) that no root holds.
SOURCES = ("--dir", "configured", "hf-cache", "lm-studio", "ollama", "assets", "by path")

MAX_DEPTH = 4  # folder levels below a root that are looked at
MAX_DIRS_PER_ROOT = 20_000  # a second guard for very wide trees

# The shipped default model, resolved from the package so it works from any cwd.
# (app/ sits beside assets/ in the repository and inside the installed package)
DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "assets" / "kvchat-mini"


@dataclass(frozen=True)
class ModelEntry:
    name: str
    path: Path
    architecture: str  # config.json model_type ("unknown" when absent)
    size_bytes: int  # sum of the safetensors files (symlinks followed), or the GGUF file
    bits: int | None  # quantization bits, None for unquantized checkpoints
    source: str  # one of SOURCES
    quantization: str | None = None  # a GGUF file's type, llama.cpp's name ("Q4_K_M")

    @property
    def supported(self) -> bool:
        """Whether kvchat's decoder knows this architecture."""
        return self.architecture in FAMILIES

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": str(self.path),
            "architecture": self.architecture,
            "size_bytes": self.size_bytes,
            "bits": self.bits,
            "quantization": self.quantization,
            "source": self.source,
            "supported": self.supported,
        }


# --- where to look ----------------------------------------------------------------


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, resolved as huggingface_hub does."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def lmstudio_dirs() -> list[Path]:
    """LM Studio's model folders (current and legacy locations)."""
    home = Path.home()
    return [home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"]


def ollama_dir() -> Path:
    """Ollama's model store, as Ollama finds it."""
    store = os.environ.get("OLLAMA_MODELS")
    return Path(store).expanduser() if store else Path.home() / ".ollama" / "models"


def default_model_dirs(
    extra: Iterable[str | os.PathLike[str]] = (),
    *,
    given: Iterable[str | os.PathLike[str]] = (),
) -> list[tuple[Path, str]]:
    """Every root that find_models() looks in, with its source, in precedence order:
    `given` (named on the command line), `extra` (settings' model_dirs), then the default
    places.

    Roots that do not exist are included (they are cheap to skip, and a "looked in"
    message should name them).
    """
    roots: list[tuple[Path, str]] = [(Path(d).expanduser(), "--dir") for d in given]
    roots += [(Path(d).expanduser(), "configured") for d in extra]
    roots.append((hf_cache_dir(), "hf-cache"))
    roots.extend((d, "lm-studio") for d in lmstudio_dirs())
    roots.append((ollama_dir(), "ollama"))
    roots.append((DEFAULT_MODEL, "assets"))
    return roots


# --- reading one folder -------------------------------------------------------------


def _bits(cfg: dict[str, Any]) -> int | None:
    for key in ("quantization", "quantization_config"):
        q = cfg.get(key)
        if isinstance(q, dict):
            bits = q.get("bits")
            if isinstance(bits, int) and not isinstance(bits, bool) and bits > 0:
                return bits
    return None


def _weight_size(folder: Path, names: list[str]) -> int | None:
    """Total bytes of the weights; None when a shard is missing or a link is broken."""
    files = {n for n in names if n.endswith(".safetensors")}
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        # a sharded checkpoint is only usable when every listed shard is present
        data = json.loads(index.read_text(encoding="utf-8"))
        shards = set(data["weight_map"].values())
        if not shards <= files:
            return None
    total = 0
    for name in files:
        total += (folder / name).stat().st_size  # stat() follows HF cache symlinks
    return total


def read_model_folder(folder: Path, name: str, source: str) -> ModelEntry | None:
    """A ModelEntry for `folder`, or None when it is not a (complete, readable) model."""
    try:
        names = os.listdir(folder)
        if "config.json" not in names or not any(n.endswith(".safetensors") for n in names):
            return None
        cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        if not isinstance(cfg, dict):
            return None
        size = _weight_size(folder, names)
        if size is None:
            return None
        arch = cfg.get("model_type")
        return ModelEntry(
            name=name,
            path=folder.resolve(),
            architecture=arch if isinstance(arch, str) and arch else "unknown",
            size_bytes=size,
            bits=_bits(cfg),
            source=source,
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        # ValueError covers JSONDecodeError and UnicodeDecodeError
        log.debug("skipping %s: %s", folder, e)
        return None


def read_gguf_file(path: Path, name: str, source: str) -> ModelEntry | None:
    """A ModelEntry for a GGUF file, or None when it is not a model kvchat would list (not
    a GGUF file, a vision projector, a later part of a split file)."""
    try:
        if _SPLIT_PART.search(path.name) and not _SPLIT_FIRST.search(path.name):
            return None  # listed once, by its first part
        if not is_gguf(path):
            return None
        gf = read_gguf(path)
        if gf.get("general.type") in ("mmproj", "adapter") or gf.architecture == "clip":
            return None
        arch = model_type_of(gf) if gf.architecture in ARCHS else gf.architecture
        return ModelEntry(name=name, path=path.resolve(), architecture=arch,
                          size_bytes=gf.size, bits=None, source=source,
                          quantization=gf.file_type)
    except (KVChatError, OSError, ValueError) as e:
        log.debug("skipping %s: %s", path, e)
        return None


# llama.cpp's split files: NAME-00001-of-00003.gguf
_SPLIT_PART = re.compile(r"-\d{5}-of-\d{5}\.gguf$")
_SPLIT_FIRST = re.compile(r"-00001-of-\d{5}\.gguf$")


def _hf_name(folder: Path) -> str | None:
    """org/name for a folder laid out as models--org--name/snapshots/<rev>."""
    if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
        return folder.parent.parent.name[len("models--") :].replace("--", "/")
    return None


# --- scanning roots -----------------------------------------------------------------


def _walk(root: Path, max_depth: int) -> Iterator[tuple[Path, list[str]]]:
    """Breadth-first (folder, entry names) under root, at most max_depth levels down.

    Does not descend into a model folder or into hidden folders (.git, .locks, ...).
    """
    queue: deque[tuple[Path, int]] = deque([(root, 0)])
    visited = 0
    seen: set[Path] = set()
    while queue and visited < MAX_DIRS_PER_ROOT:
        folder, depth = queue.popleft()
        try:
            real = folder.resolve()
            if real in seen:  # symlink loops
                continue
            seen.add(real)
            with os.scandir(folder) as it:
                entries = list(it)
        except OSError:
            continue
        visited += 1
        names = [e.name for e in entries]
        yield folder, names
        if "config.json" in names or depth >= max_depth:
            continue
        for e in sorted(entries, key=lambda e: e.name):
            try:
                if not e.name.startswith(".") and e.is_dir():
                    queue.append((Path(e.path), depth + 1))
            except OSError:
                continue


def _scan_tree(root: Path, source: str, max_depth: int) -> list[ModelEntry]:
    found = []
    for folder, names in _walk(root, max_depth):
        for gguf in sorted(n for n in names if n.lower().endswith(".gguf")):
            rel = (folder / gguf).relative_to(root).as_posix()
            entry = read_gguf_file(folder / gguf, rel, source)
            if entry is not None:
                found.append(entry)
        if "config.json" not in names:
            continue
        if folder == root:
            name = root.name
        else:
            name = _hf_name(folder) or folder.relative_to(root).as_posix()
        entry = read_model_folder(folder, name, source)
        if entry is not None:
            found.append(entry)
    return found


# --- Ollama's store -------------------------------------------------------------------

OLLAMA_HOST, OLLAMA_NAMESPACE = "registry.ollama.ai", "library"
MODEL_LAYER = "application/vnd.ollama.image.model"
TEMPLATE_LAYER = "application/vnd.ollama.image.template"
_DIGEST = re.compile(r"^sha256:([0-9a-f]{64})$")
_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")  # a name part: no "..", no "/"
MAX_MANIFEST_BYTES = 1 << 20


@dataclass(frozen=True)
class OllamaModel:
    """One tag of Ollama's store: its name, the GGUF blob and the layers beside it."""

    name: str  # as `ollama list` says it: NAME:TAG (NAMESPACE/NAME:TAG, HOST/…)
    blob: Path
    layers: frozenset[str]  # the manifest's media types


def _ollama_name(host: str, namespace: str, model: str, tag: str) -> str:
    if host == OLLAMA_HOST:
        return f"{model}:{tag}" if namespace == OLLAMA_NAMESPACE else f"{namespace}/{model}:{tag}"
    return f"{host}/{namespace}/{model}:{tag}"


def _read_manifest(root: Path, manifest: Path, name: str) -> OllamaModel | None:
    """The model a manifest names, checked: a JSON object whose model layer's digest is a
    sha256 and whose blob is a file inside `root`/blobs. None otherwise."""
    try:
        data = load_json(manifest, limit=MAX_MANIFEST_BYTES)
    except (BadJSONFile, OSError) as e:
        log.debug("skipping %s: %s", manifest, e)
        return None
    layers = data.get("layers")
    if not isinstance(layers, list):
        return None
    kinds = frozenset(x.get("mediaType") for x in layers
                      if isinstance(x, dict) and isinstance(x.get("mediaType"), str))
    model = next((x for x in layers if isinstance(x, dict)
                  and x.get("mediaType") == MODEL_LAYER), None)
    digest = model.get("digest") if model else None
    m = _DIGEST.match(digest) if isinstance(digest, str) else None
    if m is None:
        return None
    blobs = (root / "blobs").resolve()
    blob = (blobs / f"sha256-{m.group(1)}").resolve()
    if blob.parent != blobs or not blob.is_file():
        return None
    return OllamaModel(name, blob, kinds)


def _ollama_models(root: Path) -> list[OllamaModel]:
    """Every tag in the store (manifests/HOST/NAMESPACE/NAME/TAG), read-only."""
    found = []
    manifests = root / "manifests"
    for folder, _ in _walk(manifests, 3):
        try:
            parts = folder.relative_to(manifests).parts
        except ValueError:
            continue
        if len(parts) != 3:
            continue
        try:
            tags = sorted(p for p in folder.iterdir() if p.is_file())
        except OSError:
            continue
        for tag in tags[:MAX_DIRS_PER_ROOT]:
            model = _read_manifest(root, tag, _ollama_name(*parts, tag.name))
            if model is not None:
                found.append(model)
    return found


def _scan_ollama(root: Path) -> list[ModelEntry]:
    found = []
    for m in _ollama_models(root):
        entry = read_gguf_file(m.blob, m.name, "ollama")
        if entry is not None:
            found.append(entry)
    return found


@dataclass(frozen=True)
class ResolvedModel:
    """What `--model` names, as a path the loaders read, and what to tell the user."""

    path: str
    notices: tuple[str, ...] = ()


def resolve_model(spec: str) -> ResolvedModel:
    """`ollama:NAME[:TAG]` -> its GGUF blob in Ollama's store (ModelLoadError, one line,
    when there is none); anything else is a path, returned as given."""
    if not spec.startswith("ollama:"):
        return ResolvedModel(spec)
    wanted = spec[len("ollama:"):]
    name, sep, tag = wanted.rpartition(":")
    if not sep or "/" in tag:
        name, tag = wanted, "latest"
    parts = name.split("/")
    where = {1: [OLLAMA_HOST, OLLAMA_NAMESPACE], 2: [OLLAMA_HOST], 3: []}.get(len(parts))
    if where is None or not all(_PART.match(p) for p in [*parts, tag]):
        raise ModelLoadError(f"{spec!r:.80} is not an Ollama model name (ollama:NAME[:TAG])")
    root = ollama_dir()
    host, namespace, model_name = [*where, *parts]
    manifest = root / "manifests" / host / namespace / model_name / tag
    model = _read_manifest(root, manifest, _ollama_name(host, namespace, model_name, tag))
    if model is None:
        known = sorted(m.name for m in _ollama_models(root))
        have = f"; it has: {', '.join(known[:8])}{' …' if len(known) > 8 else ''}" if known \
            else ""
        raise ModelLoadError(f"no Ollama model {_ollama_name(host, namespace, model_name, tag)}"
                             f" in {root}{have}")
    notices = []
    if TEMPLATE_LAYER in model.layers and is_gguf(model.blob):
        if not isinstance(read_gguf(model.blob).get("tokenizer.chat_template"), str):
            notices.append(f"ollama:{model.name} has only Ollama's own chat template (Go"
                           " template syntax, not Jinja), which kvchat cannot run; chats"
                           " use the plain fallback format")
    return ResolvedModel(str(model.blob), tuple(notices))


def _hf_snapshot_order(repo: Path) -> list[Path]:
    """Snapshots of one cached repo, the one refs/main points to first, then newest."""
    snaps_dir = repo / "snapshots"
    try:
        snaps = [p for p in snaps_dir.iterdir() if p.is_dir()]
    except OSError:
        return []

    def mtime(p: Path) -> float:
        try:
            return p.stat().st_mtime
        except OSError:
            return 0.0

    snaps.sort(key=mtime, reverse=True)
    try:
        main = (repo / "refs" / "main").read_text(encoding="utf-8").strip()
    except (OSError, ValueError):
        main = ""
    snaps.sort(key=lambda p: p.name != main)  # stable: keeps newest-first otherwise
    return snaps


def _scan_hf_cache(root: Path) -> list[ModelEntry]:
    """One entry per cached repo (models--org--name): its main (or newest) complete
    snapshot; for a repo of GGUF files, one per file."""
    found = []
    try:
        repos = sorted(p for p in root.iterdir() if p.name.startswith("models--") and p.is_dir())
    except OSError:
        return []
    for repo in repos[:MAX_DIRS_PER_ROOT]:
        name = repo.name[len("models--") :].replace("--", "/")
        snaps = _hf_snapshot_order(repo)
        for snap in snaps:
            entry = read_model_folder(snap, name, "hf-cache")
            if entry is not None:
                found.append(entry)
                break
        else:  # a repo of GGUF files (…-GGUF): each file of its main snapshot
            for f in sorted(snaps[0].glob("*.gguf")) if snaps else ():
                entry = read_gguf_file(f, f"{name}/{f.name}", "hf-cache")
                if entry is not None:
                    found.append(entry)
    return found


def scan_root(root: Path, source: str, max_depth: int = MAX_DEPTH) -> list[ModelEntry]:
    """Model folders and GGUF files under one root (the root itself counts); never raises
    on bad folders."""
    try:
        if not root.is_dir():
            return []
    except OSError:
        return []
    if source == "hf-cache":
        return _scan_hf_cache(root)
    if source == "ollama":
        return _scan_ollama(root)
    return _scan_tree(root, source, max(0, min(max_depth, MAX_DEPTH)))


def find_models(
    extra_dirs: Iterable[str | os.PathLike[str]] = (),
    *,
    given: Iterable[str | os.PathLike[str]] = (),
    opened: Iterable[str | os.PathLike[str]] = (),
    include_defaults: bool = True,
    max_depth: int = MAX_DEPTH,
) -> list[ModelEntry]:
    """Every model found in `given` (source "--dir"), `extra_dirs` ("configured") and the
    default places, plus each `opened` model folder no root holds ("by path": the model
    in use, opened by its path, is listed like any other).

    Deduplicated by resolved path (the earlier source in SOURCES wins), sorted by source
    (SOURCES order) then name (case-insensitive).
    """
    roots = default_model_dirs(extra_dirs, given=given)
    if not include_defaults:
        roots = [r for r in roots if r[1] in ("--dir", "configured")]
    by_path: dict[Path, ModelEntry] = {}
    for root, source in roots:
        for entry in scan_root(root, source, max_depth):
            by_path.setdefault(entry.path, entry)
    for folder in opened:
        path = Path(folder).expanduser()
        entry = read_model_folder(path, path.name, "by path")
        if entry is not None:
            by_path.setdefault(entry.path, entry)
    return sorted(
        by_path.values(), key=lambda e: (SOURCES.index(e.source), e.name.lower(), str(e.path))
    )


@dataclass(frozen=True)
class ModelRow:
    """A found folder with its runtime facts, or the reason it cannot be loaded."""

    entry: ModelEntry
    facts: ModelFacts | None
    problem: str | None

    @property
    def loadable(self) -> bool:
        return self.problem is None

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.entry.to_dict(),
            "loadable": self.loadable,
            "problem": self.problem,
            "weight_bytes": self.facts.weight_bytes if self.facts else None,
            "compute_dtype": self.facts.compute_dtype if self.facts else None,
            "file_dtype": self.facts.file_dtype if self.facts else None,
        }


def model_rows(
    extra_dirs: list[str],
    *,
    given: Iterable[str | os.PathLike[str]] = (),
    opened: Iterable[str | os.PathLike[str]] = (),
    include_defaults: bool = True,
) -> list[ModelRow]:
    """find_models() plus each folder's facts (headers only; no weights are read)."""
    rows = []
    for e in find_models(extra_dirs, given=given, opened=opened,
                         include_defaults=include_defaults):
        facts, problem = folder_status(e.path)
        rows.append(ModelRow(e, facts, problem))
    return rows
