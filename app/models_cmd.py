"""`kvchat models`: list the local models kvchat can find, with their sizes."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .discovery import ModelEntry, default_model_dirs, find_models, human_bytes
from .settings import load_settings

COLUMNS = ("NAME", "ARCH", "BITS", "SIZE", "SOURCE", "PATH")


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


def format_table(entries: list[ModelEntry]) -> str:
    rows = [COLUMNS] + [
        (
            e.name,
            e.architecture if e.supported else f"{e.architecture}?",
            str(e.bits) if e.bits else "-",
            human_bytes(e.size_bytes),
            e.source,
            _short(e.path),
        )
        for e in entries
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    right = {2, 3}  # numbers align right
    lines = []
    for r in rows:
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
    entries = find_models(extra)
    looked_in = [str(root) for root, _ in default_model_dirs(extra)]
    if getattr(args, "json", False):
        out = {"models": [e.to_dict() for e in entries], "looked_in": looked_in}
        print(json.dumps(out, indent=2))
        return 0
    if not entries:
        print("no local models found; looked in: " + ", ".join(looked_in))
        return 0
    print(format_table(entries))
    if any(not e.supported for e in entries):
        print("\n? = architecture kvchat cannot run yet")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (python -m app.models_cmd); app/cli.py wires the real one."""
    parser = argparse.ArgumentParser(prog="kvchat models", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
