"""GGUF files against the Hugging Face folders they were converted from.

For each family llama.cpp writes (llama, mistral and Mixtral as llama, qwen2, qwen3 and
their MoE forms, gemma, gemma2, gemma3, phi3) a tiny checkpoint is built with
transformers, with a real tokenizer of one of the two kinds GGUF holds (a SentencePiece
BPE model trained here, or a byte-level BPE tokenizer.json), then written as GGUF the way
llama.cpp's converter does (tests/helpers/gguf_convert.py: its name map, the Q/K
permutation, Gemma's 1 + w norms, stacked experts, its metadata keys and vocabulary
code). kvchat must read the file as the same model: the same token ids and chat prompt,
logits within 1e-4 · max(1, |ref|) of the folder loaded by kvchat (itself exact against
transformers, tests/test_families.py), the same greedy ids. Q8_0, Q4_0 and Q4_1 files
give the same greedy ids (and, dequantized, the same logits) as their dequantized weights
run as floats; K-quants load as gguf.quants dequantizes them. Then hostile files: every
bound of the header parser, with hand-made bytes. (The stores: test_gguf_stores.py.)
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from kvchat.model import load_model, load_tokenizer
from kvchat.model.cache.kv import make_prompt_cache
from kvchat.model.decoder import gguf as gguf_model
from kvchat.model.decoder.config import load_config
from kvchat.model.decoder.weights import weight_bytes
from kvchat.model.errors import ConfigError, KVChatError, ModelLoadError
from kvchat.model.explain.facts import check_model_folder, model_facts
from kvchat.model.gguf_file import MAX_ARRAY, MAX_TENSORS, GGUFError, is_gguf, read_gguf

from .helpers.gguf_convert import convert
from .helpers.gguf_models import (
    _MOE,
    LLAMA3_ROPE,
    LONGROPE,
    STRINGS,
    TOKENIZERS,
    WINDOW,
    Spec,
    build,
)

SEQ = 40
GREEDY = 12

SPECS: dict[str, Spec] = {
    "llama": Spec("LlamaForCausalLM", "spm", {"tie_word_embeddings": False}, seed=1),
    # Llama 3: byte-level BPE (llama-bpe) and its RoPE schedule as llama.cpp's rope_freqs
    "llama3": Spec("LlamaForCausalLM", "llama3", {"rope_parameters": LLAMA3_ROPE,
                                                  "tie_word_embeddings": True}, seed=2),
    # llama.cpp writes Mistral as llama (it has no sliding window either)
    "mistral": Spec("MistralForCausalLM", "spm", {"sliding_window": None},
                    model_type="llama", seed=3),
    "mixtral": Spec("MixtralForCausalLM", "spm", _MOE, seed=4),
    "qwen2": Spec("Qwen2ForCausalLM", "qwen2", {
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, seed=5),
    "qwen3": Spec("Qwen3ForCausalLM", "qwen2", {"head_dim": 32,
                                                "tie_word_embeddings": False}, seed=6),
    "qwen2_moe": Spec("Qwen2MoeForCausalLM", "qwen2", {
        **_MOE, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}, seed=7),
    "qwen3_moe": Spec("Qwen3MoeForCausalLM", "qwen2", {
        **_MOE, "moe_intermediate_size": 32, "norm_topk_prob": True, "head_dim": 32}, seed=8),
    "gemma": Spec("GemmaForCausalLM", "spm_noprefix", {"head_dim": 16}, seed=9),
    # sliding, global, sliding; llama.cpp's scale rule (head_dim, = hidden / heads here)
    "gemma2": Spec("Gemma2ForCausalLM", "spm_noprefix", {
        "num_hidden_layers": 3, "head_dim": 16, "sliding_window": WINDOW,
        "query_pre_attn_scalar": 16, "attn_logit_softcapping": 5.0,
        "final_logit_softcapping": 8.0}, seed=10),
    # llama.cpp's Gemma 3: every 6th layer global, local base 1e4, linear ×8 globally
    "gemma3": Spec("Gemma3ForCausalLM", "spm_noprefix", {
        "num_hidden_layers": 6, "head_dim": 16, "sliding_window": WINDOW,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        "query_pre_attn_scalar": 16,
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
        model_type="gemma3_text", seed=11),
    "phi3": Spec("Phi3ForCausalLM", "spm", {"sliding_window": WINDOW}, seed=12),
    # partial rotary (half of head_dim) and longrope, short factors up to 32 tokens
    "phi3_longrope": Spec("Phi3ForCausalLM", "spm", {
        "max_position_embeddings": 128, "original_max_position_embeddings": 32,
        "rope_parameters": LONGROPE}, seed=13),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build(SPECS[name], tmp_path_factory.mktemp(f"hf_{name}"))
        return built[name]

    return get


@pytest.fixture(scope="module")
def gguf_of(checkpoint: Callable[[str], Path]) -> Callable[..., Path]:
    """`gguf_of(name, outtype="F32", roundtrip=False)` -> the converted file, made once."""
    made: dict[tuple[str, str, bool], Path] = {}

    def get(name: str, outtype: str = "F32", roundtrip: bool = False) -> Path:
        key = (name, outtype, roundtrip)
        if key not in made:
            folder = checkpoint(name)
            tok = TOKENIZERS[SPECS[name].tokenizer]
            out = folder.parent / f"{name}-{outtype}{'-deq' * roundtrip}.gguf"
            made[key] = convert(folder, out, tokenizer=tok.kind, pre=tok.pre,
                                outtype=outtype, space_prefix=tok.space_prefix,
                                roundtrip=roundtrip)
        return made[key]

    return get


def _ids(vocab: int) -> mx.array:
    rng = np.random.default_rng(4321)
    return mx.array(rng.integers(3, vocab, size=(1, SEQ)))


def rel_err(a: np.ndarray, ref: np.ndarray) -> float:
    assert a.shape == ref.shape, (a.shape, ref.shape)
    return float(np.abs(a - ref).max()) / max(1.0, float(np.abs(ref).max()))


def greedy(model: Any, prompt: list[int], n: int = GREEDY) -> list[int]:
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)
    out = []
    for _ in range(n):
        token = int(mx.argmax(logits[0, -1]).item())
        out.append(token)
        logits = model(mx.array([[token]]), cache=cache)
    return out


# --------------------------------------------------------------------- exactness


@pytest.mark.parametrize("name", list(SPECS))
def test_family_from_gguf_is_the_same_model(name: str, checkpoint: Callable[[str], Path],
                                            gguf_of: Callable[..., Path]) -> None:
    folder, path = checkpoint(name), gguf_of(name)
    assert is_gguf(path) and not is_gguf(folder / "config.json")
    spec = SPECS[name]
    cfg = load_config(path)
    assert cfg.model_type == (spec.model_type or json.loads(
        (folder / "config.json").read_text())["model_type"])
    ref_model, model = load_model(folder), load_model(path)
    ids = _ids(cfg.vocab_size)
    ref = np.array(ref_model(ids))
    got = np.array(model(ids))
    err = rel_err(got, ref)
    print(f"{name}: max rel err {err:.2e}")
    assert err <= 1e-4
    ref_tok, tok = load_tokenizer(folder), load_tokenizer(path)
    prompt = ref_tok.encode("Once upon a time")
    assert tok.encode("Once upon a time") == prompt
    assert greedy(model, prompt) == greedy(ref_model, prompt)


@pytest.mark.parametrize("name", ["llama", "gemma", "qwen2", "llama3"])
def test_tokenizer_from_gguf_matches_the_folder(name: str, checkpoint: Callable[[str], Path],
                                                gguf_of: Callable[..., Path]) -> None:
    """Both vocabulary kinds (SentencePiece with and without the space prefix,
    byte-level BPE with Qwen 2's and Llama 3's pre-tokenizers): the same ids, text,
    special tokens and chat prompt as the folder's own tokenizer."""
    folder, path = checkpoint(name), gguf_of(name)
    ref, tok = load_tokenizer(folder), load_tokenizer(path)
    spec = TOKENIZERS[SPECS[name].tokenizer]
    turn = f"{spec.specials[-2]}user\nhi there{spec.specials[-1]}\n{spec.specials[-2]}x"
    for text in [*STRINGS, turn, f"{spec.bos}Hello{spec.eos}"]:
        ids = ref.encode(text)
        assert tok.encode(text) == ids, text
        assert tok.decode(ids) == ref.decode(ids)
        assert tok.decode(ids, skip_special_tokens=True) == ref.decode(
            ids, skip_special_tokens=True)
    assert (tok.bos_id, tok.add_bos) == (ref.bos_id, ref.add_bos)
    assert tok.eos_ids[0] == ref.eos_ids[0]
    assert tok.chat_template == spec.template
    chat = [{"role": "user", "content": "Tell me a story."}]
    assert tok.render_chat(chat) == ref.render_chat(chat)
    assert tok.encode_chat(chat) == ref.encode_chat(chat)


