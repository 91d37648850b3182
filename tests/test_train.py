"""Training pipeline: synthetic data, tokenizer, a short run that learns, exact resume,
and the 4-bit export (tiny sizes, seconds on a CPU)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import mlx.core as mx
import pytest

from kvchat.model.runtime.client import EngineClient
from kvchat.model.runtime.events import GenParams
from kvchat.model.text.chat_template import render
from kvchat.model.training import corpus as chatdata
from kvchat.model.training import data as D
from kvchat.model.training import export as E
from kvchat.model.training import loop as L

TINY = dict(preset="tiny", batch=4, seq_len=64, lr=3e-3, warmup=5, ckpt_every=10,
            eval_every=0, log_every=10, eval_rows=8)


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("data")
    D.build_data(out, n_train=300, n_val=40, vocab_size=400, seed=0)
    return out


def test_corpus_is_deterministic_and_well_formed() -> None:
    a = list(chatdata.generate(300, seed=5))
    assert a == list(chatdata.generate(300, seed=5))
    assert a != list(chatdata.generate(300, seed=6))
    roles = set()
    for conv in a:
        body = [m for m in conv if m["role"] != "system"]
        assert conv[0]["role"] in ("system", "user")
        assert [m["role"] for m in body] == ["user", "assistant"] * (len(body) // 2)
        assert all(m["content"].strip() for m in conv)
        roles |= {m["role"] for m in conv}
    assert roles == {"system", "user", "assistant"}


def test_prompt_variety_is_large() -> None:
    rng = random.Random(0)
    questions = {chatdata.topic_question(rng, "GQA") for _ in range(2000)}
    assert len(questions) > 500


def test_story_honours_the_requested_character() -> None:
    rng = random.Random(1)
    for kind, name, pronoun in chatdata.HEROES:
        text = chatdata.story(rng, kind)
        assert f" {kind}" in text and name in text and text.endswith((".", "!"))
        assert pronoun in text.lower().replace(".", " ").replace(",", " ").split()
    named = 0
    for seed in range(60):
        q, a = chatdata.story_request(random.Random(seed))
        asked = [(k, n) for k, n, _ in chatdata.HEROES if f" {k}" in f" {q.lower()}"]
        if asked:
            named += 1
            kind, name = asked[0]
            assert kind in a and name in a, (q, a)
    assert named >= 10  # the requests that name a character were exercised


def test_render_chat_matches_the_jinja_template() -> None:
    conv = [{"role": "system", "content": "Be concise."},
            {"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "What is GQA?"}]
    for gen in (True, False):
        want = render(chatdata.CHAT_TEMPLATE, conv, bos_token="<s>", eos_token="<|im_end|>",
                      add_generation_prompt=gen)
        assert chatdata.render_chat(conv, add_generation_prompt=gen) == want
    assert want.startswith("<s><|im_start|>system\nBe concise.<|im_end|>\n")


def test_tokenizer_and_loss_mask(tiny_data: Path) -> None:
    sp = D.load_sp(tiny_data / "tokenizer.model")
    assert sp.get_piece_size() == 400
    end = sp.piece_to_id("<|im_end|>")
    assert sp.id_to_piece(end) == "<|im_end|>"
    assert len(sp.encode("<|im_start|>")) == 1  # user-defined symbol: one token in text
    assert sp.decode(sp.encode("naïve ☃")) == "naïve ☃"  # byte fallback
    conv = [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi there!"}]
    ids, mask = D.encode_conversation(sp, conv)
    assert ids[0] == D.BOS_ID
    learned = [i for i, m in zip(ids, mask, strict=True) if m]
    assert sp.decode(learned[:-1]) == "Hi there!" and learned[-1] == end


def _run(data: Path, run: Path, steps: int, **kw: object) -> L.TrainArgs:
    return L.TrainArgs(data=str(data), run=str(run), steps=steps, **{**TINY, **kw})


# The longer runs are slow; the export's 10 steps are the fast tier's pass through the
# training loop and the 4-bit export.
@pytest.mark.slow  # a training run
def test_fifty_steps_lower_the_loss(tiny_data: Path, tmp_path: Path) -> None:
    meta = L.train(_run(tiny_data, tmp_path / "run", 50))
    losses = [loss for _, loss in meta["history"]]
    assert len(losses) == 50
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 1.0, (first, last)
    assert meta["val_loss"] < losses[0]
    ck = tmp_path / "run" / "ckpt"
    assert {p.name for p in ck.iterdir()} == {"model.safetensors", "optimizer.safetensors",
                                              "state.json"}


@pytest.mark.slow  # a training run
def test_resume_continues_identically(tiny_data: Path, tmp_path: Path) -> None:
    full = L.train(_run(tiny_data, tmp_path / "a", 20))
    part = L.train(_run(tiny_data, tmp_path / "b", 20), stop_after=10)
    assert part["step"] == 10 and "val_loss" not in part
    resumed = L.train(_run(tiny_data, tmp_path / "b", 999), resume=True)  # steps from ckpt
    assert resumed["step"] == 20
    assert resumed["history"] == full["history"]
    wa = mx.load(str(tmp_path / "a" / "ckpt" / "model.safetensors"))
    wb = mx.load(str(tmp_path / "b" / "ckpt" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert mx.allclose(wa[k], wb[k], atol=1e-6, rtol=1e-5).item(), k


def test_resume_without_checkpoint_is_one_line_error(tmp_path: Path) -> None:
    with pytest.raises(D.TrainError, match="no checkpoint"):
        L.train(_run(tmp_path, tmp_path / "none", 5), resume=True)


def test_export_writes_a_loadable_4bit_folder(tiny_data: Path, tmp_path: Path) -> None:
    from kvchat.model import load_model
    from kvchat.model.text.tokenizer import load_tokenizer

    L.train(_run(tiny_data, tmp_path / "run", 10))
    out = tmp_path / "export"
    E.export(tmp_path / "run", tiny_data, out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"] == {"group_size": 32, "bits": 4, "mode": "affine"}
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]
    model = load_model(out)
    assert model.quantization["bits"] == 4
    weights = mx.load(str(out / "model.safetensors"))
    assert weights["model.layers.0.self_attn.q_proj.weight"].dtype == mx.uint32
    assert "model.layers.0.self_attn.q_proj.scales" in weights
    tok = load_tokenizer(out)
    assert tok.eos_ids[0] == cfg["eos_token_id"] == tok.token_to_id("<|im_end|>")
    ids = tok.encode_chat([{"role": "user", "content": "Hi"}])
    assert ids[0] == tok.bos_id == 1
    with EngineClient(out) as client:
        done = client.run(ids, GenParams(max_tokens=8))
    assert done.finish_reason in ("eos", "length") and len(done.ids) <= 8
