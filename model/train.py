"""Train, export and try out kvchat's shipped model (assets/kvchat-mini).

    python -m model.train data   --data /tmp/kvchat-train/data      # corpus + tokenizer
    python -m model.train train  --data ... --run /tmp/kvchat-train/run [--resume]
    python -m model.train export --data ... --run ... --out assets/kvchat-mini
    python -m model.train sample --model assets/kvchat-mini [--markdown FILE]
    python -m model.train eval   --data ... --model assets/kvchat-mini   # val loss / ppl
    python -m model.train bench  --model assets/kvchat-mini              # TTFT, decode tok/s
    python -m model.train all    --data ... --run ... --out ...          # data+train+export

Everything is deterministic for a seed: the corpus (model/chatdata.py), the tokenizer,
the packing of conversations into rows, the order of batches (a pure function of the
step, so --resume continues exactly), and the initial weights.

On a CPU, preload OpenBLAS first (MLX CPU matmuls are ~30x faster with it):
    export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
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

from . import chatdata
from .config import ModelConfig
from .errors import KVChatError
from .generate import generate_step
from .transformer import Transformer

BOS_ID, EOS_TEXT = 1, chatdata.IM_END
# Architecture presets: "mini" is the shipped model, "tiny" is for tests (seconds).
PRESETS: dict[str, dict[str, int]] = {
    "mini": dict(hidden_size=192, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, intermediate_size=512),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128),
}
SHOWCASE_PROMPTS = [
    "Hello!", "What is kvchat?", "What is a KV cache?", "Explain GQA.", "What does RoPE do?",
    "What is RMSNorm?", "What is SwiGLU?", "Tell me a short story.",
    "Tell me a story about a cat.", "Who are you?",
]


class TrainError(KVChatError):
    """A training/export step that cannot run as asked (missing data, bad checkpoint)."""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- data


def train_tokenizer(lines_file: Path, prefix: Path, vocab_size: int, seed: int) -> None:
    """SentencePiece BPE with byte fallback; ChatML markers are user-defined symbols, so
    they are single tokens matched anywhere in the text."""
    import sentencepiece as spm

    spm.set_random_generator_seed(seed)  # input sampling/shuffling
    spm.SentencePieceTrainer.train(
        input=str(lines_file),
        model_prefix=str(prefix),
        model_type="bpe",
        vocab_size=vocab_size,
        character_coverage=1.0,
        byte_fallback=True,
        user_defined_symbols=[chatdata.IM_START, chatdata.IM_END],
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        # keep text exactly as written: no NFKC, no dummy "▁" prefix, keep whitespace
        normalization_rule_name="identity",
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        split_digits=True,
        num_threads=2,
        input_sentence_size=2_000_000,
        shuffle_input_sentence=True,
        minloglevel=2,
    )


def load_sp(path: Path) -> Any:
    import sentencepiece as spm

    if not path.is_file():
        raise TrainError(f"no tokenizer at {path}; run `python -m model.train data` first")
    return spm.SentencePieceProcessor(model_file=str(path))


def encode_conversation(sp: Any, conv: chatdata.Conversation) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and a 0/1 loss mask that is 1 on assistant
    content and its closing <|im_end|> (the model learns to answer and to stop)."""
    end = sp.piece_to_id(chatdata.IM_END)
    ids, mask = [BOS_ID], [0]
    for m in conv:
        head = sp.encode(f"{chatdata.IM_START}{m['role']}\n")
        body = sp.encode(m["content"]) + [end]
        tail = sp.encode("\n")
        learn = int(m["role"] == "assistant")
        ids += head + body + tail
        mask += [0] * len(head) + [learn] * len(body) + [0] * len(tail)
    return ids, mask


