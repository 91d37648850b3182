"""Reuse on hybrid models through checkpoints of their recurrent states
(model/cache/checkpoints.py, docs/kv-cache.md "Checkpoints").

On tiny random checkpoints built with transformers (tests/helpers/hybrid_families.py):
LFM2 (short convolutions around an attention layer: a conv state beside K/V), Mamba-2
(conv and SSD states, no attention) and Falcon-H1 (K/V and a Mamba-2 state in the same
layer: model/cache/hybrid.py). The reference for every reply is a fresh engine
run on the whole prompt with no cache at all (greedy), so a restored state that is off by
one token, or a K/V cache not cut back with it, gives other ids. Reuse counts are checked
against the positions where checkpoints are documented to be taken (the prompt's end, one
token before it, the reply's end), counted by hand from the prompts.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from kvchat.model import load_model
from kvchat.model.cache.checkpoints import Checkpoints
from kvchat.model.cache.integrity import CHECKSUM_KEY, checksum
from kvchat.model.cache.kv import make_prompt_cache
from kvchat.model.cache.kv_math import human_bytes, state_bytes
from kvchat.model.cache.prefix_pool import PrefixPool
from kvchat.model.runtime.client import EngineClient
from kvchat.model.runtime.events import CacheRestored, CacheSaved, Done, GenParams, Started
from tests.helpers.families import IDS, build
from tests.helpers.hybrid_families import HYBRID_SPECS

PARAMS = GenParams(max_tokens=6, temp=0.0, ignore_eos=True)
A = [int(x) for x in IDS[0, :14]]  # the first prompt
FAMILIES = ["lfm2", "mamba2", "falcon_h1"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build(HYBRID_SPECS[name], tmp_path_factory.mktemp(f"reuse_{name}"))
        return built[name]

    return get


def _started(c: EngineClient) -> Started:
    return [e for e in c.events if isinstance(e, Started)][-1]


def _cold(folder: Path, prompt: list[int]) -> list[int]:
    """The reference: a fresh engine, nothing cached."""
    with EngineClient(folder, timeout=60) as fresh:
        done = fresh.run(prompt, PARAMS)
        assert _started(fresh).cached_tokens == 0
        return list(done.ids)


# ---- the chat -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", FAMILIES)
def test_next_turn_prefills_only_its_new_tokens_through_a_checkpoint(
        name: str, tiny: Callable[[str], Path]) -> None:
    """The second turn's prompt carries the first reply re-rendered otherwise (as a
    template that drops a reply's thinking does): the cache holds A + the reply, the
    prompt A + other tokens, so the state must go back to the end of A. Through the
    checkpoint taken there it prefills only the new tokens; the reply is the cold one."""
    folder = tiny(name)
    with EngineClient(folder, timeout=60) as c:
        first = c.run(A, PARAMS)
        b = A + [7, 7, 9, 11, 13]
        assert b[len(A)] != first.ids[0]  # the reply is not what the prompt carries
        second = c.run(b, PARAMS)
        started = _started(c)
    assert started.cached_tokens == len(A) and started.reprefill_reason is None
    assert second.stats.cached_tokens == len(A)
    assert second.stats.cache["reused_tokens"] == len(A)
    assert second.stats.cache["prefilled_tokens"] == len(b) - len(A) == 5
    assert second.stats.cache["miss_reason"] == "prefix_differs"
    # A's end, one before it, the first reply's end (5 tokens fed) went with that reply
    # when the state went back; then b's end and one before it, and the new reply's end
    assert second.stats.checkpoints == 5
    assert list(second.ids) == _cold(folder, b)
    # their bytes: the recurrent layers' states (the model's formula), 5 snapshots, each
    # of other arrays (the newest is the live state's own)
    per = state_bytes(load_model(folder).config, 4)
    assert second.stats.checkpoint_bytes == 5 * per == 5 * second.stats.state_bytes
    from kvchat.app.tui.widgets.stats_panel import checkpoint_rows

    rows = [" ".join(r.plain.split()) for r in checkpoint_rows(second.stats)]
    assert rows[0].startswith("checkpoints") and f"5 · {human_bytes(5 * per)}" in rows[0]


@pytest.mark.parametrize("name", FAMILIES)
def test_regenerated_reply_restarts_one_token_before_the_prompts_end(
        name: str, tiny: Callable[[str], Path]) -> None:
    folder = tiny(name)
    with EngineClient(folder, timeout=60) as c:
        first = c.run(A, PARAMS)
        again = c.run(A, PARAMS)
        started = _started(c)
    assert started.cached_tokens == len(A) - 1 and started.reprefill_reason is None
    assert again.stats.cache["miss_reason"] is None
    assert list(again.ids) == list(first.ids)


@pytest.mark.parametrize("name", FAMILIES)
def test_edited_last_message_restarts_from_the_previous_turns_checkpoint(
        name: str, tiny: Callable[[str], Path]) -> None:
    """Turn 2 extends turn 1 (its reply as generated, then a message); editing that
    message goes back to where turn 1's reply ended: the checkpoint there."""
    folder = tiny(name)
    with EngineClient(folder, timeout=60) as c:
        first = c.run(A, PARAMS)
        held = A + list(first.ids[:-1])  # the last generated token is never fed
        c.run(held + [first.ids[-1], 20, 21, 22], PARAMS)
        assert _started(c).cached_tokens == len(held)  # an extension: the state as is
        edited = held + [first.ids[-1], 30, 31]
        third = c.run(edited, PARAMS)
        started = _started(c)
    assert started.cached_tokens == len(held) and started.reprefill_reason is None
    assert third.stats.cache["prefilled_tokens"] == 3
    assert list(third.ids) == _cold(folder, edited)


