"""One place for a model folder's byte and dtype facts, as the runtime will allocate them.

`inspect`, `models`, the picker and the side panel all read these numbers, so they agree:
the weights' bytes and the K/V element size are what `load_model` / `make_cache` will
allocate *on this backend* (the CPU computes in float32 whatever the file holds), and
the file's own dtype and tensor bytes sit beside them. Everything comes from
safetensors headers (a GGUF file's tensor table); no tensor is read.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from kvchat.model.decoder import gguf
from kvchat.model.decoder.config import load_config
from kvchat.model.decoder.weights import (
    IGNORED_SUFFIXES,
    compute_dtype,
    dequantize_on_load,
    rename,
    validate_quantization,
)
from kvchat.model.files import has_tokenizer, tensor_headers
from kvchat.model.gguf_file import is_gguf, read_gguf
from kvchat.model.text.gguf_tokenizer import has_tokenizer as gguf_has_tokenizer

# safetensors dtype names -> MLX dtypes (the floating ones the loader casts)
_FLOAT = {"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16}


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


@dataclass(frozen=True)
class ModelFacts:
    file_dtype: str | None  # the weights' floating dtype in the files (None: none found)
    file_bytes: int  # tensor bytes in the safetensors files
    compute_dtype: str  # what this backend computes in; the KV cache uses it too
    kv_dtype_bytes: int  # bytes per K/V element the cache will allocate
    weight_bytes: int  # bytes load_model() will allocate for the parameters
    device: str  # "cpu" or "gpu"
    # quantized weights in the files, e.g. "4-bit, group 32, float16 scales" (None: none)
    quantization: str | None = None
    gguf: str | None = None  # a GGUF file's type, llama.cpp's name: "Q4_K_M" (None: a folder)

    @property
    def dtype_differs(self) -> bool:
        return self.file_dtype is not None and self.file_dtype != self.compute_dtype

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def runtime_dtype(file_dtype: str | None) -> mx.Dtype:
    """The dtype load_model() computes in for a checkpoint of `file_dtype`
    (a safetensors or torch_dtype name; None or unknown counts as float32)."""
    names = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
    key = names.get(str(file_dtype or "").removeprefix("torch."), str(file_dtype or ""))
    return compute_dtype(_FLOAT.get(key, mx.float32))


def _module(tensor: str) -> str:
    return tensor.rsplit(".", 1)[0]


def model_facts(folder: str | Path) -> ModelFacts:
    """Facts for a model folder or GGUF file (raises ModelLoadError/ConfigError, one
    line, when it is not loadable)."""
    folder = Path(folder).expanduser()
    if is_gguf(folder):
        return _gguf_facts(folder)
    cfg = load_config(folder)
    if cfg.quantization:  # a block load_model would refuse: this folder cannot load
        validate_quantization(cfg.quantization)
    tensors = list(tensor_headers(folder).items())
    file_bytes = sum(i["data_offsets"][1] - i["data_offsets"][0] for _, i in tensors)
    renamed = [(rename(cfg, n), i) for n, i in tensors]
    kept = [
        (n, i) for n, i in renamed
        if not n.endswith(IGNORED_SUFFIXES)
        and not (cfg.tie_word_embeddings and n.startswith("lm_head."))
        and (cfg.wrapper is None or n.startswith(("model.", "lm_head.")))  # no vision tower
    ]
    floats = [i["dtype"] for _, i in kept if i.get("dtype") in _FLOAT]
    file_dtype = floats[0] if floats else None
    target = compute_dtype(_FLOAT[file_dtype] if file_dtype else mx.float32)
    # quantized modules (weight + scales [+ biases]): the float weight they stand for has
    # group_size elements per scale; on the CPU load_model() dequantizes them when that fits
    quant = cfg.quantization or {}
    unpacked = {
        n[: -len(".scales")]: math.prod(i.get("shape", []))
        * (quant.get(n[: -len(".scales")]) or quant).get("group_size", 0)
        for n, i in kept if n.endswith(".scales")
    }
    floats_total = sum(math.prod(i.get("shape", [])) for n, i in kept
                       if i.get("dtype") in _FLOAT and _module(n) not in unpacked)
    dequantize = bool(unpacked) and dequantize_on_load(
        floats_total + sum(unpacked.values()), target)
    weight = 0
    for name, info in kept:
        if dequantize and _module(name) in unpacked:
            if name.endswith(".weight"):  # becomes a float weight; scales/biases go
                weight += unpacked[_module(name)] * target.size
        elif info.get("dtype") in _FLOAT:  # cast to the compute dtype on load
            weight += math.prod(info.get("shape", [])) * target.size
        else:  # packed quantized weights and integer tensors stay as they are
            weight += info["data_offsets"][1] - info["data_offsets"][0]
    scales = [i["dtype"] for n, i in kept if n.endswith(".scales") and i.get("dtype") in _FLOAT]
    return ModelFacts(
        quantization=quantization_label(quant, scales[0]) if scales else None,
        file_dtype=dtype_name(_FLOAT[file_dtype]) if file_dtype else None,
        file_bytes=file_bytes,
        compute_dtype=dtype_name(target),
        kv_dtype_bytes=target.size,
        weight_bytes=weight,
        device="cpu" if mx.default_device() == mx.cpu else "gpu",
    )


def _gguf_facts(path: Path) -> ModelFacts:
    """A GGUF file's facts from its tensor table, as load_model will allocate: floats in
    the compute dtype, Q4_0/Q4_1/Q8_0 kept packed (scales and biases in the compute
    dtype) unless the CPU dequantizes them on load, other types dequantized."""
    load_config(path)  # the architecture and its numbers are checked first
    gf = read_gguf(path)
    entries = gguf.plan(gf)
    target = compute_dtype(getattr(mx, gguf.float_dtype(gf)))
    packed = [e for e in entries if e.mlx_bits]
    params = sum(e.tensor.n_elements for e in entries)
    dequantize = bool(packed) and dequantize_on_load(params, target)
    weight = 0
    for e in entries:
        n = e.tensor.n_elements
        if e.mlx_bits and not dequantize:  # uint32 words + a scale and a bias per group
            weight += n * e.mlx_bits // 8 + 2 * (n // gguf.GROUP) * target.size
        else:
            weight += n * target.size
    floats = [e.tensor.type for e in entries if e.tensor.type in gguf.FLOATS
              and len(e.tensor.shape) >= 2]
    return ModelFacts(
        file_dtype=gguf.FLOATS[floats[0]] if floats else None,
        file_bytes=sum(t.nbytes for t in gf.tensors.values()),
        compute_dtype=dtype_name(target),
        kv_dtype_bytes=target.size,
        weight_bytes=weight,
        device="cpu" if mx.default_device() == mx.cpu else "gpu",
        gguf=gf.file_type,
    )


def quantization_label(quant: dict[str, Any], scales_dtype: str) -> str:
    """How quantized weights are stored: "4-bit, group 32, float16 scales"."""
    parts = [f"{quant['bits']}-bit" if "bits" in quant else "quantized"]
    if "group_size" in quant:
        parts.append(f"group {quant['group_size']}")
    parts.append(f"{dtype_name(_FLOAT[scales_dtype])} scales")
    return ", ".join(parts)


def check_model_folder(folder: str | Path) -> ModelFacts:
    """Everything the loader checks short of reading the weights: the folder, config.json,
    the safetensors headers (pickles refused) and the tokenizer. Raises KVChatError
    (one line) naming what is wrong; returns the folder's facts."""
    from kvchat.model.errors import ModelLoadError
    from kvchat.model.text.tokenizer import load_tokenizer

    p = Path(folder).expanduser()
    if not p.exists():
        raise ModelLoadError(f"model folder not found: {p}")
    if is_gguf(p) or (p.suffix == ".gguf" and not p.is_dir()):
        read_gguf(p)  # a .gguf that is not one (or not a regular file): the parser says why
        facts = model_facts(p)
        load_tokenizer(p)
        return facts
    if not p.is_dir():
        raise ModelLoadError(f"not a model folder or GGUF file: {p}")
    facts = model_facts(p)
    if not has_tokenizer(p):
        raise ModelLoadError(f"{p}: no tokenizer.json or tokenizer.model (kvchat needs one)")
    load_tokenizer(p)
    return facts


def folder_status(folder: str | Path) -> tuple[ModelFacts | None, str | None]:
    """(facts, None) for a folder kvchat can load, else (facts or None, why not), cheaply:
    config and headers only, the tokenizer by its files. For listings (models, picker)."""
    from kvchat.model.errors import KVChatError

    try:
        facts = model_facts(folder)
        if is_gguf(folder):
            gf = read_gguf(folder)
            return facts, None if gguf_has_tokenizer(gf) else "the GGUF file holds no tokenizer"
    except KVChatError as e:
        return None, str(e)
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, f"unreadable: {e}"
    if not has_tokenizer(folder):
        return facts, "no tokenizer.json or tokenizer.model"
    return facts, None


__all__ = [
    "ModelFacts", "check_model_folder", "dtype_name", "folder_status", "model_facts",
    "runtime_dtype",
]
