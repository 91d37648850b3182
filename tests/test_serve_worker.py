"""app/serve's parts without HTTP: the worker's queue (arrival order, bound, cancel, not
ready while loading) over the real Engine with a scripted model, the request checks, and
the log lines."""

from __future__ import annotations

import asyncio
import io
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvchat.app.serve import protocol
from kvchat.app.serve.log import RequestLog
from kvchat.app.serve.worker import EngineWorker, NotReady, QueueFull
from kvchat.model.runtime.events import Done, GenParams
from tests.helpers.scripted_engine import REPLY, ScriptedEngine

PARAMS = GenParams(max_tokens=200)


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


async def wait_until(cond: Any, timeout: float = 20.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


async def finished(job: Any) -> Done:
    await asyncio.wait_for(job.finished.wait(), 30)
    while not isinstance(ev := job.events.get_nowait(), Done):
        pass
    return ev


def test_queue_runs_in_arrival_order_with_a_bound_and_cancels() -> None:
    engines: list[ScriptedEngine] = []

    def make(on_event: Any) -> ScriptedEngine:
        engines.append(ScriptedEngine(on_event, "/models/scripted", pause_after=3,
                                      load_delay=0.3))
        return engines[-1]

    async def scenario() -> None:
        worker = EngineWorker(make, max_queue=1, notice=lambda m: None)
        await worker.start()
        with pytest.raises(NotReady):  # the model is still loading
            worker.submit(chat("too early"), PARAMS)
        await asyncio.wait_for(worker.ready.wait(), 30)
        engine = engines[0]
        first = worker.submit(chat("first"), PARAMS)
        await wait_until(engine.paused.is_set)  # running, held after 3 pieces
        second = worker.submit(chat("second"), PARAMS)
        with pytest.raises(QueueFull):  # one running, one waiting: the bound
            worker.submit(chat("third"), PARAMS)
        worker.cancel(second)  # a waiting client leaves: never reaches the engine
        assert (await finished(second)).finish_reason == "cancelled"
        third = worker.submit(chat("third"), PARAMS)
        engine.resume()
        assert (await finished(first)).text == REPLY
        assert (await finished(third)).text == REPLY
        assert [p[-1]["content"] for p, _ in engine.submitted] == ["first", "third"]
        # a running job's client leaves: its turn stops at the next step
        engine.pause_after = 2
        fourth = worker.submit(chat("fourth"), PARAMS)
        await wait_until(engine.paused.is_set)
        worker.cancel(fourth)
        done = await finished(fourth)
        assert done.finish_reason == "cancelled" and len(done.ids) <= 3
        assert worker.counters["cancelled"] == 2 and worker.counters["completed"] == 2
        worker.close()

    asyncio.run(scenario())


def test_a_model_that_fails_to_load_leaves_the_old_one_serving() -> None:
    engines: list[ScriptedEngine] = []

    def make(on_event: Any) -> ScriptedEngine:
        engines.append(ScriptedEngine(on_event, "/models/a", fail_paths=["/models/broken"]))
        return engines[-1]

    async def scenario() -> None:
        worker = EngineWorker(make, max_queue=4, notice=lambda m: None)
        await worker.start()
        await asyncio.wait_for(worker.ready.wait(), 30)
        bad = worker.submit(chat("x"), PARAMS, "/models/broken")
        good = worker.submit(chat("y"), PARAMS, "/models/b")
        done = await finished(bad)
        assert done.finish_reason == "error" and "cannot load /models/broken" in (done.error or "")
        assert (await finished(good)).text == REPLY
        assert worker.info["path"] == "/models/b" and worker.is_ready
        assert engines[0].loads == ["/models/a", "/models/broken", "/models/b"]
        assert len(engines) == 1 and worker.counters["engine_restarts"] == 0
        worker.close()

    asyncio.run(scenario())


def test_health_reports_the_engine_as_it_is() -> None:
    """/health: 503 while loading, then ok and idle; busy with the running job's age and
    the queue while a turn runs (a turn that never ends shows as one); 503 "stopped" once
    the engine is gone, although the model had loaded."""
    from kvchat.app.serve.server import health

    engines: list[ScriptedEngine] = []

    def make(on_event: Any) -> ScriptedEngine:
        engines.append(ScriptedEngine(on_event, "/models/scripted", pause_after=2,
                                      load_delay=0.3))
        return engines[-1]

    async def scenario() -> None:
        worker = EngineWorker(make, max_queue=2, notice=lambda m: None)
        await worker.start()
        assert health(worker) == (503, {"status": "loading"})
        await asyncio.wait_for(worker.ready.wait(), 30)
        assert health(worker) == (200, {"status": "ok", "engine": "idle", "running_s": None,
                                        "waiting": 0})
        engine = engines[0]
        first = worker.submit(chat("first"), PARAMS)
        await wait_until(engine.paused.is_set)
        worker.submit(chat("second"), PARAMS)
        await asyncio.sleep(0.3)
        code, body = health(worker)
        assert (code, body["status"], body["engine"], body["waiting"]) == (200, "ok", "busy", 1)
        assert body["running_s"] >= 0.3
        engine.alive = False  # the engine process died (a crash in native code)
        assert health(worker) == (503, {"status": "stopped"})
        engine.alive = True
        engine.resume()
        assert (await finished(first)).text == REPLY
        worker.close()

    asyncio.run(scenario())


LIMITS = protocol.Limits(("m", "/models/m"), capacity=64, max_kv_size=64, keep=4)


def test_parse_maps_the_openai_fields() -> None:
    req = protocol.parse("chat", {
        "model": "/models/m", "stream": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "developer", "content": "Be kind."},
                     {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                                  {"type": "text", "text": "there"}]},
                     {"role": "assistant", "content": None},
                     {"role": "user", "content": "Go"}],
        "max_tokens": 5, "max_completion_tokens": 1000, "temperature": 0.5, "top_p": 0.9,
        "stop": "END", "seed": 3}, LIMITS)
    assert req.prompt == [{"role": "system", "content": "Be kind."},
                          {"role": "user", "content": "Hi there"},
                          {"role": "assistant", "content": ""},
                          {"role": "user", "content": "Go"}]
    p = req.params
    # max_completion_tokens wins over max_tokens, then the cache bound caps it
    assert (p.max_tokens, p.temp, p.top_p, p.stop, p.seed) == (64, 0.5, 0.9, ("END",), 3)
    assert (p.max_kv_size, p.keep) == (64, 4)
    assert req.stream and req.include_usage and req.model == "m"
    text = protocol.parse("text", {"prompt": ["Once"]}, LIMITS)
    assert text.prompt == "Once" and text.params.temp == GenParams().temp


