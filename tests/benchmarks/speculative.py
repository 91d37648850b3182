"""Speculative decoding measured: plain decoding beside prompt lookup and a draft model,
each with the adaptive draft length (the policy `kvchat` runs) and with a fixed one, on a
reply that quotes the conversation and on a free story, per model.

    python -m tests.benchmarks.speculative [--models mini 135m hybrid] [--runs 3] [--json]

Tasks, as chat turns through the model's template where it has one:
- `quote`: the conversation holds the model's own earlier answer and the question is
  asked again, so the reply repeats it (kvchat-mini cannot follow "repeat this paragraph
  fixing the spelling": asked that, it says it does not know);
- `story`: "Tell me a story about a brave cat." (nothing to quote).

Models: `mini` the shipped kvchat-mini (its draft model a random 2-layer model with its
vocabulary: timings only, its drafts are noise; stories260K cannot draft for it, its
tokenizer differs, checked and printed); `135m` a random float32 model of SmolLM-135M's
shape (tests/benchmarks/threads.py) with a random 2-layer draft: random weights write no
text, so every acceptance there is meaningless, only the costs are real; `hybrid` the tiny
random Qwen3-Next of the tests (tests/helpers/hybrid_families.py: gated delta rule,
attention, gated delta rule; built by transformers), whose rejected drafts are taken back
by rolling its recurrent states back (docs/design.md, "Speculative decoding"), with the
same kind of random draft: costs only.

Columns: decode tok/s (docs/design.md's definition, median of --runs repeats that each run
every method once, in turn, so load moves them alike), ÷ plain per repeat (median, and the
lowest and highest repeat),
acceptance (kept ÷ drafted), tokens per forward pass, and whether the greedy ids equal
plain decoding's. `oracle` drafts the plain reply's own next ids (every draft right, no
cost): the most any source could gain on this machine. `pass cost` is the time of one
compiled pass of n tokens ÷ one of 1 token, at the prompt's length: where n tokens cost
about n passes, no draft can pay. The machine, its load average before and after, and the
date are printed: measure on a quiet machine and say the load.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from collections.abc import Iterator
from typing import Any

from kvchat.app.core.discovery import DEFAULT_MODEL

from .threads import SMOL_135M, STORIES, cpu_model

DRAFT_SHAPE = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
               "num_attention_heads": 4, "num_key_value_heads": 2}
QUESTION = "What is a KV cache?"
STORY = "Tell me a story about a brave cat."
K = 4  # the fixed draft length, and the adaptive one's most
METHODS = ("plain", "lookup", "lookup k=4", "draft", "draft k=4", "oracle k=4")


def random_model(shape: dict[str, Any], seed: int = 0) -> Any:
    import mlx.core as mx

    from kvchat.model.decoder.config import ModelConfig
    from kvchat.model.decoder.transformer import Transformer

    mx.random.seed(seed)
    model = Transformer(ModelConfig.from_dict(shape))
    mx.eval(model.parameters())
    return model


def hybrid_model(name: str) -> Any:
    """A tiny random checkpoint of tests/helpers/hybrid_families.py, built and loaded."""
    import tempfile
    from pathlib import Path

    import mlx.core as mx

    from kvchat.model.decoder.weights import load_model
    from tests.helpers.families import build
    from tests.helpers.hybrid_families import HYBRID_SPECS

    with tempfile.TemporaryDirectory() as tmp:
        model = load_model(build(HYBRID_SPECS[name], Path(tmp)))
        mx.eval(model.parameters())  # read before the folder goes
    return model


def load_pair(name: str) -> tuple[Any, Any, Any, str]:
    """(target, draft, tokenizer or None, what the draft is)."""
    from kvchat.model.decoder.weights import load_model
    from kvchat.model.runtime.speculative import tokenizer_mismatch
    from kvchat.model.text.tokenizer import load_tokenizer

    if name == "mini":
        target, tok = load_model(DEFAULT_MODEL), load_tokenizer(DEFAULT_MODEL)
        why = tokenizer_mismatch(tok, load_tokenizer(STORIES))
        shape = {**SMOL_135M, **DRAFT_SHAPE, "vocab_size": target.config.vocab_size,
                 "max_position_embeddings": target.config.max_position_embeddings}
        return target, random_model(shape, 1), tok, (
            f"random 2-layer model, timings only (stories260K cannot draft: {why})")
    if name == "hybrid":
        target = hybrid_model("qwen3_next")
        shape = {**SMOL_135M, **DRAFT_SHAPE, "vocab_size": target.config.vocab_size}
        return target, random_model(shape, 1), None, (
            "random 2-layer model; the target is random too: acceptance meaningless")
    target = random_model(SMOL_135M)
    return target, random_model({**SMOL_135M, **DRAFT_SHAPE}, 1), None, (
        "random 2-layer model; the target's weights are random too: acceptance meaningless")


def prompts(tok: Any, model: Any) -> dict[str, list[int]]:
    """The two tasks' prompt ids (the quote task's earlier answer is the model's own)."""
    if tok is None:  # random weights: ids of the same lengths, a paragraph quoted twice
        vocab = model.config.vocab_size
        para = [16 + (97 * i) % (vocab - 16) for i in range(48)]
        return {"quote": para + [5, 6, 7] + para[:4], "story": para[:16]}
    answer = reply(model, tok.encode_chat([{"role": "user", "content": QUESTION}]), "plain",
                   120, tok.end_ids)[0]
    quote = tok.encode_chat([{"role": "user", "content": QUESTION},
                             {"role": "assistant", "content": tok.decode(answer, True)},
                             {"role": "user", "content": QUESTION}])
    return {"quote": quote, "story": tok.encode_chat([{"role": "user", "content": STORY}])}


