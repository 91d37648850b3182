"""The model presets and the training loop: AdamW, warmup + cosine, one compiled step,
checkpoints that resume exactly."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from kvchat.model.decoder.config import ModelConfig, as_2017_block
from kvchat.model.decoder.transformer import Transformer

from .data import BOS_ID, EOS_TEXT, TrainError, batch_rows, load_sp, log, pack_rows

# Architecture presets: "mini" is the shipped model, "tiny" is for tests (seconds).
PRESETS: dict[str, dict[str, int]] = {
    "mini": dict(hidden_size=192, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, intermediate_size=512),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128),
}


BLOCKS = ("2024", "2017")


def model_config(preset: str, vocab_size: int, seq_len: int,
                 block: str = "2024") -> dict[str, Any]:
    """An HF llama config.json dict (what the export writes, minus quantization).

    block "2017": the same model with the 2017 block (config.as_2017_block)."""
    p = PRESETS[preset]
    if block == "2017":
        return as_2017_block(model_config(preset, vocab_size, seq_len))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **p,
        "head_dim": p["hidden_size"] // p["num_attention_heads"],
        "vocab_size": vocab_size,
        "max_position_embeddings": max(1024, seq_len),
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "bos_token_id": BOS_ID,
        "eos_token_id": None,  # set from the tokenizer (<|im_end|>)
        "torch_dtype": "float16",
    }


def loss_fn(model: Transformer, x: mx.array, y: mx.array, m: mx.array) -> mx.array:
    """Mean cross-entropy over the masked (assistant) target tokens."""
    ce = nn.losses.cross_entropy(model(x), y) * m
    return ce.sum() / mx.maximum(m.sum(), 1.0)


def lr_schedule(lr: float, warmup: int, steps: int, final_frac: float) -> Any:
    """Linear warmup to `lr`, then cosine decay to `lr * final_frac` at `steps`."""
    warm = optim.linear_schedule(lr / max(warmup, 1), lr, max(warmup, 1))
    cos = optim.cosine_decay(lr, max(steps - warmup, 1), end=lr * final_frac)
    return optim.join_schedules([warm, cos], [max(warmup, 1)])


@dataclass
class TrainArgs:
    data: str
    run: str
    preset: str = "mini"
    steps: int = 1700
    batch: int = 8
    seq_len: int = 256
    lr: float = 3e-3
    warmup: int = 60
    final_lr_frac: float = 0.05
    weight_decay: float = 0.01
    clip: float = 1.0
    seed: int = 0
    block: str = "2024"  # "2017": the 2017 block (see model_config)
    ckpt_every: int = 100
    eval_every: int = 500
    log_every: int = 10
    eval_rows: int = 32


def save_checkpoint(run: Path, model: Transformer, opt: optim.Optimizer,
                    meta: dict[str, Any]) -> None:
    """Weights + optimizer state + step json; each file written whole then renamed, the
    json last, so a crash mid-save leaves the previous checkpoint readable."""
    ck = run / "ckpt"
    ck.mkdir(parents=True, exist_ok=True)
    parts = {
        "model.safetensors": dict(tree_flatten(model.parameters())),
        "optimizer.safetensors": dict(tree_flatten(opt.state)),
    }
    for name, arrays in parts.items():
        tmp = ck / f"tmp-{name}"
        mx.save_safetensors(str(tmp), arrays)
        os.replace(tmp, ck / name)
    tmp = ck / "tmp-state.json"
    tmp.write_text(json.dumps(meta, indent=2))
    os.replace(tmp, ck / "state.json")


def load_checkpoint_meta(run: Path) -> dict[str, Any]:
    f = run / "ckpt" / "state.json"
    if not f.is_file():
        raise TrainError(f"no checkpoint in {run} (missing ckpt/state.json)")
    return json.loads(f.read_text())


def build_model(cfg_dict: dict[str, Any], seed: int) -> Transformer:
    mx.random.seed(seed)
    model = Transformer(ModelConfig.from_dict(cfg_dict))
    mx.eval(model.parameters())
    return model


def evaluate(model: Transformer, ids: np.ndarray, mask: np.ndarray, batch: int = 16) -> float:
    """Masked mean loss over all rows (token-weighted)."""
    total, count = 0.0, 0.0
    for i in range(0, len(ids), batch):
        x = mx.array(ids[i:i + batch])
        m = mx.array(mask[i:i + batch, 1:].astype(np.float32))
        ce = nn.losses.cross_entropy(model(x[:, :-1]), x[:, 1:]) * m
        s, c = mx.sum(ce), mx.sum(m)
        mx.eval(s, c)
        total, count = total + s.item(), count + c.item()
    return total / max(count, 1.0)


def train(a: TrainArgs, resume: bool = False, stop_after: int | None = None) -> dict[str, Any]:
    """Run (or resume) training; returns the final checkpoint metadata.

    `stop_after` ends the run early at that step (a checkpoint is written), for tests.
    """
    data, run = Path(a.data), Path(a.run)
    if resume:  # the checkpoint's settings win, so the run continues as it started
        meta = load_checkpoint_meta(run)
        a = TrainArgs(**{**meta["args"], "data": a.data, "run": a.run})
        cfg = meta["config"]
    else:
        sp = load_sp(data / "tokenizer.model")
        cfg = model_config(a.preset, sp.get_piece_size(), a.seq_len, a.block)
        cfg["eos_token_id"] = sp.piece_to_id(EOS_TEXT)
    rows_ids, rows_mask = pack_rows(data / "train_tokens.npz", a.seq_len, a.seed)
    val_ids, val_mask = pack_rows(data / "val_tokens.npz", a.seq_len, None)
    model = build_model(cfg, a.seed)
    opt = optim.AdamW(lr_schedule(a.lr, a.warmup, a.steps, a.final_lr_frac),
                      betas=[0.9, 0.95], weight_decay=a.weight_decay)
    opt.init(model.trainable_parameters())
    step, elapsed, history = 0, 0.0, []
    if resume:
        model.load_weights(str(run / "ckpt" / "model.safetensors"))
        opt.state = tree_unflatten(list(mx.load(str(run / "ckpt" / "optimizer.safetensors"))
                                        .items()))
        opt.init(model.trainable_parameters())
        step, elapsed, history = meta["step"], meta["elapsed_s"], meta["history"]
        log(f"resuming {run} at step {step}/{a.steps}")
    run.mkdir(parents=True, exist_ok=True)

    value_and_grad = nn.value_and_grad(model, loss_fn)
    state = [model.state, opt.state]

    # the whole update (forward, backward, clip, AdamW) is one compiled graph; model and
    # optimizer state are captured as implicit inputs/outputs, as in the MLX examples
    @partial(mx.compile, inputs=state, outputs=state)
    def train_step(x: mx.array, y: mx.array, m: mx.array) -> mx.array:
        loss, grads = value_and_grad(model, x, y, m)
        grads, _ = optim.clip_grad_norm(grads, a.clip)
        opt.update(model, grads)
        return loss

    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    log(f"model: {n_params / 1e6:.2f}M params, {len(rows_ids)} train rows x {a.seq_len + 1}"
        f" tokens, {len(val_ids)} val rows; {a.steps} steps of {a.batch}")
    tty = sys.stderr.isatty()
    last = stop_after if stop_after is not None else a.steps
    win_t, win_tok, win_loss, win_n = time.perf_counter(), 0, 0.0, 0

    def meta_now() -> dict[str, Any]:
        return dict(step=step, elapsed_s=elapsed, history=history, config=cfg,
                    args=asdict(a), params=n_params)

    while step < last:
        idx = batch_rows(step, len(rows_ids), a.batch, a.seed)
        xb = mx.array(rows_ids[idx])
        mb = mx.array(rows_mask[idx, 1:].astype(np.float32))
        t = time.perf_counter()
        loss = train_step(xb[:, :-1], xb[:, 1:], mb)
        mx.eval(loss, state)
        elapsed += time.perf_counter() - t
        step += 1
        lv = loss.item()
        win_loss, win_n, win_tok = win_loss + lv, win_n + 1, win_tok + a.batch * a.seq_len
        history.append([step, round(lv, 5)])
        if step % a.log_every == 0 or step == last:
            now = time.perf_counter()
            tps = win_tok / max(now - win_t, 1e-9)
            eta = (a.steps - step) * a.batch * a.seq_len / max(tps, 1e-9)
            lr = opt.learning_rate.item()
            line = (f"step {step:5d}/{a.steps}  loss {win_loss / win_n:.4f}  lr {lr:.2e}  "
                    f"{tps:6.0f} tok/s  elapsed {elapsed / 60:5.1f} min  eta {eta / 60:5.1f} min")
            print(("\r" + line) if tty else line, end="" if tty else "\n", file=sys.stderr,
                  flush=True)
            win_t, win_tok, win_loss, win_n = now, 0, 0.0, 0
        if a.eval_every and step % a.eval_every == 0 and step < a.steps:
            vl = evaluate(model, val_ids[:a.eval_rows], val_mask[:a.eval_rows])
            log(f"\n  eval @ {step}: val loss {vl:.4f}  ppl {math.exp(vl):.3f}")
            win_t = time.perf_counter()  # exclude eval time from tok/s
        if step % a.ckpt_every == 0 or step == last:
            save_checkpoint(run, model, opt, meta_now())
    meta = meta_now()
    if step >= a.steps:
        vl = evaluate(model, val_ids, val_mask)
        tl = evaluate(model, rows_ids[:128], rows_mask[:128])
        meta.update(val_loss=vl, val_ppl=math.exp(vl), train_subset_loss=tl,
                    tokens_per_s=a.steps * a.batch * a.seq_len / max(elapsed, 1e-9))
        save_checkpoint(run, model, opt, meta)
        log(f"\ndone: {step} steps in {elapsed / 60:.1f} min "
            f"({meta['tokens_per_s']:.0f} tok/s); val loss {vl:.4f} ppl {math.exp(vl):.3f}; "
            f"train-subset loss {tl:.4f}")
    return meta

