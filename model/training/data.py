"""Training data: the synthetic corpus (corpus.py) rendered, tokenized with a SentencePiece
BPE trained here, and packed into fixed-length rows with a loss mask on assistant tokens."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvchat.model.errors import KVChatError

from . import corpus

BOS_ID, EOS_TEXT = 1, corpus.IM_END
class TrainError(KVChatError):
    """A training/export step that cannot run as asked (missing data, bad checkpoint)."""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)



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
        user_defined_symbols=[corpus.IM_START, corpus.IM_END],
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
        raise TrainError(
            f"no tokenizer at {path}; run `python -m kvchat.model.training data` first"
        )
    return spm.SentencePieceProcessor(model_file=str(path))


def encode_conversation(sp: Any, conv: corpus.Conversation) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and a 0/1 loss mask that is 1 on assistant
    content and its closing <|im_end|> (the model learns to answer and to stop)."""
    end = sp.piece_to_id(corpus.IM_END)
    ids, mask = [BOS_ID], [0]
    for m in conv:
        head = sp.encode(f"{corpus.IM_START}{m['role']}\n")
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
    train = list(corpus.generate(n_train, seed))
    seen = {corpus.render_chat(c) for c in train}
    # held-out split: a different seed, minus any conversation that also occurs in train
    val_all = list(corpus.generate(n_val, seed + 7919))
    val = [c for c in val_all if corpus.render_chat(c) not in seen]
    for name, convs in (("train", train), ("val", val)):
        with open(out / f"{name}.jsonl", "w") as f:
            for c in convs:
                f.write(json.dumps(c) + "\n")
    lines = out / "tokenizer_lines.txt"
    with open(lines, "w") as f:
        for line in corpus.tokenizer_text(n_train, seed):
            f.write(line + "\n")
    log(f"corpus: {len(train)} train, {len(val)} val conversations "
        f"({len(val_all) - len(val)} val duplicates of train dropped)")
    train_tokenizer(lines, out / "tokenizer", vocab_size, seed)
    sp = load_sp(out / "tokenizer.model")
    # segment-wise encoding (for the loss mask) must equal whole-text encoding
    for c in train[:500]:
        ids, _ = encode_conversation(sp, c)
        whole = [BOS_ID] + sp.encode(corpus.render_chat(c, bos_token=""))
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

