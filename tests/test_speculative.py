"""Speculative decoding (model/runtime/speculative.py): greedy ids equal plain decoding's on
every cache kind, for both draft sources; sampling keeps the target distribution (a
chi-square test that a wrong rule fails); the faces' fields (`generate --json`, the panel)."""

from __future__ import annotations

import json
import math
import os
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map

from kvchat.model.cache.kv import KVCache, RotatingKVCache, make_prompt_cache
from kvchat.model.decoder.config import ModelConfig
from kvchat.model.decoder.kv_format import KVQuant
from kvchat.model.decoder.transformer import Transformer
from kvchat.model.decoder.weights import load_model
from kvchat.model.runtime.events import GenParams, TurnStats
from kvchat.model.runtime.generate import Progress, generate_step, prefill
from kvchat.model.runtime.sampling import Sampler, SamplingParams
from kvchat.model.runtime.speculative import (
    DraftLength,
    DraftModel,
    PromptLookup,
    accept,
    speculative_decode,
    why_not,
)
from tests.helpers import processes
from tests.helpers.paths import REPO_ROOT
from tests.helpers.stats import chi2_sf

BASE = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 48,
        "max_position_embeddings": 512}
CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", **BASE},
    # two sliding layers (a ring of exactly the window) and a global one, as Gemma 3
    "gemma3": {"model_type": "gemma3_text", **BASE, "num_hidden_layers": 3, "head_dim": 16,
               "sliding_window": 8, "layer_types": ["sliding_attention", "sliding_attention",
                                                    "full_attention"]},
    # latent attention (DeepSeek-V3): the cache holds the latent and the shared rotated key
    "mla": {"model_type": "deepseek_v3", **BASE, "n_routed_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
            "n_group": 2, "topk_group": 1, "q_lora_rank": 32, "kv_lora_rank": 16,
            "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
            "num_key_value_heads": 4},
}
PROMPT = [3, 17, 9, 30, 5, 17, 9, 30, 22, 41, 7, 3, 17]
GEN = 70


def prefilled(model: Any, prompt: list[int], caches: list[Any], progress: Progress,
              chunk: int = 8) -> mx.array:
    """The prompt run into `caches`; the logits of its last position."""
    return list(prefill(model, prompt, caches, prefill_chunk=chunk, progress=progress))[-1]


# seed and weight scale per config: a random model that does not settle into repeating
# one or two ids at once (varied ids make drafts that are sometimes wrong)
VARIED = {"llama": (1, 2.0), "gemma3": (1, 0.5), "mla": (2, 1.0)}


def tiny(name: str) -> Any:
    seed, scale = VARIED[name]
    mx.random.seed(seed)
    model = Transformer(ModelConfig.from_dict(CONFIGS[name]))
    model.update(tree_map(lambda w: w * scale, model.parameters()))
    mx.eval(model.parameters())
    return model


def noisy_copy(model: Any, name: str, scale: float, seed: int = 7) -> Any:
    """The same model with noise on every weight: a draft that agrees often, not always."""
    draft = tiny(name)
    mx.random.seed(seed)
    draft.update(tree_map(lambda w: w + scale * mx.random.normal(w.shape) * w.std(),
                          model.parameters()))
    mx.eval(draft.parameters())
    return draft


# cache kinds: how each is made for a model
CACHES: dict[str, Callable[[Any], list[Any]]] = {
    "full": lambda m: [KVCache() for _ in m.layers],
    "context": lambda m: make_prompt_cache(m),  # sliding rings where the model has them
    # wraps during the prompt already: every rejection is taken back across the wrap
    "rotating": lambda m: make_prompt_cache(m, max_kv_size=12, keep=2),
    "kv4": lambda m: make_prompt_cache(m, kv=KVQuant(4, 32)),
    "kv8": lambda m: make_prompt_cache(m, kv=KVQuant(8, 32)),
    "kv4_rotating": lambda m: make_prompt_cache(m, max_kv_size=12, keep=2, kv=KVQuant(4, 32)),
}


