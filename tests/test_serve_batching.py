"""`kvchat serve` decodes concurrent requests in one batched step (docs/serve.md, Many
clients): a real server driven with the official `openai` client.

The reference for each request is the same request alone (one at a time, on the same
server: a lone row runs the compiled step, exactly as a turn without batching). Run side
by side, 5 streams of different prompt lengths and `max_tokens` must give the same text
and token count, greedy, on a float cache, a rotating window they run past, and 4- and
8-bit K/V; and they must overlap in time (each stream decodes while all but one of the others
do), so the comparison is of batched decoding and not of a queue. A stream whose
client disconnects leaves the others' answers as they are alone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers.paths import REPO_ROOT
from tests.helpers.server_process import ServerProcess

openai = pytest.importorskip("openai")

MODEL = REPO_ROOT / "assets" / "kvchat-mini"
WINDOW = 64  # the rotating server's window: prompt + reply run past it

PROMPTS = [
    "Hi",
    "Tell me a story about a dog and a cat.",
    "Once upon a time there was a little girl who lived in a village near the forest."
    " Every day she walked to the river to look at the fish.",
    "Why?",
    "The sun was warm and the birds were singing in the tall trees by the old house.",
]
MAX_TOKENS = [40, 48, 64, 56, 60]

CACHES = {
    "float": (),
    "rotating": ("--max-kv-size", str(WINDOW), "--keep", "4"),
    "kv4": ("--kv-bits", "4", "--kv-group-size", "32"),
    "kv8": ("--kv-bits", "8", "--kv-group-size", "64"),
}


@pytest.fixture(scope="module", params=list(CACHES))
def server(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    s = ServerProcess(str(MODEL), "--max-batch", "8", *CACHES[request.param], timeout_s=90)
    s.name = request.param
    try:
        yield s
    finally:
        assert s.stop() == 0, "\n".join(s.lines[-5:])


def client(server: ServerProcess) -> Any:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def ask(server: ServerProcess, i: int, start: threading.Barrier | None = None
        ) -> dict[str, Any]:
    """Request i as a stream: its text, token count, and when its first and last chunks
    came (`start`: sent when every client is ready)."""
    c = client(server)
    if start is not None:
        start.wait(60)
    stream = c.chat.completions.create(
        model="kvchat-mini", messages=[{"role": "user", "content": PROMPTS[i]}],
        max_tokens=MAX_TOKENS[i], temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    parts: list[str] = []
    first = usage = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.monotonic()
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None
    return {"text": "".join(parts), "tokens": usage.completion_tokens, "first": first,
            "end": time.monotonic()}


def together(server: ServerProcess, which: list[int]) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(which))

    def run(i: int) -> None:
        try:
            out[i] = ask(server, i, start)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in which]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    return out


@pytest.mark.slow
def test_concurrent_streams_answer_as_they_do_alone(server: ServerProcess) -> None:
    alone = {i: ask(server, i) for i in range(len(PROMPTS))}
    assert [alone[i]["tokens"] for i in alone] == MAX_TOKENS  # ignore_eos: every token
    side_by_side = together(server, list(range(len(PROMPTS))))
    for i, a in alone.items():
        assert side_by_side[i]["text"] == a["text"], i
        assert side_by_side[i]["tokens"] == a["tokens"]
    # they ran together: each stream decoded while all but at most one of the others did
    # (run one at a time, no two would overlap; the last to arrive may start a few
    # tokens after the shortest ends, now that a batched step is fast)
    for i, r in side_by_side.items():
        overlapping = [j for j, o in side_by_side.items()
                       if j != i and o["first"] < r["end"] and r["first"] < o["end"]]
        assert len(overlapping) >= len(side_by_side) - 2, (i, overlapping)


@pytest.mark.slow
def test_a_disconnected_stream_leaves_the_others_as_they_are(server: ServerProcess) -> None:
    alone = {i: ask(server, i) for i in (0, 2, 4)}
    left = threading.Event()

    def leave() -> None:  # reads three chunks, then closes its connection
        stream = client(server).chat.completions.create(
            model="kvchat-mini", messages=[{"role": "user", "content": PROMPTS[1]}],
            max_tokens=400, temperature=0, stream=True, extra_body={"ignore_eos": True})
        for n, _ in enumerate(stream):
            if n == 3:
                break
        stream.close()
        left.set()

    leaver = threading.Thread(target=leave)
    leaver.start()
    others = together(server, [0, 2, 4])
    leaver.join(60)
    assert left.is_set()
    for i, a in alone.items():
        assert others[i]["text"] == a["text"], i
    if server.name == "rotating":
        return  # max_tokens is capped by the window: its 64 tokens may be done already
    # the server saw it leave: its turn was cancelled, not run to its 400 tokens
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if any("cancelled" in line for line in server.lines):
            break
        time.sleep(0.1)
    assert any("cancelled" in line for line in server.lines)
