"""`kvchat models`: list the local models kvchat can find, with what they cost to load.

MEMORY and DTYPE are what loading allocates on this backend (model/facts.py, the numbers
`inspect`, the picker and the side panel show too); a folder kvchat cannot load is listed
with the reason instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvchat.model.facts import ModelFacts, folder_status

from .discovery import ModelEntry, default_model_dirs, find_models, human_bytes
from .settings import load_settings

COLUMNS = ("NAME", "ARCH", "BITS", "DTYPE", "MEMORY", "SOURCE", "PATH")


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


def model_rows(extra_dirs: list[str], *, include_defaults: bool = True) -> list[ModelRow]:
    """find_models() plus each folder's facts (headers only; no weights are read)."""
    rows = []
    for e in find_models(extra_dirs, include_defaults=include_defaults):
        facts, problem = folder_status(e.path)
        rows.append(ModelRow(e, facts, problem))
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dir",
        dest="dirs",
        action="append",
        default=[],
        metavar="DIR",
        help="also look in DIR (repeatable; settings' model_dirs are always searched)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _short(path: Path) -> str:
    """~ for the home folder keeps the PATH column readable."""
    try:
        return "~/" + path.relative_to(Path.home()).as_posix()
    except ValueError:
        return str(path)


def format_table(rows: list[ModelRow]) -> str:
    table = [COLUMNS] + [
        (
            r.entry.name if r.loadable else f"{r.entry.name} ✗",
            r.entry.architecture,
            str(r.entry.bits) if r.entry.bits else "-",
            r.facts.compute_dtype if r.facts else "-",
            human_bytes(r.facts.weight_bytes) if r.facts else "-",
            r.entry.source,
            _short(r.entry.path),
        )
        for r in rows
    ]
    widths = [max(len(r[i]) for r in table) for i in range(len(COLUMNS))]
    right = {2, 4}  # numbers align right
    lines = []
    for r in table:
        cells = [
            r[i].rjust(widths[i]) if i in right else r[i].ljust(widths[i])
            for i in range(len(COLUMNS))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    settings = load_settings()
    for w in settings.warnings:
        print(f"kvchat: warning: {w}", file=sys.stderr)
    for d in getattr(args, "dirs", []):
        if not Path(d).expanduser().is_dir():
            print(f"kvchat: warning: --dir {d} is not a folder", file=sys.stderr)
    # --dir first: folders named on the command line win the dedup over settings' ones
    extra = [*getattr(args, "dirs", []), *settings.model_dirs]
    rows = model_rows(extra)
    looked_in = [str(root) for root, _ in default_model_dirs(extra)]
    if getattr(args, "json", False):
        out = {"models": [r.to_dict() for r in rows], "looked_in": looked_in}
        print(json.dumps(out, indent=2))
        return 0
    if not rows:
        print("no local models found; looked in: " + ", ".join(looked_in))
        return 0
    print(format_table(rows))
    bad = [r for r in rows if not r.loadable]
    if bad:
        print("\n✗ = kvchat cannot load it:")
        for r in bad:
            print(f"  {r.entry.name}: {r.problem}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (python -m kvchat.app.models_cmd); app/cli.py wires the real one."""
    parser = argparse.ArgumentParser(prog="kvchat models", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