def plain(model: Any, caches: list[Any], prompt: list[int], n: int, **kw: Any) -> list[int]:
    return list(generate_step(model, prompt, caches, max_tokens=n, prefill_chunk=8, **kw))


def speculative(model: Any, caches: list[Any], prompt: list[int], n: int, source: Any,
                progress: Progress, *, sampler: Sampler | None = None, k: int = 4,
                adaptive: bool = False) -> list[int]:
    logits = prefilled(model, prompt, caches, progress)
    return list(speculative_decode(
        model, logits, caches, source=source, sampler=sampler or Sampler(), n_ids=BASE[
            "vocab_size"], history=prompt, max_tokens=n, draft_tokens=k, adaptive=adaptive,
        progress=progress))


class TrimSpy:
    """Counts trims of rejected drafts on a ring that had wrapped, where the write being
    taken back displaced keys (the case an exact rollback must restore)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.across_wrap = 0
        trim = RotatingKVCache.trim
        spy = self

        def counted(cache: RotatingKVCache, n: int) -> int:
            if n and cache.offset > cache.max_size and cache._last_write() is not None:
                spy.across_wrap += 1
            return trim(cache, n)

        monkeypatch.setattr(RotatingKVCache, "trim", counted)


def _sources(model: Any, name: str) -> dict[str, Callable[[], Any]]:
    draft = noisy_copy(model, name, 0.2)
    return {"lookup": lambda: PromptLookup(3), "draft": lambda: DraftModel(draft, "noisy")}


@pytest.mark.parametrize("source", ["lookup", "draft"])
@pytest.mark.parametrize(("name", "kind"), [
    ("llama", "full"), ("llama", "context"), ("llama", "rotating"), ("llama", "kv4"),
    ("llama", "kv8"), ("llama", "kv4_rotating"),
    ("gemma3", "context"), ("gemma3", "rotating"),
    ("mla", "full"), ("mla", "context"), ("mla", "rotating"),
])
def test_greedy_ids_equal_plain_decoding(name: str, kind: str, source: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny(name)
    want = plain(model, CACHES[kind](model), PROMPT, GEN)
    spy = TrimSpy(monkeypatch)
    progress = Progress()
    caches = CACHES[kind](model)
    got = speculative(model, caches, PROMPT, GEN, _sources(model, name)[source](), progress)
    assert got == want
    # drafts were rejected (taken back out of the cache); a draft model's were kept too
    assert progress.accepted < progress.drafted, (progress.accepted, progress.drafted)
    assert progress.accepted > 0 or source == "lookup"
    assert caches[0].offset == len(PROMPT) + progress.fed == len(PROMPT) + GEN - 1
    rings = [c for c in caches if isinstance(c, RotatingKVCache)]
    if kind.endswith("rotating") or (name == "gemma3" and kind == "context"):
        assert rings and rings[0].offset > rings[0].max_size  # past the window
        assert spy.across_wrap > 0  # rejected drafts were taken back across the wrap


class Corrupted:
    """Drafts the reference reply's next ids with one of them wrong every other pass: a
    pass keeps some drafts and rejects the rest, every time, whatever the model does."""

    name = "corrupted"

    def __init__(self, prompt: list[int], ids: list[int]) -> None:
        self.full, self.passes = prompt + ids, 0

    def propose(self, history: list[int], k: int) -> tuple[list[int], None]:
        n = len(history)
        drafts = self.full[n : n + k]
        self.passes += 1
        if self.passes % 2 and len(drafts) > 1:
            drafts[-2] = (drafts[-2] + 1) % BASE["vocab_size"]
        return drafts, None


@pytest.mark.parametrize("kind", list(CACHES))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_partly_kept_passes_roll_back_exactly(name: str, kind: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    if name == "mla" and kind.startswith("kv"):
        pytest.skip("a latent cache is never quantized")
    model = tiny(name)
    want = plain(model, CACHES[kind](model), PROMPT, GEN)
    spy = TrimSpy(monkeypatch)
    progress = Progress()
    caches = CACHES[kind](model)
    got = speculative(model, caches, PROMPT, GEN, Corrupted(PROMPT, want), progress, k=5)
    assert got == want
    assert 0 < progress.accepted < progress.drafted
    assert caches[0].offset == len(PROMPT) + GEN - 1
    if any(isinstance(c, RotatingKVCache) and c.offset > c.max_size for c in caches):
        assert spy.across_wrap > 0


def test_greedy_with_repetition_penalty_and_its_history(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """Each verified position is judged with the repetition window it would have had."""
    model = tiny("llama")
    params = SamplingParams(repetition_penalty=1.3, repetition_context_size=6)
    history = mx.array(PROMPT[-6:], dtype=mx.int32)
    ref = Sampler(params)

    def sample(logits: mx.array) -> mx.array:
        nonlocal history
        y = ref(logits, history)
        history = mx.concatenate([history, y])[-6:]
        return y

    want = plain(model, CACHES["rotating"](model), PROMPT, GEN, sample=sample)
    for source in _sources(model, "llama").values():
        progress = Progress()
        got = speculative(model, CACHES["rotating"](model), PROMPT, GEN, source(), progress,
                          sampler=Sampler(params))
        assert got == want and progress.drafted > progress.accepted


def test_stories260k_prompt_lookup_and_itself_as_draft(stories260k: Path) -> None:
    """A real model: lookup drafts from a repeated prompt; the model as its own draft
    has every draft accepted (k + 1 tokens per pass); adaptive lengths change nothing."""
    model = load_model(stories260k)
    prompt = [1, 403, 407, 261, 426, 297] * 10
    want = list(generate_step(model, prompt, make_prompt_cache(model, max_kv_size=40, keep=4),
                              max_tokens=120))
    itself = DraftModel(model, "self")
    itself.start(None, 512, 40, 4)  # the target's cache bound: the same predictions
    for source, adaptive in ((PromptLookup(3), True), (itself, False)):
        progress = Progress()
        caches = make_prompt_cache(model, max_kv_size=40, keep=4)
        logits = prefilled(model, prompt, caches, progress, 512)
        got = list(speculative_decode(model, logits, caches, source=source, sampler=Sampler(),
                                      n_ids=512, history=prompt, max_tokens=120,
                                      adaptive=adaptive, progress=progress))
        assert got == want
        assert progress.accepted > 0
    # every draft kept: 4 + 1 ids per pass after the first id
    assert progress.accepted == progress.drafted and progress.forwards == math.ceil(119 / 5)


def test_closing_mid_reply_leaves_the_cache_holding_what_was_yielded() -> None:
    model = tiny("llama")
    source = DraftModel(noisy_copy(model, "llama", 0.0), "same")  # every draft kept
    progress = Progress()
    caches = CACHES["rotating"](model)
    logits = prefilled(model, PROMPT, caches, progress)
    steps = speculative_decode(model, logits, caches, source=source, sampler=Sampler(),
                               n_ids=48, history=PROMPT, max_tokens=50, progress=progress,
                               adaptive=False)
    got = [next(steps) for _ in range(3)]  # mid-way through a step's kept drafts
    steps.close()
    assert len(got) == 3 and progress.fed in (2, 3)
    assert caches[0].offset == len(PROMPT) + progress.fed


# ---- the lookup and the draft length --------------------------------------------------------
def test_prompt_lookup_drafts_what_followed_the_latest_longest_match() -> None:
    lookup = PromptLookup(3)
    history = [1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 2, 3, 4]
    assert lookup.propose(history, 2) == ([7, 8], None)  # "2 3 4" last seen before 7 8
    assert lookup.propose(history + [6], 3) == ([], None)  # 6 never seen before
    assert lookup.propose([5, 6, 5], 4) == ([6, 5], None)  # "5" then what followed it


def test_draft_length_drafts_nothing_where_a_pass_costs_its_tokens() -> None:
    """Measured costs decide: if a pass of n tokens costs n plain steps no length pays,
    if it costs about one step the longest does (every draft accepted)."""
    for cost, want in ((lambda n: 0.01 * n, 0), (lambda n: 0.01 + 0.0005 * n, 6)):
        length = DraftLength(6)
        assert length.next() == 6  # nothing measured: try drafting
        for _ in range(3):
            length.plain(16, 16 * cost(1))
            for k in range(1, 7):  # each length measured (a first pass is not timed)
                length.drafted(k, k, cost(k + 1))
                length.drafted(k, k, cost(k + 1))
        assert length.next() == want
    length = DraftLength(6)
    for _ in range(10):  # every draft rejected: a pass of 2 at 1.3 steps does not pay
        length.plain(16, 0.16)
        length.drafted(1, 0, 0.013)
        length.drafted(1, 0, 0.013)
    assert length.rate < 0.2 and length.next() == 0


# ---- sampling keeps the target distribution -------------------------------------------------
V = 4
P = np.array([[0.1, 0.2, 0.3, 0.4], [0.5, 0.1, 0.1, 0.3], [0.25, 0.25, 0.4, 0.1],
              [0.3, 0.3, 0.2, 0.2], [0.1, 0.6, 0.1, 0.2]])
Q = np.array([[0.4, 0.3, 0.2, 0.1], [0.1, 0.1, 0.7, 0.1], [0.25, 0.25, 0.25, 0.25],
              [0.6, 0.1, 0.1, 0.2], [0.1, 0.1, 0.1, 0.7]])
DRAWS = 3000


def wrong_accept(p: mx.array, drafts: list[int], q: Any, u: list[float],
                 draw: Callable[[mx.array], int]) -> tuple[int, int]:
    """A common mistake: on a rejection, draw from p instead of max(p − q, 0)."""
    for i, d in enumerate(drafts):
        qd = 1.0 if q is None else q[i, d].item()
        if u[i] * qd >= p[i, d].item():
            return i, draw(p[i])
    return len(drafts), draw(p[len(drafts)])


def first_two(rule: Callable[..., tuple[int, int]], draft: bool, seed: int) -> Counter[tuple]:
    """The first two ids emitted, DRAWS times, by speculative steps of k = 2 over a
    'model' whose distribution at position t is P[t] (and the draft's Q[t])."""
    rng = np.random.default_rng(seed)
    counts: Counter[tuple[int, int]] = Counter()

    def draw(probs: mx.array) -> int:
        p = np.asarray(probs, dtype=np.float64)
        return int(rng.choice(V, p=p / p.sum()))

    for _ in range(DRAWS):
        out: list[int] = []
        t = 0
        while len(out) < 2:
            if draft:  # a draft model: drafts drawn from Q
                drafts = [int(rng.choice(V, p=Q[t + i])) for i in range(2)]
                q = mx.array(Q[t : t + 2], dtype=mx.float32)
            else:  # prompt lookup: a fixed guess (certain: q one-hot)
                drafts, q = [2, 1], None
            p = mx.array(P[t : t + 3], dtype=mx.float32)
            kept, nxt = rule(p, drafts, q, rng.random(2).tolist(), draw)
            out += [*drafts[:kept], nxt]
            t += kept + 1
        counts[(out[0], out[1])] += 1
    return counts


def chi_square_p(counts: Counter[tuple]) -> float:
    """P-value of the first two ids following P[0] × P[1] (independent positions)."""
    expected = np.outer(P[0], P[1]).ravel() * DRAWS
    observed = np.array([counts[(a, b)] for a in range(V) for b in range(V)])
    stat = float(((observed - expected) ** 2 / expected).sum())
    return chi2_sf(stat, V * V - 1)


@pytest.mark.parametrize("draft", [True, False], ids=["draft_model", "prompt_lookup"])
def test_speculative_sampling_keeps_the_target_distribution(draft: bool) -> None:
    assert chi_square_p(first_two(accept, draft, seed=5)) > 1e-3
    # the test can fail: the wrong rule is caught on the same draws
    assert chi_square_p(first_two(wrong_accept, draft, seed=5)) < 1e-6


def test_sampler_probs_are_the_distribution_it_draws_from() -> None:
    params = SamplingParams(temp=0.7, top_k=5, top_p=0.9, min_p=0.05, seed=3)
    logits = mx.random.normal((1, 12), key=mx.random.key(2)) * 2
    probs = np.asarray(Sampler(params).probs(logits))[0]
    s = Sampler(params)
    counts = Counter(int(s(logits).item()) for _ in range(4000))
    observed = np.array([counts[i] for i in range(12)])
    assert observed[probs == 0].sum() == 0  # filtered ids are never drawn
    keep = probs > 0
    stat = float(((observed[keep] - 4000 * probs[keep]) ** 2 / (4000 * probs[keep])).sum())
    assert chi2_sf(stat, int(keep.sum()) - 1) > 1e-3
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-5)


