"""Try a model folder out: replies to the showcase prompts, TTFT and decode speed, and
validation loss. Replies and speed go through the app's engine (model.client), so what
is reported here is what `kvchat` does."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from kvchat.model.runtime.client import EngineClient
from kvchat.model.runtime.events import GenParams

from .data import log, pack_rows
from .loop import evaluate

SHOWCASE_PROMPTS = [
    "Hello!", "What is kvchat?", "What is a KV cache?", "Explain GQA.", "What does RoPE do?",
    "What is RMSNorm?", "What is SwiGLU?", "Tell me a short story.",
    "Tell me a story about a cat.", "Who are you?",
]


def reply(client: EngineClient, prompt: str, temp: float, seed: int = 0,
          max_tokens: int = 256, system: str | None = None) -> tuple[str, str, int]:
    """(text, finish_reason, generated tokens) for one user prompt, from a fresh cache."""
    msgs = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}]
    client.reset()
    done = client.run(msgs, GenParams(max_tokens=max_tokens, temp=temp, seed=seed))
    return done.text, done.finish_reason, len(done.ids) - (done.finish_reason == "eos")


def cmd_sample(args: argparse.Namespace) -> None:
    prompts = args.prompt or SHOWCASE_PROMPTS
    rows = []
    with EngineClient(args.model) as client:
        for p in prompts:
            g = reply(client, p, 0.0, max_tokens=args.max_tokens, system=args.system)
            s = reply(client, p, args.temp, seed=args.seed, max_tokens=args.max_tokens,
                      system=args.system)
            rows.append((p, g, s))
            print(f"> {p}\n  greedy [{g[1]}, {g[2]} tok]: {g[0]}\n"
                  f"  temp {args.temp} [{s[1]}, {s[2]} tok]: {s[0]}\n", flush=True)
    n_g = sum(r[1][1] == "eos" for r in rows)
    n_s = sum(r[2][1] == "eos" for r in rows)
    print(f"ended at EOS: greedy {n_g}/{len(rows)}, sampled {n_s}/{len(rows)}")
    if args.markdown:
        md = [f"# kvchat-mini: sample replies\n\nModel: `{args.model}` (4-bit). Greedy, and"
              f" sampled at temperature {args.temp} with seed {args.seed}; at most"
              f" {args.max_tokens} new tokens. Ended at EOS: greedy {n_g}/{len(rows)},"
              f" sampled {n_s}/{len(rows)}.\n"
              f"\nReproduce: `python -m kvchat.model.training sample --model {args.model}`\n"]
        for p, g, s in rows:
            md.append(f"\n**{p}**\n\n- greedy: {g[0]}" + ("" if g[1] == "eos" else
                                                           " *(token limit)*")
                      + f"\n- sampled: {s[0]}" + ("" if s[1] == "eos" else " *(token limit)*")
                      + "\n")
        Path(args.markdown).write_text("".join(md))
        log(f"wrote {args.markdown}")


def cmd_bench(args: argparse.Namespace) -> None:
    """TTFT and decode tok/s of the model through the engine (median of runs)."""
    msgs = [{"role": "user", "content": args.prompt}]
    params = GenParams(max_tokens=args.gen_tokens, ignore_eos=True)
    with EngineClient(args.model) as client:
        client.run(msgs, GenParams(max_tokens=16, ignore_eos=True))  # warm-up
        runs = []
        for _ in range(args.runs):
            client.reset()
            runs.append(client.run(msgs, params).stats)
    device = runs[-1].device
    print(json.dumps({
        "prompt_tokens": runs[-1].prompt_tokens, "gen_tokens": args.gen_tokens,
        "ttft_s": float(np.median([s.ttft_s or 0.0 for s in runs])),
        "decode_tps": float(np.median([s.decode_tps or 0.0 for s in runs])),
        "device": device,
    }))


def cmd_eval(args: argparse.Namespace) -> None:
    from kvchat.model.decoder.weights import load_model

    model = load_model(Path(args.model))
    ids, mask = pack_rows(Path(args.data) / "val_tokens.npz", args.seq_len, None)
    vl = evaluate(model, ids, mask)
    print(json.dumps({"model": args.model, "val_loss": vl, "val_ppl": math.exp(vl),
                      "val_rows": len(ids), "loss_tokens": int(mask[:, 1:].sum())}))
