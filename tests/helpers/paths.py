"""Where the tests find the repository and the models it carries."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
# the real pretrained model the tests use is part of the repository (1 MB, MIT, see its
# PROVENANCE.md), so a fresh clone tests itself
STORIES260K = REPO_ROOT / "tests" / "models" / "stories260K"
# the shipped demo model (a 4-bit SentencePiece chat model, 1.3 MiB)
MINI = REPO_ROOT / "assets" / "kvchat-mini"
