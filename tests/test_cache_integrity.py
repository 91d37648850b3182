"""A saved K/V cache is used only when it is provably this model's and intact.

On the real stories260K model (copied, so its weights can change in place): a cache is
saved after one turn, then damaged the ways an unlucky disk or user damages it. Each
damaged file is refused in one line, and the next reply is identical to the reply after a
cold prefill (greedy, the reference run with no cache at all). The intact file is used
(all of it) and gives the same reply too, so the comparison cannot pass vacuously."""

from __future__ import annotations

import json
import os
import shutil
import struct
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import pytest

from kvchat.model.cache.integrity import CHECKSUM_KEY, checksum, model_fingerprint
from kvchat.model.runtime.client import EngineClient
from kvchat.model.runtime.events import CacheRestored, CacheSaved, GenParams, Started
from tests.helpers.paths import STORIES260K as _BESIDE

# beside the checkout (as conftest finds it), or where KVCHAT_STORIES260K says (a worktree)
STORIES260K = _BESIDE if _BESIDE.is_dir() else Path(os.environ.get("KVCHAT_STORIES260K", _BESIDE))
pytestmark = pytest.mark.skipif(
    not STORIES260K.is_dir(), reason=f"real model folder absent: {STORIES260K}"
)

PARAMS = GenParams(max_tokens=12, temp=0.0)
FIRST = [1, 403, 407, 261, 378, 432]  # "Once upon a time," in its tokenizer


def _rewrite(path: Path, edit: Callable[[dict[str, mx.array], dict[str, str]], None],
             reseal: bool) -> None:
    """Load the file, let `edit` change arrays/metadata, write it back; `reseal` puts a
    fresh checksum in (so the layer checks, not the checksum, must catch it)."""
    arrays, header = mx.load(str(path), return_metadata=True)
    edit(arrays, header)
    key = f"0.{CHECKSUM_KEY}"
    if reseal:
        header[key] = checksum(arrays, header)
    mx.save_safetensors(str(path), arrays, header)


def _flip_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    n = struct.unpack("<Q", data[:8])[0]
    data[8 + n + 100] ^= 0x10  # inside the first array
    path.write_bytes(bytes(data))


def _offset_by_2(arrays: dict[str, mx.array]) -> None:
    """Every layer's offset (the scalar after K and V in mlx-lm's state layout) + 2."""
    for key in [k for k in arrays if k.count(".") == 1 and k.endswith(".2")]:
        arrays[key] = arrays[key] + 2


def _first_key(arrays: dict[str, mx.array]) -> str:
    return sorted(k for k in arrays if arrays[k].ndim == 4)[0]


def _set(arrays: dict[str, mx.array], fn: Callable[[mx.array], mx.array]) -> None:
    k = _first_key(arrays)
    arrays[k] = fn(arrays[k])


def _nan(a: mx.array) -> mx.array:
    return mx.where(mx.arange(a.shape[2])[None, None, :, None] == 1, mx.nan, a)