# --------------------------------------------------------------------- quantized files


@pytest.mark.parametrize(("name", "outtype"), [
    ("llama", "Q8_0"), ("llama", "Q4_0"), ("llama", "Q4_1"),
    ("qwen2_moe", "Q8_0"), ("qwen2_moe", "Q4_0")])  # experts: 3-D quantized tensors
def test_quantized_file_runs_as_its_dequantized_weights(
        name: str, outtype: str, gguf_of: Callable[..., Path]) -> None:
    """A Q8_0 / Q4_0 file against the same values written as F32 (gguf.quants'
    dequantize of the same blocks): dequantized on load, the same logits and greedy
    ids; kept quantized in MLX's layout (the GPU policy), the same greedy ids."""
    path, ref_path = gguf_of(name, outtype), gguf_of(name, outtype, roundtrip=True)
    gf = read_gguf(path)
    assert gf.file_type == outtype
    assert {t.type_name for t in gf.tensors.values() if len(t.shape) >= 2} >= {outtype}
    ref = load_model(ref_path)
    deq = load_model(path, dequantize=True)
    kept = load_model(path, dequantize=False)
    assert deq.dequantized and not kept.dequantized
    assert kept.quantization["bits"] == (8 if outtype == "Q8_0" else 4)
    assert kept.quantization["group_size"] == 32
    ids = _ids(ref.config.vocab_size)
    err = rel_err(np.array(deq(ids)), np.array(ref(ids)))
    print(f"{name} {outtype}: dequantized on load, max rel err {err:.2e}")
    assert err <= 1e-5
    prompt = load_tokenizer(path).encode("Once upon a time")
    assert greedy(deq, prompt) == greedy(ref, prompt) == greedy(kept, prompt)