def test_sampled_speculation_runs_and_keeps_the_cache_consistent(stories260k: Path) -> None:
    model = load_model(stories260k)
    prompt = [1, 403, 407, 261, 426, 297] * 6
    for source in (PromptLookup(2), DraftModel(model, "self")):
        sampler = Sampler(SamplingParams(temp=0.8, top_p=0.95, seed=1))
        if isinstance(source, DraftModel):
            source.start(Sampler(SamplingParams(temp=0.8, top_p=0.95, seed=2)), 512, 40, 4)
        progress = Progress()
        caches = make_prompt_cache(model, max_kv_size=40, keep=4)
        logits = prefilled(model, prompt, caches, progress, 512)
        ids = list(speculative_decode(model, logits, caches, source=source, sampler=sampler,
                                      n_ids=512, history=prompt, max_tokens=60,
                                      progress=progress))
        assert len(ids) == 60 and progress.drafted > 0
        assert caches[0].offset == len(prompt) + progress.fed


# ---- refusing where it cannot be exact ------------------------------------------------------
class StateCache(KVCache):
    """A recurrent state (a colleague's hybrid caches): it cannot take tokens back."""

    def is_trimmable(self) -> bool:
        return False


def test_speculation_refuses_caches_it_cannot_roll_back() -> None:
    model = tiny("llama")
    assert why_not(model, [KVCache(), KVCache()]) is None
    assert "StateCache" in (why_not(model, [KVCache(), StateCache()]) or "")
    assert "one-token window" in (why_not(model, [RotatingKVCache(1, 0)]) or "")


