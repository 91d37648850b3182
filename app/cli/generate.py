"""`kvchat generate`: one turn on the command line, streamed to stdout or as one JSON object."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import Any

from kvchat.app.core import memory
from kvchat.app.core.discovery import DEFAULT_MODEL
from kvchat.app.core.engine_service import EngineOptions, EngineService
from kvchat.app.core.errors import UsageError, debug, interrupted, report
from kvchat.app.core.kv_args import add_kv_arguments, kv_quant_from_args
from kvchat.app.core.speculation_args import add_speculation_arguments, speculation_fields
from kvchat.app.core.text import SafeStream, json_text
from kvchat.model.cache.kv_math import human_bytes
from kvchat.model.errors import KVChatError, error_line
from kvchat.model.files import load_json
from kvchat.model.runtime.events import Done, GenParams, stats_json


def add_model_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="DIR", help="model folder, GGUF file or ollama:NAME[:TAG]"
                   f" (default: {DEFAULT_MODEL})")


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    d = GenParams()
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, metavar="N",
                   help="generate at most N tokens (default %(default)s)")
    p.add_argument("--temp", type=float, default=d.temp, metavar="T",
                   help="sampling temperature; 0 = greedy (default %(default)s)")
    p.add_argument("--top-p", type=float, default=d.top_p, metavar="P",
                   help="sample from the most likely tokens whose probabilities add up to P;"
                   " 1 = off (default %(default)s)")
    p.add_argument("--top-k", type=int, default=d.top_k, metavar="K",
                   help="sample from the K most likely tokens; 0 = off (default %(default)s)")
    p.add_argument("--min-p", type=float, default=d.min_p, metavar="M",
                   help="drop tokens less likely than M x the likeliest; 0 = off"
                   " (default %(default)s)")
    p.add_argument("--repetition-penalty", type=float, default=d.repetition_penalty,
                   metavar="R", help="penalise tokens of the last"
                   f" {d.repetition_context_size} by R; 1 = off (default %(default)s)")
    p.add_argument("--seed", type=int, default=None, metavar="S",
                   help="random seed (default: a new one each run)")
    p.add_argument("--max-kv-size", type=int, default=None, metavar="N",
                   help="bound the KV cache to N tokens (rotating); default: the context length")
    p.add_argument("--keep", type=int, default=None, metavar="K",
                   help=f"sink tokens kept when the cache rotates (needs --max-kv-size;"
                   f" default {d.keep})")
    p.add_argument("--overflow", choices=["rotate", "refuse"], default=d.overflow,
                   help="past the cache bound: rotate (keep sinks, evict the oldest) or refuse"
                   " (default %(default)s)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop when this text appears (repeatable)")
    add_kv_arguments(p)


def chat_defaults_note() -> str:
    """--help's epilog: the chat keeps its own sampling defaults (its settings file)."""
    from kvchat.app.core.settings import Settings, settings_path

    s = Settings()
    return (f"These defaults are greedy and reproducible. The chat (kvchat without a command)"
            f" has its own, in {settings_path()}: temperature {s.temp}, top-p {s.top_p},"
            f" min-p {s.min_p}, repetition penalty {s.repetition_penalty},"
            f" max tokens {s.max_tokens}.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = chat_defaults_note()
    add_model_argument(p)
    p.add_argument("--prompt", metavar="TEXT", help="prompt text (default: read stdin)")
    p.add_argument("--system", metavar="TEXT",
                   help="system prompt (a model without a chat template gets it as plain text"
                   " before the prompt, and the prompt then ends with a newline;"
                   " mlx_lm.generate drops it)")
    p.add_argument("--raw", action="store_true",
                   help="skip the chat template; add BOS as the tokenizer says. A model"
                   " without a chat template (a base model) always gets its prompt so, as"
                   " mlx_lm.generate gives it")
    p.add_argument("--tokenizer", choices=["auto", "sentencepiece", "hf"], default="auto",
                   help="tokenizer file to use: auto prefers tokenizer.json over tokenizer.model"
                   " (default %(default)s)")
    add_sampling_arguments(p)
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json-schema", metavar="FILE",
                     help="constrain the reply to JSON valid for the JSON Schema in FILE"
                     " (a keyword that cannot be enforced is refused by name)")
    fmt.add_argument("--json-object", action="store_true",
                     help="constrain the reply to one JSON object")
    add_speculation_arguments(p)
    p.add_argument("--ignore-eos", action="store_true",
                   help="generate --max-tokens tokens: EOS (and a base model's BOS) does not"
                   " end the reply, as llama.cpp's --ignore-eos")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    p.add_argument("--quiet", action="store_true",
                   help="no statistics line on stderr after the text")
    memory.add_argument(p)


