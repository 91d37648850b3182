"""`kvchat` command line: the TUI by default, plus generate, inspect, bench, models, serve.

Exit status: 0 ok, 2 usage (argparse's errors included), 1 model or runtime error, 130
interrupted, with one line on stderr (a traceback only with KVCHAT_DEBUG=1). With --json,
stdout holds one JSON object whatever happens. Only the standard library is imported
before `main()`'s guard, so Ctrl+C during start-up never prints a traceback.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from kvchat.app.core import blas, sigint
from kvchat.app.core.errors import UsageError, interrupted, report, report_exception

COMMANDS = {
    "generate": "generate one reply on the command line",
    "inspect": "KV-cache memory math for a model or config",
    "bench": "measure prefill and decode speed (optionally against mlx-lm)",
    "models": "list local models with their sizes",
    "pull": "download a model from the Hugging Face Hub (resumable)",
    "serve": "serve the model over an OpenAI-compatible HTTP API",
    "explain": "the model's decoder block, explained with its own numbers",
}
QUIT_WAIT_S = 0.8  # at exit, how long a busy engine thread may take before we leave anyway


def _command_module(name: str) -> Any:
    from kvchat.app.cli import bench as bench_cmd
    from kvchat.app.cli import explain as explain_cmd
    from kvchat.app.cli import generate as generate_cmd
    from kvchat.app.cli import inspect as inspect_cmd
    from kvchat.app.cli import models as models_cmd
    from kvchat.app.cli import pull as pull_cmd
    from kvchat.app.serve import command as serve_cmd

    return {"generate": generate_cmd, "inspect": inspect_cmd, "bench": bench_cmd,
            "models": models_cmd, "pull": pull_cmd, "serve": serve_cmd,
            "explain": explain_cmd}[name]


def build_parser() -> Any:
    import argparse

    class Parser(argparse.ArgumentParser):
        def error(self, message: str) -> Any:  # argparse prints a usage block and exits 2
            raise UsageError(f"{message} (see {self.prog} --help)")

    p = Parser(
        prog="kvchat",
        description="Chat with a local LLM on MLX and watch its KV cache. "
        "Without a command: open the chat.",
    )
    p.add_argument("--version", action=blas.VersionAction,
                   help="print kvchat, MLX, device and BLAS, then exit")
    p.add_argument("--model", dest="tui_model", metavar="DIR",
                   help="model folder, GGUF file or ollama:NAME[:TAG] for the chat (default:"
                   " the last one used, else the shipped model)")
    p.add_argument("--hosts", dest="hostfile", metavar="HOSTFILE",
                   help="split the chat's model across the hosts of an mlx.launch hostfile")
    p.add_argument("--ignore-memory-check", action="store_true",
                   help="open the chat's model even when its weights plus its K/V cache need"
                   " more memory than the machine has available")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")  # parser_class: Parser
    for name, help_text in COMMANDS.items():
        _command_module(name).add_arguments(
            sub.add_parser(name, help=help_text, description=help_text)
        )
    return p


def _usage_error(message: str, argv: Sequence[str]) -> int:
    report(message)
    if "--json" in argv:  # the one JSON object, even for a command line we cannot parse
        import json

        command = next((a for a in argv if a in COMMANDS), None)
        if command == "generate":
            from kvchat.app.cli.generate import error_done, result_object

            print(json.dumps(result_object(error_done(message))))
        else:
            print(json.dumps({"error": message}))
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _main(argv)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `kvchat models | head`: the reader left; say nothing
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's final flush must not fail again
        return 141
    except Exception as e:  # a bug: still one line unless KVCHAT_DEBUG=1
        if interrupted(e):
            return 130
        report_exception(e)
        return 1


def _main(argv: list[str]) -> int:
    from kvchat import metal_kernels
    from kvchat.app.core import hosts
    from kvchat.app.core.settings import load_settings
    from kvchat.model.errors import KVChatError
    from kvchat.model.runtime import threads

    try:
        args = build_parser().parse_args(argv)
    except UsageError as e:
        return _usage_error(str(e), argv)
    try:  # KVCHAT_KERNELS / KVCHAT_THREADS (an unusable value is a usage error), else the
        settings = load_settings()  # settings entries
        metal_kernels.configure(settings.kernels)
        threads.configure(settings.threads)  # the OpenBLAS entry() loaded, if any
    except (metal_kernels.KernelError, threads.ThreadsError) as e:
        return _usage_error(str(e), argv)
    try:
        if args.hostfile is not None:
            if args.command is not None:
                report(f"--hosts opens the chat; for {args.command} run it under"
                       " mlx.launch --hostfile (see README)")
                return 2
            from kvchat.app.tui.app import run_chat

            return run_chat(args.hostfile, args.tui_model)
        _resolve_models(args)  # ollama:NAME -> its GGUF blob, for every command alike
        # under mlx.launch: ranks other than 0 serve the model's layers and stop here
        model = getattr(args, "model", None) or args.tui_model
        if (code := hosts.join_if_launched(model)) is not None:
            return code  # a pipeline rank other than 0: it served its layers
        if args.command is None:
            from kvchat.app.tui.app import run_tui

            return run_tui(args.tui_model, ignore_memory_check=args.ignore_memory_check)
        with _visible_output(json_mode=bool(getattr(args, "json", False)),
                             names=args.command != "generate"):
            return _command_module(args.command).run(args)
    except UsageError as e:  # a command's own check of its options
        return _usage_error(str(e), argv)
    except KVChatError as e:
        report(str(e))
        if "--json" in argv and args.command == "generate":  # its one JSON object, still
            import json

            from kvchat.app.cli.generate import error_done, result_object

            print(json.dumps(result_object(error_done(str(e)))))
        return 1


def _resolve_models(args: Any) -> None:
    """`--model ollama:NAME[:TAG]` names a model of Ollama's store: the loaders get its GGUF
    blob (read where it is); what the user should know is one note on stderr."""
    from kvchat.app.core.discovery import resolve_model
    from kvchat.app.core.text import visible_name

    for attr in ("model", "tui_model"):
        value = getattr(args, attr, None)
        if isinstance(value, str) and value:
            resolved = resolve_model(value)
            setattr(args, attr, resolved.path)
            for notice in resolved.notices:
                print(f"kvchat: note: {visible_name(notice)}", file=sys.stderr)


@contextlib.contextmanager
def _visible_output(json_mode: bool, names: bool) -> Iterator[None]:
    """Plain output reaches the terminal with control characters made visible, and with
    bidi and zero-width characters shown too where it holds only names and figures
    (`names`: every command but generate, which prints a reply; stderr's lines always);
    --json output is `json_text`'s (exact, escaped)."""
    from kvchat.app.core.text import VisibleWriter

    saved = sys.stdout, sys.stderr
    if not json_mode:
        sys.stdout = VisibleWriter(sys.stdout, names)  # type: ignore[assignment]
    sys.stderr = VisibleWriter(sys.stderr, names=True)  # type: ignore[assignment]
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved


def finish(rc: int) -> None:
    """Exit with `rc`. An engine thread still busy (a slow load, say) would make the
    interpreter's shutdown abort the process ("terminate called without an active
    exception", status 134) or wait for it: give it QUIT_WAIT_S, then leave at once.
    After Ctrl+C (130) leave at once too: the interrupt may have landed while a native
    library (MLX) was still initialising, and its teardown would abort the same way."""
    import signal

    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # no traceback from shutdown itself
    except ValueError:  # not the main thread
        pass
    busy = [t for t in threading.enumerate() if t.name == "kvchat-engine" and t.is_alive()]
    for t in busy:
        t.join(QUIT_WAIT_S / len(busy))
    if rc == 130 or any(t.is_alive() for t in busy):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(rc)
    sys.exit(rc)


def entry() -> None:
    """Console-script entry point."""
    sigint.install()  # a Ctrl+C during an import is delivered after it, never lost
    try:
        blas.load_fast_blas()  # before anything imports MLX
        rc = main()
    except KeyboardInterrupt:
        rc = 130
    finish(rc)


if __name__ == "__main__":
    entry()
