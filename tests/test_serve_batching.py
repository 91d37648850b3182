"""`kvchat serve` decodes concurrent requests in one batched step (docs/serve.md, Many
clients): a real server driven with the official `openai` client.

The reference for each request is the same request alone (one at a time, on the same
server: a lone row runs the compiled step, exactly as a turn without batching). Run side
by side, 5 streams of different prompt lengths and `max_tokens` must give the same text
and token count, greedy, on a float cache, a rotating window they run past, and 4- and
8-bit K/V; and the server must have run several at once (its stats, polled), so the
comparison is of batched decoding and not of a queue. A stream whose
client disconnects leaves the others' answers as they are alone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers.paths import REPO_ROOT
from tests.helpers.server_process import ServerProcess, side_by_side

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


def ask(server: ServerProcess, i: int) -> dict[str, Any]:
    """Request i as a stream: its text and token count."""
    c = client(server)
    stream = c.chat.completions.create(
        model="kvchat-mini", messages=[{"role": "user", "content": PROMPTS[i]}],
        max_tokens=MAX_TOKENS[i], temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    parts: list[str] = []
    usage = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None
    return {"text": "".join(parts), "tokens": usage.completion_tokens}


def together(server: ServerProcess, which: list[int]) -> tuple[dict[int, dict[str, Any]], int]:
    """The requests `which` sent at once, each its own stream; and the most requests the
    server said it ran at once meanwhile."""
    results, most = side_by_side(server.url, [lambda i=i: ask(server, i) for i in which])
    return dict(zip(which, results, strict=True)), most


@pytest.mark.slow
def test_concurrent_streams_answer_as_they_do_alone(server: ServerProcess) -> None:
    alone = {i: ask(server, i) for i in range(len(PROMPTS))}
    assert [alone[i]["tokens"] for i in alone] == MAX_TOKENS  # ignore_eos: every token
    both, running = together(server, list(range(len(PROMPTS))))
    for i, a in alone.items():
        assert both[i]["text"] == a["text"], i
        assert both[i]["tokens"] == a["tokens"]
    # they ran together: the server ran several at once (`--max-batch 1`: never more than
    # one); read from the server, as a loaded machine may start a client late
    assert running >= 2


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
    others, _ = together(server, [0, 2, 4])
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