def params_from_args(args: argparse.Namespace) -> GenParams:
    return GenParams.from_fields(
        args,
        stop=tuple(t for t in map(_text_arg, args.stop) if t is not None),
        keep=GenParams().keep if args.keep is None else args.keep,
        response_format=_response_format(args),
        **speculation_fields(args),
    )


def _response_format(args: argparse.Namespace) -> dict[str, Any] | None:
    """--json-schema FILE / --json-object as OpenAI's response_format; UsageError (one
    line) for a file that is no JSON object or a schema that cannot be enforced."""
    if getattr(args, "json_object", False):
        return {"type": "json_object"}
    path = getattr(args, "json_schema", None)
    if path is None:
        return None
    try:
        schema = load_json(path, dict)
    except FileNotFoundError:
        raise UsageError(f"--json-schema: {path}: no such file") from None
    except KVChatError as e:
        raise UsageError(f"--json-schema: {e}") from None
    from kvchat.model.runtime.constrained import json_schema_grammar

    try:
        json_schema_grammar(schema, f"--json-schema {path}")  # refused before the model loads
    except KVChatError as e:
        raise UsageError(str(e)) from None
    return {"type": "json_schema", "json_schema": {"name": "schema", "schema": schema}}


QUIT_WAIT_S = 1.0  # how long an interrupted run waits for the engine thread to end


def result_object(done: Done) -> dict[str, Any]:
    """The one --json object: text, ids, finish_reason, every statistic (0 when unknown),
    counts that agree with the ids, and `error` on an error."""
    out: dict[str, Any] = {
        "text": done.text,
        "prompt_ids": list(done.prompt_ids),
        "ids": list(done.ids),
        "finish_reason": done.finish_reason,
        **stats_json(done.stats),
    }
    # one definition each (docs/design.md): the rendered prompt's tokens, the generated ids
    out["prompt_tokens"] = len(done.prompt_ids)
    out["generated_tokens"] = len(done.ids)
    if done.finish_reason == "error":
        out["error"] = done.error or "generation failed"
    return out


def error_done(message: str) -> Done:
    return Done("error", "", [], [], error=message)


def _text_arg(value: str | None) -> str | None:
    """Command-line text as UTF-8: bytes that are not UTF-8 become U+FFFD (Python hands
    them over as lone surrogates, which no tokenizer accepts)."""
    if value is None:
        return None
    return os.fsencode(value).decode("utf-8", errors="replace")


def _read_stdin() -> str:
    data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read()
    if isinstance(data, str):
        return _text_arg(data) or ""
    return data.decode("utf-8", errors="replace")


def _prompt(args: argparse.Namespace) -> tuple[Any, GenParams]:
    """The prompt and parameters from the flags; UsageError on any bad value."""
    if args.keep is not None and args.max_kv_size is None:
        raise UsageError("--keep applies to a bounded cache; give --max-kv-size too")
    kv_quant_from_args(args)  # the K/V flags' errors in the flags' own words
    params = params_from_args(args)
    try:
        params.validate()
    except KVChatError as e:
        raise UsageError(str(e)) from None
    if args.raw and args.system:
        raise UsageError("--system needs the chat template; it cannot be used with --raw")
    if args.prompt is not None:
        text = _text_arg(args.prompt) or ""
    elif not sys.stdin.isatty():
        text = _read_stdin()
    else:
        raise UsageError("give --prompt TEXT or pipe the prompt on stdin")
    if not text.strip():
        raise UsageError("the prompt is empty: give --prompt TEXT or pipe text on stdin")
    if args.raw:
        return text, params
    system = _text_arg(args.system)
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": text}
    ]
    return messages, params


