"""The engine service (app/core/engine_service.py): which engine it builds for which face,
that a new engine replaces the old one only once it exists, that a failed model swap keeps
the old model, that closing ends the child process and the ranks, and its policies: the
engine's child ignores SIGINT (the face alone acts on Ctrl+C) and no priority changes."""

from __future__ import annotations

import os
import queue
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from kvchat.app.core import hosts
from kvchat.app.core.engine_service import EngineOptions, EngineService
from kvchat.app.core.hosts import HostsError
from kvchat.model.runtime import engine as engine_mod
from kvchat.model.runtime.engine_process import EngineProcess
from kvchat.model.runtime.events import Done, Event, Explained, GenParams, Loaded, LoadFailed
from tests.helpers.server_process import ServerProcess

PIPELINE_ENV = ("MLX_RANK", "MLX_HOSTFILE", "MLX_JACCL_COORDINATOR", "MLX_IBV_DEVICES",
                "OMPI_COMM_WORLD_SIZE")
WAIT_S = 120  # a loaded machine: generous, and only ever reached on a failure


def _next(events: queue.Queue[Event], kind: type, failed: type = LoadFailed) -> Any:
    """The next event of `kind`; a `failed` one (a child that died says LoadFailed) is an
    assertion error at once."""
    while not isinstance(ev := events.get(timeout=WAIT_S), kind | failed):
        pass
    assert isinstance(ev, kind), ev
    return ev


def _sigint_ignored(pid: int) -> bool:
    """SigIgn of /proc/PID/status: a hex mask whose bit n-1 stands for signal n."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGINT - 1) & 1)
    raise AssertionError("no SigIgn line")


@pytest.fixture
def not_launched(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in PIPELINE_ENV:
        monkeypatch.delenv(name, raising=False)


def test_the_kind_is_the_faces_except_a_pipeline_keeps_the_engine_here(
        monkeypatch: pytest.MonkeyPatch, not_launched: None) -> None:
    assert EngineService().kind == "process"  # the chat, serve
    assert EngineService("thread").kind == "thread"  # generate, bench
    # rank 0 of a pipeline (kvchat --hosts, or under mlx.launch): its link lives here
    monkeypatch.setenv("MLX_RANK", "0")
    monkeypatch.setenv("MLX_HOSTFILE", "/nowhere/ring.json")
    assert EngineService("process").kind == "thread"


def test_thread_kind_engine_has_the_options_and_the_views(
        stories260k: Path, not_launched: None) -> None:
    events: queue.Queue[Event] = queue.Queue()
    with EngineService("thread", EngineOptions(tokenizer="sentencepiece", compiled=False)) \
            as service:
        engine = service.build(events.put, str(stories260k))
        assert isinstance(engine, engine_mod.Engine) and service.engine is engine
        loaded = _next(events, Loaded)
        assert loaded.info["tokenizer"] == "sentencepiece"  # stories260K also has .json
        engine.submit("Once upon a time", GenParams(max_tokens=4))
        assert _next(events, Done).stats.compiled_step is False
        engine.explain()  # an engine built without the views explains nothing
        assert _next(events, Explained).data["model"]["layers"] == 5


def test_a_new_engine_replaces_the_old_only_once_it_exists(
        monkeypatch: pytest.MonkeyPatch, not_launched: None) -> None:
    service = EngineService("thread")
    first = service.build(lambda ev: None)  # no model: an idle engine thread
    assert isinstance(first, engine_mod.Engine)

    def cannot_start(*args: Any, **kwargs: Any) -> Any:
        raise OSError("cannot start a thread")

    with monkeypatch.context() as m:
        m.setattr(engine_mod, "Engine", cannot_start)
        with pytest.raises(OSError):
            service.build(lambda ev: None)
    assert service.engine is first and first._thread.is_alive()  # the old one stays
    second = service.build(lambda ev: None)
    assert service.engine is second and not first._thread.is_alive()
    service.close()
    assert service.engine is None and not second._thread.is_alive()


def test_a_failed_model_swap_keeps_the_old_model(
        stories260k: Path, tmp_path: Path, not_launched: None) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{")
    params = GenParams(max_tokens=12)  # greedy
    with EngineService("thread") as service:
        client = service.client(stories260k, timeout=WAIT_S)
        before = client.run("Once upon a time", params)
        client.engine.load(broken)
        assert client.wait(LoadFailed).path == str(broken)  # type: ignore[attr-defined]
        after = client.run("Once upon a time", params)
        assert after.finish_reason == before.finish_reason != "error"
        assert after.ids == before.ids and after.text == before.text


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/PID/status")
def test_the_child_ignores_sigint_and_close_ends_it(stories260k: Path,
                                                     not_launched: None) -> None:
    """Ctrl+C at a terminal reaches the engine's child too: it must neither die of it nor
    of one that lands while it starts; the face keeps taking SIGINT; nobody's priority
    changes; closing the service ends the child cleanly."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    nice, policy = os.getpriority(os.PRIO_PROCESS, 0), os.sched_getscheduler(0)
    events: queue.Queue[Event] = queue.Queue()
    service = EngineService("process", EngineOptions(tokenizer="sentencepiece"))
    engine = service.build(events.put)
    assert isinstance(engine, EngineProcess)
    pid = engine._proc.pid
    try:
        os.kill(pid, signal.SIGINT)  # while the child starts
        assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == mask  # ours is unchanged
        engine.load(str(stories260k))
        assert _next(events, Loaded).info["tokenizer"] == "sentencepiece"
        assert _sigint_ignored(pid) and not _sigint_ignored(os.getpid())
        os.kill(pid, signal.SIGINT)
        engine.submit("Once upon a time", GenParams(max_tokens=4))
        assert _next(events, Done).finish_reason != "error"
        engine.explain()  # the views reached the child (pickled by name)
        assert _next(events, Explained).data["model"]["layers"] == 5
        assert engine.alive
        assert os.getpriority(os.PRIO_PROCESS, 0) == nice == os.getpriority(os.PRIO_PROCESS, pid)
        assert os.sched_getscheduler(0) == policy == os.sched_getscheduler(pid)
    finally:
        service.close()
    assert engine._proc.poll() == 0  # it ended by itself, at close, not by a signal
    assert service.engine is None