def build_data(out: Path, n_train: int, n_val: int, vocab_size: int, seed: int) -> dict[str, Any]:
    """Write the corpus (jsonl), the tokenizer and the tokenized splits (npz) to `out`."""
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    train = list(chatdata.generate(n_train, seed))
    seen = {chatdata.render_chat(c) for c in train}
    # held-out split: a different seed, minus any conversation that also occurs in train
    val_all = list(chatdata.generate(n_val, seed + 7919))
    val = [c for c in val_all if chatdata.render_chat(c) not in seen]
    for name, convs in (("train", train), ("val", val)):
        with open(out / f"{name}.jsonl", "w") as f:
            for c in convs:
                f.write(json.dumps(c) + "\n")
    lines = out / "tokenizer_lines.txt"
    with open(lines, "w") as f:
        for line in chatdata.tokenizer_text(n_train, seed):
            f.write(line + "\n")
    log(f"corpus: {len(train)} train, {len(val)} val conversations "
        f"({len(val_all) - len(val)} val duplicates of train dropped)")
    train_tokenizer(lines, out / "tokenizer", vocab_size, seed)
    sp = load_sp(out / "tokenizer.model")
    # segment-wise encoding (for the loss mask) must equal whole-text encoding
    for c in train[:500]:
        ids, _ = encode_conversation(sp, c)
        whole = [BOS_ID] + sp.encode(chatdata.render_chat(c, bos_token=""))
        if ids != whole:
            raise TrainError("tokenizer splits across chat-template segments; adjust options")
    stats = {}
    for name, convs in (("train", train), ("val", val)):
        ids_all, mask_all, offsets = [], [], [0]
        for c in convs:
            ids, mask = encode_conversation(sp, c)
            ids_all += ids
            mask_all += mask
            offsets.append(len(ids_all))
        np.savez(out / f"{name}_tokens.npz", ids=np.array(ids_all, np.int32),
                 mask=np.array(mask_all, np.uint8), offsets=np.array(offsets, np.int64))
        stats[name] = dict(conversations=len(convs), tokens=len(ids_all),
                           loss_tokens=int(sum(mask_all)),
                           max_len=int(np.diff(offsets).max()),
                           mean_len=float(np.diff(offsets).mean()))
    stats.update(vocab_size=sp.get_piece_size(), seed=seed,
                 seconds=round(time.perf_counter() - t0, 1))
    (out / "stats.json").write_text(json.dumps(stats, indent=2))
    log(json.dumps(stats))
    return stats


