"""Which BLAS serves MLX's CPU matmuls, for `kvchat --version`, the side panel and
`kvchat bench`, and at start-up on Linux a fast one loaded before MLX.

macOS: MLX's matmuls run in Accelerate and nothing here loads, probes or imports anything
else. Linux: app/core/linux_blas.py, imported only there, finds the library, loads it
into this process and says what to do when MLX still runs on its slow reference BLAS.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Any

_QUIET = {"core": None, "core_chosen": None, "note": None, "fix": None}


def load_fast_blas() -> None:
    """At start-up, before MLX is first imported: on Linux, a fast BLAS into this process
    (linux_blas.load); elsewhere nothing."""
    if sys.platform == "linux":
        from kvchat.app.core import linux_blas

        linux_blas.load()


@functools.cache
def active_blas() -> dict[str, Any]:
    """{"name", "path", "fast", "core", "core_chosen", "note", "fix"}: the BLAS that serves
    MLX's matmuls in this process, OpenBLAS's kernel set and the one kvchat loaded it with
    (`core_chosen`, where OpenBLAS did not know the CPU), and, where it is slow, why (`note`)
    and the one command that would help on this machine (`fix`, or None)."""
    if sys.platform == "darwin":
        return {"name": "Accelerate", "path": None, "fast": True, **_QUIET}
    if sys.platform == "linux":
        from kvchat.app.core import linux_blas

        return linux_blas.active()
    return {"name": "unknown", "path": None, "fast": False, **_QUIET}


def label(b: dict[str, Any], where: str = "") -> str:
    """`active_blas()`'s answer in words: name, (where,) kernels, and who chose them:
    kvchat, the environment's OPENBLAS_CORETYPE, or (unsaid) OpenBLAS from the CPU."""
    core = b.get("core")
    who = ""
    if b.get("core_chosen"):
        who = " (chosen by kvchat: this OpenBLAS does not know this CPU)"
    elif core and os.environ.get("OPENBLAS_CORETYPE", "").lower() == core.lower():
        who = " (set by OPENBLAS_CORETYPE)"
    return b["name"] + where + (f", {core} kernels" if core else "") + who


def advice(b: dict[str, Any]) -> str:
    """Why it is slow and what to run, one line; "" when there is nothing to say."""
    note, fix = b.get("note"), b.get("fix")
    return "; ".join([*([note] if note else []), *([f"fix: {fix}"] if fix else [])])


def describe() -> str:
    """One line for diagnostics: the BLAS in use, its kernels, and the advice."""
    b = active_blas()
    text = label(b, f" ({b['path']})" if b["path"] else "")
    return text + (f"; {tip}" if (tip := advice(b)) else "")


def short_label() -> str:
    """For the side panel: the BLAS name, or the slow one with the command to run."""
    b = active_blas()
    if not b["fast"]:
        return "reference (slow)" + (f": {b['fix']}" if b.get("fix") else "")
    return b["name"] + (f" ({b['core']}: {b['fix']})" if b.get("fix") else "")


def version_text() -> str:
    """`kvchat --version`: kvchat, MLX, device, BLAS and the thread policy."""
    import mlx.core as mx

    from kvchat.app import __version__
    from kvchat.model.runtime import threads

    threads.configure(None)  # --version runs before main(): a bad KVCHAT_THREADS raises
    return (f"kvchat {__version__}\nmlx {mx.__version__} on {mx.default_device()}\n"
            f"BLAS: {describe()}\nthreads: {threads.describe()}")


class VersionAction(argparse.Action):
    """`--version`, computed only when asked (it imports MLX)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS,
                 default: str = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        from kvchat.model.runtime.threads import ThreadsError

        try:
            text = version_text()
        except ThreadsError as e:
            parser.error(str(e))  # a usage error: one line, exit 2
        print(text)
        parser.exit()
