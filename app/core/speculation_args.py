"""The speculative decoding flags (--prompt-lookup, --lookup-ngram, --draft-model,
--draft-tokens), shared by generate, bench and serve (docs/design.md, "Speculative
decoding")."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvchat.app.core.errors import UsageError
from kvchat.model.runtime.events import MAX_DRAFT_TOKENS, MAX_NGRAM, GenParams


def add_speculation_arguments(p: argparse.ArgumentParser) -> None:
    d = GenParams()
    p.add_argument("--prompt-lookup", action="store_true",
                   help="speculative decoding with drafts found in the conversation"
                   " (n-gram match; no second model)")
    p.add_argument("--lookup-ngram", type=int, default=d.lookup_ngram, metavar="N",
                   help=f"--prompt-lookup matches the last N ids, then fewer, down to 1"
                   f" (1..{MAX_NGRAM}, default %(default)s)")
    p.add_argument("--draft-model", metavar="DIR",
                   help="speculative decoding with drafts from a smaller model that shares"
                   " the model's tokenizer")
    p.add_argument("--draft-tokens", type=int, default=d.draft_tokens, metavar="K",
                   help=f"draft at most K tokens per step; fewer, or none, where measured"
                   f" speed says more do not pay (1..{MAX_DRAFT_TOKENS}, default %(default)s)")


def speculation_fields(args: argparse.Namespace) -> dict[str, Any]:
    """GenParams' speculation fields from the flags; UsageError on a bad combination."""
    if args.prompt_lookup and args.draft_model:
        raise UsageError("give --prompt-lookup or --draft-model, not both")
    if not 1 <= args.draft_tokens <= MAX_DRAFT_TOKENS:
        raise UsageError(f"--draft-tokens must be 1..{MAX_DRAFT_TOKENS}, got {args.draft_tokens}")
    if not 1 <= args.lookup_ngram <= MAX_NGRAM:
        raise UsageError(f"--lookup-ngram must be 1..{MAX_NGRAM}, got {args.lookup_ngram}")
    draft = None
    if args.draft_model:
        folder = Path(args.draft_model).expanduser()
        if not folder.is_dir():
            raise UsageError(f"--draft-model: not a folder: {folder}")
        draft = str(folder.resolve())
    speculation = "draft" if draft else "lookup" if args.prompt_lookup else "off"
    return {"speculation": speculation, "draft_model": draft,
            "draft_tokens": args.draft_tokens, "lookup_ngram": args.lookup_ngram}