def as_the_model_expects(prompt: Any, info: dict[str, Any]) -> Any:
    """The prompt as mlx_lm.generate builds it: a model without a chat template gets the
    text itself (BOS as its tokenizer adds it). The chat's plain template would end it
    with a newline (model/text/chat_template.py: so each reply of a chat starts on a line
    of its own), one token more than mlx-lm and another continuation. With a system
    prompt the plain template stays: mlx_lm.generate would drop it."""
    if isinstance(prompt, list) and len(prompt) == 1 and not info.get("chat_template"):
        return prompt[0]["content"]
    return prompt


def run(args: argparse.Namespace) -> int:
    """One turn. Every outcome (usage, load, turn error, Ctrl+C) ends the same way: with
    --json exactly one object on stdout; otherwise the text, then one stderr line on error.
    Exit status: 0 ok, 1 error, 2 usage, 130 cancelled."""
    safe = SafeStream()
    streamed = False

    def stream(delta: str) -> None:
        nonlocal streamed
        streamed = True
        sys.stdout.write(safe.feed(delta))  # model text may hold terminal escapes
        sys.stdout.flush()

    rc = 0
    try:
        prompt, params = _prompt(args)
        memory.require_fit(args.model or DEFAULT_MODEL, params.max_kv_size,
                           kv_quant_from_args(args), ignore=args.ignore_memory_check)
        service = EngineService("thread", EngineOptions(tokenizer=args.tokenizer))
        runner = service.client(args.model or DEFAULT_MODEL,
                                on_delta=None if args.json else stream)
        try:
            done = runner.run(as_the_model_expects(prompt, runner.info), params)
        except BaseException:
            runner.close(QUIT_WAIT_S)
            raise
        # a cancelled run may leave the engine busy: don't wait long (the CLI then exits
        # without waiting for it, see app.main.finish)
        runner.close(QUIT_WAIT_S if done.finish_reason == "cancelled" else 10.0)
    except UsageError as e:
        done, rc = error_done(str(e)), 2
    except KVChatError as e:
        done, rc = error_done(str(e)), 1
    except KeyboardInterrupt:
        done = Done("cancelled", "", [], [])
    except Exception as e:  # a bug: still one line (a traceback with KVCHAT_DEBUG=1)
        if interrupted(e):
            done = Done("cancelled", "", [], [])
        else:
            if debug():
                traceback.print_exc()
            done, rc = error_done(error_line(e)), 1
    if done.finish_reason == "cancelled":
        rc = 130
    elif done.finish_reason == "error" and rc == 0:
        rc = 1
    if args.json:
        print(json_text(result_object(done)))
    else:
        tail = safe.flush()
        if streamed or tail:
            sys.stdout.write(tail + "\n")
        sys.stdout.flush()
        if done.finish_reason == "context_full":  # --overflow refuse: say why it stopped
            print(f"kvchat: {context_full_line(done)}", file=sys.stderr)
        if done.finish_reason not in ("error", "cancelled") and not args.quiet:
            print(f"kvchat: {stats_line(done)}", file=sys.stderr)
            if done.stats.speculation_note:  # asked for and not possible: say why
                print(f"kvchat: {done.stats.speculation_note}", file=sys.stderr)
    if done.finish_reason == "error":
        report(done.error or "generation failed")
    return rc


def context_full_line(done: Done) -> str:
    cap = done.stats.cache_capacity
    window = f"the {cap:,}-token cache" if cap else "the cache"
    return (f"stopped: {window} is full (--overflow refuse); give a larger --max-kv-size"
            " or --overflow rotate")


def stats_line(done: Done) -> str:
    """Plain mode's one line on stderr, as mlx_lm.generate prints it: the prompt and the
    generation (tokens and rate), then the peak memory of the turn."""
    s = done.stats
    return (f"prompt {len(done.prompt_ids):,} tokens at {s.prefill_tps or 0:,.1f} tok/s"
            f" · generated {len(done.ids):,} tokens at {s.decode_tps or 0:,.1f} tok/s"
            + (f" · {speculation_summary(done.stats)}" if s.speculation else "")
            + f" · peak memory {human_bytes(s.peak_memory or 0)}")


def speculation_summary(s: Any) -> str:
    """What speculation did this reply: drafts accepted, and tokens per forward pass."""
    return (f"{s.speculation}: {s.accepted or 0:,} of {s.drafted or 0:,} drafted accepted"
            f" ({(s.acceptance or 0):.0%}), {s.tokens_per_forward or 0:.2f} tokens per pass")