def test_finish_reasons_and_usage() -> None:
    req = protocol.parse("chat", {"messages": chat("hi")}, LIMITS)
    done = Done("eos", "Hello", [5, 6, 2], [1, 7, 8, 9])
    done.stats.cached_tokens = 3
    out = protocol.completion(req, done)
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7,
                            "prompt_tokens_details": {"cached_tokens": 3}}
    assert out["kvchat"]["prefilled_tokens"] == 1 and out["kvchat"]["cached_tokens"] == 3
    for engine_reason, openai_reason in (("length", "length"), ("context_full", "length"),
                                         ("stop", "stop")):
        d = Done(engine_reason, "", [], [])
        assert protocol.chunk(req, done=d)["choices"][0]["finish_reason"] == openai_reason


def test_log_lines_keep_request_text_inert() -> None:
    out = io.StringIO()
    RequestLog(False, out).write(client="1.2.3.4:5", method="POST", path="/v1/x\x1b]52;c;",
                                 status=404, error="model 'a\nb\x07'")
    line = out.getvalue()
    assert line.count("\n") == 1 and "\x1b" not in line and "\x07" not in line
    assert "/v1/x␛]52;c;" in line and "model 'a␤b␇'" in line
    out = io.StringIO()
    RequestLog(True, out).write(client="c", method="POST", path="/p", status=200,
                                prompt_tokens=4, finish_reason="eos")
    rec = json.loads(out.getvalue())
    assert rec["status"] == 200 and rec["prompt_tokens"] == 4 and rec["time"].endswith("Z")


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=12)
FIELDS = st.sampled_from(["model", "messages", "prompt", "max_tokens", "max_completion_tokens",
                          "temperature", "top_p", "stop", "seed", "stream", "stream_options",
                          "n", "logprobs", "top_k", "min_p", "repetition_penalty",
                          "ignore_eos", "echo"])
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "tool", 3]),
                                 "content": JSON})


