"""`kvchat inspect`: KV-cache memory math for a model folder or a config.json.

Bytes per token across layers, bytes at a context length, the MHA / GQA / MQA table,
weight bytes (from safetensors headers), tokens that fit a memory budget, and with
--live a short greedy run whose cache bytes, measured from the arrays, must equal the
formula.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kvchat.app.core import memory
from kvchat.app.core.discovery import DEFAULT_MODEL
from kvchat.app.core.errors import UsageError, report
from kvchat.app.core.kv_args import add_kv_arguments, kv_quant_from_args
from kvchat.app.core.text import json_text
from kvchat.model.cache.kv_math import (
    BudgetError,
    KVQuant,
    attention_name,
    attention_table,
    cached_widths,
    context_that_fits,
    dtype_bytes_of,
    human_bytes,
    kv_bytes_at,
    kv_bytes_by_kind,
    kv_saving,
    parse_size,
    state_bytes,
)
from kvchat.model.cache.layer_kinds import kinds_line, layer_kinds
from kvchat.model.decoder.config import ModelConfig, load_config
from kvchat.model.errors import ConfigError, KVChatError, ModelLoadError
from kvchat.model.explain.facts import model_facts
from kvchat.model.gguf_file import is_gguf

LIVE_TOKENS = 32  # generated tokens in --live (a few dozen: cheap, and enough to fill a step)


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", metavar="DIR",
                     help="model folder, GGUF file or ollama:NAME[:TAG]"
                     f" (default: {DEFAULT_MODEL})")
    src.add_argument("--config", metavar="FILE", help="a config.json (no weights needed)")
    p.add_argument("--context", type=int, default=None, metavar="N",
                   help="context length for the totals (default: max_position_embeddings)")
    p.add_argument("--dtype-bytes", type=int, default=None, metavar="B",
                   help="bytes per K/V element (default: from torch_dtype; 2 = fp16/bf16)")
    p.add_argument("--budget", default=None, metavar="BYTES",
                   help="memory budget, e.g. 8GiB, 512MiB or a byte count: tokens of KV cache"
                   " that fit (after the weights, for a model folder); one sequence still"
                   " stops at the model's context")
    p.add_argument("--live", action="store_true",
                   help="load the model, generate a few tokens, and compare the cache's"
                   " measured bytes with the formula")
    add_kv_arguments(p, start=False)
    p.add_argument("--hosts", type=int, default=None, metavar="N",
                   help="split the layers across N pipeline ranks: bytes per rank")
    memory.add_argument(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    if not getattr(args, "model", None) and not getattr(args, "config", None):
        args.model = str(DEFAULT_MODEL)  # as generate, explain, bench and serve
    try:
        out = _inspect(args)
    except UsageError as e:
        print(f"kvchat inspect: error: {e}", file=sys.stderr)
        return 2
    except KVChatError as e:
        report(str(e))
        return 1
    if args.json:
        print(json_text(out))
    else:
        print(_render(out))
    if out.get("live") and not out["live"]["equal"]:
        report("live cache bytes differ from the formula")
        return 1
    return 0


def _check_args(args: argparse.Namespace) -> None:
    model, config = getattr(args, "model", None), getattr(args, "config", None)
    if bool(model) == bool(config):
        raise UsageError("give exactly one of --model DIR or --config FILE")
    if args.context is not None and args.context < 1:
        raise UsageError(f"--context must be >= 1, got {args.context}")
    if args.dtype_bytes is not None and args.dtype_bytes < 1:
        raise UsageError(f"--dtype-bytes must be >= 1, got {args.dtype_bytes}")
    if args.hosts is not None and args.hosts < 1:
        raise UsageError(f"--hosts must be >= 1, got {args.hosts}")
    if args.live and not model:
        raise UsageError("--live needs --model DIR (it runs the model)")
    kv_quant_from_args(args)


def _dtype_bytes(args: argparse.Namespace, cfg: ModelConfig) -> tuple[int, str]:
    """(bytes, where it came from): --dtype-bytes; for a model folder what this backend
    will allocate (model/explain/facts.py); for a bare config its torch_dtype, else fp16."""
    if args.dtype_bytes is not None:
        return args.dtype_bytes, "--dtype-bytes"
    if args.model:
        f = model_facts(args.model)
        return f.kv_dtype_bytes, f"{f.compute_dtype}, what kvchat allocates on the {f.device}"
    b = dtype_bytes_of(cfg.torch_dtype)
    if b is not None:
        return b, f"torch_dtype {cfg.torch_dtype}"
    return 2, "assumed fp16"


def _inspect(args: argparse.Namespace) -> dict[str, Any]:
    _check_args(args)
    budget = None
    if args.budget is not None:
        try:
            budget = parse_size(args.budget)
        except BudgetError as e:
            raise UsageError(str(e)) from None
    source = Path(args.model or args.config).expanduser()
    if args.model and not source.exists():
        raise ModelLoadError(f"model folder not found: {source}")
    if args.model and not source.is_dir() and not (is_gguf(source) or source.suffix == ".gguf"):
        raise ModelLoadError(f"not a model folder or GGUF file: {source}")
    if args.config and not source.exists():
        raise ConfigError(f"config file not found: {source}")
    cfg = load_config(source)
    dtype_bytes, dtype_from = _dtype_bytes(args, cfg)
    context = args.context or cfg.max_position_embeddings
    L, h, kv, hd = (cfg.num_hidden_layers, cfg.num_attention_heads,
                    cfg.num_key_value_heads, cfg.head_dim)
    # the layers that attend hold K/V; the recurrent ones a state of fixed size
    per_token = cached_widths(cfg).bytes_per_token(cfg.attention_layers, dtype_bytes)
    at_context = kv_bytes_at(cfg, context, dtype_bytes)
    kinds = kv_bytes_by_kind(cfg, context, dtype_bytes)
    facts = model_facts(source) if args.model else None
    weights = facts.weight_bytes if facts else None
    q = kv_quant_from_args(args)
    out: dict[str, Any] = {
        "source": str(source),
        "model_type": cfg.model_type,
        "note": cfg.note,
        "layers": L,
        "heads": h,
        "kv_heads": kv,
        "head_dim": hd,
        "dtype_bytes": dtype_bytes,
        "dtype_from": dtype_from,
        "context": context,
        "max_position_embeddings": cfg.max_position_embeddings,
        "sliding_window": cfg.sliding_window,
        "bytes_per_token": per_token,
        "bytes_at_context": at_context,
        # with sliding layers the cost of a token depends on how long the context is
        "bytes_per_token_at_context": at_context / context,
        "layer_kinds": [
            {"kind": r.kind, "layers": r.layers, "window": r.window, "tokens": r.tokens,
             "bytes": r.bytes} for r in kinds
        ],
        "window_saving": per_token * context / at_context if at_context else 1.0,
        # recurrent layers (Mamba, gated delta, short conv): their states, the same bytes
        # at every context length
        "attention_layers": cfg.attention_layers,
        "state_layers": cfg.recurrent_layers,
        "state_bytes": state_bytes(cfg, dtype_bytes),
        # each layer's kind, as the chat's Ctrl+L names it (model/cache/layer_kinds.py)
        "kind_of_layer": layer_kinds(cfg),
        "gqa_saving": kv_saving(cfg),  # over MHA (latent attention: its own saving)
        "attention": attention_name(cfg),
        "latent": None if cfg.mla is None else {
            "kv_lora_rank": cfg.mla.kv_lora_rank, "rope_dim": cfg.mla.rope_dim,
            "v_head_dim": cfg.mla.v_dim,
        },
        "table": [
            {"name": r.name, "kv_heads": r.kv_heads, "bytes_per_token": r.bytes_per_token,
             "bytes_at_context": r.bytes_at_context, "saving_vs_mha": r.saving_vs_mha}
            for r in attention_table(cfg, dtype_bytes, context)
        ],
        "weights_bytes": weights,  # as loaded on this backend
        "facts": facts.to_dict() if facts else None,
        "budget_bytes": budget,
        "budget_tokens": None if budget is None else context_that_fits(
            cfg, budget, dtype_bytes, weights or 0),
        "kv_bits": q.bits if q else dtype_bytes * 8,
        "kv_group_size": q.group_for(hd) if q else None,
        "quantized": _quantized(cfg, q, dtype_bytes, context, budget, weights),
        # will it fit: the weights and the K/V at this context, against what is available
        "memory": memory.model_fit(source, context, q).to_dict() if args.model else None,
        "live": _live(source, cfg, q, args.ignore_memory_check) if args.live else None,
        "ranks": _ranks(args, source, cfg, dtype_bytes, context),
    }
    return out


def _ranks(args: argparse.Namespace, source: Path, cfg: ModelConfig, dtype_bytes: int,
           context: int) -> list[dict[str, Any]] | None:
    """--hosts N: the pipeline split (model/distributed/pipeline.py), from the checkpoint's tensor
    sizes, or estimated from the config's shapes when there are no weights."""
    if args.hosts is None:
        return None
    from kvchat.model.distributed.pipeline import config_tensor_bytes, split_table
    from kvchat.model.files import tensor_bytes

    if args.model and is_gguf(source):  # the file's tensors under our names
        from kvchat.model.decoder.gguf import tensor_bytes as gguf_tensor_bytes
        from kvchat.model.gguf_file import read_gguf

        sizes = gguf_tensor_bytes(read_gguf(source))
    else:
        sizes = tensor_bytes(source) if args.model else config_tensor_bytes(cfg, dtype_bytes)
    return split_table(cfg, sizes, args.hosts, dtype_bytes, context)