def test_a_branch_before_every_checkpoint_prefills_again_and_says_why(
        tiny: Callable[[str], Path]) -> None:
    folder = tiny("lfm2")
    with EngineClient(folder, timeout=60) as c:
        c.run(A, PARAMS)
        other = A[:6] + [9, 9, 9]
        done = c.run(other, PARAMS)
        started = _started(c)
    assert started.cached_tokens == 0 and "recurrent layers" in started.reprefill_reason
    assert done.stats.cache["miss_reason"] == "no_checkpoint"
    assert done.stats.cache["miss"] == ("the recurrent layers' state cannot go back: no"
                                        " checkpoint at or before token 6")
    assert list(done.ids) == _cold(folder, other)


# ---- the mechanism --------------------------------------------------------------------------
def _logits(model: Any, cache: list[Any], ids: list[int]) -> np.ndarray:
    return np.array(model(mx.array([ids]), cache=cache)[0, -1])


def test_checkpoints_are_exact_bounded_thinned_and_counted(tiny: Callable[[str], Path]) -> None:
    """A prefill paused every 4 tokens with room for 4 checkpoints: the older ones are
    thinned (closest to their older neighbour first, oldest on a tie), the newest three
    kept; each holds the conv state of both recurrent layers (their bytes by the
    model's formula); restoring one continues exactly as the whole prompt from scratch,
    its K/V cut back to it."""
    folder = tiny("lfm2")
    model = load_model(folder)
    ids = [int(x) for x in IDS[0, :24]]
    cache = make_prompt_cache(model)
    cps = Checkpoints(max_count=4, interval=4)
    assert cps.plan(0, 24) == [0, 4, 8, 12, 16, 20, 23, 24]
    for a, b in zip([0, 4, 8, 12, 16], [4, 8, 12, 16, 20], strict=True):
        model(mx.array([ids[a:b]]), cache=cache)
        cps.take(cache)
    # 4, 8, 12, 16 kept, then 20: the gaps of the older ones are all 4, so 4 goes
    assert cps.positions == [8, 12, 16, 20]
    per = state_bytes(model.config, 4)  # float32 on the CPU
    assert cps.nbytes == 4 * per
    cp = cps.latest(14, cache)
    assert cp is not None and cp.at == 12
    cps.restore(cache, cp)
    assert cps.positions == [8, 12] and all(c.offset == 12 for c in cache)
    tail = ids[12:] + [5, 6]
    ref_cache = make_prompt_cache(model)
    ref = _logits(model, ref_cache, ids[:12] + tail)
    got = _logits(model, cache, tail)
    np.testing.assert_allclose(got, ref, atol=1e-5)