@pytest.mark.parametrize("outtype", ["F32", "F16", "Q4_0"])
def test_facts_are_what_loading_allocates(outtype: str, gguf_of: Callable[..., Path]) -> None:
    """`inspect`, `models` and the picker read model_facts: for a GGUF file its bytes must
    be what load_model allocates, and it names the file's type."""
    path = gguf_of("llama", outtype)
    facts = model_facts(path)
    assert facts.gguf == outtype
    assert facts.weight_bytes == weight_bytes(load_model(path))
    assert facts.file_bytes == sum(t.nbytes for t in read_gguf(path).tensors.values())
    assert check_model_folder(path) == facts


def test_engine_chats_with_a_gguf_file(checkpoint: Callable[[str], Path],
                                      gguf_of: Callable[..., Path]) -> None:
    """The engine loads the file (its one loading place), says how it is stored, and a
    chat turn through the file's own template gives the folder's greedy reply."""
    from kvchat.model.runtime.client import EngineClient
    from kvchat.model.runtime.events import GenParams

    chat = [{"role": "user", "content": "Tell me a story."}]
    params = GenParams(max_tokens=8, temp=0.0, ignore_eos=True)
    with EngineClient(checkpoint("qwen2"), timeout=120) as ref:
        want = ref.run(chat, params)
    with EngineClient(gguf_of("qwen2"), timeout=120) as c:
        assert c.info["gguf"] == "F32" and c.info["name"] == "qwen2-F32"
        assert c.info["chat_template"] and c.info["architecture"] == "qwen2"
        got = c.run(chat, params)
    assert got.prompt_ids == want.prompt_ids
    assert (got.ids, got.text) == (want.ids, want.text)


