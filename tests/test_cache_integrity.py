"""A saved K/V cache is used only when it is provably this model's and intact (issue 19).

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
    assert ev.error == "K/V cache not restored: it was saved with another model"


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