def test_prefix_pool_restarts_a_clone_from_a_checkpoint(tiny: Callable[[str], Path]) -> None:
    """The server's pool: an entry with checkpoints at 8 and 14 serves a prompt that
    branches at 11 from the one at 8 (a clone, restored; the entry unchanged), says the
    state could not go back to 11, and one that branches at 5 not at all
    (no_checkpoint at token 5)."""
    model = load_model(tiny("mamba2"))
    held = [int(x) for x in IDS[0, :14]]
    cache = make_prompt_cache(model)
    cps = Checkpoints()
    model(mx.array([held[:8]]), cache=cache)
    cps.take(cache)
    model(mx.array([held[8:]]), cache=cache)
    cps.take(cache)
    pool = PrefixPool(budget_bytes=10**9)
    pool.put(held, cache, ("k",), checkpoints=cps)
    assert pool.stats()["bytes"] == 2 * state_bytes(model.config, 4)  # the last is live
    found = pool.find(held[:11] + [3, 4], ("k",))
    assert found.found is not None
    ids, clone = found.found
    assert ids == held[:8] and all(c.offset == 8 for c in clone)
    assert found.checkpoints.positions == [8]
    assert (found.miss.reason, found.miss.differs_at) == ("checkpoint_before", 11)
    assert all(c.offset == 14 for c in cache) and pool.stats()["reused_tokens"] == 8
    ref = _logits(model, make_prompt_cache(model), held[:8] + [3, 4])
    np.testing.assert_allclose(_logits(model, clone, [3, 4]), ref, atol=1e-5)
    miss = pool.find(held[:5] + [3, 4], ("k",))
    assert miss.found is None
    assert (miss.miss.reason, miss.miss.differs_at) == ("no_checkpoint", 5)


# ---- saved chats ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tiny: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
          ) -> dict[str, Any]:
    """Two LFM2 turns, the cache saved; the uninterrupted third turn, and an edit of the
    second message, each as the chat that never closed gives them."""
    folder = tiny("lfm2")
    path = tmp_path_factory.mktemp("hybrid-saved") / "chat.kv.safetensors"
    with EngineClient(folder, timeout=60) as c:
        first = c.run(A, PARAMS)
        turn2 = A + list(first.ids) + [20, 21]
        second = c.run(turn2, PARAMS)
        c.engine.save_cache(path)
        ev = c.wait(CacheSaved)
        assert isinstance(ev, CacheSaved) and ev.error is None
        held = turn2 + list(second.ids[:-1])
        turn3 = held + [second.ids[-1], 40, 41]
        third = c.run(turn3, PARAMS)
    edit = A + list(first.ids[:-1]) + [first.ids[-1], 50, 51]
    return {"folder": folder, "path": path, "held": held, "turn3": turn3,
            "third": list(third.ids), "edit": edit, "first_end": len(A) + len(first.ids) - 1}


def _reopen(saved: dict[str, Any], path: Path, prompt: list[int]
            ) -> tuple[CacheRestored, Done, Started]:
    with EngineClient(saved["folder"], timeout=60) as c:
        c.engine.restore_cache(path)
        ev = c.wait(CacheRestored)
        done = c.run(prompt, PARAMS)
        started = _started(c)
    assert isinstance(ev, CacheRestored)
    return ev, done, started


def test_reopened_hybrid_chat_continues_as_the_uninterrupted_one(saved: dict[str, Any]) -> None:
    ev, done, started = _reopen(saved, saved["path"], saved["turn3"])
    assert ev.error is None and ev.tokens == len(saved["held"])
    assert started.cached_tokens == len(saved["held"])  # nothing of the history again
    assert list(done.ids) == saved["third"]


def test_reopened_hybrid_chat_keeps_its_checkpoints(saved: dict[str, Any]) -> None:
    """Editing the second message after reopening restarts from the first reply's end,
    a checkpoint that came back with the file."""
    _, done, started = _reopen(saved, saved["path"], saved["edit"])
    assert started.cached_tokens == saved["first_end"]
    assert list(done.ids) == _cold(saved["folder"], saved["edit"])


def _rewrite(path: Path, edit: Callable[[dict[str, mx.array], dict[str, str]], None]) -> None:
    """Change the file's arrays or metadata, then seal it again: the layer and
    checkpoint checks, not the checksum, must refuse it."""
    arrays, header = mx.load(str(path), return_metadata=True)
    edit(arrays, header)
    header[f"0.{CHECKSUM_KEY}"] = checksum(arrays, header)
    mx.save_safetensors(str(path), arrays, header)


