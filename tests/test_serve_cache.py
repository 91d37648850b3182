"""`kvchat serve`'s prompt cache explains itself (docs/serve.md, Why a request missed): a
real server driven with the official `openai` client, one test per miss reason, each
reproducing it, with the answer's `kvchat.cache`, `cached_tokens` and the log line
agreeing; `/v1/kvchat/stats` listing a client's own conversations; the pool's budget at
start.

References: the first differing token is counted here from the two prompts' ids (the
model's tokenizer, as the server tokenizes); an entry's bytes from the model's config by
docs/design.md's formula (K and V, every layer, kv heads, the window's slots, float32);
the machine's memory from /proc/meminfo.

The server: kvchat-mini with a 96-token rotating window (every cache then holds 96
slots) and a pool of 0.2 MiB, room for one idle conversation, so a third conversation
evicts the first; two API keys; a --models-dir with a copy of the model. Beside it (slow):
a tiny random hybrid (LFM2) whose recurrent states go back only through checkpoints.
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.paths import REPO_ROOT
from tests.helpers.server_process import ServerProcess

openai = pytest.importorskip("openai")
try:  # the HTTP client the openai package depends on (newer releases ship it as httpx2)
    import httpx
except ImportError:
    import httpx2 as httpx

MODEL = REPO_ROOT / "assets" / "kvchat-mini"
KEY_A, KEY_B = "cache-key-a", "cache-key-b"
WINDOW = 96
POOL_MB = 0.2


@pytest.fixture(scope="module")
def other_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("serve-cache-models")
    shutil.copytree(MODEL, d / "other-mini")
    return d


@pytest.fixture(scope="module")
def server(other_models: Path) -> Iterator[ServerProcess]:
    s = ServerProcess(str(MODEL), "--api-key", KEY_A, "--api-key", KEY_B, "--max-kv-size",
                      str(WINDOW), "--cache-pool-mb", str(POOL_MB), "--models-dir",
                      str(other_models), timeout_s=60)
    try:
        yield s
    finally:
        rc = s.stop()
        assert rc == 0, "\n".join(s.lines[-5:])
        assert all("Traceback" not in x for x in s.lines)


def client(server: ServerProcess, key: str = KEY_A) -> Any:
    return openai.OpenAI(base_url=server.url, api_key=key, max_retries=0, timeout=60)


def ask(server: ServerProcess, messages: list[dict[str, str]], user: str,
        model: str = "kvchat-mini", max_tokens: int = 8) -> tuple[Any, str]:
    """The answer, and the request's log line."""
    before = len(server.lines)
    r = client(server).chat.completions.create(model=model, messages=messages, user=user,
                                               max_tokens=max_tokens, temperature=0)
    # the line is written once the answer is out: it may come a moment after it
    deadline = time.monotonic() + 30
    while not (lines := [x for x in server.lines[before:] if "/chat/completions 200" in x]):
        assert time.monotonic() < deadline, "no log line for the request"
        time.sleep(0.01)
    return r, lines[0]


def cache_of(r: Any) -> dict[str, Any]:
    c = r.model_extra["kvchat"]["cache"]
    # the object agrees with the usage beside it
    assert c["reused_tokens"] == r.usage.prompt_tokens_details.cached_tokens
    assert c["reused_tokens"] + c["prefilled_tokens"] == r.usage.prompt_tokens
    return c


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def fresh() -> str:
    return f"u-{uuid.uuid4().hex[:12]}"  # a partition no other test used


def prompt_ids(messages: list[dict[str, str]]) -> list[int]:
    from kvchat.model.text.tokenizer import load_tokenizer

    return load_tokenizer(MODEL).encode_chat(messages)


def shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# ---- one test per reason ----------------------------------------------------------------
def test_a_new_conversation(server: ServerProcess) -> None:
    r, line = ask(server, user("Tell me a story."), fresh())
    c = cache_of(r)
    assert c["miss_reason"] == "new_conversation" and c["reused_tokens"] == 0
    assert c["miss"] == "nothing cached for this client shares the prompt's first token"
    assert "miss=new_conversation" in line


