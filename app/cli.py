"""`kvchat` command line: the TUI by default, plus generate, inspect, bench and models.

Exit status: 0 ok, 2 usage, 1 model or runtime error, with one line on stderr
(a traceback only with KVCHAT_DEBUG=1).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from model.errors import KVChatError

from . import bench_cmd, generate_cmd, inspect_cmd, models_cmd, pull_cmd
from .errors import report, report_exception

COMMANDS = {
    "generate": (generate_cmd, "generate one reply on the command line"),
    "inspect": (inspect_cmd, "KV-cache memory math for a model or config"),
    "bench": (bench_cmd, "measure prefill and decode speed (optionally against mlx-lm)"),
    "models": (models_cmd, "list local models with their sizes"),
    "pull": (pull_cmd, "download a model from the Hugging Face Hub (resumable)"),
}


def version() -> str:
    """The installed distribution's version, else pyproject.toml's (a source checkout)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("kvchat")
    except PackageNotFoundError:
        import re
        from pathlib import Path

        text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text("utf-8")
        m = re.search(r'^version = "([^"]+)"', text, re.M)
        return m.group(1) if m else "unknown"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvchat",
        description="Chat with a local LLM on MLX and watch its KV cache. "
        "Without a command: open the chat.",
    )
    p.add_argument("--model", dest="tui_model", metavar="DIR",
                   help="model folder for the chat (default: the last one used, else the"
                   " shipped model)")
    p.add_argument("--version", action="version", version=f"kvchat {version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        module.add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command is None:
            from .tui import run_tui

            return run_tui(args.tui_model)
        return COMMANDS[args.command][0].run(args)
    except KVChatError as e:
        report(str(e))
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a bug: still one line unless KVCHAT_DEBUG=1
        report_exception(e)
        return 1


# MLX's Linux CPU wheel calls the reference BLAS; Debian's OpenBLAS, preloaded, serves the
# same cblas symbols ~30x faster (measured: 5.7 -> 185 GFLOP/s fp32 matmul).
OPENBLAS = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"


def _with_openblas() -> None:
    """Re-exec once with OpenBLAS preloaded where it is installed (KVCHAT_NO_OPENBLAS=1: never)."""
    preload = os.environ.get("LD_PRELOAD", "")
    if (
        sys.platform != "linux"
        or "openblas" in preload
        or os.environ.get("KVCHAT_NO_OPENBLAS") == "1"
        or not os.path.exists(OPENBLAS)
    ):
        return
    env = {**os.environ, "LD_PRELOAD": f"{OPENBLAS} {preload}".strip()}
    try:
        os.execve(sys.executable, [sys.executable, "-m", "app", *sys.argv[1:]], env)
    except OSError:
        pass  # run on the slower BLAS rather than not at all


def entry() -> None:
    """Console-script entry point."""
    _with_openblas()
    sys.exit(main())


if __name__ == "__main__":
    entry()
