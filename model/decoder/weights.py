"""Load a model folder (config.json + safetensors, plain or mlx-community quantized).

Checks happen before any weight reaches the model, so a bad folder fails with one line
that names the file or tensor, and nothing half-loaded is left behind.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from kvchat.model.errors import ModelLoadError
from kvchat.model.files import mlx_path, safetensors_header, weight_files
from kvchat.model.gguf_file import is_gguf, read_gguf

from . import gguf
from .config import ModelConfig, load_config
from .families import FAMILIES, HYBRID
from .mla import QuantizedMultiLinear, split_kv_b
from .moe import QuantizedSwitchLinear, split_gate_up, stack_experts, unfuse_experts
from .transformer import Transformer

QUANT_BITS = (2, 3, 4, 5, 6, 8)
QUANT_GROUPS = (32, 64, 128)
# tensors some exporters write that carry no parameters
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# a multimodal checkpoint's language model, as transformers 5 and mlx-vlm name it
WRAPPED_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                    ("language_model.lm_head.", "lm_head."))
# what a wrapper's language model holds, once renamed (transformer.DecoderModel's parts and
# the head); everything else in its folder (a vision tower under model.visual., a
# projector) is left out
LANGUAGE_MODEL_PREFIXES = ("model.embed_tokens.", "model.embed_positions.", "model.layers.",
                           "model.norm.", "lm_head.")


def rename(cfg: ModelConfig, name: str) -> str:
    """A checkpoint tensor (or module path) under our name: the family's renames
    (e.g. Mixtral's block_sparse_moe.experts.{i}.w1 -> mlp.experts.{i}.gate_proj)."""
    if cfg.wrapper is not None:
        for old, new in WRAPPED_PREFIXES:
            if name.startswith(old):
                name = new + name[len(old):]
    fam = FAMILIES[cfg.model_type]
    for old, new in (*(fam.dense_renames if cfg.moe is None else ()), *fam.renames):
        name = name.replace(old, new)
    if fam.recurrent_renames and _recurrent_layer(cfg, name):
        for old, new in fam.recurrent_renames:
            name = name.replace(old, new)
    return name


def _recurrent_layer(cfg: ModelConfig, name: str) -> bool:
    """Whether `name` (ours) lies in a layer whose token mixer is the recurrent one."""
    parts = name.split(".")
    if len(parts) < 3 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
        return False
    i = int(parts[2])
    return i < len(cfg.layers) and cfg.layers[i].mixer is not None


def our_names(cfg: ModelConfig, weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Checkpoint tensors as our modules name them: renamed, and transformers'
    per-expert tensors stacked into mlx-community's `switch_mlp` layout."""
    weights = {rename(cfg, k): v for k, v in weights.items()}
    if cfg.wrapper is not None:  # the vision tower and projector are not loaded
        weights = {k: v for k, v in weights.items() if k.startswith(LANGUAGE_MODEL_PREFIXES)}
    for k in [k for k in weights if k.endswith(".e_score_correction_bias")]:
        weights[k] = weights[k].reshape(-1)  # ERNIE stores it as (1, experts)
    if cfg.mla is not None:
        weights = split_kv_b(cfg, weights)
    weights = _split_fused_qkv(cfg, weights)
    weights = _concatenated(cfg, weights)
    if cfg.block == "shared_block":  # Zamba2: blocks stored once, used by several layers
        weights = share_blocks(cfg, weights)
    weights = {k: _conv_layout(k, v) for k, v in weights.items()}
    if cfg.moe is None:
        return weights
    fused = FAMILIES[cfg.model_type].moe.fused_experts  # type: ignore[union-attr]
    return split_gate_up(stack_experts(unfuse_experts(weights, fused, cfg.moe.experts)))


# Zamba2: a use's adapter, stored in the list of its shared block's first user
_ADAPTER = re.compile(r"^(model\.layers\.)(\d+)(\.shared_transformer\..*)_adapter_list\.(\d+)\.")


def share_blocks(cfg: ModelConfig, weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Each hybrid layer's shared-block tensors (our names): the block's, stored under its
    first user, bound to this layer too (the same arrays), and this use's adapters (stored
    in that first user's `*_adapter_list.{use}`) as its own `*_adapter`."""
    hybrid = [i for i, s in enumerate(cfg.layers) if s.kind == HYBRID]
    blocks = cfg.shared_blocks
    out: dict[str, mx.array] = {}
    for name, w in weights.items():
        m = _ADAPTER.match(name)
        if m is None:
            out[name] = w
            continue
        use = int(m.group(4))
        if use < len(hybrid):  # an adapter of a use that does not exist is left unread
            out[f"{m.group(1)}{hybrid[use]}{m.group(3)}_adapter." + name[m.end():]] = w
    for use, layer in enumerate(hybrid):
        first = hybrid[use % blocks]
        if first == layer:
            continue
        src, dst = f"model.layers.{first}.shared_transformer.", \
            f"model.layers.{layer}.shared_transformer."
        for name in [n for n in out if n.startswith(src) and "_adapter." not in n]:
            out[dst + name[len(src):]] = out[name]
    return out


def _concatenated(cfg: ModelConfig, weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """The family's `concat_on_load`: tensors stored in parts (OLMo-hybrid's per-q/k/v
    convolutions) as the one tensor our module holds, the parts in order along the first
    axis (the output channels, so a quantized part's scales and biases too)."""
    out = dict(weights)
    for parts, whole in FAMILIES[cfg.model_type].concat_on_load:
        for name in [k for k in weights if parts[0] in k]:
            names = [name.replace(parts[0], p) for p in parts]
            if all(n in out for n in names):  # else _check_tensors names what is missing
                out[name.replace(parts[0], whole)] = mx.concatenate(
                    [out.pop(n) for n in names], axis=0)
    return out


def _conv_layout(name: str, w: mx.array) -> mx.array:
    """A recurrent mixer's depthwise convolution (conv.CausalConv1d) as MLX stores it,
    (channels, K, 1): transformers saves (channels, 1, K); mlx-community's files are
    already in MLX's layout."""
    if name.endswith((".conv1d.weight", ".conv.weight")) and w.ndim == 3 and w.shape[-1] != 1:
        return w.swapaxes(1, 2)
    return w


def conv1d_weight(cfg: ModelConfig, name: str) -> bool:
    """A tensor (our name) that GPT-2's Conv1D stores (in, out) where a Linear holds
    (out, in). Only its float form is transposed on load: a quantized one is packed along
    the input axis, so it is stored (out, in) as any quantized Linear (as mlx-lm writes)."""
    return FAMILIES[cfg.model_type].fused_qkv == "conv1d" and name.endswith(".weight") and (
        ".self_attn.c_attn." in name or ".self_attn.o_proj." in name or ".mlp." in name)


def _split_fused_qkv(cfg: ModelConfig, weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """GPT-NeoX's `query_key_value` holds q|k|v per head (heads, 3, head_dim) in its
    rows; GPT-2's and StarCoder's `c_attn` q, then k, then v (GPT-2 stores it (in, out)):
    split into q_proj, k_proj, v_proj (by rows, so packed quantized tensors too)."""
    q_rows = cfg.num_attention_heads * cfg.head_dim
    kv_rows = cfg.num_key_value_heads * cfg.head_dim
    out: dict[str, mx.array] = {}
    for name, w in weights.items():
        if ".self_attn.c_attn." in name:
            if conv1d_weight(cfg, name) and mx.issubdtype(w.dtype, mx.floating):
                w = w.T
            for proj, part in zip(("q_proj", "k_proj", "v_proj"),
                                  mx.split(w, [q_rows, q_rows + kv_rows], axis=0), strict=True):
                out[name.replace(".c_attn.", f".{proj}.")] = part
            continue
        if conv1d_weight(cfg, name) and mx.issubdtype(w.dtype, mx.floating):
            out[name] = w.T  # GPT-2's Conv1D: (in, out)
            continue
        if ".self_attn.query_key_value." not in name:
            out[name] = w
            continue
        parts = w.reshape(cfg.num_attention_heads, 3, -1, *w.shape[1:])
        for i, proj in enumerate(("q_proj", "k_proj", "v_proj")):
            part = parts[:, i].reshape(-1, *w.shape[1:])
            out[name.replace(".query_key_value.", f".{proj}.")] = part
    return out


def validate_quantization(q: Any) -> dict[str, Any]:
    """config.json's quantization block as load_model will apply it (mlx's format: bits
    and group_size, and per-layer overrides of the same shape); ModelLoadError naming
    the file and the values otherwise. `inspect`, `models` and `pull` check it too."""
    if not isinstance(q, dict) or "bits" not in q or "group_size" not in q:
        raise ModelLoadError(
            "config.json quantization block is not in the mlx format (needs bits and group_size)"
        )
    layers = [("", q)] + [(f" for {k}", v) for k, v in q.items() if isinstance(v, dict)]
    for where, block in layers:
        bits, group = block.get("bits", q["bits"]), block.get("group_size", q["group_size"])
        if bits not in QUANT_BITS or group not in QUANT_GROUPS or isinstance(bits, bool) \
                or isinstance(group, bool):
            raise ModelLoadError(
                f"config.json: unsupported quantization bits={bits!r:.20}"
                f" group_size={group!r:.20}{where[:80]} (kvchat loads bits"
                f" {', '.join(map(str, QUANT_BITS))} in groups of"
                f" {', '.join(map(str, QUANT_GROUPS))})")
    return q


def _apply_checkpoint_quantization(
    model: Transformer, q: dict[str, Any], weights: dict[str, mx.array]
) -> None:
    """Swap Linear/Embedding for quantized layers where the checkpoint has `.scales`,
    honouring mlx-lm's per-layer overrides (`"path": {"bits":..}` or `"path": false`)."""
    if not any(k.endswith(".scales") for k in weights):
        raise ModelLoadError(
            "config.json has a quantization block but no tensor has .scales"
            " (the quantization block disagrees with the tensors)"
        )

    # module paths: renamed as the tensors under them (the renames match "name." parts)
    overrides = {rename(model.config, k + ".")[:-1]: v for k, v in q.items()}

    def predicate(path: str, module: nn.Module) -> bool | dict[str, Any]:
        if path in overrides:
            return overrides[path]
        return hasattr(module, "to_quantized") and f"{path}.scales" in weights

    nn.quantize(
        model,
        group_size=q["group_size"],
        bits=q["bits"],
        mode=q.get("mode", "affine"),
        class_predicate=predicate,
    )


def _check_tensors(
    model: Transformer, weights: dict[str, mx.array], quant: dict[str, Any] | None
) -> None:
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise ModelLoadError(f"checkpoint lacks tensor {missing[0]!r} ({len(missing)} missing)")
    extra = sorted(set(weights) - set(expected))
    if extra:
        hint = " (quantized tensors but no quantization block)" if extra[0].endswith(
            (".scales", ".biases")
        ) and quant is None else ""
        raise ModelLoadError(f"checkpoint has unexpected tensor {extra[0]!r}{hint}")
    for name, arr in expected.items():
        got = weights[name]
        floats = mx.issubdtype(got.dtype, mx.floating) and mx.issubdtype(arr.dtype, mx.floating)
        if got.dtype != arr.dtype and not floats:  # int32/bool values would be used as numbers
            want = "a float" if mx.issubdtype(arr.dtype, mx.floating) else _dtype_name(arr.dtype)
            raise ModelLoadError(
                f"tensor {name!r} is {_dtype_name(got.dtype)} in the checkpoint; kvchat needs"
                f" {want} there (not a float or quantized checkpoint?)"
            )
        if tuple(got.shape) != tuple(arr.shape):
            where = (
                f" (quantization bits={quant['bits']} group_size={quant['group_size']}"
                " disagrees with the tensors)"
                if quant is not None and (name.endswith((".scales", ".biases")) or
                                          got.dtype == mx.uint32)
                else ""
            )
            raise ModelLoadError(
                f"tensor {name!r} has shape {tuple(got.shape)}, the config implies"
                f" {tuple(arr.shape)}{where}"
            )


def _dtype_name(d: mx.Dtype) -> str:
    return str(d).removeprefix("mlx.core.")


FINITE_CHECK_GROUP_BYTES = 1 << 28  # tensors reduced per evaluation: bounds temporaries


def _check_finite(weights: dict[str, mx.array]) -> None:
    """Refuse NaN/Inf weights (one NaN in a norm gives <unk><unk>... and exit 0).
    One reduction per tensor (isfinite().all()), evaluated a group at a time."""
    names = [k for k, v in weights.items() if mx.issubdtype(v.dtype, mx.floating)]
    flags: dict[str, mx.array] = {}
    group: list[mx.array] = []
    size = 0
    for k in names:
        flags[k] = mx.isfinite(weights[k]).all()
        group.append(flags[k])
        size += weights[k].nbytes
        if size >= FINITE_CHECK_GROUP_BYTES:
            mx.eval(group)
            group, size = [], 0
    mx.eval(group)
    for k in names:
        if not flags[k].item():
            raise ModelLoadError(
                f"tensor {k!r} holds NaN or Inf values; the checkpoint is corrupt"
            )


def compute_dtype(checkpoint_dtype: mx.Dtype) -> mx.Dtype:
    """float32 on the CPU (fp16/bf16 are emulated on x86 and far slower), else the checkpoint's."""
    return mx.float32 if mx.default_device() == mx.cpu else checkpoint_dtype


def load_model(
    path: str | Path,
    *,
    quantize: tuple[int, int] | None = None,
    dtype: mx.Dtype | None = None,
    build: Callable[[ModelConfig], nn.Module] = Transformer,
    dequantize: bool | None = None,
) -> Transformer:
    """Load a model folder (or a GGUF file) ready for inference.

    `quantize=(bits, group_size)` quantizes a float checkpoint on load. `build` makes the
    module to fill (a pipeline rank's slice); tensors under its `excluded_prefixes` are
    never read (mx.load is lazy), so a rank holds only its own weights. A quantized
    checkpoint is dequantized to the compute dtype when `dequantize` is True, or by
    default on the CPU when it fits (see `dequantize_on_load`).
    """
    folder = Path(path).expanduser()
    if not folder.exists():
        raise ModelLoadError(f"model folder not found: {folder}")
    gguf_file = read_gguf(folder) if is_gguf(folder) else None
    if gguf_file is None and not folder.is_dir():
        raise ModelLoadError(f"not a model folder or GGUF file: {folder}")
    cfg: ModelConfig = load_config(folder)
    model = build(cfg)
    excluded = getattr(model, "excluded_prefixes", ())
    if gguf_file is not None:
        # the file's own float type: what a GPU computes in (the CPU: float32 anyway)
        file_dtype = getattr(mx, gguf.float_dtype(gguf_file))
        dtype = dtype or compute_dtype(file_dtype)
        weights = gguf.read_weights(gguf_file, skip=lambda n: n.startswith(tuple(excluded)),
                                    dequant_dtype=compute_dtype(file_dtype))
    else:
        weights = _read_safetensors(folder)
    weights = {k: v for k, v in weights.items() if not k.endswith(IGNORED_SUFFIXES)}
    weights = our_names(cfg, weights)
    if cfg.tie_word_embeddings:
        for k in [k for k in weights if k.startswith("lm_head.")]:
            del weights[k]
    if excluded:
        weights = {k: v for k, v in weights.items() if not k.startswith(excluded)}
    quant = validate_quantization(cfg.quantization) if cfg.quantization else None
    if quant is not None:
        if quantize is not None:
            raise ModelLoadError("the checkpoint is already quantized; drop the quantize option")
        _apply_checkpoint_quantization(model, quant, weights)
    _check_tensors(model, weights, quant)
    _check_finite(weights)

    float_dtypes = [v.dtype for v in weights.values() if mx.issubdtype(v.dtype, mx.floating)]
    target = dtype or compute_dtype(float_dtypes[0] if float_dtypes else mx.float32)
    weights = {
        k: v.astype(target) if mx.issubdtype(v.dtype, mx.floating) else v
        for k, v in weights.items()
    }
    model.load_weights(list(weights.items()), strict=True)

    if quantize is not None:
        bits, group = quantize
        if bits not in (4, 8) or group not in QUANT_GROUPS:
            raise ModelLoadError(
                f"quantize-on-load supports bits 4/8 and group size 32/64/128, got {bits}/{group}"
            )
        nn.quantize(
            model,
            group_size=group,
            bits=bits,
            class_predicate=lambda _, m: hasattr(m, "to_quantized")
            and m.weight.shape[-1] % group == 0,
        )
        quant = {"bits": bits, "group_size": group}
    model.dequantized = False  # type: ignore[attr-defined]
    if quant is not None and quantize is None:
        if dequantize is None:
            dequantize = dequantize_on_load(parameter_count(model), target)
        if dequantize:
            dequantize_model(model)
            model.dequantized = True  # type: ignore[attr-defined]
    mx.eval(model.parameters())
    model.path = folder  # type: ignore[attr-defined]
    model.quantization = quant  # type: ignore[attr-defined]
    # what the model info says of a GGUF file: its name and how it is stored
    model.source_info = {} if gguf_file is None else {  # type: ignore[attr-defined]
        "name": gguf.display_name(gguf_file), "gguf": gguf_file.file_type}
    return model


def _read_safetensors(folder: Path) -> dict[str, mx.array]:
    """A folder's tensors, lazily (mx.load maps them), each file's header checked first."""
    weights: dict[str, mx.array] = {}
    for f in weight_files(folder):
        safetensors_header(f)
        native = mlx_path(f)
        try:
            weights.update(mx.load(native))
        except Exception as e:  # mlx raises RuntimeError/ValueError with long texts
            raise ModelLoadError(f"cannot read {f.name}: {str(e).splitlines()[0]}") from None
    return weights


# MLX's CPU quantized matmul is slower than a float32 matmul through BLAS (measured on
# a 4-bit 135M model: see docs/performance.md), so on the CPU quantized checkpoints
# are dequantized on load unless that would take more than this share of free memory.
DEQUANTIZE_MEMORY_SHARE = 0.5


def _available_memory() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def dequantize_on_load(n_params: int, dtype: mx.Dtype) -> bool:
    """The default for quantized checkpoints: dequantize on the CPU backend when the
    float weights fit in DEQUANTIZE_MEMORY_SHARE of free memory; KVCHAT_KEEP_QUANTIZED=1
    keeps them quantized."""
    if os.environ.get("KVCHAT_KEEP_QUANTIZED") == "1" or mx.default_device() != mx.cpu:
        return False
    free = _available_memory()
    return free is not None and n_params * dtype.size <= DEQUANTIZE_MEMORY_SHARE * free


def dequantize_model(model: nn.Module) -> None:
    """Replace every quantized Linear / Embedding by its float equivalent, in place."""
    swaps: list[tuple[str, nn.Module]] = []
    for name, m in model.named_modules():
        if isinstance(m, (QuantizedSwitchLinear, QuantizedMultiLinear)):  # experts, MLA
            swaps.append((name, m.dequantized()))
        elif isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            w = mx.dequantize(m.weight, m.scales, m.get("biases"), m.group_size, m.bits,
                              mode=getattr(m, "mode", "affine")).astype(m.scales.dtype)
            if isinstance(m, nn.QuantizedLinear):
                new: nn.Module = nn.Linear(w.shape[1], w.shape[0], bias="bias" in m)
                new.weight = w
                if "bias" in m:
                    new.bias = m.bias
            else:
                new = nn.Embedding(w.shape[0], w.shape[1])
                new.weight = w
            swaps.append((name, new))
    model.update_modules(tree_unflatten(swaps))


def parameter_count(model: nn.Module) -> int:
    """Logical parameters (quantized weights counted unpacked; scales and biases not)."""
    total = 0
    for name, arr in tree_flatten(model.parameters()):
        if name.endswith((".scales", ".biases")):
            # quantization metadata; a real bias on a quantized layer is named ".bias"
            continue
        if arr.dtype == mx.uint32:
            bits = _bits_of(model, name)
            total += arr.size * 32 // bits
        else:
            total += arr.size
    return total


def _bits_of(model: nn.Module, weight_name: str) -> int:
    module: Any = model
    for part in weight_name.split(".")[:-1]:
        module = module[int(part)] if part.isdigit() else getattr(module, part)
    return int(module.bits)


def weight_bytes(model: nn.Module) -> int:
    return sum(a.nbytes for _, a in tree_flatten(model.parameters()))