def test_the_turn_falls_back_to_plain_decoding_and_says_why(stories260k: Path) -> None:
    from kvchat.model.runtime.client import EngineClient

    with EngineClient(stories260k) as client:
        plain_done = client.run("Once upon a time", GenParams(max_tokens=20, max_kv_size=1,
                                                              keep=0))
        client.reset()
        done = client.run("Once upon a time", GenParams(max_tokens=20, max_kv_size=1, keep=0,
                                                        speculation="lookup"))
    assert done.ids == plain_done.ids
    assert done.stats.speculation is None
    assert "one-token window" in (done.stats.speculation_note or "")


# ---- the faces -------------------------------------------------------------------------------
def _generate_json(*args: str) -> dict[str, Any]:
    r = processes.run(
        [sys.executable, "-m", "kvchat.app", "generate", "--raw", "--max-tokens", "48",
         "--json", "--prompt", "Once upon a time, there was a little girl. She liked to play."
         " Once upon a time, there was a little", *args],
        capture_output=True, text=True, cwd=REPO_ROOT, env=dict(os.environ), timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)  # type: ignore[no-any-return]


def test_generate_json_carries_drafted_accepted_acceptance(stories260k: Path) -> None:
    base = _generate_json("--model", str(stories260k))
    assert (base["drafted"], base["accepted"], base["acceptance"]) == (0, 0, 0)
    assert base["speculation"] is None
    lookup = _generate_json("--model", str(stories260k), "--prompt-lookup")
    draft = _generate_json("--model", str(stories260k), "--draft-model", str(stories260k),
                           "--draft-tokens", "3")
    for out in (lookup, draft):
        assert out["ids"] == base["ids"]  # greedy: the same reply
        assert 0 <= out["accepted"] <= out["drafted"] and out["drafted"] > 0
        assert out["acceptance"] == pytest.approx(out["accepted"] / out["drafted"])
        assert out["tokens_per_forward"] >= 1.0
    assert lookup["speculation"] == "prompt lookup"
    # the model drafting for itself: every draft kept (how many it drafts is the
    # adaptive length's choice: a draft that costs a whole step rarely pays)
    assert draft["speculation"] == "stories260K" and draft["acceptance"] == 1.0
    assert draft["tokens_per_forward"] > 1.0


