"""A GGUF file (llama.cpp, Ollama, LM Studio) as a Hugging Face model: the config dict
`ModelConfig.from_dict` reads and the weights under our (Hugging Face) tensor names.

What llama.cpp's converter (convert_hf_to_gguf.py) did to a checkpoint is undone here,
per architecture (`ARCHS`):

- metadata keys (`{arch}.block_count`, `.embedding_length`, `.attention.head_count`, …)
  become config.json keys, with llama.cpp's own defaults where a key is absent (Gemma 2's
  soft-caps, Gemma 3's sliding pattern of 6 and local RoPE base 1e4);
- tensor names (`blk.N.attn_q.weight`, `token_embd.weight`, …) become ours
  (`model.layers.N.self_attn.q_proj.weight`, …); experts stay stacked, as our
  `switch_mlp` holds them;
- the Llama architecture's Q and K rows were permuted so llama.cpp's interleaved rotary
  matches the checkpoint's rotate-half one: `w.reshape(heads, 2, rows/heads/2, …)
  .swapaxes(1, 2)`; the inverse is `w.reshape(heads, rows/heads/2, 2, …).swapaxes(1, 2)`,
  applied to whole rows, so it works on quantized blocks as on floats;
- Gemma's norms were stored as 1 + w (its RMSNorm multiplies by 1 + w);
- RoPE schedules held as tensors (Llama 3's `rope_freqs` divisors, Phi-3's long/short
  factors) become config values.

Tensor types: F32/F16/BF16 as stored; Q4_0, Q4_1 and Q8_0 are affine blocks of 32 that
MLX holds as they are (4 or 8 bits, one scale and one bias per 32), so they become
quantized layers and the loader's usual policy applies (dequantized on load on the CPU,
kept on a GPU); every other type (the K-quants, IQ*, …) is dequantized with
`gguf.quants.dequantize`.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvchat.model import gguf_file as ggml
from kvchat.model.errors import ConfigError, ModelLoadError
from kvchat.model.files import shown_path
from kvchat.model.gguf_file import GGUFError, GGUFFile, GGUFTensor, tensor_data

if TYPE_CHECKING:
    import mlx.core as mx

GROUP = 32  # the block of Q4_0, Q4_1 and Q8_0: one MLX quantization group
# types MLX keeps quantized as they are: bits, and whether the block holds a minimum
MLX_LAYOUT: dict[int, tuple[int, bool]] = {ggml.Q4_0: (4, False), ggml.Q4_1: (4, True),
                                           ggml.Q8_0: (8, False)}
FLOATS = {ggml.F32: "float32", ggml.F16: "float16", ggml.BF16: "bfloat16",
          ggml.F64: "float32"}


@dataclass(frozen=True)
class Arch:
    """How llama.cpp wrote one architecture."""

    model_type: str  # our family
    moe_type: str | None = None  # the family when the file holds experts
    permuted_qk: bool = False  # Llama: Q/K rows permuted for interleaved RoPE
    norm_plus_one: bool = False  # Gemma: norm weights stored as 1 + w
    names: tuple[tuple[str, str], ...] = ()  # this architecture's own layer names
    config: Callable[[GGUFFile, dict[str, Any]], dict[str, Any]] | None = None


# llama.cpp's per-layer tensor names -> ours (under model.layers.N.)
LAYER_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj", "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                "output": "lm_head"}
# tensors that are settings, not parameters (read into the config)
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
_LAYER = re.compile(r"^blk\.(\d+)\.(\w+?)(?:\.(\d+))?\.(weight|bias)$")
# before April 2024 llama.cpp wrote Mixtral's experts one by one: blk.N.ffn_gate.E.weight
_EXPERT_PROJ = {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}


def _f32(value: Any) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not
    9.99999974e-06)."""
    return float(str(np.float32(value)))


def _count(value: Any, key: str, name: str) -> int:
    """A count that llama.cpp may also write per layer (then every layer must agree)."""
    if isinstance(value, np.ndarray):
        values = set(value.tolist())
        if len(values) != 1:
            raise ConfigError(f"{name}: {key} differs between layers ({sorted(values)[:4]});"
                              " kvchat needs one value")
        value = values.pop()
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ConfigError(f"{name}: {key} is {value!r:.40}, not a count")
    return int(value)


