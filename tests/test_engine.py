"""The engine on the real stories260K model: streaming, cancel, stop strings, stats,
multi-turn prompt reuse. References: mlx-lm's greedy loop and the engine itself with
reuse switched off."""

from __future__ import annotations

import queue
import threading

import pytest

from kvchat.model.cache.prefix_pool import common_prefix_len
from kvchat.model.runtime.client import EngineClient
from kvchat.model.runtime.engine import Engine
from kvchat.model.runtime.events import (
    Done,
    Event,
    GenParams,
    LoadFailed,
    PrefillProgress,
    Started,
    Stats,
    TextDelta,
)
from tests.helpers.paths import STORIES260K


def Client(**kw) -> EngineClient:  # noqa: N802 - reads as a class at the call sites
    return EngineClient(STORIES260K, timeout=60, **kw)


def turn(client: EngineClient, prompt, params: GenParams) -> tuple[Done, list[Event]]:
    done = client.run(prompt, params)
    return done, list(client.events)


@pytest.fixture(scope="module")
def client():
    c = Client()
    yield c
    c.close()


def test_common_prefix_len():
    assert common_prefix_len([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len([1, 2], [1, 2]) == 2


def test_greedy_matches_mlx_lm_and_streams(client):
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    client.engine.reset()
    done, seen = turn(client, "Once upon a time", GenParams(max_tokens=40, ignore_eos=True))
    assert done.prompt_ids == [1, 403, 407, 261, 378]
    assert done.finish_reason == "length" and len(done.ids) == 40

    ref_model, _ = load(str(STORIES260K))
    ref = [
        int(t)
        for t, _ in generate_step(
            mx.array(done.prompt_ids), ref_model, max_tokens=40,
            sampler=lambda x: mx.argmax(x, axis=-1),
        )
    ]
    assert done.ids == ref
    deltas = "".join(e.text for e in seen if isinstance(e, TextDelta))
    assert deltas == done.text
    assert done.text == client.engine.tokenizer.decode(done.ids)


def test_stats_follow_their_definitions(client):
    client.engine.reset()
    done, seen = turn(client, "Once upon a time", GenParams(max_tokens=30, ignore_eos=True))
    s = done.stats
    assert s.prompt_tokens == 5 and s.cached_tokens == 0
    assert s.generated_tokens == 30
    assert s.decode_tps > 0 and s.prefill_tps > 0 and 0 < s.ttft_s < 30
    # the last generated token is sampled but not yet fed to the model
    assert s.cache_offset == s.cache_tokens == 5 + 29
    cfg = client.engine.model.config
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    assert s.cache_bytes == per_token * s.cache_tokens
    assert s.mha_bytes == s.cache_bytes * cfg.num_attention_heads // cfg.num_key_value_heads
    assert s.gqa_saving == 2
    assert all(isinstance(e, (Started, PrefillProgress, TextDelta, Stats, Done)) for e in seen)


def test_stop_string_cuts_before_it(client):
    client.engine.reset()
    full, _ = turn(client, "Once upon a time", GenParams(max_tokens=40, ignore_eos=True))
    assert "Lily" in full.text
    client.engine.reset()
    done, seen = turn(client,
        "Once upon a time", GenParams(max_tokens=40, stop=("Lily",), ignore_eos=True)
    )
    assert done.finish_reason == "stop"
    assert done.text == full.text[: full.text.index("Lily")]
    assert "".join(e.text for e in seen if isinstance(e, TextDelta)) == done.text


def test_cancel_from_another_thread_keeps_partial_text(client):
    client.engine.reset()
    client.engine.submit("Once upon a time", GenParams(max_tokens=400, ignore_eos=True))
    got: list[str] = []
    while True:
        ev = client.wait(TextDelta, Done)
        if isinstance(ev, TextDelta):
            got.append(ev.text)
            if len(got) == 5:
                t = threading.Thread(target=client.engine.cancel)
                t.start()
                t.join()
                # the engine runs ahead of this reader: count what it had emitted
                # (queued events included) when cancel() returned
                n_at_cancel = len(got) + client.queued()
        if isinstance(ev, Done):
            break
    assert ev.finish_reason == "cancelled"
    # within one decode step: at most one more token after the cancel call returned
    assert len(ev.ids) <= n_at_cancel + 2
    assert ev.text == "".join(got) and ev.text
    # the cache holds exactly the prompt and every token of the partial reply
    s = client.engine.cache_stats()
    assert s.cache_tokens == len(ev.prompt_ids) + len(ev.ids)


class Panic(BaseException):
    """Like pyo3_runtime.PanicException, a Rust tokenizer's panic: not an Exception."""


def _panic(*_args: object, **_kw: object) -> list[int]:
    raise Panic("tokenizer panicked")


def test_a_base_exception_fails_its_turn_and_the_engine_serves_on(client, monkeypatch):
    """A panic while encoding the prompt, one mid-reply and one escaping the turn job
    itself: each ends that turn with Done("error") and one line (the reply shown so far
    kept); the next turn answers as before."""
    engine = client.engine
    params = GenParams(max_tokens=8, ignore_eos=True)
    engine.reset()
    want, _ = turn(client, "Once upon a time", params)
    assert want.finish_reason == "length" and len(want.ids) == 8

    monkeypatch.setattr(engine.tokenizer, "encode", _panic)
    done, _ = turn(client, "Once upon a time", params)
    assert (done.finish_reason, done.error, done.text, done.ids) == (
        "error", "Panic: tokenizer panicked", "", [])
    monkeypatch.undo()

    make_detokenizer = engine.tokenizer.detokenizer

    def panics_at_the_fourth_token(**kw):
        detok = make_detokenizer(**kw)
        add, fed = detok.add_token, []

        def add_token(token: int) -> str:
            fed.append(token)
            return _panic() if len(fed) == 4 else add(token)

        detok.add_token = add_token
        return detok

    monkeypatch.setattr(engine.tokenizer, "detokenizer", panics_at_the_fourth_token)
    done, seen = turn(client, "Once upon a time", params)
    shown = "".join(e.text for e in seen if isinstance(e, TextDelta))
    assert (done.finish_reason, done.error) == ("error", "Panic: tokenizer panicked")
    assert done.text == shown and shown and done.ids == want.ids[:4]
    monkeypatch.undo()

    monkeypatch.setattr("kvchat.model.runtime.engine.run_turn", _panic)
    done, _ = turn(client, "Once upon a time", params)
    assert (done.finish_reason, done.error) == ("error", "Panic: tokenizer panicked")
    monkeypatch.undo()

    again, _ = turn(client, "Once upon a time", params)
    assert (again.finish_reason, again.ids, again.text) == ("length", want.ids, want.text)


def _chat(client: EngineClient, turns: list[str]) -> tuple[list[str], list[int]]:
    client.engine.reset()
    messages: list[dict[str, str]] = []
    replies, prefilled = [], []
    for text in turns:
        messages.append({"role": "user", "content": text})
        done, _ = turn(client, messages, GenParams(max_tokens=24))
        assert done.finish_reason in ("eos", "length")
        replies.append(done.text)
        prefilled.append(done.stats.prompt_tokens - done.stats.cached_tokens)
        messages.append({"role": "assistant", "content": done.text})
    return replies, prefilled


@pytest.mark.slow
def test_five_turn_chat_reuse_gives_same_replies_with_far_less_prefill():
    turns = [
        "Tell me about a cat.",
        "What did the cat see?",
        "Where did the dog go?",
        "Was Lily happy?",
        "What happened at the end?",
    ]
    on = Client()
    off = Client(reuse_prefix=False)
    try:
        replies_on, pre_on = _chat(on, turns)
        replies_off, pre_off = _chat(off, turns)
    finally:
        on.close()
        off.close()
    assert replies_on == replies_off
    assert sum(pre_off) >= 5 * sum(pre_on), (pre_on, pre_off)


def test_regenerate_trims_cache_back(client):
    client.engine.reset()
    msgs = [{"role": "user", "content": "Tell me a story."}]
    first, _ = turn(client, msgs, GenParams(max_tokens=12))
    again, _ = turn(client, msgs, GenParams(max_tokens=12))
    assert again.text == first.text
    # all but the last prompt token came from the cache
    assert again.stats.cached_tokens == again.stats.prompt_tokens - 1


def test_bad_model_path_keeps_current_model(client, tmp_path):
    client.engine.load(tmp_path / "nope")
    ev = client.wait(LoadFailed)
    assert "not found" in ev.message and "\n" not in ev.message
    done, _ = turn(client, "Once upon a time", GenParams(max_tokens=3))
    assert done.finish_reason == "length"


def test_invalid_params_are_one_line_errors(client):
    done, _ = turn(client, "Once", GenParams(temp=-1))
    assert done.finish_reason == "error" and "\n" not in done.error and "temp" in done.error


def test_prompt_longer_than_context_rotates_or_refuses(client):
    long_prompt = "Once upon a time there was a cat. " * 120  # ~1200 tokens > 512 context
    client.engine.reset()
    done, _ = turn(client, long_prompt, GenParams(max_tokens=10))
    assert done.finish_reason == "length"
    s = done.stats
    assert s.cache_tokens == s.cache_capacity == 512
    assert s.evicted_tokens == s.cache_offset - 512 > 0

    client.engine.reset()
    done, _ = turn(client, long_prompt, GenParams(max_tokens=10, overflow="refuse"))
    assert done.finish_reason == "error" and "exceeds the 512-token context" in done.error
    # a prompt that fits stops at the context limit instead of rotating
    client.engine.reset()
    done, _ = turn(client,
        [1] * 500, GenParams(max_tokens=50, overflow="refuse", ignore_eos=True)
    )
    assert done.finish_reason == "context_full" and len(done.ids) == 13  # not --max-tokens
    assert done.stats.cache_tokens == 512 and done.stats.evicted_tokens == 0


def test_ids_past_the_tokenizer_vocab_are_never_sampled(copy_checkpoint):
    """Embedding tables are often padded past the tokenizer; those ids cannot be decoded."""
    from tests.helpers.checkpoints import write_tokenizer

    folder = copy_checkpoint("llama")  # model vocab 256
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / f).unlink(missing_ok=True)
    write_tokenizer(folder, 40)
    events: queue.Queue[Event] = queue.Queue()
    engine = Engine(events.put, folder)
    try:
        engine.submit([1, 5, 7], GenParams(max_tokens=60, temp=1.0, seed=0, ignore_eos=True))
        while not isinstance(done := events.get(timeout=60), Done):
            pass
    finally:
        engine.close()
    assert done.finish_reason == "length", done.error
    assert len(done.ids) == 60 and max(done.ids) < 40


def _prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_each_turn_says_why_the_cache_gave_no_more():
    """The chat's one cache (no pool): a new chat, a branch (differs at the first token
    the two prompts do not share), whole reuse, other cache settings, a window rotated
    past the branch point, reuse switched off; reused + prefilled = the prompt."""
    c = Client()
    off = Client(reuse_prefix=False)
    try:
        story = [{"role": "user", "content": "Tell me a story about a cat."}]
        dog = [{"role": "user", "content": "Tell me a story about a dog."}]
        first, _ = turn(c, story, GenParams(max_tokens=8))
        assert first.stats.cache["miss_reason"] == "new_conversation"
        branch, _ = turn(c, dog, GenParams(max_tokens=8))
        at = _prefix(first.prompt_ids, branch.prompt_ids)
        assert 0 < at < len(first.prompt_ids)
        assert branch.stats.cache == {
            "reused_tokens": at, "prefilled_tokens": len(branch.prompt_ids) - at,
            "miss_reason": "prefix_differs", "differs_at": at,
            "miss": f"the prompt differs from the cached conversation at token {at}"}
        more = dog + [{"role": "assistant", "content": branch.text},
                       {"role": "user", "content": "And then?"}]
        whole, _ = turn(c, more, GenParams(max_tokens=8))
        assert whole.stats.cache["miss_reason"] is None
        assert whole.stats.cache["reused_tokens"] == whole.stats.cached_tokens > at
        bounded, _ = turn(c, more, GenParams(max_tokens=8, max_kv_size=48))
        assert bounded.stats.cache["miss_reason"] == "model_or_settings_changed"
        # a prompt past the 48-token window rotates; a branch inside it cannot be cut back
        long_a = [{"role": "user", "content": "Once upon a time " * 12 + "there was a cat."}]
        long_b = [{"role": "user", "content": "Once upon a time " * 12 + "there was a dog."}]
        a, _ = turn(c, long_a, GenParams(max_tokens=4, max_kv_size=48))
        assert len(a.prompt_ids) > 48
        b, _ = turn(c, long_b, GenParams(max_tokens=4, max_kv_size=48))
        assert b.stats.cache["miss_reason"] == "window_rotated"
        assert b.stats.cache["reused_tokens"] == 0
        turn(off, story, GenParams(max_tokens=8))
        again, _ = turn(off, story, GenParams(max_tokens=8))
        assert again.stats.cache["miss_reason"] == "reuse_off"
        assert again.stats.cache["prefilled_tokens"] == len(again.prompt_ids)
    finally:
        c.close()
        off.close()