def _quantized(cfg: ModelConfig, q: KVQuant | None, dtype_bytes: int, context: int,
               budget: int | None, weights: int | None) -> dict[str, Any] | None:
    """--kv-bits: the same figures with K/V stored in q.bits bits (scales and biases at
    the float dtype, head_dim padded to the group), and the saving against the float."""
    if q is None:
        return None
    hd = cfg.head_dim
    at_context = kv_bytes_at(cfg, context, dtype_bytes, q=q)
    return {
        "bits": q.bits,
        "group_size": q.group_for(hd),
        "padded_head_dim": q.padded_dim(hd),
        "scale_bytes": dtype_bytes,
        "bytes_per_token": cached_widths(cfg).bytes_per_token(cfg.attention_layers,
                                                              dtype_bytes, q),
        "bytes_at_context": at_context,
        "saving_vs_float": kv_bytes_at(cfg, context, dtype_bytes) / at_context
        if at_context else 1.0,
        "table": [
            {"name": r.name, "kv_heads": r.kv_heads, "bytes_per_token": r.bytes_per_token,
             "bytes_at_context": r.bytes_at_context}
            for r in attention_table(cfg, dtype_bytes, context, q)
        ],
        "budget_tokens": None if budget is None else context_that_fits(
            cfg, budget, dtype_bytes, weights or 0, q),
    }