def test_panel_says_how_a_gguf_file_is_stored() -> None:
    from kvchat.app.tui.widgets.stats_panel import model_rows

    info = {"name": "Qwen2.5-7B-Instruct-Q4_K_M", "architecture": "qwen2", "dtype": "float32",
            "parameters": 7_600_000_000, "weight_bytes": 30_400_000_000, "n_layers": 28,
            "n_heads": 28, "n_kv_heads": 4}
    plain = [r.plain for r in model_rows({**info, "gguf": "Q4_K_M"})]
    assert "from GGUF Q4_K_M" in plain[4] and plain[4].startswith("file")
    assert not any("GGUF" in r.plain for r in model_rows(info))  # a folder: no such row


def _k_quant_blocks(rows: int, cols: int, qtype: Any, seed: int) -> np.ndarray:
    """Random K-quant blocks with sane scales (gguf-py cannot quantize to K-quants)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(seed).integers(0, 256, (rows, cols // block, size), np.uint8)
    scale = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
    if qtype == GGMLQuantizationType.Q6_K:  # ql, qh, int8 scales, then d
        raw[..., size - 2:] = scale
    else:  # Q4_K: d, dmin, then scales and quants
        raw[..., 0:2] = scale
        raw[..., 2:4] = scale
    return raw.reshape(rows, -1)


def test_k_quants_are_dequantized_as_gguf_does(tmp_path: Path) -> None:
    """Q6_K and Q4_K matrices (rows of 256) load as gguf.quants.dequantize reads them,
    in the right place and orientation."""
    from gguf import quants
    from gguf.constants import GGMLQuantizationType as Q

    folder = tmp_path / "hf"
    folder.mkdir()
    build(Spec("LlamaForCausalLM", "spm", {"hidden_size": 256, "intermediate_size": 512},
               seed=21), folder)
    stored: dict[str, np.ndarray] = {}

    def types(name: str, data: np.ndarray) -> tuple[np.ndarray, Any] | None:
        qtype = {"blk.0.ffn_down.weight": Q.Q6_K, "blk.1.attn_v.weight": Q.Q4_K}.get(name)
        if qtype is None:
            return None
        stored[name] = raw = _k_quant_blocks(*data.shape, qtype, seed=len(stored))
        return raw, qtype

    path = convert(folder, tmp_path / "k.gguf", tokenizer="spm", types=types)
    weights = gguf_model.read_weights(read_gguf(path))
    for name, ours, qtype in (("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight",
                               Q.Q6_K),
                              ("blk.1.attn_v.weight", "model.layers.1.self_attn.v_proj.weight",
                               Q.Q4_K)):
        want = quants.dequantize(stored[name], qtype)
        assert np.array_equal(np.array(weights[ours]), want)
    model = load_model(path)
    assert np.isfinite(np.array(model(_ids(model.config.vocab_size)))).all()
    assert model_facts(path).weight_bytes == weight_bytes(model)


# --------------------------------------------------------------------- hostile files


def _s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str, vtype: int, value: bytes) -> bytes:
    return _s(key) + struct.pack("<I", vtype) + value


def u32(key: str, v: int) -> bytes:
    return kv(key, 4, struct.pack("<I", v))


def text(key: str, v: str) -> bytes:
    return kv(key, 8, _s(v))


def tensor(name: str, ne: list[int], ttype: int = 0, offset: int = 0) -> bytes:
    return (_s(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", d) for d in ne)
            + struct.pack("<IQ", ttype, offset))


def raw_gguf(path: Path, kvs: list[bytes], tensors: list[bytes], data: bytes = b"", *,
             n_tensors: int | None = None, n_kv: int | None = None, version: int = 3,
             magic: bytes = b"GGUF") -> Path:
    """A GGUF file from parts, counts as claimed (default: as many as given)."""
    head = magic + struct.pack("<IQQ", version, len(tensors) if n_tensors is None
                               else n_tensors, len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(tensors)
    body += b"\0" * (-len(body) % 32)
    path.write_bytes(body + data)
    return path


LLAMA_KVS = [text("general.architecture", "llama"), u32("llama.block_count", 1),
             u32("llama.embedding_length", 32), u32("llama.feed_forward_length", 64),
             u32("llama.attention.head_count", 2), u32("llama.context_length", 64)]


def _refused(path: Path, *words: str) -> str:
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(GGUFError) as e:
            read_gguf(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(e.value)
    assert "\n" not in message and path.name in message
    for w in words:
        assert w in message, message
    assert peak < 8 << 20, f"parsing a hostile header allocated {peak:,} bytes"
    return message


def test_a_terabyte_tensor_is_refused_before_any_read(tmp_path: Path) -> None:
    # 2^20 × 2^20 float32: 4 TiB claimed by a file of a few hundred bytes
    path = raw_gguf(tmp_path / "big.gguf", LLAMA_KVS,
                    [tensor("token_embd.weight", [1 << 20, 1 << 20])], b"\0" * 64)
    _refused(path, "token_embd.weight", "4,398,046,511,104 bytes", "truncated")


@pytest.mark.parametrize(("case", "words"), [
    ("tensor_count", ("tensors", f"{MAX_TENSORS:,}")),
    ("kv_count", ("metadata entries",)),
    ("string", ("claims", "bytes")),
    ("string_past_end", ("needs", "left")),
    ("array_count", ("items", f"{MAX_ARRAY:,}")),
    ("array_past_end", ("needs",)),
    ("nested_arrays", ("deeper",)),
    ("value_type", ("unknown value type 77",)),
    ("tensor_type", ("unknown tensor type 99",)),
    ("partial_block", ("whole blocks",)),
    ("dims", ("5 dimensions",)),
    ("empty_dim", ("empty dimension",)),
    ("unaligned", ("not a multiple of the alignment",)),
    ("offset_past_end", ("offset",)),
    ("alignment", ("general.alignment",)),
    ("duplicate_key", ("appears twice",)),
    ("duplicate_tensor", ("appears twice",)),
    ("version", ("GGUF version 1",)),
    ("big_endian", ("big-endian",)),
    ("magic", ("not a GGUF file",)),
    ("truncated", ("truncated",)),
])
def test_hostile_headers_are_refused_in_one_line(tmp_path: Path, case: str,
                                                 words: tuple[str, ...]) -> None:
    path = tmp_path / f"{case}.gguf"
    ok = tensor("token_embd.weight", [32, 8])
    data = b"\0" * 1024
    if case == "tensor_count":
        raw_gguf(path, LLAMA_KVS, [], data, n_tensors=1 << 40)
    elif case == "kv_count":
        raw_gguf(path, [], [], data, n_kv=1 << 40)
    elif case == "string":
        raw_gguf(path, [kv("general.name", 8, struct.pack("<Q", 1 << 40))], [])
    elif case == "string_past_end":
        raw_gguf(path, [kv("general.name", 8, struct.pack("<Q", 4096) + b"abc")], [])
    elif case == "array_count":
        raw_gguf(path, [kv("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 1 << 40))], [])
    elif case == "array_past_end":
        raw_gguf(path, [kv("tokenizer.ggml.scores", 9, struct.pack("<IQ", 6, 1 << 20))], [])
    elif case == "nested_arrays":
        nest = struct.pack("<IQ", 9, 1) + struct.pack("<IQ", 9, 1) + struct.pack("<IQ", 4, 0)
        raw_gguf(path, [kv("x", 9, nest)], [])
    elif case == "value_type":
        raw_gguf(path, [kv("x", 77, b"")], [])
    elif case == "tensor_type":
        raw_gguf(path, LLAMA_KVS, [tensor("token_embd.weight", [32, 8], ttype=99)], data)
    elif case == "partial_block":  # Q4_0 rows hold blocks of 32
        raw_gguf(path, LLAMA_KVS, [tensor("token_embd.weight", [33, 8], ttype=2)], data)
    elif case == "dims":
        raw_gguf(path, LLAMA_KVS, [tensor("token_embd.weight", [2, 2, 2, 2, 2])], data)
    elif case == "empty_dim":
        raw_gguf(path, LLAMA_KVS, [tensor("token_embd.weight", [32, 0])], data)
    elif case == "unaligned":
        raw_gguf(path, LLAMA_KVS, [tensor("token_embd.weight", [32, 2], offset=4)], data)
    elif case == "offset_past_end":
        raw_gguf(path, LLAMA_KVS, [tensor("token_embd.weight", [32, 2], offset=1 << 50)], data)
    elif case == "alignment":
        raw_gguf(path, [u32("general.alignment", 3)], [ok], data)
    elif case == "duplicate_key":
        raw_gguf(path, [u32("llama.block_count", 1), u32("llama.block_count", 2)], [])
    elif case == "duplicate_tensor":
        raw_gguf(path, LLAMA_KVS, [ok, ok], data)
    elif case == "version":
        raw_gguf(path, [], [], version=1)
    elif case == "big_endian":
        path.write_bytes(b"GGUF" + struct.pack(">IQQ", 3, 0, 0))
    elif case == "magic":
        raw_gguf(path, [], [], magic=b"PK\3\4")
    elif case == "truncated":
        raw_gguf(path, LLAMA_KVS, [ok])  # the table, then no data
    _refused(path, *words)


def test_unknown_architecture_and_tensors_are_one_line(tmp_path: Path) -> None:
    emb = tensor("token_embd.weight", [32, 8])
    mamba = raw_gguf(tmp_path / "mamba.gguf", [text("general.architecture", "mamba"),
                                               u32("mamba.block_count", 1)], [emb],
                     b"\0" * 1024)
    with pytest.raises(ConfigError, match="unknown GGUF architecture 'mamba'; kvchat reads: "
                       "gemma, gemma2, gemma3, llama, phi3, qwen2"):
        load_config(mamba)
    odd = raw_gguf(tmp_path / "odd.gguf", LLAMA_KVS,
                   [emb, tensor("blk.0.attn_rot.weight", [32], offset=1024)], b"\0" * 1280)
    for load in (load_config, load_model, model_facts):  # the numbers are fine, one name not
        with pytest.raises(ModelLoadError, match=r"odd.gguf: GGUF tensor 'blk.0.attn_rot.weight'"
                           r" has no place in kvchat's llama model"):
            load(odd)
    ints = raw_gguf(tmp_path / "ints.gguf", LLAMA_KVS, [tensor("token_embd.weight", [32, 8],
                                                               ttype=26)], b"\0" * 1024)
    with pytest.raises(ModelLoadError, match="holds integers"):
        gguf_model.read_weights(read_gguf(ints))


def test_a_fifo_named_gguf_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    assert not is_gguf(fifo)
    for read in (read_gguf, check_model_folder):
        with pytest.raises(KVChatError, match=r"model.gguf is not a regular file \(a FIFO\)"):
            read(fifo)


def test_cli_reports_a_bad_gguf_in_one_line(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    from kvchat.app.main import main

    path = raw_gguf(tmp_path / "bad.gguf", LLAMA_KVS,
                    [tensor("token_embd.weight", [1 << 20, 1 << 20])], b"\0" * 64)
    assert main(["inspect", "--model", str(path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvchat: error: bad GGUF file bad.gguf")