def _set(key: str, fn: Callable[[mx.array], mx.array]) -> Callable[..., None]:
    def edit(arrays: dict[str, mx.array], header: dict[str, str]) -> None:
        arrays[key] = fn(arrays[key])
    return edit


def _move_checkpoint(arrays: dict[str, mx.array], header: dict[str, str]) -> None:
    listing = json.loads(header["0.kvchat_checkpoints"])
    listing[-1]["at"] = 10_000
    header["0.kvchat_checkpoints"] = json.dumps(listing)


def _flip(path: Path) -> None:
    arrays, header = mx.load(str(path), return_metadata=True)
    arrays["0.0"] = arrays["0.0"] + 1.0  # the first layer's conv state, not resealed
    mx.save_safetensors(str(path), arrays, header)


TAMPER: dict[str, tuple[Callable[[Path], None], str]] = {
    "state changed": (_flip, "its checksum does not match"),
    "conv state one row short": (
        lambda p: _rewrite(p, _set("0.0", lambda a: a[:, :-1, :])),
        "layer 0's state is float32 (1, 1, 64), the model's float32 (1, 2, 64)"),
    "state as float16": (
        lambda p: _rewrite(p, _set("2.0", lambda a: a.astype(mx.float16))),
        "layer 2's state is float16"),
    "state offset +1": (lambda p: _rewrite(p, _set("0.2", lambda a: a + 1)),
                        "layer 0 says"),
    "NaN in a checkpoint": (
        lambda p: _rewrite(p, _set("kvchat_ckpt_0_0_conv", lambda a: a * mx.nan)),
        "checkpoint 0's layer 0 holds values that are not finite"),
    "checkpoint past the chat": (lambda p: _rewrite(p, _move_checkpoint),
                                 "is at token 10000, outside the chat's"),
}


@pytest.mark.parametrize("tamper", TAMPER)
def test_tampered_saved_state_is_refused_in_one_line(
        saved: dict[str, Any], tmp_path: Path, tamper: str) -> None:
    path = tmp_path / "chat.kv.safetensors"
    shutil.copyfile(saved["path"], path)
    damage, why = TAMPER[tamper]
    damage(path)
    ev, done, started = _reopen(saved, path, saved["turn3"])
    assert ev.error is not None and ev.error.startswith("K/V cache not restored: ")
    assert why in ev.error and "\n" not in ev.error and ev.tokens == 0
    assert started.cached_tokens == 0
    assert list(done.ids) == saved["third"]  # the history read again: the same reply


def test_saved_chat_of_layers_with_kv_and_a_state(
        tiny: Callable[[str], Path], tmp_path: Path) -> None:
    """Falcon-H1's layers keep K/V and a state each: saved with the chat, they reopen and
    continue as the chat that never closed, and an edit restarts from a checkpoint that
    came back with the file; keys one token short are refused in one line."""
    folder = tiny("falcon_h1")
    path = tmp_path / "chat.kv.safetensors"
    with EngineClient(folder, timeout=60) as c:
        first = c.run(A, PARAMS)
        c.engine.save_cache(path)
        ev = c.wait(CacheSaved)
        assert isinstance(ev, CacheSaved) and ev.error is None
        turn2 = A + list(first.ids) + [20, 21]
        second = c.run(turn2, PARAMS)
    saved = {"folder": folder}
    ev, done, started = _reopen(saved, path, turn2)
    assert ev.error is None and ev.tokens == len(A) + len(first.ids) - 1
    assert started.cached_tokens == ev.tokens and list(done.ids) == list(second.ids)
    edit = A + [50, 51]  # another reply: restarts from the checkpoint at the prompt's end
    _, done, started = _reopen(saved, path, edit)
    assert started.cached_tokens == len(A)
    assert list(done.ids) == _cold(folder, edit)
    _rewrite(path, _set("0.0.0", lambda a: a[:, :, :-1, :]))  # layer 0's keys, K/V part
    ev, done, started = _reopen(saved, path, turn2)
    assert ev.error is not None and ev.error.startswith("K/V cache not restored: ")
    assert "layer 0's values are float32 (1, 2, 19, 16)" in ev.error  # keys say 19 tokens
    assert "\n" not in ev.error
    assert started.cached_tokens == 0 and list(done.ids) == list(second.ids)