def _live(folder: Path, cfg: ModelConfig, q: KVQuant | None = None,
          ignore_memory: bool = False) -> dict[str, Any]:
    """Greedy-generate LIVE_TOKENS tokens from BOS through make_cache and measure the
    cache from its arrays (resident slices' nbytes, every part of a quantized buffer)
    next to the formula."""

    from kvchat.model.cache.kv import cache_stats, make_cache, parts
    from kvchat.model.cache.state import StateCache
    from kvchat.model.decoder.weights import load_model
    from kvchat.model.runtime.events import CACHE_FIELDS, stats_json
    from kvchat.model.runtime.generate import generate_step

    memory.require_fit(folder, None, q, kv_tokens=LIVE_TOKENS, ignore=ignore_memory)
    model = load_model(folder)
    caches = make_cache(model.config, kv=q)
    bos = cfg.raw.get("bos_token_id", 1)
    if isinstance(bos, list):
        bos = bos[0] if bos else 1
    # LIVE_TOKENS tokens end up cached: BOS and all generated ids but the last
    for _ in generate_step(model, [int(bos) if bos is not None else 1], caches,
                           max_tokens=LIVE_TOKENS):
        pass
    measured = allocated = state = 0
    live_dtype = None
    # what the arrays hold: the resident slots' slices (a layer with K/V and a state side
    # by side, model/cache/hybrid.py: each member)
    for c in (m for layer in caches for m in getattr(layer, "members", (layer,))):
        if isinstance(c, StateCache):  # a recurrent layer: its whole state
            state += sum(a.nbytes for a in (c.conv, c.recurrent) if a is not None)
            if c.conv is not None:
                live_dtype = live_dtype or c.conv.dtype
            continue
        n = c.size()
        for p in (*parts(c.keys), *parts(c.values)):
            measured += p[..., :n, :].nbytes
            allocated += p.nbytes
        live_dtype = parts(c.keys)[-1].dtype  # a quantized cache's scales: the float
    assert live_dtype is not None
    stats = cache_stats(caches, model.config)
    tokens = stats.cache_tokens or 0
    formula = kv_bytes_at(cfg, tokens, live_dtype.size, q=q)
    state_formula = state_bytes(cfg, live_dtype.size)
    return {
        "tokens": tokens,
        "dtype": str(live_dtype).removeprefix("mlx.core."),
        "dtype_bytes": live_dtype.size,
        "measured_bytes": measured,
        "nbytes_sum": sum(c.nbytes for c in caches),
        "formula_bytes": formula,
        "allocated_bytes": allocated,
        "kv_bits": q.bits if q else live_dtype.size * 8,
        "float_bytes": stats.float_bytes,
        "cache_stats": {k: v for k, v in stats_json(stats).items() if k in CACHE_FIELDS},
        "state_bytes": state,
        "state_formula_bytes": state_formula,
        "equal": measured == formula == stats.cache_bytes
        and state == state_formula == stats.state_bytes
        and measured + state == sum(c.nbytes for c in caches),
    }