DAMAGE: dict[str, Callable[[Path], None]] = {
    "bit flip": _flip_bit,
    "NaN": lambda p: _rewrite(p, lambda a, h: _set(a, _nan), reseal=False),
    "NaN, resealed": lambda p: _rewrite(p, lambda a, h: _set(a, _nan), reseal=True),
    "zeros": lambda p: _rewrite(p, lambda a, h: _set(a, mx.zeros_like), reseal=False),
    "int32 copy": lambda p: _rewrite(
        p, lambda a, h: _set(a, lambda x: (x * 1000).astype(mx.int32)), reseal=False),
    "int32 copy, resealed": lambda p: _rewrite(
        p, lambda a, h: _set(a, lambda x: (x * 1000).astype(mx.int32)), reseal=True),
    "offset +2": lambda p: _rewrite(p, lambda a, h: _offset_by_2(a), reseal=False),
    "offset +2, resealed": lambda p: _rewrite(p, lambda a, h: _offset_by_2(a), reseal=True),
    "wrong shape, resealed": lambda p: _rewrite(
        p, lambda a, h: _set(a, lambda x: x[:, :, :, :-1]), reseal=True),
    "ids changed": lambda p: _rewrite(p, lambda a, h: h.update(
        {"0.kvchat_ids": json.dumps([5, *json.loads(h["0.kvchat_ids"])[1:]])}), reseal=False),
    "no checksum": lambda p: _rewrite(p, lambda a, h: h.pop(f"0.{CHECKSUM_KEY}"),
                                      reseal=False),
    "truncated": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The model copy, a saved cache after one turn, the follow-up prompt and its reply
    after a cold prefill."""
    root = tmp_path_factory.mktemp("integrity")
    model = root / "stories"
    shutil.copytree(STORIES260K, model)
    for f in model.iterdir():
        f.chmod(0o644)
    path = root / "chat.kv.safetensors"
    with EngineClient(model, timeout=60) as c:
        done = c.run(FIRST, PARAMS)
        c.engine.save_cache(path)
        ev = c.wait(CacheSaved)
        assert isinstance(ev, CacheSaved) and ev.error is None
        follow = FIRST + list(done.ids) + [291, 416]
        c.reset()
        cold = c.run(follow, PARAMS)
        started = [e for e in c.events if isinstance(e, Started)][-1]
        assert started.cached_tokens == 0
    return {"model": model, "path": path, "follow": follow, "cold": cold.ids,
            "tokens": ev.tokens}


def _restore_then_reply(saved: dict[str, object], path: Path) -> tuple[CacheRestored, list[int],
                                                                         int]:
    with EngineClient(saved["model"], timeout=60) as c:  # type: ignore[arg-type]
        c.engine.restore_cache(path)
        ev = c.wait(CacheRestored)
        done = c.run(saved["follow"], PARAMS)  # type: ignore[arg-type]
        started = [e for e in c.events if isinstance(e, Started)][-1]
    assert isinstance(ev, CacheRestored)
    return ev, list(done.ids), started.cached_tokens


def test_intact_cache_is_used_whole_and_replies_as_cold(saved: dict[str, object]) -> None:
    ev, ids, cached = _restore_then_reply(saved, saved["path"])  # type: ignore[arg-type]
    assert ev.error is None and ev.tokens == saved["tokens"]
    assert cached == saved["tokens"]
    assert ids == saved["cold"]


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_cache_is_refused_in_one_line_and_reply_is_cold(
        saved: dict[str, object], tmp_path: Path, damage: str) -> None:
    path = tmp_path / "chat.kv.safetensors"
    shutil.copyfile(saved["path"], path)  # type: ignore[arg-type]
    DAMAGE[damage](path)
    ev, ids, cached = _restore_then_reply(saved, path)
    assert ev.error and ev.error.startswith("K/V cache not restored: ") and "\n" not in ev.error
    assert path.name in ev.error  # names the file
    assert ev.tokens == 0 and cached == 0
    assert ids == saved["cold"]


def test_weights_changed_in_place_refuse_the_old_cache(saved: dict[str, object],
                                                       tmp_path: Path) -> None:
    model = tmp_path / "stories"
    shutil.copytree(saved["model"], model)  # type: ignore[arg-type]
    before = model_fingerprint(model)
    assert model_fingerprint(model) == before  # cached, and stable
    path = tmp_path / "chat.kv.safetensors"
    with EngineClient(model, timeout=60) as c:
        c.run(FIRST, PARAMS)
        c.engine.save_cache(path)
        c.wait(CacheSaved)
    # same names, same shapes and header: other values (a fine-tune copied over it)
    arrays, meta = mx.load(str(model / "model.safetensors"), return_metadata=True)
    mx.save_safetensors(str(model / "model.safetensors"),
                        {k: v * 1.01 if v.ndim == 2 else v for k, v in arrays.items()}, meta)
    assert model_fingerprint(model) != before
    with EngineClient(model, timeout=60) as c:
        c.engine.restore_cache(path)
        ev = c.wait(CacheRestored)
    assert isinstance(ev, CacheRestored) and ev.tokens == 0
    assert ev.error == ("K/V cache not restored: it was saved with another model (this"
                        " folder's files have changed since)")


def test_failed_save_is_one_notice_and_keeps_the_cache(saved: dict[str, object],
                                                       tmp_path: Path) -> None:
    """A full disk (here: a folder where the file should go) is one notice; the next
    turn still reuses the cache in memory."""
    path = tmp_path / "chat.kv.safetensors"
    path.mkdir()
    with EngineClient(saved["model"], timeout=60) as c:  # type: ignore[arg-type]
        done = c.run(FIRST, PARAMS)
        c.engine.save_cache(path)
        ev = c.wait(CacheSaved)
        assert isinstance(ev, CacheSaved) and ev.error
        assert "K/V cache not saved to chat.kv.safetensors" in ev.error and "\n" not in ev.error
        c.run(FIRST + list(done.ids) + [13], PARAMS)
        started = [e for e in c.events if isinstance(e, Started)][-1]
    assert started.cached_tokens == len(FIRST) + len(done.ids) - 1


def test_token_ids_outside_the_vocabulary_are_one_line_not_a_crash(
        saved: dict[str, object]) -> None:
    """Ids handed straight to the engine (a saved chat's, --json callers') are checked:
    an embedding lookup past the table crashed the process."""
    with EngineClient(saved["model"], timeout=60) as c:  # type: ignore[arg-type]
        done = c.run([1, 403, 99_999], PARAMS)
        ok = c.run(FIRST, PARAMS)
    assert done.finish_reason == "error"
    assert done.error == "token id 99999 is outside the vocabulary (0..511)"
    assert ok.finish_reason != "error" and ok.ids


# ---- every structural field, on quantized and rotating caches -------------------------
# A file edited and resealed (a fresh checksum: anyone can compute one) must still be
# refused when any field disagrees with what the model writes for the chat's bound.

BOUNDS = {
    # 8-bit K/V: packed uint32 rows plus a float32 scale and bias per group
    "8-bit": GenParams(max_tokens=12, temp=0.0, kv_bits=8),
    # a ring of 16 slots with 2 sinks: 6 + 11 tokens wrap it (lowest position 3)
    "ring": GenParams(max_tokens=12, temp=0.0, max_kv_size=16, keep=2),
    "4-bit ring": GenParams(max_tokens=12, temp=0.0, max_kv_size=16, keep=2, kv_bits=4),
}


@pytest.fixture(scope="module", params=list(BOUNDS))
def bound_saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                ) -> dict[str, object]:
    """A cache of one turn saved under the bound, and the follow-up's reply after a
    cold prefill under the same bound (the reference)."""
    params = BOUNDS[request.param]
    root = tmp_path_factory.mktemp("bounds")
    path = root / "chat.kv.safetensors"
    with EngineClient(STORIES260K, timeout=60) as c:
        done = c.run(FIRST, params)
        c.engine.save_cache(path)
        ev = c.wait(CacheSaved)
        assert isinstance(ev, CacheSaved) and ev.error is None
        follow = FIRST + list(done.ids) + [291, 416]
        c.reset()
        cold = c.run(follow, params)
    return {"kind": request.param, "params": params, "path": path, "follow": follow,
            "cold": cold.ids, "tokens": ev.tokens}


def _restore_with(saved: dict[str, object], path: Path) -> tuple[CacheRestored, list[int], int]:
    with EngineClient(STORIES260K, timeout=60) as c:
        c.engine.restore_cache(path)
        ev = c.wait(CacheRestored)
        done = c.run(saved["follow"], saved["params"])  # type: ignore[arg-type]
        started = [e for e in c.events if isinstance(e, Started)][-1]
    assert isinstance(ev, CacheRestored)
    return ev, list(done.ids), started.cached_tokens


def _layer0(arrays: dict[str, mx.array], key: str, fn: Callable[[mx.array], mx.array]) -> None:
    arrays[f"0.{key}"] = fn(arrays[f"0.{key}"])


def _extras(header: dict[str, str], **values: object) -> None:
    extras = json.loads(header["0.kvchat_extras"])
    extras[0].update(values)
    header["0.kvchat_extras"] = json.dumps(extras)


def _wider(a: mx.array) -> mx.array:
    return mx.concatenate([a, a], axis=-1)


# (bound, what) -> the edit; each is resealed. State keys of layer 0: "0.0" keys and "0.1"
# values (".0" packed, ".1" scales, ".2" biases when quantized), "0.2" offset, "0.3" keep
# (rings), "0.4" max size; a quantized ring then idx, group size, bits, head_dim, lowest.
FIELDS: dict[tuple[str, str], Callable[[dict[str, mx.array], dict[str, str]], None]] = {
    ("8-bit", "key scales wider"): lambda a, h: _layer0(a, "0.1", _wider),
    ("8-bit", "key scales float16"): lambda a, h: _layer0(a, "0.1",
                                                          lambda x: x.astype(mx.float16)),
    ("8-bit", "value biases one token short"): lambda a, h: _layer0(
        a, "1.2", lambda x: x[:, :, :-1]),
    ("8-bit", "value biases bfloat16"): lambda a, h: _layer0(a, "1.2",
                                                             lambda x: x.astype(mx.bfloat16)),
    ("8-bit", "packed keys int32"): lambda a, h: _layer0(a, "0.0",
                                                         lambda x: x.view(mx.int32)),
    ("8-bit", "bits 4 over 8-bit rows"): lambda a, h: _layer0(a, "7", lambda x: x * 0 + 4),
    ("8-bit", "group size 64"): lambda a, h: _layer0(a, "6", lambda x: x * 0 + 64),
    ("ring", "lowest position at the newest token"): lambda a, h: _extras(h, _lo=17),
    ("ring", "lowest position below the sinks"): lambda a, h: _extras(h, _lo=-4),
    ("ring", "lowest position not a number"): lambda a, h: _extras(h, _lo="3"),
    ("ring", "fewer slots than tokens"): lambda a, h: (
        _layer0(a, "0", lambda x: x[:, :, :12]), _layer0(a, "1", lambda x: x[:, :, :12])),
    ("ring", "values narrower"): lambda a, h: _layer0(a, "1", lambda x: x[..., :4]),
    ("ring", "values float16"): lambda a, h: _layer0(a, "1", lambda x: x.astype(mx.float16)),
    ("ring", "ring of 32 slots"): lambda a, h: _layer0(a, "4", lambda x: x * 0 + 32),
    ("4-bit ring", "lowest position at the newest token"): lambda a, h: _layer0(
        a, "9", lambda x: x * 0 + 17),
    ("4-bit ring", "fewer slots than tokens"): lambda a, h: [
        _layer0(a, f"{kv}.{p}", lambda x: x[:, :, :12]) for kv in (0, 1) for p in (0, 1, 2)],
    ("4-bit ring", "head_dim 16"): lambda a, h: _layer0(a, "8", lambda x: x * 0 + 16),
}


def test_intact_quantized_and_ring_caches_are_used_whole(bound_saved: dict[str, object]
                                                         ) -> None:
    """The control: each bound's intact file restores in full and replies as cold."""
    ev, ids, cached = _restore_with(bound_saved, bound_saved["path"])  # type: ignore[arg-type]
    assert ev.error is None and ev.tokens == bound_saved["tokens"] == cached
    assert ids == bound_saved["cold"]


@pytest.mark.parametrize("field", [f for f in FIELDS], ids=[f"{b}: {w}" for b, w in FIELDS])
def test_a_resealed_file_with_a_wrong_field_is_refused(
        bound_saved: dict[str, object], tmp_path: Path, field: tuple[str, str]) -> None:
    if field[0] != bound_saved["kind"]:
        pytest.skip("another bound's field")
    path = tmp_path / "chat.kv.safetensors"
    shutil.copyfile(bound_saved["path"], path)  # type: ignore[arg-type]
    _rewrite(path, FIELDS[field], reseal=True)
    ev, ids, cached = _restore_with(bound_saved, path)
    assert ev.error and ev.error.startswith("K/V cache not restored: ") and "\n" not in ev.error
    assert path.name in ev.error and "checksum" not in ev.error  # the field, not the seal
    assert ev.tokens == 0 and cached == 0
    assert ids == bound_saved["cold"]


# ---- the fingerprint covers every weight byte --------------------------------------------


def _negate_in_place(weights: Path, names: list[str]) -> None:
    """Flip the sign of every float32 of the named tensors, writing into the file where
    it is (same inode and size), then set its times back as they were."""
    st = weights.stat()
    header_len = struct.unpack("<Q", weights.read_bytes()[:8])[0]
    header = json.loads(weights.read_bytes()[8:8 + header_len])
    with open(weights, "r+b") as f:
        for name in names:
            assert header[name]["dtype"] == "F32"
            begin, end = header[name]["data_offsets"]
            f.seek(8 + header_len + begin)
            data = bytearray(f.read(end - begin))
            data[3::4] = bytes(b ^ 0x80 for b in data[3::4])  # little-endian sign bits
            f.seek(8 + header_len + begin)
            f.write(data)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = weights.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (
        st.st_size, st.st_mtime_ns, st.st_ino)


def test_three_tensors_negated_in_place_refuse_the_old_cache(saved: dict[str, object],
                                                             tmp_path: Path) -> None:
    """Three layer-0 tensors negated in place, size, inode and mtime kept (what the old
    sampled fingerprint missed): the fingerprint changes, in this process and in a fresh
    one, and the cache saved before is refused."""
    from kvchat.model.cache import integrity

    model = tmp_path / "stories"
    shutil.copytree(saved["model"], model)  # type: ignore[arg-type]
    path = tmp_path / "chat.kv.safetensors"
    with EngineClient(model, timeout=60) as c:
        c.run(FIRST, PARAMS)
        c.engine.save_cache(path)
        assert isinstance(c.wait(CacheSaved), CacheSaved)
    before = model_fingerprint(model)
    time.sleep(0.05)  # past the file system's clock tick, so the write moves the ctime
    _negate_in_place(model / "model.safetensors", [
        "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.mlp.up_proj.weight"])
    changed = model_fingerprint(model)
    integrity._digests.clear()  # as a fresh process finds it
    assert changed != before and model_fingerprint(model) == changed
    with EngineClient(model, timeout=60) as c:
        c.engine.restore_cache(path)
        ev = c.wait(CacheRestored)
    assert isinstance(ev, CacheRestored) and ev.tokens == 0
    assert ev.error == ("K/V cache not restored: it was saved with another model (this"
                        " folder's files have changed since)")


def test_a_second_fingerprint_reads_no_file_again(saved: dict[str, object],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The digests are kept per file: once computed, the fingerprint opens each file for
    its identity only and reads no byte of it; the value is a sha256 over every byte."""
    import hashlib

    from kvchat.model.cache import integrity

    model: Path = saved["model"]  # type: ignore[assignment]
    integrity._digests.clear()
    first = model_fingerprint(model)
    reads: list[str] = []
    real_open = integrity.open_regular

    class Counted:
        def __init__(self, path: str) -> None:
            self.f = real_open(path)
            self.name = path

        def __enter__(self) -> Counted:
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.close()

        def fileno(self) -> int:
            return self.f.fileno()

        def readinto(self, buf: bytearray) -> int:
            reads.append(self.name)
            return self.f.readinto(buf)

    monkeypatch.setattr(integrity, "open_regular", Counted)
    assert model_fingerprint(model) == first and reads == []
    weights = model / "model.safetensors"
    digest = integrity.file_digest(weights)
    assert digest == hashlib.sha256(weights.read_bytes()).hexdigest() and reads == []


def test_the_chat_engine_hashes_a_loaded_model_in_the_background(
        saved: dict[str, object]) -> None:
    """warm_fingerprint (the chat's engine option): the weights are hashed once the model
    loads, so the first save finds the digest kept; an engine without it reads nothing."""
    from kvchat.model.cache import integrity

    weights = os.path.realpath(saved["model"] / "model.safetensors")  # type: ignore[operator]
    integrity._digests.clear()
    with EngineClient(saved["model"], timeout=60):  # type: ignore[arg-type]
        time.sleep(0.2)
        assert weights not in integrity._digests
    with EngineClient(saved["model"], timeout=60, warm_fingerprint=True):  # type: ignore[arg-type]
        deadline = time.monotonic() + 30
        while weights not in integrity._digests and time.monotonic() < deadline:
            time.sleep(0.02)
    assert weights in integrity._digests
