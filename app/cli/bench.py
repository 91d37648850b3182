"""`kvchat bench`: prefill and decode speed of our engine, optionally beside mlx-lm's
generation loop on the same folder, the same prompt ids and the same dtype.

Honest by construction:
- runs alternate, ours then mlx-lm's (A B A B …), after one warm-up run of each, so a
  machine that gets busier or quieter moves both sides alike;
- mlx-lm runs in our compute dtype (its float parameters cast), and the dtypes of both
  sides are printed; if they still differ the ratio is refused unless
  --allow-dtype-mismatch;
- min / median / max per side, and the ratio of every A B pair;
- one decode roofline: kvchat's bytes read per generated token (its weights + resident
  K/V at the middle of the reply) over a measured memory bandwidth; both sides' tok/s
  are given as a fraction of that same roofline, and every ratio is kvchat ÷ mlx-lm;
- the OpenBLAS thread policy in effect is printed (model/runtime/threads.py);
- with --prompt-lookup or --draft-model, speculative decoding runs beside plain decoding
  on the same engine and prompt ids (plain, speculative, plain, … after a warm-up of
  each), with its acceptance and tokens per forward pass, and speculative ÷ plain per pair.

A quantized folder (the shipped kvchat-mini) is dequantized by kvchat on the CPU; mlx-lm's
own 4-bit CPU path is no comparison, so give mlx-lm a float copy of the same weights made
by its own converter: `python -m mlx_lm convert --hf-path assets/kvchat-mini -d --dtype
float32 --mlx-path /tmp/mini-f32`, then `--mlx-lm-model /tmp/mini-f32`.

Definitions (docs/design.md): prefill_tps = prompt tokens / prefill seconds; decode_tps =
(generated − 1) / (time of last token − time of first token). mlx-lm is timed with the
same definitions around `mlx_lm.generate.generate_step`.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time
from typing import Any

import numpy as np

from kvchat.app.cli.generate import add_model_argument
from kvchat.app.core import blas, kv_quality, memory
from kvchat.app.core.discovery import DEFAULT_MODEL
from kvchat.app.core.engine_service import EngineOptions, EngineService
from kvchat.app.core.errors import UsageError, report
from kvchat.app.core.kv_args import add_kv_arguments, kv_quant_from_args
from kvchat.app.core.speculation_args import add_speculation_arguments, speculation_fields
from kvchat.app.core.text import json_text
from kvchat.model.cache.kv_math import kv_bytes_per_token
from kvchat.model.decoder.kv_format import KVQuant
from kvchat.model.errors import KVChatError
from kvchat.model.gguf_file import is_gguf
from kvchat.model.runtime import threads
from kvchat.model.runtime.events import GenParams

METRICS = ("prefill_tps", "decode_tps", "ttft_s")
RATIO = "kvchat ÷ mlx-lm"  # how every ratio is taken (the label printed beside it)
SPEC_RATIO = "speculative ÷ plain"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_argument(p)
    p.add_argument("--prompt-tokens", type=int, default=128, metavar="N",
                   help="prompt length in tokens: fixed pseudo-random ids, the same for both"
                   " sides (default %(default)s)")
    p.add_argument("--gen-tokens", type=int, default=64, metavar="M",
                   help="tokens generated per timed run (default %(default)s)")
    p.add_argument("--runs", type=int, default=3, metavar="R",
                   help="timed runs per side, after a short warm-up run (default %(default)s)")
    p.add_argument("--against", choices=["mlx-lm"], help="also time mlx-lm on the same ids")
    p.add_argument("--mlx-lm-model", metavar="DIR",
                   help="the folder mlx-lm loads (default: --model); e.g. a float32 copy of a"
                   " quantized model made by `python -m mlx_lm convert -d --dtype float32`")
    p.add_argument("--mlx-lm-dtype", choices=["ours", "native"], default="ours",
                   help="ours: cast mlx-lm's float parameters to our compute dtype (default);"
                   " native: the dtype mlx-lm loads the folder in")
    p.add_argument("--allow-dtype-mismatch", action="store_true",
                   help="print ratios even when the two sides compute in different dtypes")
    p.add_argument("--no-compile", action="store_true",
                   help="decode with the plain (uncompiled) step")
    p.add_argument("--keep-quantized", action="store_true",
                   help="keep quantized weights quantized (CPU default: dequantize)")
    add_kv_arguments(p)
    memory.add_argument(p)
    add_speculation_arguments(p)
    p.add_argument("--agreement-tokens", type=int, default=512, metavar="N",
                   help="with --kv-bits: also measure greedy agreement with the float cache"
                   " over N tokens (0 = skip; default %(default)s); the settings screen shows"
                   " the result")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (the machine, every timed run, min / median /"
                   " max) instead of the table")


def prompt_ids(vocab: int, n: int, seed: int = 0) -> list[int]:
    """Deterministic ids away from the low special-token range."""
    rng = random.Random(seed)
    lo = min(16, vocab - 1)
    return [rng.randrange(lo, vocab) for _ in range(n)]


def summary(values: list[float]) -> dict[str, Any]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values),
            "runs": values}


def memory_bandwidth(n_bytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes per second of a large array copy (read + write), best of `repeats`."""
    src = np.ones(n_bytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return 2 * n_bytes / best


def float_dtype(model: Any) -> str:
    """The dtype a model computes in: that of its final norm weight."""
    return str(model.model.norm.weight.dtype).removeprefix("mlx.core.")


def weights_label(bits: int | None, dequantized: bool, dtype: str) -> str:
    if bits is None:
        return dtype
    return f"{bits}-bit dequantized to {dtype}" if dequantized else f"{bits}-bit"


class _Ours:
    def __init__(self, path: str, compiled: bool, q: KVQuant | None = None):
        # on a thread of this process, as `generate` runs it (and its tokenizer is read)
        self.runner = EngineService("thread", EngineOptions(compiled=compiled)).client(path)
        self.info = self.runner.info
        self.kv = {} if q is None else {"kv_bits": q.bits, "kv_group_size": q.group_size,
                                        "quantized_kv_start": q.start}

    def once(self, ids: list[int], gen: int, spec: dict[str, Any] | None = None
             ) -> dict[str, Any]:
        self.runner.engine.reset()
        done = self.runner.run(ids, GenParams(max_tokens=gen, temp=0.0, ignore_eos=True,
                                              **self.kv, **(spec or {})))
        if done.finish_reason == "error":
            raise RuntimeError(done.error)
        s = done.stats
        return {k: getattr(s, k) or 0.0 for k in (*METRICS, "peak_memory")} | {
            "compiled_step": s.compiled_step, "ids": done.ids,
            **{k: getattr(s, k) for k in ("speculation", "drafted", "accepted",
                                          "tokens_per_forward", "speculation_note")}}

    def close(self) -> None:
        self.runner.close()


class _MlxLm:
    def __init__(self, path: str, dtype: str | None, kv: dict[str, Any] | None = None):
        import mlx.core as mx
        from mlx.utils import tree_flatten
        from mlx_lm import load

        self.mx = mx
        self.model, _ = load(path)
        if dtype is not None:
            self.model.set_dtype(getattr(mx, dtype))
        self.dtype = float_dtype(self.model)
        self.weight_bytes = sum(a.nbytes for _, a in tree_flatten(self.model.parameters()))
        self.kv = kv or {}  # mlx-lm's kv_bits / kv_group_size / quantized_kv_start

    def once(self, ids: list[int], gen: int) -> dict[str, float]:
        from mlx_lm.generate import generate_step

        mx = self.mx
        # the same OpenBLAS as ours, at the count our policy gives this model's decode
        # steps (mlx-lm cannot switch counts between its prefill and its decode)
        self.threads = threads.apply_decode(threads.step_work(self.model))
        mx.reset_peak_memory()
        prompt = mx.array(ids)
        t0 = time.perf_counter()
        t_first = t_last = t0
        count = 0
        for tok, _ in generate_step(prompt, self.model, max_tokens=gen,
                                    sampler=lambda x: mx.argmax(x, axis=-1), **self.kv):
            _ = int(tok)
            t_last = time.perf_counter()
            if count == 0:
                t_first = t_last
            count += 1
        span = t_last - t_first
        return {
            "prefill_tps": len(ids) / (t_first - t0),
            "decode_tps": (count - 1) / span if count > 1 and span > 0 else 0.0,
            "ttft_s": t_first - t0,
            "peak_memory": mx.get_peak_memory(),
        }


def _side(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {k: summary([r[k] for r in rows]) for k in METRICS}
    out["peak_memory"] = max(r["peak_memory"] for r in rows)
    return out


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run(args: argparse.Namespace) -> int:
    if args.prompt_tokens < 1 or args.gen_tokens < 2 or args.runs < 1:
        report("--prompt-tokens must be >= 1, --gen-tokens >= 2 and --runs >= 1")
        return 2
    try:
        q = kv_quant_from_args(args)
        spec = speculation_fields(args)
    except UsageError as e:
        report(str(e))
        return 2
    if args.against and not args.mlx_lm_model and is_gguf(str(args.model or DEFAULT_MODEL)):
        report("--against mlx-lm: mlx-lm reads model folders, not GGUF files; give it one"
               " with --mlx-lm-model DIR")
        return 2
    speculative = spec if spec["speculation"] != "off" else None
    if args.keep_quantized:
        os.environ["KVCHAT_KEEP_QUANTIZED"] = "1"
    import mlx.core as mx

    path = str(args.model or DEFAULT_MODEL)
    try:  # the runs hold at most the prompt and the generated tokens
        memory.require_fit(path, None, q, kv_tokens=args.prompt_tokens + args.gen_tokens,
                           ignore=args.ignore_memory_check)
    except KVChatError as e:
        report(str(e))
        return 1
    ours = _Ours(path, compiled=not args.no_compile, q=q)
    try:
        info = ours.info
        tokenizer = ours.runner.engine.tokenizer
        vocab = min(info["vocab_size"], tokenizer.vocab_size if tokenizer else 1 << 30)
        ids = prompt_ids(vocab, args.prompt_tokens)
        ref = None
        ref_kv, ref_kv_note = _mlx_lm_kv(q, info["head_dim"])
        if args.against == "mlx-lm":
            ref = _MlxLm(args.mlx_lm_model or path,
                         info["dtype"] if args.mlx_lm_dtype == "ours" else None, ref_kv)
        # warm-up (traces the compiled step, fills allocator caches), then A B A B …
        ours.once(ids[:8], 4)
        if ref is not None:
            ref.once(ids[:8], 4)
        if speculative is not None:  # loads the draft model, traces the verify step
            ours.once(ids[:8], 8, speculative)
        a_rows, b_rows, s_rows = [], [], []
        for _ in range(args.runs):
            a_rows.append(ours.once(ids, args.gen_tokens))
            if ref is not None:
                b_rows.append(ref.once(ids, args.gen_tokens))
            if speculative is not None:
                s_rows.append(ours.once(ids, args.gen_tokens, speculative))
    finally:
        ours.close()

    kv_token = kv_bytes_per_token(info["n_layers"], info["n_kv_heads"], info["head_dim"],
                                  getattr(mx, info["dtype"]).size, q=q)
    context = args.prompt_tokens + args.gen_tokens // 2  # mean resident tokens while decoding
    bandwidth = memory_bandwidth()
    ours_bytes = info["weight_bytes"] + kv_token * context
    result: dict[str, Any] = {
        "model": path,
        "machine": {"platform": platform.platform(), "cpu": _cpu_name(),
                    "cores": os.cpu_count(), "device": str(mx.default_device()),
                    "mlx": mx.__version__, "blas": blas.active_blas(),
                    "threads": threads.describe()},
        "prompt_tokens": args.prompt_tokens,
        "gen_tokens": args.gen_tokens,
        "runs": args.runs,
        "order": "interleaved: one warm-up each, then kvchat, mlx-lm, kvchat, mlx-lm, …"
        if ref is not None else "kvchat only, after one warm-up",
        "kvchat": {
            "dtype": info["dtype"],
            "weights": weights_label(info.get("bits"), bool(info.get("dequantized")),
                                     info["dtype"]),
            "weight_bytes": info["weight_bytes"],
            "compiled_step": bool(a_rows[-1]["compiled_step"]),
            "kv_bits": q.bits if q else getattr(mx, info["dtype"]).size * 8,
            "kv_group_size": q.group_for(info["head_dim"]) if q else None,
            **_side(a_rows),
        },
        "roofline": {
            "basis": f"kvchat's weights ({info['dtype']}) + K/V of the mean context, read"
            " once per decoded token",
            "bandwidth_bytes_per_s": bandwidth,
            "bandwidth_method": "numpy copy of 256 MiB, best of 5, read + write bytes",
            "kv_bytes_per_token": kv_token,
            "context_tokens": context,
            "bytes_per_token": ours_bytes,
            "roofline_tps": bandwidth / ours_bytes,
            "kvchat_fraction": statistics.median(r["decode_tps"] for r in a_rows)
            / (bandwidth / ours_bytes),
        },
    }
    if ref is not None:
        quant = info.get("bits") if args.mlx_lm_model is None else None
        result["mlx_lm"] = {
            "model": args.mlx_lm_model or path,
            "dtype": ref.dtype,
            "weights": weights_label(quant, False, ref.dtype),
            "weight_bytes": ref.weight_bytes,
            "blas_threads": ref.threads if threads.bound() else None,
            **_side(b_rows),
        }
        # the same roofline: a side that reads more bytes per token shows a lower fraction
        result["roofline"]["mlx_lm_fraction"] = statistics.median(
            r["decode_tps"] for r in b_rows) / result["roofline"]["roofline_tps"]
        mismatch = ref.dtype != info["dtype"]
        result["dtype_mismatch"] = mismatch
        if mismatch and not args.allow_dtype_mismatch:
            result["ratio"] = None
            result["ratio_refused"] = (
                f"kvchat computes in {info['dtype']}, mlx-lm in {ref.dtype}; pass"
                " --allow-dtype-mismatch to print ratios anyway")
        else:
            result["ratio"] = {
                k: summary([a[k] / b[k] for a, b in zip(a_rows, b_rows, strict=True)])
                for k in ("prefill_tps", "decode_tps")
            }
            result["ratio_of"] = RATIO
    if ref is not None and q is not None:
        result["mlx_lm"]["kv"] = ref_kv or None
        if ref_kv_note:
            result["mlx_lm"]["kv_note"] = ref_kv_note
    if speculative is not None:
        result["speculative"] = _speculative(a_rows, s_rows, args.draft_tokens)
    if q is not None and args.agreement_tokens > 0:
        result["kv_quality"] = _agreement(path, q, args.agreement_tokens)
    if args.json:
        print(json_text(result))
        return 0
    print(_render(result))
    return 0


def _speculative(plain: list[dict[str, Any]], spec: list[dict[str, Any]], most: int
                 ) -> dict[str, Any]:
    """Speculative decoding beside plain decoding on the same ids: its speeds, what it
    drafted and kept, and speculative ÷ plain per pair; greedy, so the ids must agree."""
    last = spec[-1]
    drafted = sum(r["drafted"] or 0 for r in spec)
    accepted = sum(r["accepted"] or 0 for r in spec)
    return {
        "source": last["speculation"], "draft_tokens": most,
        "note": last["speculation_note"],
        **_side(spec),
        "drafted": drafted, "accepted": accepted,
        "acceptance": accepted / drafted if drafted else 0.0,
        "tokens_per_forward": summary([r["tokens_per_forward"] or 0.0 for r in spec]),
        "same_ids": all(a["ids"] == b["ids"] for a, b in zip(plain, spec, strict=True)),
        "ratio": {k: summary([b[k] / a[k] if a[k] else 0.0
                              for a, b in zip(plain, spec, strict=True)])
                  for k in ("decode_tps",)},
        "ratio_of": SPEC_RATIO,
    }


def _mlx_lm_kv(q: KVQuant | None, head_dim: int) -> tuple[dict[str, Any], str | None]:
    """The same K/V quantization for mlx-lm's generate_step, where it can do it (its
    QuantizedKVCache does not pad: head_dim must be a multiple of the group)."""
    if q is None:
        return {}, None
    group = q.group_for(head_dim)
    if head_dim % group:
        return {}, (f"mlx-lm cannot quantize head_dim {head_dim} in groups of {group}:"
                    " it runs a float cache")
    return {"kv_bits": q.bits, "kv_group_size": group, "quantized_kv_start": q.start}, None


def _agreement(path: str, q: KVQuant, n: int) -> dict[str, Any]:
    """Greedy agreement, KL and perplexity of `q`'s cache against the float one on this
    model (model/explain/kv_quality.py), kept for the settings screen (app/core/kv_quality)."""
    from kvchat.model.decoder.weights import load_model
    from kvchat.model.explain.kv_quality import measure, texts
    from kvchat.model.text.tokenizer import load_tokenizer

    model = load_model(path)
    prompt, held_out = texts(load_tokenizer(path))
    result = measure(model, prompt, q, n=n, held_out=held_out).to_dict()
    kv_quality.record(path, result, how="kvchat bench")
    return result


def _render_speculative(sp: dict[str, Any]) -> list[str]:
    if sp.get("note"):
        return [f"speculative: {sp['note']}"]
    v = sp["ratio"]["decode_tps"]
    pairs = ", ".join(f"{x:.2f}" for x in v["runs"])
    return [
        f"speculative ({sp['source']}, up to {sp['draft_tokens']} drafts):"
        f" {sp['accepted']:,} of {sp['drafted']:,} drafted accepted ({sp['acceptance']:.0%}),"
        f" {sp['tokens_per_forward']['median']:.2f} tokens per forward pass; same ids as"
        f" plain: {'yes' if sp['same_ids'] else 'NO'}",
        f"{'speculative decode_tps':<28}" + "".join(
            f"{_fmt(sp['decode_tps'][x]):>12}" for x in ("min", "median", "max")),
        f"{SPEC_RATIO + ' decode_tps':<28}{v['min']:>12.2f}{v['median']:>12.2f}"
        f"{v['max']:>12.2f}   per pair: {pairs}",
    ]


def _fmt(v: float) -> str:
    return f"{v:,.3f}" if v < 10 else f"{v:,.1f}"


def _render(r: dict[str, Any]) -> str:
    m = r["machine"]
    b = m["blas"]
    lines = [
        f"model {r['model']}: prompt {r['prompt_tokens']} tokens, generate {r['gen_tokens']},"
        f" {r['runs']} runs per side ({r['order']})",
        f"machine: {m['cpu']}, {m['cores']} cores, {m['device']}, mlx {m['mlx']},"
        f" BLAS {blas.label(b)}" + (f" ({tip})" if (tip := blas.advice(b)) else ""),
        f"threads: {m['threads']}",
    ]
    sides = [("kvchat", r["kvchat"])] + ([("mlx-lm", r["mlx_lm"])] if "mlx_lm" in r else [])
    for name, s in sides:
        extra = f", compiled step {'on' if s.get('compiled_step') else 'off'}" if (
            name == "kvchat") else ""
        if name == "kvchat" and s.get("kv_group_size"):
            extra += f", {s['kv_bits']}-bit K/V (group {s['kv_group_size']})"
        if name == "mlx-lm" and s.get("kv"):
            extra += f", {s['kv']['kv_bits']}-bit K/V (group {s['kv']['kv_group_size']})"
        if s.get("model", r["model"]) != r["model"]:
            extra += f", from {s['model']}"
        lines.append(f"{name}: {s['weights']} weights ({s['weight_bytes']:,} bytes),"
                     f" computes in {s['dtype']}{extra}" + (
                         f" ({s['kv_note']})" if s.get("kv_note") else ""))
    lines.append(f"{'':28}{'min':>12}{'median':>12}{'max':>12}")
    for name, s in sides:
        for k in METRICS:
            lines.append(f"{name + ' ' + k:<28}" + "".join(
                f"{_fmt(s[k][x]):>12}" for x in ("min", "median", "max")))
    if r.get("ratio"):
        for k, v in r["ratio"].items():
            pairs = ", ".join(f"{x:.2f}" for x in v["runs"])
            lines.append(f"{RATIO + ' ' + k:<28}{v['min']:>12.2f}{v['median']:>12.2f}"
                         f"{v['max']:>12.2f}   per pair: {pairs}")
    elif "ratio_refused" in r:
        lines.append(f"no ratio: {r['ratio_refused']}")
    sp = r.get("speculative")
    if sp:
        lines += _render_speculative(sp)
    kq = r.get("kv_quality")
    if kq:
        first = kq["first_divergence"]
        lines.append(
            f"{kq['bits']}-bit K/V (group {kq['group_size']}) against the float cache over"
            f" {kq['tokens']} greedy tokens: {kq['forced_match']:.1%} same next token on the"
            f" float run's ids, free-running first divergence at "
            + ("none" if first is None else f"token {first}")
            + f" ({kq['free_match']:.1%} equal), mean KL {kq['mean_kl']:.3g} nats"
            + (f", perplexity {kq['ppl_float']:.3f} -> {kq['ppl_quant']:.3f}"
               if kq["ppl_float"] else ""))
    rf = r["roofline"]
    lines.append(
        f"decode roofline: {rf['bytes_per_token']:,} bytes/token (kvchat's weights + K/V of"
        f" {rf['context_tokens']} tokens) at {rf['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s"
        f" measured = {_fmt(rf['roofline_tps'])} tok/s")
    lines.append(f"of that roofline: kvchat {rf['kvchat_fraction']:.1%}" + (
        f", mlx-lm {rf['mlx_lm_fraction']:.1%}" if "mlx_lm_fraction" in rf else ""))
    return "\n".join(lines)