class _Meta:
    """`{arch}.` keys of one file, read with llama.cpp's defaults."""

    def __init__(self, gf: GGUFFile) -> None:
        self.gf, self.arch, self.name = gf, gf.architecture, shown_path(gf.path.name)

    def raw(self, key: str, default: Any = None) -> Any:
        return self.gf.get(f"{self.arch}.{key}", default)

    def count(self, key: str, default: int | None = None) -> int:
        value = self.raw(key)
        if value is None:
            if default is None:
                raise ConfigError(f"{self.name}: the GGUF metadata lacks {self.arch}.{key}")
            return default
        return _count(value, f"{self.arch}.{key}", self.name)

    def real(self, key: str, default: float | None = None) -> float | None:
        value = self.raw(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
            raise ConfigError(f"{self.name}: {self.arch}.{key} is {value!r:.40}, not a number")
        return _f32(value)


def _small_tensor(gf: GGUFFile, name: str) -> list[float] | None:
    """A short F32 settings tensor (RoPE factors) as a list, or None when absent."""
    t = gf.tensors.get(name)
    if t is None:
        return None
    if t.type != ggml.F32 or len(t.shape) != 1 or t.n_elements > 65_536:
        raise ConfigError(f"{shown_path(gf.path.name)}: {name} should be a short F32 vector,"
                          f" it is {t.type_name} {list(t.shape)}")
    with tensor_data(gf) as get:
        return [_f32(v) for v in get(t).view("<f4").tolist()]


def _rope_scaling(m: _Meta, cfg: dict[str, Any]) -> dict[str, Any] | None:
    """The classic `rope_scaling` dict from `rope.scaling.*` and the RoPE tensors."""
    freqs = _small_tensor(m.gf, "rope_freqs.weight")
    if freqs is not None:
        # Llama 3's schedule as llama.cpp keeps it: a divisor per rotated pair. longrope
        # with equal short and long factors and no attention factor is that function.
        return {"rope_type": "longrope", "short_factor": freqs, "long_factor": freqs,
                "original_max_position_embeddings": cfg["max_position_embeddings"],
                "attention_factor": 1.0}
    kind = m.raw("rope.scaling.type")
    factor = m.real("rope.scaling.factor")
    if kind in (None, "none") or not factor:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        out: dict[str, Any] = {
            "rope_type": "yarn", "factor": factor,
            "original_max_position_embeddings": m.count(
                "rope.scaling.original_context_length", cfg["max_position_embeddings"]),
        }
        for key, ours in (("beta_fast", "beta_fast"), ("beta_slow", "beta_slow"),
                          ("attn_factor", "attention_factor")):
            value = m.real(f"rope.scaling.yarn_{key}")
            if value is not None:
                out[ours] = value
        return out
    raise ConfigError(f"{m.name}: RoPE scaling {kind!r:.40} in a GGUF file is not supported"
                      " (linear, yarn and Llama 3's rope_freqs are)")


def _gemma_scale(m: _Meta, cfg: dict[str, Any], big_layers: int) -> float:
    """query_pre_attn_scalar as llama.cpp derives it: `attention.scale` when written,
    else hidden/heads for the 27B (its layer count) and head_dim for the others."""
    scale = m.real("attention.scale")
    if scale:
        return 1.0 / scale ** 2
    if cfg["num_hidden_layers"] == big_layers:
        return cfg["hidden_size"] / cfg["num_attention_heads"]
    return float(cfg["head_dim"])


def _llama(gf: GGUFFile, cfg: dict[str, Any]) -> dict[str, Any]:
    m = _Meta(gf)
    extra: dict[str, Any] = {"rope_scaling": _rope_scaling(m, cfg),
                             "attention_bias": "blk.0.attn_q.bias" in gf.tensors,
                             "mlp_bias": "blk.0.ffn_up.bias" in gf.tensors}
    if m.count("expert_count", 0):
        extra.update(num_local_experts=m.count("expert_count"),
                     num_experts_per_tok=m.count("expert_used_count"))
    return extra


def _qwen(gf: GGUFFile, cfg: dict[str, Any]) -> dict[str, Any]:
    m = _Meta(gf)
    extra: dict[str, Any] = {"rope_scaling": _rope_scaling(m, cfg), "use_sliding_window": False}
    if m.count("expert_count", 0):
        extra.update(num_experts=m.count("expert_count"),
                     num_experts_per_tok=m.count("expert_used_count"),
                     moe_intermediate_size=m.count("expert_feed_forward_length"),
                     decoder_sparse_step=1, mlp_only_layers=[],
                     # llama.cpp: Qwen3-MoE renormalises the top-k weights, Qwen2-MoE not
                     norm_topk_prob=bool(m.raw("expert_weights_norm", gf.architecture
                                                == "qwen3moe")))
        shared = gf.tensors.get("blk.0.ffn_up_shexp.weight")
        if shared is not None:
            extra["shared_expert_intermediate_size"] = m.count(
                "expert_shared_feed_forward_length", shared.shape[0])
    return extra


def _gemma(gf: GGUFFile, cfg: dict[str, Any]) -> dict[str, Any]:
    return {"hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh"}


def _gemma2(gf: GGUFFile, cfg: dict[str, Any]) -> dict[str, Any]:
    m = _Meta(gf)
    return {
        **_gemma(gf, cfg),
        "sliding_window": m.count("attention.sliding_window", 4096),
        "attn_logit_softcapping": m.real("attn_logit_softcapping", 50.0),
        "final_logit_softcapping": m.real("final_logit_softcapping", 30.0),
        "query_pre_attn_scalar": _gemma_scale(m, cfg, big_layers=46),
    }


def _gemma3(gf: GGUFFile, cfg: dict[str, Any]) -> dict[str, Any]:
    m = _Meta(gf)
    n = cfg["num_hidden_layers"]
    window = m.count("attention.sliding_window", 0)
    pattern = m.raw("attention.sliding_window_pattern", 6)
    if not window:
        sliding = [False] * n
    elif isinstance(pattern, np.ndarray):
        if len(pattern) != n:
            raise ConfigError(f"{m.name}: gemma3.attention.sliding_window_pattern has"
                              f" {len(pattern)} entries for {n} layers")
        sliding = [bool(v) for v in pattern.tolist()]
    else:
        every = _count(pattern, "gemma3.attention.sliding_window_pattern", m.name) or 1
        sliding = [(i + 1) % every != 0 for i in range(n)]
    scaling = _rope_scaling(m, cfg)
    full = {"rope_type": "default", "rope_theta": cfg["rope_theta"]}
    if scaling is not None:
        full = {**scaling, "rope_theta": cfg["rope_theta"]}
    return {
        **_gemma(gf, cfg),
        "sliding_window": window or None,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "rope_parameters": {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default",
                                  "rope_theta": m.real("rope.freq_base_swa", 10000.0)},
        },
        "attn_logit_softcapping": None,
        "final_logit_softcapping": m.real("final_logit_softcapping"),
        "query_pre_attn_scalar": _gemma_scale(m, cfg, big_layers=62),
    }


