"""Hostile and unlucky model folders: bounded, one line each, never a hang or a crash.

Safetensors headers and tensor sizes are checked against the file size before anything is
read; only regular files are opened (a FIFO would block a reader forever); configs are
validated with bounds that name the key; NaN/Inf weights are refused naming the tensor;
the engine thread survives any exception in a job and always says what happened.
"""

from __future__ import annotations

import json
import os
import queue
import struct
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from kvchat.model.decoder.config import load_config
from kvchat.model.decoder.weights import load_model
from kvchat.model.errors import ConfigError, KVChatError
from kvchat.model.files import read_json_object, safetensors_header
from kvchat.model.runtime.engine import Engine
from kvchat.model.runtime.events import Done, GenParams, Loaded, LoadFailed
from tests.helpers import processes
from tests.helpers.paths import REPO_ROOT


@pytest.fixture
def llama(copy_checkpoint: Callable[[str], Path]) -> Path:
    return copy_checkpoint("llama")


def load_error(path: Path) -> str:
    with pytest.raises(KVChatError) as info:
        load_model(path)
    msg = str(info.value)
    assert msg.strip() and "\n" not in msg, repr(msg)
    return msg


def write_safetensors(path: Path, header: dict[str, Any], data: bytes = b"",
                      claimed_len: int | None = None) -> None:
    raw = json.dumps(header).encode()
    n = len(raw) if claimed_len is None else claimed_len
    path.write_bytes(struct.pack("<Q", n) + raw + data)


# ---- safetensors bounds ---------------------------------------------------------------


def test_header_length_past_the_file_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "model.safetensors"
    write_safetensors(f, {}, claimed_len=8 * 10**12)  # "8 TB of header"
    with pytest.raises(KVChatError, match="header"):
        safetensors_header(f)


def test_header_length_over_the_cap_is_refused_before_reading(tmp_path: Path) -> None:
    # a file big enough to hold the claimed header (sparse), but the claim is absurd
    f = tmp_path / "model.safetensors"
    write_safetensors(f, {}, claimed_len=1 << 31)
    with open(f, "r+b") as fh:
        fh.truncate((1 << 31) + 16)
    with pytest.raises(KVChatError, match="header of 2147483648 bytes"):
        safetensors_header(f)


def test_tensor_claiming_more_bytes_than_its_offsets_is_refused(tmp_path: Path) -> None:
    # shape says 2**40 floats (4 TB); the offsets and the file hold 4 bytes. mx.load would
    # try to allocate the shape (MemoryError on the engine thread before this check).
    f = tmp_path / "model.safetensors"
    write_safetensors(f, {"w": {"dtype": "F32", "shape": [2**40], "data_offsets": [0, 4]}},
                      b"\0" * 4)
    with pytest.raises(KVChatError, match="'w'.*4398046511104 bytes.*4"):
        safetensors_header(f)


@pytest.mark.parametrize("info", [
    {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]},
    {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]},
    {"dtype": "F32", "shape": "x", "data_offsets": [0, 4]},
    {"dtype": "F32", "shape": [1], "data_offsets": [0]},
    {"dtype": "F32", "shape": [1], "data_offsets": ["0", 4]},
    {"dtype": "NOPE", "shape": [1], "data_offsets": [0, 4]},
    "not a dict",
])
def test_malformed_tensor_entries_are_one_line(tmp_path: Path, info: Any) -> None:
    f = tmp_path / "model.safetensors"
    write_safetensors(f, {"w": info}, b"\0" * 4)
    with pytest.raises(KVChatError, match="'w'"):
        safetensors_header(f)


def test_header_that_is_not_an_object(tmp_path: Path) -> None:
    f = tmp_path / "model.safetensors"
    f.write_bytes(struct.pack("<Q", 2) + b"[]")
    with pytest.raises(KVChatError, match="not a JSON object"):
        safetensors_header(f)


def test_overlapping_tensor_over_8tb_claim_in_a_real_folder(llama: Path) -> None:
    f = llama / "model.safetensors"
    header = safetensors_header(f)
    name = next(k for k in header if k != "__metadata__")
    header[name]["shape"] = [2**40]
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    write_safetensors(f, header, raw[8 + n:])
    assert name in load_error(llama)


# ---- only regular files ----------------------------------------------------------------