def test_split_across_stops_the_ranks_it_started(monkeypatch: pytest.MonkeyPatch) -> None:
    stopped: list[list[Any]] = []
    monkeypatch.setattr(hosts, "start_ranks", lambda hostfile, model, log_dir: ["rank 1"])
    monkeypatch.setattr(hosts, "join_if_launched", lambda model: None)
    monkeypatch.setattr(hosts, "stop_ranks", lambda procs: stopped.append(list(procs)))
    service = EngineService()
    service.split_across("hosts.json", "/models/m")
    assert service.ranks == ["rank 1"] and stopped == []
    service.close()
    service.close()
    assert stopped == [["rank 1"]]  # once

    def no_ring(model: str) -> None:
        raise HostsError("the ring did not form")

    monkeypatch.setattr(hosts, "join_if_launched", no_ring)
    with pytest.raises(HostsError):
        service.split_across("hosts.json", "/models/m")
    assert stopped == [["rank 1"], ["rank 1"]] and service.ranks == []  # none left running


@pytest.mark.skipif(sys.platform == "win32", reason="process groups")
def test_ctrl_c_stops_serve_and_only_serve_acts_on_it(stories260k: Path) -> None:
    """SIGINT to the whole group, as a terminal sends Ctrl+C: the server exits 130 and
    closes its engine; the engine's child prints nothing (no KeyboardInterrupt)."""
    server = ServerProcess(str(stories260k))
    try:
        os.killpg(server.proc.pid, signal.SIGINT)
        server.proc.wait(60)
    finally:
        rc = server.stop()
    assert rc == 130, "\n".join(server.lines[-10:])
    assert not any("Traceback" in x or "KeyboardInterrupt" in x for x in server.lines)
