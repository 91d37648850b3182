"""A saved K/V cache continues exactly where the live one would have: for the full and the
rotating cache, read back by our loader and by mlx-lm's `load_prompt_cache` (into
mlx-lm's own classes). The reference is the same greedy run never interrupted."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models import cache as mlx_cache

from kvchat.model.cache.file import load_cache, save_cache
from kvchat.model.cache.kv import ChunkedKVCache, KVCache, RotatingKVCache
from kvchat.model.decoder.config import ModelConfig
from kvchat.model.decoder.transformer import Transformer

PROMPT = [1, 17, 42, 5, 88, 23, 61, 9, 14, 70, 33, 2]
BEFORE, AFTER = 40, 40  # greedy tokens before the save and after the restore


def tiny() -> Transformer:
    mx.random.seed(3)
    m = Transformer(ModelConfig.from_dict({
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
        "vocab_size": 97, "max_position_embeddings": 256,
    }))
    mx.eval(m.parameters())
    return m


def greedy(model: Transformer, caches: list[Any], first: list[int], n: int) -> list[int]:
    """Feed `first`, then greedy steps; returns n ids (the last one is not fed, as the
    engine leaves it)."""
    y = mx.argmax(model(mx.array([first]), cache=caches)[:, -1, :], axis=-1)
    out = [int(y.item())]
    while len(out) < n:
        y = mx.argmax(model(y[None], cache=caches)[:, -1, :], axis=-1)
        out.append(int(y.item()))
    return out


MAKERS = {
    "full": lambda: [KVCache() for _ in range(2)],
    # 24 slots, 4 sinks: the 12-token prompt + 40 tokens wrap the ring twice before the save
    "rotating": lambda: [RotatingKVCache(24, 4) for _ in range(2)],
    # Llama 4's chunked attention, chunks of 16: the save lands mid-chunk
    "chunked": lambda: [ChunkedKVCache(16) for _ in range(2)],
}


# mlx-lm's ChunkedKVCache keeps another state: kvchat's chunked files are ours alone
@pytest.mark.parametrize(("kind", "loader"), [
    ("full", "ours"), ("full", "mlx_lm"), ("rotating", "ours"), ("rotating", "mlx_lm"),
    ("chunked", "ours")])
def test_restored_cache_continues_to_the_same_ids(kind: str, loader: str, tmp_path: Path) -> None:
    model = tiny()
    straight = greedy(model, MAKERS[kind](), PROMPT, BEFORE + AFTER)

    caches = MAKERS[kind]()
    head = greedy(model, caches, PROMPT, BEFORE)
    assert head == straight[:BEFORE]
    # the cache holds the prompt and every generated token but the last (not yet fed)
    assert caches[0].offset == len(PROMPT) + BEFORE - 1
    if kind != "full":
        assert caches[0].offset > caches[0].max_size  # wrapped
    path = tmp_path / "chat.kv.safetensors"
    written = save_cache(path, caches, {"note": "test"})
    assert written == path.stat().st_size > 0
    assert not [p for p in tmp_path.iterdir() if p != path]  # no temp file left behind
    del caches

    if loader == "ours":
        restored, meta = load_cache(path)
        assert meta == {"note": "test"}
        assert [type(c) for c in restored] == [type(c) for c in MAKERS[kind]()]
    else:
        restored = mlx_cache.load_prompt_cache(str(path))
        want = mlx_cache.KVCache if kind == "full" else mlx_cache.RotatingKVCache
        assert all(type(c) is want for c in restored)
    assert restored[0].offset == len(PROMPT) + BEFORE - 1
    tail = greedy(model, restored, [head[-1]], AFTER)
    assert tail == straight[BEFORE:]


def test_state_follows_mlx_lm_032_protocol() -> None:
    """`state` is mlx-lm's: the arrays then the scalars, in its order; no meta_state;
    from_state(state) alone rebuilds the cache."""
    model = tiny()
    for kind, make in MAKERS.items():
        if kind == "chunked":  # kvchat's own class (see above)
            continue
        caches = make()
        greedy(model, caches, PROMPT, 30)
        c = caches[0]
        assert not hasattr(c, "meta_state")
        k, v, *scalars = c.state
        assert isinstance(k, mx.array) and isinstance(v, mx.array)
        assert all(isinstance(s, int) for s in scalars)
        # mlx-lm's own class takes our state as is (its setter unpacks every field)
        theirs = (mlx_cache.KVCache if kind == "full" else mlx_cache.RotatingKVCache
                  ).from_state(c.state)
        assert theirs.offset == c.offset and len(theirs.state) == len(c.state)
        again = type(c).from_state(c.state)
        assert again.offset == c.offset and again.state[2:] == c.state[2:]


def test_unreadable_file_is_one_line(tmp_path: Path) -> None:
    from kvchat.model.cache.kv import CacheError

    bad = tmp_path / "x.kv.safetensors"
    bad.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(CacheError, match="K/V cache file x.kv.safetensors"):
        load_cache(bad)


def test_engine_restores_only_for_the_model_that_saved(tmp_path: Path) -> None:
    """Through the real Engine (scripted model): a cache saved for one model is refused,
    in one line, by another; for the same model the next turn reuses all of it."""
    from kvchat.model.runtime.client import EngineClient
    from kvchat.model.runtime.events import CacheRestored, CacheSaved, GenParams, Started
    from tests.helpers.scripted_engine import ScriptedEngine

    chat = [{"role": "user", "content": "hello there"}]
    path = tmp_path / "c.kv.safetensors"
    with EngineClient("/models/a", engine=ScriptedEngine, timeout=30) as a:
        done = a.run(chat, GenParams(max_tokens=8))
        a.engine.save_cache(path)
        saved = a.wait(CacheSaved)
        assert isinstance(saved, CacheSaved) and saved.error is None
        assert saved.tokens == len(done.prompt_ids) + len(done.ids) - 1  # last not fed
        assert saved.nbytes == path.stat().st_size
        # over the cap: not written, and the older file goes (it would only mislead)
        a.engine.save_cache(path, max_bytes=saved.nbytes // 2)
        a.run(chat, GenParams(max_tokens=2))  # jobs run in order: the save came first
        assert not path.exists()
        a.run(chat, GenParams(max_tokens=8))
        a.engine.save_cache(path)
        assert isinstance(a.wait(CacheSaved), CacheSaved) and path.is_file()
    with EngineClient("/models/b", engine=ScriptedEngine, timeout=30) as b:
        b.engine.restore_cache(path)
        ev = b.wait(CacheRestored)
        assert isinstance(ev, CacheRestored) and ev.tokens == 0
        assert ev.error == (
            "K/V cache not restored: it was saved with another model (a, not b)")
    with EngineClient("/models/a", engine=ScriptedEngine, timeout=30) as again:
        again.engine.restore_cache(path)
        ev = again.wait(CacheRestored)
        assert isinstance(ev, CacheRestored) and ev.error is None
        follow = chat + [{"role": "assistant", "content": done.text},
                         {"role": "user", "content": "more"}]
        again.run(follow, GenParams(max_tokens=4))
        started = [e for e in again.events if isinstance(e, Started)][-1]
        assert started.cached_tokens == saved.tokens and started.reprefilled_tokens == 0


def test_a_cache_file_is_as_private_as_its_chat(tmp_path: Path) -> None:
    """0600 whatever the umask, as the chat's JSON (app/core/store.py's atomic writes):
    the K/V are the conversation in another form. Written over an older 0644 file too."""
    from kvchat.app.core.store import Conversation, ConversationStore

    model = tiny()
    caches = MAKERS["full"]()
    greedy(model, caches, PROMPT, 3)
    store = ConversationStore(tmp_path)
    conv = Conversation()
    conv.add_message("user", "hello")
    chat = store.save(conv)
    path = store.cache_path(conv.id)
    path.write_bytes(b"old")
    path.chmod(0o644)
    old = os.umask(0o022)
    try:
        save_cache(path, caches, {"kvchat_ids": "[]"})
    finally:
        os.umask(old)
    assert chat.stat().st_mode & 0o777 == 0o600
    assert path.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir() if ".tmp" in p.name] == []
    loaded, meta = load_cache(path)
    assert meta["kvchat_ids"] == "[]" and loaded[0].offset == caches[0].offset
