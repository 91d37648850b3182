"""Every bad model folder fails with one clear line (a KVChatError), never a traceback."""

from __future__ import annotations

import json
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from kvchat.model import load_model
from kvchat.model.decoder.weights import safetensors_header
from kvchat.model.errors import KVChatError


def load_error(path: Path, **kwargs: Any) -> str:
    """load_model's message; any exception other than KVChatError fails the test."""
    with pytest.raises(KVChatError) as info:
        load_model(path, **kwargs)
    message = str(info.value)
    assert message.strip() and "\n" not in message, repr(message)
    return message


def edit_config(folder: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    edit(cfg)
    path.write_text(json.dumps(cfg))


def edit_tensors(folder: Path, edit: Callable[[dict[str, mx.array]], None]) -> None:
    path = folder / "model.safetensors"
    tensors = dict(mx.load(str(path)))
    edit(tensors)
    mx.save_safetensors(str(path), tensors)


@pytest.fixture
def llama(copy_checkpoint: Callable[[str], Path]) -> Path:
    """A writable copy of the tiny untied llama (hidden 64, 2 layers, 4 heads, 2 KV heads)."""
    return copy_checkpoint("llama")


@pytest.fixture
def llama_q4(mlx_quantized: Callable[[str, int], Path], tmp_path: Path) -> Path:
    return Path(shutil.copytree(mlx_quantized("llama", 4), tmp_path / "q4"))


# --- folder and config -------------------------------------------------------------------


def test_folder_missing(tmp_path: Path) -> None:
    msg = load_error(tmp_path / "no-such-model")
    assert "not found" in msg and "no-such-model" in msg


def test_path_is_a_file(llama: Path) -> None:
    assert "not a model folder" in load_error(llama / "config.json")


def test_no_config_json(llama: Path) -> None:
    (llama / "config.json").unlink()
    assert "no config.json" in load_error(llama)


def test_config_not_json(llama: Path) -> None:
    (llama / "config.json").write_text("{ not json")
    assert "config.json" in load_error(llama)


def test_no_weights(llama: Path) -> None:
    (llama / "model.safetensors").unlink()
    msg = load_error(llama)
    assert "no *.safetensors" in msg and str(llama) in msg


def test_unknown_model_type_lists_supported(llama: Path) -> None:
    edit_config(llama, lambda c: c.update(model_type="bitnet"))
    msg = load_error(llama)
    assert "'bitnet'" in msg
    from kvchat.model.decoder.families import FAMILIES

    assert "supported: " + ", ".join(sorted(FAMILIES)) in msg


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_parameters": {"rope_type": "ntk-by-parts", "rope_theta": 1e4, "factor": 4.0}},
        {"rope_scaling": {"type": "mrope", "factor": 2.0}, "rope_parameters": None},
    ],
    ids=["unknown-parameters", "unknown-classic"],
)
def test_unsupported_rope_type(llama: Path, rope: dict[str, Any]) -> None:
    edit_config(llama, lambda c: c.update(rope))
    msg = load_error(llama)
    assert "unsupported RoPE type" in msg
    assert ("'ntk-by-parts'" in msg) or ("'mrope'" in msg)
    assert "llama3" in msg  # names what is supported


# --- tensors -----------------------------------------------------------------------------


def test_tensor_missing(llama: Path) -> None:
    edit_tensors(llama, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    msg = load_error(llama)
    assert "lacks tensor 'model.layers.1.mlp.up_proj.weight'" in msg


def test_tensor_extra(llama: Path) -> None:
    edit_tensors(llama, lambda t: t.update({"model.layers.0.mlp.extra_proj.weight": mx.ones((2,))}))
    assert "unexpected tensor 'model.layers.0.mlp.extra_proj.weight'" in load_error(llama)


def test_tensor_wrong_shape_names_both_shapes(llama: Path) -> None:
    name = "model.layers.0.self_attn.k_proj.weight"  # 2 KV heads x 16 = 32 rows
    edit_tensors(llama, lambda t: t.update({name: mx.zeros((16, 64))}))
    msg = load_error(llama)
    assert f"'{name}'" in msg
    assert "(16, 64)" in msg and "(32, 64)" in msg


def test_truncated_safetensors_names_the_tensor(llama: Path) -> None:
    f = llama / "model.safetensors"
    header = safetensors_header(f)
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    last = max(tensors, key=lambda k: tensors[k]["data_offsets"][1])
    header_len = int.from_bytes(f.read_bytes()[:8], "little")
    cut = 8 + header_len + tensors[last]["data_offsets"][0] + 10  # 10 bytes into `last`
    f.write_bytes(f.read_bytes()[:cut])
    msg = load_error(llama)
    assert "truncated" in msg and "model.safetensors" in msg
    assert f"'{last}'" in msg  # the only tensor the cut reaches


def test_truncated_safetensors_header(llama: Path) -> None:
    f = llama / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    msg = load_error(llama)
    assert "truncated" in msg and "model.safetensors" in msg


class _Trap:
    """Unpickling this creates `marker`: proof that someone unpickled it."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


def test_pickle_checkpoint_refused_and_never_unpickled(llama: Path, tmp_path: Path) -> None:
    # the trap works: unpickling it really creates its marker
    armed = tmp_path / "trap-armed"
    pickle.loads(pickle.dumps(_Trap(armed)))
    assert armed.exists()

    marker = tmp_path / "unpickled"
    (llama / "model.safetensors").unlink()
    (llama / "pytorch_model.bin").write_bytes(pickle.dumps({"state": _Trap(marker)}))
    msg = load_error(llama)
    assert "pytorch_model.bin" in msg and "pickle" in msg
    assert not marker.exists()


# --- quantization block vs tensors ------------------------------------------------------


def test_quant_bits_disagree_with_tensors(llama_q4: Path) -> None:
    def to_8_bits(cfg: dict[str, Any]) -> None:
        for key in ("quantization", "quantization_config"):
            if key in cfg:
                cfg[key]["bits"] = 8

    edit_config(llama_q4, to_8_bits)
    msg = load_error(llama_q4)
    assert "bits=8" in msg and "disagrees with the tensors" in msg
    assert "tensor 'model." in msg  # names the tensor


def test_quant_block_on_float_checkpoint(llama: Path) -> None:
    edit_config(llama, lambda c: c.update(quantization={"group_size": 64, "bits": 4}))
    msg = load_error(llama)
    assert "quantization block" in msg and ".scales" in msg


def test_scales_without_quant_block(llama_q4: Path) -> None:
    def drop_block(cfg: dict[str, Any]) -> None:
        cfg.pop("quantization", None)
        cfg.pop("quantization_config", None)

    edit_config(llama_q4, drop_block)
    msg = load_error(llama_q4)
    assert "unexpected tensor" in msg and "no quantization block" in msg


def test_quantize_option_on_quantized_checkpoint(llama_q4: Path) -> None:
    assert "already quantized" in load_error(llama_q4, quantize=(4, 64))


def test_quantize_option_bad_bits(llama: Path) -> None:
    assert "3/64" in load_error(llama, quantize=(3, 64))