def _phi3(gf: GGUFFile, cfg: dict[str, Any]) -> dict[str, Any]:
    m = _Meta(gf)
    window = m.count("attention.sliding_window", 0)
    extra: dict[str, Any] = {
        "sliding_window": window or None,  # 0: none (how the converter marks Phi-4)
        "original_max_position_embeddings": m.count("rope.scaling.original_context_length",
                                                    cfg["max_position_embeddings"]),
    }
    long, short = (_small_tensor(gf, f"rope_factors_{k}.weight") for k in ("long", "short"))
    if long is not None and short is not None:
        extra["rope_scaling"] = {"rope_type": "longrope", "long_factor": long,
                                 "short_factor": short}
    return extra


_GEMMA_NAMES = (("ffn_norm", "pre_feedforward_layernorm"),
                ("post_attention_norm", "post_attention_layernorm"),
                ("post_ffw_norm", "post_feedforward_layernorm"))

ARCHS: dict[str, Arch] = {
    "llama": Arch("llama", moe_type="mixtral", permuted_qk=True, config=_llama),
    "qwen2": Arch("qwen2", config=_qwen),
    "qwen2moe": Arch("qwen2_moe", config=_qwen),
    "qwen3": Arch("qwen3", config=_qwen),
    "qwen3moe": Arch("qwen3_moe", config=_qwen),
    "gemma": Arch("gemma", norm_plus_one=True, config=_gemma),
    "gemma2": Arch("gemma2", norm_plus_one=True, names=_GEMMA_NAMES, config=_gemma2),
    "gemma3": Arch("gemma3_text", norm_plus_one=True, names=_GEMMA_NAMES, config=_gemma3),
    "phi3": Arch("phi3", names=(("ffn_up", "mlp.gate_up_proj"),), config=_phi3),
}


