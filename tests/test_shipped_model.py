"""The shipped default model (assets/kvchat-mini): format, architecture, tokenizer, chat
template, and that it answers and stops at EOS. It loads through our loader and mlx-lm's."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

from kvchat.model import load_model
from kvchat.model.decoder.weights import parameter_count
from kvchat.model.runtime.client import EngineClient
from kvchat.model.runtime.events import GenParams
from kvchat.model.text.tokenizer import load_tokenizer

MODEL = Path(__file__).resolve().parents[1] / "assets" / "kvchat-mini"
FILES = ("config.json", "model.safetensors", "tokenizer.model", "tokenizer_config.json",
         "special_tokens_map.json", "generation_config.json")


@pytest.fixture(scope="module")
def model() -> nn.Module:
    # the checkpoint as stored (the CPU default dequantizes it on load)
    return load_model(str(MODEL), dequantize=False)


@pytest.fixture(scope="module")
def tok():  # noqa: ANN201 - model.tokenizer.Tokenizer
    return load_tokenizer(MODEL)


def test_folder_has_the_usual_files_and_is_small() -> None:
    for name in FILES:
        assert (MODEL / name).is_file(), name
    size = sum(f.stat().st_size for f in MODEL.iterdir())
    assert size < 25 * 2**20, size


def test_config_is_llama_with_gqa_and_4bit(model: nn.Module) -> None:
    raw = json.loads((MODEL / "config.json").read_text())
    cfg = model.config
    assert raw["model_type"] == "llama" and raw["hidden_act"] == "silu"
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # GQA
    assert cfg.num_attention_heads % cfg.num_key_value_heads == 0
    q = raw["quantization"]
    assert q["bits"] == 4 and q["group_size"] in (32, 64)
    assert model.quantization["bits"] == 4
    assert 1_000_000 < parameter_count(model) < 10_000_000


def test_modern_decoder_pieces(model: nn.Module) -> None:
    """Pre-norm RMSNorm, SwiGLU (gate/up/down), RoPE, GQA projections, 4-bit linears."""
    block = model.layers[0]
    attn, cfg = block.self_attn, model.config
    assert isinstance(attn.q_proj, nn.QuantizedLinear) and attn.q_proj.bits == 4
    assert attn.k_proj.weight.shape[0] == cfg.num_key_value_heads * cfg.head_dim
    assert attn.q_proj.weight.shape[0] == cfg.num_attention_heads * cfg.head_dim
    assert {"gate_proj", "up_proj", "down_proj"} <= set(block.mlp.children())
    assert type(block.input_layernorm).__name__ == "RMSNorm"
    assert type(attn.rope).__name__ == "RoPE"


def test_tokenizer_and_chat_template(tok) -> None:  # noqa: ANN001
    assert tok.kind == "sentencepiece" and 2048 <= tok.vocab_size <= 8192
    assert tok.eos_token == "<|im_end|>" and tok.eos_ids[0] == tok.token_to_id("<|im_end|>")
    assert tok.chat_template is not None and tok.add_bos is False  # BOS comes from the template
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    text = tok.render_chat(msgs)
    assert text == ("<s><|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode_chat(msgs)
    assert ids[0] == tok.bos_id == 1
    assert ids.count(tok.token_to_id("<|im_start|>")) == 3
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode("naïve ☃", add_special_tokens=False)) == "naïve ☃"


@pytest.mark.parametrize("prompt", ["Hello!", "What is a KV cache?", "Tell me a short story."])
def test_greedy_reply_stops_at_eos(model: nn.Module, tok, prompt: str) -> None:  # noqa: ANN001
    with EngineClient(MODEL) as client:
        done = client.run([{"role": "user", "content": prompt}], GenParams(max_tokens=200))
    text = done.text
    assert done.finish_reason == "eos", text
    assert len(text.split()) >= 3 and text[0].isupper(), text


def test_mlx_lm_loads_it_and_agrees(model: nn.Module, tok) -> None:  # noqa: ANN001
    """mlx-lm reads the same folder (weights, config, tokenizer) and predicts the same."""
    mlx_lm = pytest.importorskip("mlx_lm")
    ref, ref_tok = mlx_lm.load(str(MODEL))
    msgs = [{"role": "user", "content": "What is GQA?"}]
    ids = tok.encode_chat(msgs)
    hf_ids = ref_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    if not isinstance(hf_ids, list):  # transformers 5 may return a BatchEncoding
        hf_ids = hf_ids["input_ids"]
    assert list(hf_ids) == ids
    assert tok.eos_ids[0] in ref_tok.eos_token_ids
    x = mx.array([ids])
    ours, theirs = model(x)[0, -1], ref(x)[0, -1].astype(mx.float32)
    assert mx.argmax(ours).item() == mx.argmax(theirs).item()
    assert mx.allclose(ours, theirs, atol=0.1, rtol=0.05).item()