class Oracle:
    """Drafts the plain reply's own next ids: every draft right, at no cost."""

    name = "oracle"

    def __init__(self, prompt: list[int], ids: list[int]) -> None:
        self.full = prompt + ids

    def propose(self, history: list[int], k: int) -> tuple[list[int], None]:
        n = len(history)
        return self.full[n : n + k], None


def reply(model: Any, prompt: list[int], method: str, gen: int, stop: list[int],
          draft: Any = None, plain_ids: list[int] | None = None
          ) -> tuple[list[int], float, Any]:
    """One greedy reply: (ids, decode tok/s, progress); prefill not timed."""
    from kvchat.model.cache.kv import make_prompt_cache
    from kvchat.model.runtime.generate import Progress, decode, prefill
    from kvchat.model.runtime.sampling import Sampler
    from kvchat.model.runtime.speculative import DraftModel, PromptLookup, speculative_decode

    caches = make_prompt_cache(model)
    progress = Progress()
    logits = list(prefill(model, prompt, caches, progress=progress))[-1]
    steps: Iterator[int]
    if method == "plain":
        steps = decode(model, logits, caches, max_tokens=gen, progress=progress)
    else:
        kind, _, fixed = method.partition(" ")
        if kind == "lookup":
            source: Any = PromptLookup(3)
        elif kind == "oracle":
            source = Oracle(prompt, plain_ids or [])
        else:
            source = DraftModel(draft, "draft")
        steps = speculative_decode(model, logits, caches, source=source, sampler=Sampler(),
                                   n_ids=model.config.vocab_size, history=prompt,
                                   max_tokens=gen, draft_tokens=K, adaptive=not fixed,
                                   progress=progress)
    ids: list[int] = []
    t_first = t_last = time.perf_counter()
    for tok in steps:
        t_last = time.perf_counter()
        if not ids:
            t_first = t_last
        ids.append(tok)
        if tok in stop:
            break
    steps.close()
    span = t_last - t_first
    return ids, (len(ids) - 1) / span if span > 0 and len(ids) > 1 else 0.0, progress


def pass_costs(model: Any, prompt: list[int], repeats: int = 5) -> dict[int, float]:
    """One compiled pass of n tokens ÷ one of 1, at the prompt's length (best of repeats)."""
    import mlx.core as mx

    from kvchat.model.cache.kv import make_prompt_cache, trim_to
    from kvchat.model.cache.state import set_rollback
    from kvchat.model.runtime import threads
    from kvchat.model.runtime.generate import CompiledStep, Progress, prefill

    threads.apply_decode(threads.step_work(model))
    caches = make_prompt_cache(model)
    list(prefill(model, prompt, caches, progress=Progress()))
    set_rollback(caches, 5)  # a recurrent state keeps what a pass may take back, as a reply
    step, base = CompiledStep(model, caches), caches[0].offset
    best: dict[int, float] = {}
    for _ in range(repeats):
        for n in (1, 2, 3, 5):
            ys = mx.array(prompt[:n])
            for timed in (False, True):  # the first call traces
                t = time.perf_counter()
                mx.eval(step.verify(ys) if n > 1 else step(ys))
                trim_to(caches, base)
                if timed:
                    best[n] = min(best.get(n, float("inf")), time.perf_counter() - t)
    return {n: best[n] / best[1] for n in best}


def kept_states_cost(model: Any, prompt: list[int], n: int = 5, repeats: int = 7
                     ) -> float | None:
    """A pass of n tokens through the model (uncompiled) that keeps every position's
    recurrent state (the decode form, token by token) ÷ the same pass in the prompt form
    keeping the last state only: what taking drafts back costs a verify pass. None for a
    model without recurrent layers."""
    import mlx.core as mx

    from kvchat.model.cache.kv import make_prompt_cache
    from kvchat.model.cache.state import StateCache, set_rollback
    from kvchat.model.runtime.generate import Progress, prefill

    caches = make_prompt_cache(model)
    if not any(isinstance(c, StateCache) for c in caches):
        return None
    list(prefill(model, prompt, caches, progress=Progress()))
    saved = [c.state for c in caches]
    ys = mx.array([prompt[:n]])
    best: dict[int, float] = {}
    for _ in range(repeats):
        for keep in (0, n):
            for timed in (False, True):
                set_rollback(caches, keep)
                t = time.perf_counter()
                mx.eval(model(ys, cache=caches))
                mx.eval([c.state for c in caches])
                if timed:
                    best[keep] = min(best.get(keep, float("inf")), time.perf_counter() - t)
                for c, st in zip(caches, saved, strict=True):
                    c.state = st
    set_rollback(caches, 0)
    return best[n] / best[0]


