"""`kvchat generate`: one turn on the command line, streamed to stdout or as one JSON object."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from model.client import EngineClient
from model.errors import KVChatError
from model.events import GenParams, stats_json

from .discovery import DEFAULT_MODEL
from .errors import report


def add_model_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="DIR", help=f"model folder (default: {DEFAULT_MODEL})")


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    d = GenParams()
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, metavar="N")
    p.add_argument("--temp", type=float, default=d.temp, metavar="T", help="0 = greedy")
    p.add_argument("--top-p", type=float, default=d.top_p, metavar="P")
    p.add_argument("--top-k", type=int, default=d.top_k, metavar="K", help="0 = off")
    p.add_argument("--min-p", type=float, default=d.min_p, metavar="M")
    p.add_argument("--repetition-penalty", type=float, default=d.repetition_penalty, metavar="R")
    p.add_argument("--seed", type=int, default=None, metavar="S")
    p.add_argument("--max-kv-size", type=int, default=None, metavar="N",
                   help="bound the KV cache to N tokens (rotating); default: the context length")
    p.add_argument("--keep", type=int, default=d.keep, metavar="K",
                   help="sink tokens kept when the cache rotates (default %(default)s)")
    p.add_argument("--overflow", choices=["rotate", "refuse"], default=d.overflow,
                   help="past the cache bound: rotate (keep sinks, evict the oldest) or refuse"
                   " (default %(default)s)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop when this text appears (repeatable)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_argument(p)
    p.add_argument("--prompt", metavar="TEXT", help="prompt text (default: read stdin)")
    p.add_argument("--system", metavar="TEXT", help="system prompt")
    p.add_argument("--raw", action="store_true",
                   help="skip the chat template; add BOS as the tokenizer says")
    p.add_argument("--tokenizer", choices=["auto", "sentencepiece", "hf"], default="auto",
                   help="tokenizer file to use: auto prefers tokenizer.json over tokenizer.model")
    add_sampling_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")


def params_from_args(args: argparse.Namespace) -> GenParams:
    return GenParams.from_fields(args, stop=tuple(args.stop))


def run(args: argparse.Namespace) -> int:
    params = params_from_args(args)
    try:
        params.validate()
    except KVChatError as e:  # a bad flag value is a usage error
        report(str(e))
        return 2
    if args.prompt is not None:
        text = args.prompt
    elif not sys.stdin.isatty():
        text = sys.stdin.read()
    else:
        report("give --prompt TEXT or pipe the prompt on stdin")
        return 2
    if args.raw and args.system:
        report("--system needs the chat template; it cannot be used with --raw")
        return 2

    def stream(delta: str) -> None:
        sys.stdout.write(delta)
        sys.stdout.flush()

    try:
        runner = EngineClient(
            args.model or DEFAULT_MODEL, on_delta=None if args.json else stream,
            tokenizer=args.tokenizer,
        )
    except KVChatError as e:
        report(str(e))
        return 1
    try:
        if args.raw:
            prompt: Any = text
        else:
            prompt = ([{"role": "system", "content": args.system}] if args.system else []) + [
                {"role": "user", "content": text}
            ]
        done = runner.run(prompt, params)
    finally:
        runner.close()
    if args.json:
        out = {
            "text": done.text,
            "prompt_ids": done.prompt_ids,
            "ids": done.ids,
            "finish_reason": done.finish_reason,
            **stats_json(done.stats),
        }
        if done.error:
            out["error"] = done.error
        print(json.dumps(out))
    elif done.finish_reason != "error":
        print()
    if done.finish_reason == "error":
        report(done.error or "generation failed")
        return 1
    return 0
