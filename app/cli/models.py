"""`kvchat models`: list the local models kvchat can find, with what they cost to load.

Folders and GGUF files (LM Studio's, configured folders', Ollama's store: `ollama:NAME`
loads one); BITS is a GGUF file's type (Q4_K_M, …) there.

MEMORY and DTYPE are what loading allocates on this backend (model/explain/facts.py, the numbers
`inspect`, the picker and the side panel show too); a folder kvchat cannot load is listed
with the reason instead. FITS: whether the weights plus the chat's K/V cache (its settings'
bound, else the model's context) fit the memory available now (app/core/memory.py; "?"
when the machine cannot tell).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvchat.app.core import memory
from kvchat.app.core.discovery import ModelRow, default_model_dirs, human_bytes, model_rows
from kvchat.app.core.settings import Settings, load_settings
from kvchat.app.core.text import json_text, visible_name
from kvchat.model.errors import KVChatError

COLUMNS = ("NAME", "ARCH", "BITS", "DTYPE", "MEMORY", "FITS", "SOURCE", "PATH")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dir",
        dest="dirs",
        action="append",
        default=[],
        metavar="DIR",
        help="also look in DIR (repeatable; its models are listed with source --dir;"
        " settings' model_dirs are always searched, source configured)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _short(path: Path) -> str:
    """~ for the home folder keeps the PATH column readable."""
    try:
        return "~/" + path.relative_to(Path.home()).as_posix()
    except ValueError:
        return str(path)


def fits(rows: list[ModelRow], settings: Settings) -> dict[Path, memory.Fit]:
    """Each loadable row's verdict with the chat's cache bound."""
    params = settings.gen_params()
    out = {}
    for r in rows:
        if r.loadable and r.facts is not None:
            try:
                out[r.entry.path] = memory.model_fit(r.entry.path, params.max_kv_size,
                                                     params.kv_quant(), facts=r.facts)
            except (KVChatError, OSError, ValueError):
                pass
    return out


def _fits_cell(fit: memory.Fit | None) -> str:
    if fit is None:
        return "-"
    return "?" if fit.available is None else "yes" if fit.fits else "no"


def format_table(rows: list[ModelRow], verdicts: dict[Path, memory.Fit] | None = None) -> str:
    # names and paths come from folders: shown as what they are (bidi, zero-width, bytes
    # that are not UTF-8), and measured after that, so the columns line up
    table = [COLUMNS] + [
        tuple(visible_name(c) for c in (
            r.entry.name if r.loadable else f"{r.entry.name} ✗",
            r.entry.architecture,
            str(r.entry.bits or r.entry.quantization or "-"),  # a GGUF file: its type
            r.facts.compute_dtype if r.facts else "-",
            human_bytes(r.facts.weight_bytes) if r.facts else "-",
            _fits_cell((verdicts or {}).get(r.entry.path)),
            r.entry.source,
            _short(r.entry.path),
        ))
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
    given = list(getattr(args, "dirs", []))
    rows = model_rows(settings.model_dirs, given=given)
    looked_in = [str(root) for root, _ in default_model_dirs(settings.model_dirs, given=given)]
    verdicts = fits(rows, settings)
    if getattr(args, "json", False):
        out = {"models": [{**r.to_dict(), "memory": verdicts[r.entry.path].to_dict()
                           if r.entry.path in verdicts else None} for r in rows],
               "looked_in": looked_in}
        # a folder name that is not UTF-8 cannot be JSON text: U+FFFD, as on screen; C1
        # and bidi characters escaped (app/core/text.py)
        print(json_text(out, indent=2))
        return 0
    if not rows:
        print("no local models found; looked in: " + ", ".join(looked_in))
        return 0
    print(format_table(rows, verdicts))
    bad = [r for r in rows if not r.loadable]
    if bad:
        print("\n✗ = kvchat cannot load it:")
        for r in bad:
            print(visible_name(f"  {r.entry.name}: {r.problem}"))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (python -m kvchat.app.cli.models); app/main.py wires the real one."""
    parser = argparse.ArgumentParser(prog="kvchat models", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