def run_python(code: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Run `code` in a fresh interpreter: a reader blocked on a FIFO is killed, never hangs
    the test run."""
    return processes.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=timeout)


def test_fifo_named_model_safetensors_is_refused(llama: Path) -> None:
    (llama / "model.safetensors").unlink()
    os.mkfifo(llama / "model.safetensors")
    r = run_python(f"""
        from kvchat.model.errors import KVChatError
        from kvchat.model.decoder.weights import load_model
        try:
            load_model({str(llama)!r})
        except KVChatError as e:
            print("ERR", e)
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ERR") and "not a regular file" in r.stdout
    assert "model.safetensors" in r.stdout


def test_fifo_tokenizer_config_and_directory_weights_refused(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "tokenizer_config.json")
    r = run_python(f"""
        from pathlib import Path
        from kvchat.model.errors import KVChatError
        from kvchat.model.files import read_json_object
        try:
            read_json_object(Path({str(tmp_path)!r}) / "tokenizer_config.json", KVChatError)
        except KVChatError as e:
            print("ERR", e)
    """)
    assert r.stdout.startswith("ERR") and "not a regular file" in r.stdout, r.stderr
    (tmp_path / "d.safetensors").mkdir()
    with pytest.raises(KVChatError, match="not a regular file"):
        safetensors_header(tmp_path / "d.safetensors")
    with pytest.raises(KVChatError, match="not a regular file"):
        read_json_object(Path("/dev/null"), KVChatError)


# ---- config bounds ---------------------------------------------------------------------


BAD_CONFIG_VALUES = [
    ("hidden_size", 0),
    ("hidden_size", -64),
    ("hidden_size", [64]),
    ("hidden_size", "sixty-four"),
    ("hidden_size", 63),  # not divisible by the heads, no head_dim given
    ("num_attention_heads", 0),
    ("num_key_value_heads", -2),
    ("num_hidden_layers", 0),
    ("num_hidden_layers", 1_000_000),
    ("intermediate_size", 0),
    ("vocab_size", 0),
    ("head_dim", 0),
    ("rms_norm_eps", -1),
    ("rms_norm_eps", 0),
    ("rms_norm_eps", float("nan")),
    ("rope_theta", 0),
    ("rope_theta", -10000.0),
    ("max_position_embeddings", 0),
    ("sliding_window", 0),
]


@pytest.mark.parametrize("key,value", BAD_CONFIG_VALUES)
def test_config_bounds_name_the_key(llama: Path, key: str, value: Any) -> None:
    cfg = json.loads((llama / "config.json").read_text())
    if key == "hidden_size" and value == 63:
        cfg.pop("head_dim", None)
    if key == "sliding_window":
        cfg["use_sliding_window"] = True
    if key == "rope_theta":
        cfg.pop("rope_parameters", None)
    cfg[key] = value
    (llama / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as info:
        load_config(llama)
    msg = str(info.value)
    assert key in msg and "\n" not in msg, msg


def test_sane_config_still_loads(llama: Path) -> None:
    assert load_config(llama).num_hidden_layers == 2


# ---- NaN / Inf weights -----------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weight_names_the_tensor(llama: Path, bad: float) -> None:
    f = llama / "model.safetensors"
    tensors = dict(mx.load(str(f)))
    w = tensors["model.norm.weight"]
    tensors["model.norm.weight"] = mx.concatenate([w[:-1], mx.array([bad], dtype=w.dtype)])
    mx.save_safetensors(str(f), tensors)
    msg = load_error(llama)
    assert "model.norm.weight" in msg and ("NaN" in msg or "Inf" in msg), msg


# ---- the engine thread survives and always says what happened --------------------------


def collect(engine_events: queue.Queue[Any], kind: Any, timeout: float = 30) -> Any:
    while True:
        ev = engine_events.get(timeout=timeout)
        if isinstance(ev, kind):
            return ev


def test_engine_survives_any_job_exception_and_message_is_never_empty(
    llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvchat.model.runtime.engine as engine_mod
    from kvchat.model.distributed import pipeline

    real_load = pipeline.load
    events: queue.Queue[Any] = queue.Queue()
    eng = Engine(events.put)
    try:
        monkeypatch.setattr(pipeline, "load", lambda p: (_ for _ in ()).throw(MemoryError()))
        eng.load(llama)
        failed = collect(events, LoadFailed)
        assert failed.message == "MemoryError"

        # a failure outside loading (model facts) still reports and keeps the thread
        monkeypatch.setattr(pipeline, "load", real_load)
        monkeypatch.setattr(engine_mod, "model_info", lambda *a: {}[""])
        eng.load(llama)
        failed = collect(events, (LoadFailed, Loaded))
        assert isinstance(failed, LoadFailed) and failed.message.startswith("KeyError")

        monkeypatch.undo()
        eng.load(llama)
        assert isinstance(collect(events, (LoadFailed, Loaded)), Loaded)
        eng.submit([1, 2, 3], GenParams(max_tokens=2, temp=0))
        done = collect(events, Done)
        assert done.finish_reason in ("length", "eos"), done
    finally:
        eng.close()
