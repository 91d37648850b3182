"""`kvchat explain`: the model's decoder block, stage by stage, with its own numbers.

The four swaps of a modern block (RMSNorm with pre-norm, SwiGLU, RoPE, GQA on a KV
cache) annotated from the model's config, the design's worked numbers computed by the
app's kernels on the active backend, and the cache the block implies against MHA and
MQA. The data is model/explain/anatomy.py's; the chat's Anatomy screen shows the same.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvchat.app.core import memory
from kvchat.app.core.discovery import DEFAULT_MODEL
from kvchat.app.core.errors import UsageError, report
from kvchat.app.core.text import json_text
from kvchat.model.errors import KVChatError, ModelLoadError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="DIR", help="model folder, GGUF file or ollama:NAME[:TAG]"
                   f" (default: {DEFAULT_MODEL})")
    p.add_argument("--context", type=int, default=None, metavar="N",
                   help="context for the cache figures (default: the model's maximum)")
    p.add_argument("--gap", type=int, default=3, metavar="N",
                   help="token gap for the RoPE dial table's cos(gap·θ) column (default 3)")
    p.add_argument("--block", choices=("model", "2017"), default="model",
                   help="2017: the same model with the 2017 block (post-LayerNorm, ReLU FFN"
                   " 1.5x wider, sinusoidal positions, MHA), for comparison"
                   " (default %(default)s)")
    memory.add_argument(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")


def explain_folder(folder: str | Path, context: int | None = None, gap: int = 3,
                   block: str = "model") -> dict[str, Any]:
    """Load the model (its q and k show RoPE's relative property) and explain it, or the
    same model with the 2017 block."""
    from kvchat.model.decoder.config import ModelConfig, as_2017_block
    from kvchat.model.decoder.weights import load_model
    from kvchat.model.explain.anatomy import explain
    from kvchat.model.explain.facts import check_model_folder
    from kvchat.model.files import model_name

    path = Path(folder).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model folder not found: {path}")
    facts = check_model_folder(path)  # a folder or a GGUF file
    model = load_model(path)
    cfg = model.config
    if block == "2017":
        cfg, model = ModelConfig.from_dict(as_2017_block(cfg.raw)), None
    return explain(cfg, dtype_bytes=facts.kv_dtype_bytes, context=context,
                   model=model, gap=gap, name=model_name(path), path=str(path.resolve()))


def run(args: argparse.Namespace) -> int:
    try:
        if args.context is not None and args.context < 0:
            raise UsageError(f"--context must be >= 0, got {args.context}")
        if args.gap < 0:
            raise UsageError(f"--gap must be >= 0, got {args.gap}")
        folder = args.model or DEFAULT_MODEL
        # the model is loaded (its weights; no cache is made)
        memory.require_fit(folder, kv_tokens=0, ignore=args.ignore_memory_check)
        out = explain_folder(folder, args.context, args.gap, args.block)
    except KVChatError as e:
        report(str(e))
        if args.json:
            print(json_text({"error": str(e)}))
        return 2 if isinstance(e, UsageError) else 1
    if args.json:
        print(json_text(out))
    else:
        from kvchat.model.explain.anatomy import render_text

        print(render_text(out), end="")
    return 0