def pack_rows(data_file: Path, seq_len: int, seed: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Pack whole conversations (each starts with BOS) into rows of seq_len + 1 tokens,
    in a seeded shuffled order (None: file order); pad with id 0 and mask 0. A
    conversation never straddles two rows; longer ones are dropped."""
    z = np.load(data_file)
    ids, mask, offs = z["ids"], z["mask"], z["offsets"]
    order = np.arange(len(offs) - 1)
    if seed is not None:
        np.random.default_rng(seed).shuffle(order)
    width = seq_len + 1
    rows_ids, rows_mask = [], []
    cur_i: list[np.ndarray] = []
    cur_m: list[np.ndarray] = []
    used = 0

    def flush() -> None:
        nonlocal cur_i, cur_m, used
        if used:
            r_i, r_m = np.zeros(width, np.int32), np.zeros(width, np.uint8)
            r_i[:used], r_m[:used] = np.concatenate(cur_i), np.concatenate(cur_m)
            rows_ids.append(r_i)
            rows_mask.append(r_m)
        cur_i, cur_m, used = [], [], 0

    for k in order:
        a, b = offs[k], offs[k + 1]
        n = b - a
        if n > width:
            continue
        if used + n > width:
            flush()
        cur_i.append(ids[a:b])
        cur_m.append(mask[a:b])
        used += n
    flush()
    return np.stack(rows_ids), np.stack(rows_mask)


def batch_rows(step: int, n_rows: int, batch: int, seed: int) -> np.ndarray:
    """Row indices of the batch at `step`: epochs are seeded permutations of all rows,
    so the batch depends only on (step, seed) and a resumed run sees the same data."""
    start = step * batch
    out = []
    while len(out) < batch:
        epoch, pos = divmod(start + len(out), n_rows)
        perm = np.random.default_rng([seed, epoch]).permutation(n_rows)
        take = min(batch - len(out), n_rows - pos)
        out.extend(perm[pos:pos + take])
    return np.array(out)


# --------------------------------------------------------------------------- model


def model_config(preset: str, vocab_size: int, seq_len: int) -> dict[str, Any]:
    """An HF llama config.json dict (what the export writes, minus quantization)."""
    p = PRESETS[preset]
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
        cfg = model_config(a.preset, sp.get_piece_size(), a.seq_len)
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


# --------------------------------------------------------------------------- export

GROUP_SIZE, BITS = 32, 4


def tokenizer_files(sp: Any, max_len: int) -> dict[str, Any]:
    """tokenizer_config.json, special_tokens_map.json (HF/mlx-lm conventions)."""
    added = {}
    for i in range(sp.get_piece_size()):
        if sp.is_control(i) or sp.is_unknown(i) or sp.id_to_piece(i) in (
                chatdata.IM_START, chatdata.IM_END):
            added[str(i)] = {"content": sp.id_to_piece(i), "lstrip": False, "normalized": False,
                             "rstrip": False, "single_word": False, "special": True}
    tok_cfg = {
        "tokenizer_class": "LlamaTokenizer",
        "add_bos_token": False,  # the chat template writes <s> itself
        "add_eos_token": False,
        "add_prefix_space": False,
        "legacy": False,
        "bos_token": "<s>",
        "eos_token": EOS_TEXT,
        "unk_token": "<unk>",
        "pad_token": "<unk>",
        "additional_special_tokens": [chatdata.IM_START, chatdata.IM_END],
        "added_tokens_decoder": added,
        "chat_template": chatdata.CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "spaces_between_special_tokens": False,
        "model_max_length": max_len,
        "sp_model_kwargs": {},
    }
    special = {"bos_token": "<s>", "eos_token": EOS_TEXT, "unk_token": "<unk>",
               "pad_token": "<unk>",
               "additional_special_tokens": [chatdata.IM_START, chatdata.IM_END]}
    return {"tokenizer_config.json": tok_cfg, "special_tokens_map.json": special}


def export(run: Path, data: Path, out: Path, group_size: int = GROUP_SIZE,
           bits: int = BITS) -> dict[str, Any]:
    """Quantize the checkpoint to 4 bits the mlx-lm way and write a model folder."""
    meta = load_checkpoint_meta(run)
    cfg = dict(meta["config"])
    sp = load_sp(data / "tokenizer.model")
    model = build_model(cfg, 0)
    model.load_weights(str(run / "ckpt" / "model.safetensors"))
    # float16 like mlx-community checkpoints (scales/biases inherit it); CPU loaders
    # upcast to float32 for speed
    model.set_dtype(mx.float16)

    # mlx-lm's rule (utils.quantize_model): every Linear/Embedding whose input dim
    # divides the group size
    def predicate(_: str, m: nn.Module) -> bool:
        return hasattr(m, "to_quantized") and m.weight.shape[-1] % group_size == 0

    nn.quantize(model, group_size=group_size, bits=bits, class_predicate=predicate)
    q = {"group_size": group_size, "bits": bits, "mode": "affine"}
    cfg["quantization"] = q
    cfg["quantization_config"] = q  # mlx-lm writes both (HF tree support)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    index = {"metadata": {"total_size": sum(v.nbytes for v in weights.values()),
                          "total_parameters": meta["params"]},
             "weight_map": {k: "model.safetensors" for k in sorted(weights)}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))
    (out / "config.json").write_text(json.dumps(dict(sorted(cfg.items())), indent=4))
    shutil.copyfile(data / "tokenizer.model", out / "tokenizer.model")
    for name, obj in tokenizer_files(sp, cfg["max_position_embeddings"]).items():
        (out / name).write_text(json.dumps(obj, indent=2))
    gen = {"bos_token_id": BOS_ID, "eos_token_id": [cfg["eos_token_id"]],
           "pad_token_id": 0, "do_sample": True, "temperature": 0.8}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    readme = MODEL_CARD.format(params=meta["params"], layers=cfg["num_hidden_layers"],
                               hidden=cfg["hidden_size"], heads=cfg["num_attention_heads"],
                               kv=cfg["num_key_value_heads"], ff=cfg["intermediate_size"],
                               vocab=cfg["vocab_size"], gs=group_size, bits=bits,
                               val=meta.get("val_loss", float("nan")),
                               ppl=meta.get("val_ppl", float("nan")), steps=meta["step"])
    (out / "README.md").write_text(readme)
    size = sum(f.stat().st_size for f in out.iterdir())
    log(f"exported {out}: {size / 1e6:.2f} MB")
    return {"bytes": size, **meta}


MODEL_CARD = """# kvchat-mini

kvchat's default model: a {params:,}-parameter Llama-style chat model trained from scratch
by `python -m model.train` on the project's own synthetic conversations (see ../DATA.md).
It greets, tells short simple stories, and explains kvchat, KV caches, GQA, RoPE, RMSNorm
and SwiGLU in a sentence or two. It knows nothing else.

- {layers} layers, hidden {hidden}, SwiGLU {ff}, {heads} query heads over {kv} KV heads
  (GQA), RoPE, pre-norm RMSNorm, tied embeddings, vocabulary {vocab} (SentencePiece BPE,
  byte fallback)
- {bits}-bit affine quantization, group size {gs} (mlx-lm format)
- ChatML-style template: `<|im_start|>role\\n...<|im_end|>`; EOS is `<|im_end|>`
- {steps} training steps; validation loss {val:.4f} (perplexity {ppl:.3f}) on held-out
  assistant tokens

Licence: MIT (weights, tokenizer and data are the project's own).
"""


# --------------------------------------------------------------------------- sampling


def load_for_sampling(folder: Path) -> tuple[Transformer, Any]:
    """The model and the app's tokenizer (model/tokenizer.py), as the app loads them."""
    from .tokenizer import load_tokenizer
    from .weights import load_model

    return load_model(folder), load_tokenizer(folder)


def generate(model: Transformer, prompt: list[int], eos: list[int], max_tokens: int,
             temp: float = 0.0, seed: int = 0) -> tuple[list[int], str, float, float]:
    """Greedy or temperature sampling through the app's decode loop (model/generate.py).

    Returns (ids, finish_reason, ttft_s, decode_tps)."""
    key = mx.random.key(seed)
    cache = model.make_cache()

    def pick(logits: mx.array) -> mx.array:
        nonlocal key
        if temp == 0:
            return mx.argmax(logits, axis=-1)
        key, sub = mx.random.split(key)
        return mx.random.categorical(logits * (1.0 / temp), key=sub)

    t0 = time.perf_counter()
    t_first = t0
    out: list[int] = []
    reason = "length"
    steps = generate_step(model, prompt, cache, sample=pick, max_tokens=max_tokens)
    for i, tid in enumerate(steps):
        if i == 0:
            t_first = time.perf_counter()
        if tid in eos:
            reason = "eos"
            break
        out.append(tid)
    t_end = time.perf_counter()
    n = len(out) + (reason == "eos")
    decode_tps = (n - 1) / (t_end - t_first) if n > 1 and t_end > t_first else 0.0
    return out, reason, t_first - t0, decode_tps


def reply(model: Transformer, tok: Any, prompt: str, temp: float, seed: int = 0,
          max_tokens: int = 256, system: str | None = None) -> tuple[str, str, int]:
    """(text, finish_reason, generated tokens) for one user prompt."""
    msgs = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}]
    ids, reason, _, _ = generate(model, tok.encode_chat(msgs), tok.eos_ids, max_tokens, temp,
                                 seed)
    return tok.decode(ids), reason, len(ids)