def _context_cap(tokens: int | None, context: int) -> str:
    """Where the budget holds more tokens than the model's context: one sequence still
    stops at the context; the rest is room for more sequences (or a longer model)."""
    if tokens is None or tokens <= context:
        return ""
    return (f"; one sequence stops at the model's {context:,}-token context"
            f" (room for {tokens // context:,} such)")


def _b(n: int | None) -> str:
    """Exact bytes with thousands separators, and binary units beside them."""
    if n is None:
        return "n/a"
    return f"{n:,} B" if abs(n) < 1024 else f"{n:,} B ({human_bytes(n)})"


def _render(o: dict[str, Any]) -> str:
    sliding = any(k["window"] is not None for k in o["layer_kinds"])
    lat = o.get("latent")
    kv_desc = (f"latent attention: {lat['kv_lora_rank']} latent + {lat['rope_dim']} RoPE"
               f" features cached per token and layer, q/k head_dim {o['head_dim']}" if lat
               else f"{o['kv_heads']} KV heads, head_dim {o['head_dim']}")
    heads = f"{o['heads']} query heads, {kv_desc}"
    if o["attention"] == "none":
        heads = "no attention layers"
    elif o["layers"] != o["attention_layers"]:
        plural = "s" if o["attention_layers"] != 1 else ""
        heads = f"{o['attention_layers']} attention layer{plural} with {heads}"
    lines = [
        f"{o['source']}  ({o['model_type']}: {o['layers']} layers, {heads},"
        f" {o['dtype_bytes']} B/element from {o['dtype_from']})",
        f"KV cache per token (all layers{sliding and ', until the windows fill' or ''}):"
        f" {_b(o['bytes_per_token'])}",
        f"KV cache at {o['context']:,} tokens: {_b(o['bytes_at_context'])}",
    ]
    mixed = kinds_line(o["kind_of_layer"])  # a hybrid: which layer is which
    if mixed:
        lines.insert(1, f"layers: {mixed}")
    if o["state_layers"]:  # a fixed size: the same after one token as at any context
        plural = "s" if o["state_layers"] != 1 else ""
        lines.append(f"state of {o['state_layers']} recurrent layer{plural}:"
                     f" {_b(o['state_bytes'])},"
                     " the same at every context length")
    if o.get("note"):
        lines.insert(1, f"note: {o['note']}")
    if sliding:
        for k in o["layer_kinds"]:
            what = ("global" if k["window"] is None else f"chunked (chunk {k['window']:,})"
                    if k["kind"] == "chunked" else f"sliding (window {k['window']:,})")
            lines.append(f"  {k['layers']} {what} layers: {k['tokens']:,} tokens each,"
                         f" {_b(k['bytes'])}")
        lines.append(
            f"  per token at {o['context']:,} tokens: {o['bytes_per_token_at_context']:,.1f} B;"
            f" the sliding layers save {o['window_saving']:.3g}x over full attention"
        )
    qd = o.get("quantized")
    if qd:
        pad = (f", head_dim {o['head_dim']} padded to {qd['padded_head_dim']}"
               if qd["padded_head_dim"] != o["head_dim"] else "")
        lines += [
            f"K/V in {qd['bits']} bits (group {qd['group_size']}{pad}; scales and biases at"
            f" {qd['scale_bytes']} B): {_b(qd['bytes_per_token'])} per token,"
            f" {_b(qd['bytes_at_context'])} at {o['context']:,} tokens",
            f"  {qd['saving_vs_float']:.3g}x smaller than the {o['dtype_bytes']} B/element cache",
        ]
    lines += [] if not o["table"] else [
        "",
        f"{'attention':<18} {'KV heads':>8}  {'per token':<26} "
        f"{'at ' + format(o['context'], ',') + ' tokens':<34} MHA / this"
        + (f"  {qd['bits']}-bit at {o['context']:,}" if qd else ""),
    ]
    for i, r in enumerate(o["table"]):
        lines.append(
            f"{r['name']:<18} {r['kv_heads']:>8}  {_b(r['bytes_per_token']):<26} "
            f"{_b(r['bytes_at_context']):<34} "
            + (f"{format(r['saving_vs_mha'], '.3g') + 'x':<12}"
               f"{_b(qd['table'][i]['bytes_at_context'])}" if qd
               else f"{r['saving_vs_mha']:.3g}x")
        )
    lines.append("")
    f = o.get("facts")
    if f:
        # a quantized folder's float tensors are only its scales, norms and biases
        held = (f"from GGUF {f['gguf']}" if f.get("gguf")
                else f"quantized: {f['quantization']}" if f.get("quantization")
                else f"{f['file_dtype'] or 'no float'} tensors")
        lines.append(f"weights: {_b(f['weight_bytes'])} loaded as {f['compute_dtype']} on the"
                     f" {f['device']} (files: {_b(f['file_bytes'])}, {held})")
        if f["file_dtype"] and f["file_dtype"] != f["compute_dtype"] and not f.get("gguf"):
            what = ("the files' float tensors (scales, norms) are" if f.get("quantization")
                    else "the files hold")
            lines.append(f"note: {what} {f['file_dtype']}; kvchat computes and caches in"
                         f" {f['compute_dtype']} on the {f['device']}, so the figures above use"
                         f" {f['kv_dtype_bytes']} B/element")
    m = o.get("memory")
    if m:
        verdict = "fits" if m["fits"] else (
            "does NOT fit" + (f"; --max-kv-size {m['max_kv_size_that_fits']:,} would"
                              if m["max_kv_size_that_fits"] else ""))
        lines.append(f"memory: {m['line']}: {verdict}")
    if o["budget_bytes"] is not None:
        after = " after the weights" if o["weights_bytes"] else ""
        fits = ("any context length fits (every layer slides)" if o["budget_tokens"] is None
                else f"{o['budget_tokens']:,} tokens of KV cache fit")
        lines.append(f"budget {_b(o['budget_bytes'])}: {fits}{after}"
                     + _context_cap(o["budget_tokens"], o["max_position_embeddings"]))
        if qd:
            fits = ("any context length" if qd["budget_tokens"] is None
                    else f"{qd['budget_tokens']:,} tokens")
            lines.append(f"  in {qd['bits']} bits: {fits}")
    for r in o.get("ranks") or []:
        a, b = r["layers"]
        tied = r["embedding"] and r["rank"] > 0  # the tied head: the embedding again
        extra = " + embedding" * (r["embedding"] and not tied) + " + norm/head" * r["head"] \
            + " (tied: embedding)" * tied
        lines.append(
            f"rank {r['rank']}: layers {a}-{b - 1}{extra}: weights {_b(r['weight_bytes'])},"
            f" KV {_b(r['kv_bytes_per_token'])}/token, {_b(r['kv_bytes_at_context'])}"
            f" at {o['context']:,} tokens"
        )
    live = o.get("live")
    if live:
        mark = "equal" if live["equal"] else "DIFFERENT"
        what = (f"{live['kv_bits']}-bit, scales in {live['dtype']}" if qd
                else f"{live['dtype']}, {live['dtype_bytes']} B/element")
        lines.append(
            f"live ({live['tokens']} tokens, {what}):"
            f" measured {_b(live['measured_bytes'])}, formula {_b(live['formula_bytes'])}"
            + (f", state {_b(live['state_bytes'])} (formula {_b(live['state_formula_bytes'])})"
               if o["state_layers"] else "")
            + f" -> {mark}; allocated buffers {_b(live['allocated_bytes'])}"
            + (f"; unquantized {_b(live['float_bytes'])}" if qd else "")
        )
    return "\n".join(lines).rstrip()