@settings(max_examples=150, deadline=None)
@given(kind=st.sampled_from(["chat", "text"]),
       body=st.dictionaries(FIELDS, JSON | st.lists(MESSAGE, max_size=3), max_size=6) | JSON)
def test_any_json_body_is_a_request_or_a_4xx(kind: str, body: Any) -> None:
    """Whatever a client sends, parse() answers with a checked request or an ApiError
    with a 4xx status, never another exception (which would be a 500)."""
    try:
        req = protocol.parse(kind, body, LIMITS)
    except protocol.ApiError as e:
        assert 400 <= e.status < 500 and e.message
        return
    assert 1 <= req.params.max_tokens <= LIMITS.capacity
    req.params.validate()


def test_uvicorn_warnings_are_log_lines_too() -> None:
    import logging

    from kvchat.app.serve.log import route_uvicorn_logs

    out = io.StringIO()
    route_uvicorn_logs(RequestLog(True, out))
    logging.getLogger("uvicorn.error").warning("Invalid HTTP request received.")
    logging.getLogger("uvicorn.error").info("not shown")
    rec = json.loads(out.getvalue())
    assert rec["event"] == "warning: Invalid HTTP request received."


def _doc_table(section: str) -> dict[str, str]:
    """Field -> status from the table under `section` of docs/serve.md."""
    import re

    from tests.helpers.paths import REPO_ROOT

    text = (REPO_ROOT / "docs" / "serve.md").read_text()
    body = text.split(section, 1)[1].split("\n## ", 1)[0]
    rows: dict[str, str] = {}
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[1] in ("honoured", "refused", "advisory"):
            for name in re.findall(r"`([a-z_]+)`", cells[0]):
                rows[name] = cells[1]
    return rows


def test_the_docs_fields_tables_are_the_codes() -> None:
    """docs/serve.md, Fields: every field of app/serve/fields.py's tables, with its status."""
    from kvchat.app.serve import fields

    openai_fields = {**fields.TEXT, **fields.CHAT}
    assert _doc_table("### OpenAI's routes") == {k: f.status for k, f in openai_fields.items()}
    assert _doc_table("## Anthropic's Messages API") == {
        k: f.status for k, f in fields.MESSAGES.items()}


def test_refused_fields_accept_only_what_asks_for_nothing() -> None:
    from kvchat.app.serve import fields

    body = {"messages": chat("hi")}
    for extra in ({"n": 1}, {"tools": []}, {"tool_choice": "none"}, {"logprobs": False},
                  {"response_format": {"type": "text"}}, {"frequency_penalty": 0.0},
                  {"store": True}, {"web_search_options": None}):
        protocol.parse("chat", {**body, **extra}, LIMITS)
    for extra in ({"n": True}, {"n": 1.0}, {"logprobs": 0}, {"web_search_options": {}},
                  {"tool_choice": "required"}, {"functions": [{"name": "f"}]},
                  {"response_format": {"type": "json_schema", "json_schema": {
                      "name": "x", "schema": {"type": "array", "uniqueItems": True}}}}):
        name = next(iter(extra))
        with pytest.raises(protocol.ApiError) as e:
            protocol.parse("chat", {**body, **extra}, LIMITS)
        assert e.value.param == name and e.value.status == 400
    assert fields.CHAT["n"].status == fields.REFUSED
