"""Find local model folders: folders named with --dir, configured dirs, the Hugging Face
cache, LM Studio, assets, and a folder opened by its path that none of those holds.

A model folder is one holding `config.json` and at least one `*.safetensors` file.
Scanning never raises on a bad folder (unreadable, malformed config, incomplete download):
the folder is skipped, because one broken download must not hide every other model.
Walks are bounded in depth (and in folders visited) so pointing at a huge tree cannot hang.
"""

from __future__ import annotations

import json
import logging
import os
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvchat.model.cache.kv_math import (
    human_bytes,  # one formatter for the whole app; re-exported here
)
from kvchat.model.decoder.families import FAMILIES
from kvchat.model.explain.facts import ModelFacts, folder_status

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
    "read_model_folder",
    "scan_root",
]

# Order = precedence: when one folder is reachable from several roots, the first wins,
# and listings are grouped in this order. "--dir": named on the command line (`kvchat
# models --dir`); "configured": settings' model_dirs; "by path": a folder opened by its
# path (`--model DIR`, typed in the picker) that no root holds.
SOURCES = ("--dir", "configured", "hf-cache", "lm-studio", "assets", "by path")

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
    size_bytes: int  # sum of the safetensors files (symlinks followed)
    bits: int | None  # quantization bits, None for unquantized checkpoints
    source: str  # one of SOURCES

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
    """One entry per cached repo (models--org--name): its main (or newest) complete snapshot."""
    found = []
    try:
        repos = sorted(p for p in root.iterdir() if p.name.startswith("models--") and p.is_dir())
    except OSError:
        return []
    for repo in repos[:MAX_DIRS_PER_ROOT]:
        name = repo.name[len("models--") :].replace("--", "/")
        for snap in _hf_snapshot_order(repo):
            entry = read_model_folder(snap, name, "hf-cache")
            if entry is not None:
                found.append(entry)
                break
    return found


def scan_root(root: Path, source: str, max_depth: int = MAX_DEPTH) -> list[ModelEntry]:
    """Model folders under one root (the root itself counts); never raises on bad folders."""
    try:
        if not root.is_dir():
            return []
    except OSError:
        return []
    if source == "hf-cache":
        return _scan_hf_cache(root)
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