def test_the_panel_shows_drafted_accepted_rate_and_tokens_per_pass() -> None:
    from kvchat.app.tui.widgets.stats_panel import speculation_rows

    assert speculation_rows(TurnStats()) == []
    rows = [r.plain for r in speculation_rows(TurnStats(
        speculation="prompt lookup", drafted=40, accepted=30, acceptance=0.75,
        tokens_per_forward=2.5))]
    assert rows[0].split() == ["drafts", "prompt", "lookup"]
    assert "30 / 40" in rows[1] and "75%" in rows[1]
    assert "2.50" in rows[2]
    off = [r.plain for r in speculation_rows(TurnStats(
        speculation_note="speculation off: the StateCache cache cannot take back rejected"
        " tokens"))]
    assert "StateCache" in " ".join(off)


def test_chat_settings_carry_speculation_and_fix_a_draft_without_its_folder() -> None:
    from kvchat.app.core.settings import Settings, SettingsError

    s = Settings(speculation="lookup", draft_tokens=6, lookup_ngram=2)
    p = s.gen_params()
    assert (p.speculation, p.draft_tokens, p.lookup_ngram) == ("lookup", 6, 2)
    loaded = Settings.from_dict({"speculation": "draft", "draft_tokens": 99})
    assert (loaded.speculation, loaded.draft_tokens) == ("off", 4)
    assert len(loaded.warnings) == 2
    with pytest.raises(SettingsError) as e:
        Settings(speculation="draft").validate()
    assert e.value.field == "draft_model"