def cmd_sample(args: argparse.Namespace) -> None:
    model, tok = load_for_sampling(Path(args.model))
    prompts = args.prompt or SHOWCASE_PROMPTS
    rows = []
    for p in prompts:
        g = reply(model, tok, p, 0.0, max_tokens=args.max_tokens, system=args.system)
        s = reply(model, tok, p, args.temp, seed=args.seed, max_tokens=args.max_tokens,
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
              f"\nReproduce: `python -m model.train sample --model {args.model}`\n"]
        for p, g, s in rows:
            md.append(f"\n**{p}**\n\n- greedy: {g[0]}" + ("" if g[1] == "eos" else
                                                           " *(token limit)*")
                      + f"\n- sampled: {s[0]}" + ("" if s[1] == "eos" else " *(token limit)*")
                      + "\n")
        Path(args.markdown).write_text("".join(md))
        log(f"wrote {args.markdown}")


def cmd_bench(args: argparse.Namespace) -> None:
    """TTFT and decode tok/s of the model on this machine (median of runs)."""
    model, tok = load_for_sampling(Path(args.model))
    prompt = tok.encode_chat([{"role": "user", "content": args.prompt}])
    generate(model, prompt, [], 16)  # warm-up
    ttfts, tpss = [], []
    for r in range(args.runs):
        _, _, ttft, tps = generate(model, prompt, [], args.gen_tokens, temp=0.0, seed=r)
        ttfts.append(ttft)
        tpss.append(tps)
    res = {"prompt_tokens": len(prompt), "gen_tokens": args.gen_tokens,
           "ttft_s": float(np.median(ttfts)), "decode_tps": float(np.median(tpss)),
           "device": str(mx.default_device())}
    print(json.dumps(res))


def cmd_eval(args: argparse.Namespace) -> None:
    from .weights import load_model

    model = load_model(Path(args.model))
    ids, mask = pack_rows(Path(args.data) / "val_tokens.npz", args.seq_len, None)
    vl = evaluate(model, ids, mask)
    print(json.dumps({"model": args.model, "val_loss": vl, "val_ppl": math.exp(vl),
                      "val_rows": len(ids), "loss_tokens": int(mask[:, 1:].sum())}))


# --------------------------------------------------------------------------- CLI


def _train_args(ns: argparse.Namespace) -> TrainArgs:
    return TrainArgs(**{k: getattr(ns, k) for k in TrainArgs.__dataclass_fields__})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m model.train", description=__doc__,
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
    except KVChatError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
