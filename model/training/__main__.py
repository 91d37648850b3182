"""`python -m kvchat.model.training`: data, train, export, all, sample, bench, eval (see the
package docstring)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvchat.model.errors import KVChatError

from . import __doc__ as USAGE
from .data import build_data
from .export import BITS, GROUP_SIZE, export
from .loop import BLOCKS, PRESETS, TrainArgs, train
from .sample import cmd_bench, cmd_eval, cmd_sample


def _train_args(ns: argparse.Namespace) -> TrainArgs:
    return TrainArgs(**{k: getattr(ns, k) for k in TrainArgs.__dataclass_fields__})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvchat.model.training", description=USAGE,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    default_data, default_run = "/tmp/kvchat-train/data", "/tmp/kvchat-train/run"

    def data_opts(p: argparse.ArgumentParser) -> None:
        p.add_argument("--data", default=default_data, help="corpus + tokenizer folder")
        p.add_argument("--n-train", type=int, default=60000)
        p.add_argument("--n-val", type=int, default=2000)
        p.add_argument("--vocab-size", type=int, default=3072)

    def train_opts(p: argparse.ArgumentParser) -> None:
        d = TrainArgs(data="", run="")
        p.add_argument("--run", default=default_run, help="checkpoint folder")
        p.add_argument("--preset", choices=sorted(PRESETS), default=d.preset)
        for name in ("steps", "batch", "seq_len", "warmup", "ckpt_every", "eval_every",
                     "log_every", "eval_rows"):
            p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
        for name in ("lr", "final_lr_frac", "weight_decay", "clip"):
            p.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name))
        p.add_argument("--resume", action="store_true", help="continue from --run's checkpoint")
        p.add_argument("--block", choices=BLOCKS, default=d.block,
                       help="2024: RMSNorm pre-norm, SwiGLU, RoPE, GQA (the shipped model);"
                       " 2017: post-LayerNorm, ReLU FFN, sinusoidal positions, MHA")

    p = sub.add_parser("data", help="generate the corpus and train the tokenizer")
    data_opts(p)
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("train", help="train (or --resume) the model")
    data_opts(p)
    train_opts(p)
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("export", help="quantize the checkpoint and write the model folder")
    data_opts(p)
    p.add_argument("--run", default=default_run)
    p.add_argument("--out", default="assets/kvchat-mini")
    p.add_argument("--group-size", type=int, default=GROUP_SIZE)
    p.add_argument("--bits", type=int, default=BITS)
    p = sub.add_parser("all", help="data, train, export")
    data_opts(p)
    train_opts(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="assets/kvchat-mini")
    p = sub.add_parser("sample", help="replies to the showcase prompts")
    p.add_argument("--model", default="assets/kvchat-mini")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p.add_argument("--system", default=None)
    p.add_argument("--temp", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--markdown", help="also write the replies as markdown here")
    p = sub.add_parser("bench", help="TTFT and decode tokens/s")
    p.add_argument("--model", default="assets/kvchat-mini")
    p.add_argument("--prompt", default="Tell me a short story.")
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=5)
    p = sub.add_parser("blocks", help="the 2017 and 2024 runs side by side (markdown)")
    p.add_argument("runs", nargs=2, metavar="RUN", help="two --run folders (trained)")
    p.add_argument("--gen-tokens", type=int, default=128)
    p = sub.add_parser("eval", help="validation loss and perplexity of a model folder")
    p.add_argument("--model", default="assets/kvchat-mini")
    p.add_argument("--data", default=default_data)
    p.add_argument("--seq-len", type=int, default=256)
    ns = ap.parse_args(argv)
    try:
        if ns.cmd in ("data", "all"):
            build_data(Path(ns.data), ns.n_train, ns.n_val, ns.vocab_size, ns.seed)
        if ns.cmd in ("train", "all"):
            train(_train_args(ns), resume=ns.resume)
        if ns.cmd in ("export", "all"):
            export(Path(ns.run), Path(ns.data), Path(ns.out), getattr(ns, "group_size",
                   GROUP_SIZE), getattr(ns, "bits", BITS))
        if ns.cmd == "sample":
            cmd_sample(ns)
        if ns.cmd == "bench":
            cmd_bench(ns)
        if ns.cmd == "eval":
            cmd_eval(ns)
        if ns.cmd == "blocks":
            from .blocks import compare_blocks

            print(compare_blocks([Path(r) for r in ns.runs], ns.gen_tokens))
    except KVChatError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