def measure(name: str, runs: int, gen: int) -> dict[str, Any]:
    target, draft, tok, draft_note = load_pair(name)
    stop = tok.end_ids if tok is not None else []
    out: dict[str, Any] = {"model": name, "draft": draft_note, "tasks": {}}
    tasks = prompts(tok, target)
    for task, prompt in tasks.items():
        plain_ids = reply(target, prompt, "plain", gen, stop)[0]
        for m in METHODS:  # warm-up: traces of every pass length, the draft's too
            reply(target, prompt, m, gen, stop, draft, plain_ids)
        rows: dict[str, list[dict[str, Any]]] = {m: [] for m in METHODS}
        for _ in range(runs):
            for m in METHODS:
                ids, tps, p = reply(target, prompt, m, gen, stop, draft, plain_ids)
                rows[m].append({"tps": tps, "same": ids == plain_ids, "drafted": p.drafted,
                                "accepted": p.accepted, "forwards": p.forwards,
                                "tokens": len(ids)})
        plain = [r["tps"] for r in rows["plain"]]
        table = {}
        for m, rs in rows.items():
            drafted = sum(r["drafted"] for r in rs)
            passes = sum(r["forwards"] for r in rs)
            ratios = [r["tps"] / p for r, p in zip(rs, plain, strict=True)]
            table[m] = {
                "tps": statistics.median(r["tps"] for r in rs),
                "vs_plain": statistics.median(ratios),
                "vs_plain_repeats": ratios,
                "acceptance": sum(r["accepted"] for r in rs) / drafted if drafted else None,
                "tokens_per_pass": sum(r["tokens"] - 1 for r in rs) / passes if passes else None,
                "same_ids": all(r["same"] for r in rs),
            }
        out["tasks"][task] = {"prompt_tokens": len(prompt), "reply_tokens": len(plain_ids),
                              "methods": table}
    out["pass_cost"] = pass_costs(target, tasks["quote"])
    out["kept_states_cost"] = kept_states_cost(target, tasks["quote"])
    return out


def loadavg() -> str:
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "unknown"


def render(result: dict[str, Any]) -> str:
    lines = [f"machine: {result['cpu']}, {result['cores']} cores; load average (1, 5, 15"
             f" min) {result['load_before']} before, {result['load_after']} after;"
             f" {result['date']}"]
    for m in result["models"]:
        lines.append(f"\nmodel {m['model']} (draft: {m['draft']})")
        lines.append("pass cost (n tokens ÷ 1): " + ", ".join(
            f"{n}: {c:.2f}" for n, c in sorted(m["pass_cost"].items(), key=lambda x: int(x[0]))))
        if m.get("kept_states_cost") is not None:
            lines.append("a 5-token pass keeping each position's recurrent state ÷ the prompt"
                         f" form (uncompiled): {m['kept_states_cost']:.2f}")
        lines.append(f"{'task':<7}{'method':<12}{'tok/s':>9}{'÷ plain':>9}{'(min–max)':>13}"
                     f"{'accept':>8}{'tok/pass':>9}  same ids")
        for task, t in m["tasks"].items():
            for meth, r in t["methods"].items():
                acc = "–" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
                tpp = "–" if r["tokens_per_pass"] is None else f"{r['tokens_per_pass']:.2f}"
                spread = f"{min(r['vs_plain_repeats']):.2f}–{max(r['vs_plain_repeats']):.2f}"
                lines.append(f"{task:<7}{meth:<12}{r['tps']:>9.1f}{r['vs_plain']:>9.2f}"
                             f"{spread:>13}{acc:>8}{tpp:>9}  {'yes' if r['same_ids'] else 'NO'}")
            lines.append(f"{'':7}({t['prompt_tokens']} prompt tokens, a reply of"
                         f" {t['reply_tokens']})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=["mini", "135m", "hybrid"],
                   default=["mini", "135m"])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--gen-tokens", type=int, default=96,
                   help="most tokens per reply (kvchat-mini stops at its end of text)")
    p.add_argument("--gen-tokens-135m", type=int, default=32)
    p.add_argument("--json", action="store_true")
    p.add_argument("--render", metavar="FILE", help="print the table of a --json result")
    args = p.parse_args(argv)
    if args.render:
        print(render(json.loads(open(args.render).read())))
        return 0
    result: dict[str, Any] = {
        "cpu": cpu_model(), "cores": os.cpu_count(), "load_before": loadavg(),
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "models": []}
    for name in args.models:
        gen = args.gen_tokens_135m if name == "135m" else args.gen_tokens
        result["models"].append(measure(name, args.runs, gen))
    result["load_after"] = loadavg()
    print(json.dumps(result) if args.json else render(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