def arch_of(gf: GGUFFile) -> Arch:
    arch = ARCHS.get(gf.architecture)
    if arch is None:
        raise ConfigError(
            f"{shown_path(gf.path.name)}: unknown GGUF architecture {gf.architecture!r:.60};"
            f" kvchat reads: {', '.join(sorted(ARCHS))}")
    return arch


def model_type_of(gf: GGUFFile) -> str:
    """Our family for the file (Mixtral is llama.cpp's llama with experts)."""
    arch = arch_of(gf)
    if arch.moe_type and gf.get(f"{gf.architecture}.expert_count"):
        return arch.moe_type
    return arch.model_type


def float_dtype(gf: GGUFFile) -> str:
    """The dtype the file's float matrices have; float16 for a file of quantized ones
    (llama.cpp's own compute type for them)."""
    kinds = Counter(FLOATS[t.type] for t in gf.tensors.values()
                    if t.type in FLOATS and len(t.shape) >= 2)
    return kinds.most_common(1)[0][0] if kinds else "float16"


def gguf_config(gf: GGUFFile) -> dict[str, Any]:
    """The config.json dict of the model in `gf` (ConfigError naming what is missing)."""
    arch = arch_of(gf)
    m = _Meta(gf)
    embed = gf.tensors.get("token_embd.weight")
    if embed is None or len(embed.shape) != 2:
        raise ConfigError(f"{m.name}: the GGUF file has no token_embd.weight matrix")
    hidden = m.count("embedding_length")
    heads = m.count("attention.head_count")
    if not heads or hidden % heads and m.raw("attention.key_length") is None:
        raise ConfigError(f"{m.name}: {heads} attention heads do not divide {hidden}")
    head_dim = m.count("attention.key_length", hidden // heads)
    if m.count("attention.value_length", head_dim) != head_dim:
        raise ConfigError(f"{m.name}: key and value heads of different sizes are not"
                          " supported")
    cfg: dict[str, Any] = {
        "model_type": model_type_of(gf),
        "hidden_size": hidden,
        "num_hidden_layers": m.count("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": m.count("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "intermediate_size": m.count("feed_forward_length"),
        "max_position_embeddings": m.count("context_length", 4096),
        "rms_norm_eps": m.real("attention.layer_norm_rms_epsilon",
                               1e-6 if arch.norm_plus_one else 1e-5),
        "rope_theta": m.real("rope.freq_base", 10000.0),
        "vocab_size": embed.shape[0],
        # llama.cpp's rule too: no output matrix means the head is the embedding
        "tie_word_embeddings": "output.weight" not in gf.tensors,
        "torch_dtype": float_dtype(gf),
        "bos_token_id": gf.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": gf.get("tokenizer.ggml.eos_token_id"),
    }
    rope_dims = m.count("rope.dimension_count", head_dim)
    if rope_dims != head_dim:  # rotary on part of each head
        cfg["partial_rotary_factor"] = rope_dims / head_dim
    if arch.config is not None:
        cfg.update(arch.config(gf, cfg))
    cfg = {k: v for k, v in cfg.items() if v is not None}
    quant = _quantization(gf, arch)
    if quant:
        cfg["quantization"] = quant
    return cfg


# ------------------------------------------------------------------------- tensors


@dataclass(frozen=True)
class Entry:
    """One file tensor and what it becomes."""

    tensor: GGUFTensor
    name: str  # ours
    unpermute_heads: int | None = None  # the Q/K row permutation to undo
    minus_one: bool = False  # a Gemma norm stored as 1 + w
    mlx_bits: int | None = None  # kept as an MLX quantized layer of this many bits


def our_name(gf: GGUFFile, arch: Arch, name: str) -> str | None:
    """Our name for a file tensor; None for the RoPE settings tensors."""
    if name in ROPE_TENSORS:
        return None
    base, _, param = name.rpartition(".")
    if base in GLOBAL_NAMES and param == "weight":
        return f"{GLOBAL_NAMES[base]}.weight"
    m = _LAYER.match(name)
    layers = _count(gf.get(f"{gf.architecture}.block_count", 0), "block_count", "")
    if m is not None and int(m.group(1)) < layers:
        layer, kind, expert, param = m.groups()
        names = {**LAYER_NAMES, **dict(arch.names)}
        if expert is not None and kind in _EXPERT_PROJ:
            return f"model.layers.{layer}.mlp.experts.{expert}.{_EXPERT_PROJ[kind]}.{param}"
        if expert is None and kind in names:
            return f"model.layers.{layer}.{names[kind]}.{param}"
    raise ModelLoadError(f"{shown_path(gf.path.name)}: GGUF tensor {name!r:.80} has no place"
                         f" in kvchat's {arch.model_type} model")


def plan(gf: GGUFFile) -> list[Entry]:
    """Every parameter tensor of the file with its name and the transforms it needs."""
    arch = arch_of(gf)
    heads = _count(gf.get(f"{gf.architecture}.attention.head_count", 0), "head_count", "")
    kv_heads = _count(gf.get(f"{gf.architecture}.attention.head_count_kv", heads),
                      "head_count_kv", "")
    out = []
    for t in gf.tensors.values():
        name = our_name(gf, arch, t.name)
        if name is None:
            continue
        unpermute = None
        if arch.permuted_qk and ".self_attn.q_proj." in name:
            unpermute = heads
        elif arch.permuted_qk and ".self_attn.k_proj." in name:
            unpermute = kv_heads
        layout = MLX_LAYOUT.get(t.type)
        keep = layout[0] if layout and name.endswith(".weight") and len(t.shape) >= 2 else None
        out.append(Entry(t, name, unpermute, arch.norm_plus_one and name.endswith(
            "norm.weight"), keep))
    return out


def _quantization(gf: GGUFFile, arch: Arch) -> dict[str, Any] | None:
    """mlx-lm's quantization block for the tensors kept quantized: the commonest bit
    width at the top, the others per module."""
    kept = [(e.name.removesuffix(".weight"), e.mlx_bits) for e in plan(gf) if e.mlx_bits]
    if not kept:
        return None
    bits = Counter(b for _, b in kept).most_common(1)[0][0]
    quant: dict[str, Any] = {"group_size": GROUP, "bits": bits, "mode": "affine"}
    for module, b in kept:
        if b != bits:
            quant[module] = {"group_size": GROUP, "bits": b}
    return quant


def _unpermute(raw: np.ndarray, heads: int, name: str) -> np.ndarray:
    """Undo the converter's Q/K permutation on whole rows (any tensor type)."""
    rows = raw.shape[0]
    if heads < 1 or rows % (2 * heads):
        raise ModelLoadError(f"tensor {name!r}: {rows} rows do not split into {heads} heads"
                             " of pairs (wrong head count?)")
    return (raw.reshape(heads, rows // heads // 2, 2, *raw.shape[1:])
            .swapaxes(1, 2).reshape(raw.shape))


def _blocks(raw: np.ndarray, size: int) -> np.ndarray:
    return raw.reshape(*raw.shape[:-1], raw.shape[-1] // size, size)


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned `bits`-bit values, element order along the last axis, packed into
    uint32 as MLX does (element k of a word in bits [k·bits, (k+1)·bits))."""
    per = 32 // bits
    words = q.reshape(*q.shape[:-1], q.shape[-1] // per, per).astype(np.uint32)
    shifts = (np.arange(per, dtype=np.uint32) * bits)
    return (words << shifts).sum(axis=-1, dtype=np.uint32)


def mlx_quantized(raw: np.ndarray, qtype: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(weight, scales, biases) of MLX's affine layout, group 32, for a Q4_0, Q4_1 or
    Q8_0 tensor's raw rows: the same numbers, as scale · q + bias."""
    bits, has_min = MLX_LAYOUT[qtype]
    if bits == 8:  # d (f16), 32 × int8: x = d·q = d·(q + 128) − 128·d
        b = _blocks(raw, 34)
        d = np.ascontiguousarray(b[..., :2]).view("<f2")[..., 0].astype(np.float32)
        q = b[..., 2:].view(np.int8).astype(np.int16) + 128
        return _pack(q.reshape(*raw.shape[:-1], -1), 8), d, -128.0 * d
    size = 20 if has_min else 18  # d (f16) [, m (f16)], 16 bytes of nibbles
    b = _blocks(raw, size)
    d = np.ascontiguousarray(b[..., :2]).view("<f2")[..., 0].astype(np.float32)
    qs = b[..., size - 16:]
    # byte j holds element j (low nibble) and element j + 16 (high nibble)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    if has_min:  # x = d·q + m
        bias = np.ascontiguousarray(b[..., 2:4]).view("<f2")[..., 0].astype(np.float32)
    else:  # x = d·(q − 8)
        bias = -8.0 * d
    return _pack(q.reshape(*raw.shape[:-1], -1), 4), d, bias


def _float(raw: np.ndarray, t: GGUFTensor, dequant_dtype: mx.Dtype) -> mx.array:
    import mlx.core as mx

    if t.type == ggml.F32:
        return mx.array(raw.view("<f4"))
    if t.type == ggml.F16:
        return mx.array(raw.view("<f2"))
    if t.type == ggml.BF16:
        return mx.array(raw.view("<u2")).view(mx.bfloat16)
    if t.type == ggml.F64:
        return mx.array(raw.view("<f8").astype(np.float32))
    if t.type in (ggml.I8, ggml.I16, ggml.I32, ggml.I64):
        raise ModelLoadError(f"GGUF tensor {t.name!r} holds integers ({t.type_name}); kvchat"
                             " needs floating or quantized weights there")
    from gguf import quants
    from gguf.constants import GGMLQuantizationType

    try:
        values = quants.dequantize(raw, GGMLQuantizationType(t.type))
    except (NotImplementedError, ValueError, TypeError) as e:
        raise ModelLoadError(f"GGUF tensor {t.name!r} has type {t.type_name}, which kvchat"
                             f" cannot read ({type(e).__name__})") from None
    return mx.array(values.reshape(t.shape)).astype(dequant_dtype)


def read_weights(gf: GGUFFile, *, skip: Callable[[str], bool] = lambda _: False,
                 dequant_dtype: mx.Dtype | None = None) -> dict[str, mx.array]:
    """The file's parameters under our names (Q4_0/Q4_1/Q8_0 as MLX quantized
    weight/scales/biases, the rest as floats; other quantized types dequantized to
    `dequant_dtype`, float32 by default); tensors whose name `skip` accepts are never
    read (a pipeline rank's other layers)."""
    import mlx.core as mx

    dequant_dtype = dequant_dtype or mx.float32
    weights: dict[str, mx.array] = {}
    with tensor_data(gf) as get:
        for e in plan(gf):
            if skip(e.name):
                continue
            raw = get(e.tensor)
            if e.unpermute_heads is not None:
                raw = _unpermute(raw, e.unpermute_heads, e.tensor.name)
            if e.mlx_bits is not None:
                w, s, b = mlx_quantized(raw, e.tensor.type)
                module = e.name.removesuffix(".weight")
                weights[e.name] = mx.array(w)
                weights[f"{module}.scales"] = mx.array(s)
                weights[f"{module}.biases"] = mx.array(b)
                continue
            arr = _float(raw, e.tensor, dequant_dtype)
            if e.minus_one:
                arr = arr.astype(mx.float32) - 1.0
            if e.name.endswith(".shared_expert_gate.weight"):
                arr = arr.reshape(1, -1)  # llama.cpp holds it as a vector
            weights[e.name] = arr
        mx.eval(list(weights.values()))  # copied out of the map before it closes
    return weights


def tensor_bytes(gf: GGUFFile) -> dict[str, int]:
    """Bytes of every parameter tensor as stored, under our names."""
    return {e.name: e.tensor.nbytes for e in plan(gf)}


def describe(gf: GGUFFile) -> str:
    """How the file is stored, for the model info: "GGUF Q4_K_M"."""
    return f"GGUF {gf.file_type}"


def display_name(gf: GGUFFile) -> str:
    """What to call the model: the file's name (an LM Studio file says what it is);
    for a file named by its digest (an Ollama blob), the model's own `general.name`."""
    stem = gf.path.name.removesuffix(".gguf")
    general = gf.get("general.name")
    if gf.path.suffix != ".gguf" and isinstance(general, str) and general.strip():
        return general.strip()
    return stem


__all__ = ["ARCHS", "Entry", "GGUFError", "arch_of", "describe", "display_name", "float_dtype",
           "gguf_config", "mlx_quantized", "model_type_of", "our_name", "plan", "read_weights",
           "tensor_bytes"]