def test_the_prompt_differs_at_token_n(server: ServerProcess) -> None:
    """A regenerated turn with an edited question: reused up to the first differing token."""
    me = fresh()
    cat, dog = user("Tell me a story about a cat."), user("Tell me a story about a dog.")
    ask(server, cat, me)
    r, line = ask(server, dog, me)
    n = shared_prefix(prompt_ids(cat), prompt_ids(dog))
    assert 0 < n < len(prompt_ids(dog))
    c = cache_of(r)
    assert (c["miss_reason"], c["differs_at"], c["reused_tokens"]) == ("prefix_differs", n, n)
    assert f"miss=prefix_differs@{n}" in line and f"reused={n}" in line
    # and a turn that continues the whole cached conversation misses nothing
    more = dog + [{"role": "assistant", "content": r.choices[0].message.content},
                  {"role": "user", "content": "And then?"}]
    r, line = ask(server, more, me)
    c = cache_of(r)
    assert c["miss_reason"] is None and c["reused_tokens"] > n and "miss=" not in line


def test_evicted_for_the_budget(server: ServerProcess) -> None:
    """The pool holds one idle conversation: a's waits there while b runs, then c's turn
    pushes b's in and a's out; a's next turn names the eviction."""
    a, b, c = fresh(), fresh(), fresh()
    first = user("Tell me a story.")
    r, _ = ask(server, first, a)
    ask(server, user("Sing a song."), b)
    ask(server, user("What is a cat?"), c)
    second = first + [{"role": "assistant", "content": r.choices[0].message.content},
                      {"role": "user", "content": "And then?"}]
    r, line = ask(server, second, a)
    got = cache_of(r)
    assert got["miss_reason"] == "evicted" and got["reused_tokens"] == 0
    assert "miss=evicted" in line


def test_the_model_changed(server: ServerProcess) -> None:
    """A request for another --models-dir model loads it (every cache goes); the
    conversation's next turn, on either model, names the change."""
    me = fresh()
    story = user("Tell me a story.")
    ask(server, story, me)
    ask(server, user("Hello there."), fresh(), model="other-mini")  # loads other-mini
    try:
        r, line = ask(server, story, me, model="other-mini")
        c = cache_of(r)
        assert c["miss_reason"] == "model_or_settings_changed" and c["reused_tokens"] == 0
        assert "miss=model_or_settings_changed" in line
    finally:
        ask(server, user("Back."), fresh())  # kvchat-mini again, for the other tests


def test_the_window_rotated_past_the_prefix(server: ServerProcess) -> None:
    """A prompt longer than the 96-token window rotates as it is read; an edit near its
    end is inside what the window dropped and kept, so the cache cannot be cut back."""
    me = fresh()
    cat = user("Once upon a time " * 24 + "there was a cat.")
    dog = user("Once upon a time " * 24 + "there was a dog.")
    assert len(prompt_ids(cat)) > WINDOW
    ask(server, cat, me, max_tokens=4)
    r, line = ask(server, dog, me, max_tokens=4)
    c = cache_of(r)
    assert c["miss_reason"] == "window_rotated" and c["reused_tokens"] == 0
    assert "miss=window_rotated" in line