def test_serve_requests_choose_speculation_within_the_server_default() -> None:
    from kvchat.app.serve.protocol import ApiError, Limits, parse

    body = {"messages": [{"role": "user", "content": "hi"}]}
    plain = Limits(("m",), 256)
    lookup = Limits(("m",), 256, kv={"speculation": "lookup", "draft_tokens": 3})
    drafts = Limits(("m",), 256, kv={"speculation": "draft", "draft_model": "/models/d"})
    assert parse("chat", body, plain).params.speculation == "off"
    assert parse("chat", body, lookup).params.draft_tokens == 3  # the server's default
    asked = parse("chat", {**body, "speculation": "off"}, lookup).params
    assert asked.speculation == "off"
    asked = parse("chat", {**body, "speculation": "lookup", "draft_tokens": 6}, plain).params
    assert (asked.speculation, asked.draft_tokens) == ("lookup", 6)
    assert parse("chat", body, drafts).params.draft_model == "/models/d"
    for bad_body, limits in (({**body, "speculation": "draft"}, plain),
                             ({**body, "speculation": "medusa"}, plain),
                             ({**body, "draft_tokens": 99}, lookup)):
        with pytest.raises(ApiError) as e:
            parse("chat", bad_body, limits)
        assert e.value.status == 400


def test_bench_reports_speculative_beside_plain(stories260k: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    from kvchat.app.main import main

    assert main(["bench", "--model", str(stories260k), "--runs", "2", "--json",
                 "--prompt-tokens", "24", "--gen-tokens", "24", "--draft-model",
                 str(stories260k), "--draft-tokens", "3"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    sp = r["speculative"]
    assert sp["source"] == "stories260K" and sp["same_ids"] is True
    assert sp["ratio_of"] == "speculative ÷ plain"
    assert len(sp["ratio"]["decode_tps"]["runs"]) == 2
    assert sp["accepted"] <= sp["drafted"] and sp["decode_tps"]["median"] > 0
    assert main(["bench", "--model", str(stories260k), "--prompt-lookup", "--draft-model",
                 str(stories260k)]) == 2  # one source at a time