# ---- what the pool holds ------------------------------------------------------------------
def pool(server: ServerProcess, key: str) -> dict[str, Any]:
    r = httpx.get(server.url + "/kvchat/stats", headers={"Authorization": f"Bearer {key}"},
                  timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["cache"]["prefix_pool"]


def test_the_stats_list_a_clients_own_conversations(server: ServerProcess) -> None:
    me = fresh()
    story = user("Tell me a story.")
    r, _ = ask(server, story, me)
    more = story + [{"role": "assistant", "content": r.choices[0].message.content},
                    {"role": "user", "content": "And then?"}]
    r2, _ = ask(server, more, me)  # continues the first turn's cache: a hit
    mine = pool(server, KEY_A)["conversations"]
    current = mine[0]
    assert current["current"] and current["hits"] == 1
    # what it holds: the prompt and the reply's tokens that ran through the model
    assert current["tokens"] in (r2.usage.total_tokens - 1, r2.usage.total_tokens)
    cfg = json.loads((MODEL / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    slots = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * WINDOW * head_dim * 4
    assert current["bytes"] == slots
    assert 0 <= current["idle_s"] <= current["age_s"] < 120
    assert set(current) == {"tokens", "bytes", "age_s", "idle_s", "hits", "current"}
    # the other key's client sees none of it
    theirs = pool(server, KEY_B)
    assert theirs["conversations"] == [] and "tokens" not in theirs
    client(server, KEY_B).chat.completions.create(
        model="kvchat-mini", messages=user("Hi."), max_tokens=4, temperature=0)
    assert [c["current"] for c in pool(server, KEY_B)["conversations"]] == [True]
    assert all(not c["current"] for c in pool(server, KEY_A)["conversations"])


def test_the_start_shows_the_pools_budget_and_the_stats_route(server: ServerProcess) -> None:
    assert any("prefix pool: up to 204.8 KiB of idle caches (--cache-pool-mb)" in x
               for x in server.lines)
    ready = next(x for x in server.lines if "ready:" in x)
    assert f"{server.url}/kvchat/stats" in ready and "/v1/messages" in ready


def test_the_default_budget_is_an_eighth_of_the_machines_memory() -> None:
    from kvchat.app.serve.command import MIN_POOL_MB, physical_memory, pool_budget, pool_line

    meminfo = Path("/proc/meminfo")
    if not meminfo.exists():
        pytest.skip("no /proc/meminfo to compare with")
    kib = next(int(x.split()[1]) for x in meminfo.read_text().splitlines()
               if x.startswith("MemTotal:"))
    total = physical_memory()
    assert total is not None and abs(total - kib * 1024) <= 0.01 * total
    assert pool_budget(None, 16 * 2**30) == (2 * 2**30, "1/8 of the machine's 16 GiB;"
                                                         " --cache-pool-mb MB")
    assert pool_budget(None, 2**28)[0] == MIN_POOL_MB * 2**20  # a small machine's floor
    assert pool_budget(100, 16 * 2**30) == (100 * 2**20, "--cache-pool-mb")
    assert pool_line(0).startswith("prefix pool off")


# ---- a hybrid model: its recurrent states go back through checkpoints -----------------------
@pytest.fixture(scope="module")
def hybrid_server(tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[tuple[ServerProcess, Path]]:
    """A tiny random LFM2 (short convolutions around an attention layer; its word-level
    tokenizer reads "w3" … "w255") with room for several idle conversations."""
    from tests.helpers.families import build
    from tests.helpers.hybrid_families import HYBRID_SPECS

    folder = build(HYBRID_SPECS["lfm2"], tmp_path_factory.mktemp("serve-hybrid") / "tiny-lfm2")
    s = ServerProcess(str(folder), "--api-key", KEY_A, "--cache-pool-mb", "4", timeout_s=60)
    try:
        yield s, folder
    finally:
        rc = s.stop()
        assert rc == 0, "\n".join(s.lines[-5:])
        assert all("Traceback" not in x for x in s.lines)


def hybrid_ids(folder: Path, messages: list[dict[str, str]]) -> list[int]:
    from kvchat.model.text.tokenizer import load_tokenizer

    return load_tokenizer(folder).encode_chat(messages)


@pytest.mark.slow  # builds a model and starts a second server
def test_a_hybrid_pool_reuses_through_a_checkpoint_and_says_when_none_applies(
        hybrid_server: tuple[ServerProcess, Path]) -> None:
    """A regenerated reply restarts from the checkpoint one token before the prompt's
    end (no miss); an edited last message from an earlier checkpoint (the first turn's),
    and the answer says the state could not go back to the shared prefix; a question
    that differs before every checkpoint reuses nothing: no_checkpoint at that token."""
    (s, folder), me = hybrid_server, fresh()
    name = folder.name
    first = user("w10 w11 w12 w13 w14 w15 w16 w17")
    ask(s, first, me, model=name)
    r, line = ask(s, first, me, model=name)  # regenerate
    c = cache_of(r)
    n1 = len(hybrid_ids(folder, first))
    assert (c["reused_tokens"], c["miss_reason"]) == (n1 - 1, None)
    assert "miss=" not in line
    more = first + [{"role": "assistant", "content": r.choices[0].message.content},
                    {"role": "user", "content": "w30 w31 w32 w33"}]
    ask(s, more, me, model=name)
    edited = more[:-1] + [{"role": "user", "content": "w40 w41 w42 w43"}]
    r, line = ask(s, edited, me, model=name)
    c = cache_of(r)
    keep = shared_prefix(hybrid_ids(folder, more), hybrid_ids(folder, edited))
    assert n1 <= c["reused_tokens"] < keep  # from the first turn's checkpoints
    assert (c["miss_reason"], c["differs_at"]) == ("checkpoint_before", keep)
    assert f"miss=checkpoint_before@{keep}" in line
    other = user("w10 w11 w12 w99 w98")
    r, line = ask(s, other, me, model=name)
    c = cache_of(r)
    n = shared_prefix(hybrid_ids(folder, first), hybrid_ids(folder, other))
    assert 0 < n < n1 - 1
    assert (c["miss_reason"], c["differs_at"], c["reused_tokens"]) == ("no_checkpoint", n, 0)
    assert c["miss"] == f"the recurrent layers' state cannot go back: no checkpoint at or" \
                        f" before token {n}"
