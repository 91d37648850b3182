"""The engine in a child process answers like the in-process engine: same events, same
greedy ids, layer stats, cancel, and a clear error if the child dies."""

from __future__ import annotations

import os
import queue
import sys
import time
from pathlib import Path

import pytest

from kvchat.model.runtime.engine import Engine
from kvchat.model.runtime.engine_process import EngineProcess
from kvchat.model.runtime.events import (
    Done,
    Event,
    GenParams,
    Loaded,
    LoadFailed,
    Started,
    TextDelta,
)
from tests.helpers.native_noise import AT_START, DIE_STATUS, PANIC, noisy_child_env
from tests.helpers.paths import STORIES260K as STORIES


def _turn(engine: Engine | EngineProcess, events: queue.Queue[Event], prompt: str,
          params: GenParams) -> tuple[Done, list[Event]]:
    engine.submit(prompt, params)
    seen: list[Event] = []
    while not isinstance(ev := events.get(timeout=120), Done):
        seen.append(ev)
    return ev, seen


def _loaded(events: queue.Queue[Event]) -> None:
    while not isinstance(events.get(timeout=120), Loaded):
        pass


def test_child_process_engine_matches_in_process(stories260k: Path) -> None:
    params = GenParams(max_tokens=40, ignore_eos=True)
    a_events: queue.Queue[Event] = queue.Queue()
    a = Engine(a_events.put, stories260k)
    _loaded(a_events)
    want, _ = _turn(a, a_events, "Once upon a time", params)
    a.close()

    events: queue.Queue[Event] = queue.Queue()
    child = EngineProcess(events.put, stories260k)
    try:
        _loaded(events)
        assert child.layer_stats() == []
        got, seen = _turn(child, events, "Once upon a time", params)
        assert got.ids == want.ids and got.text == want.text
        assert isinstance(seen[0], Started)
        assert "".join(e.text for e in seen if isinstance(e, TextDelta)) == got.text
        layers = child.layer_stats()
        assert len(layers) == 5 and layers[0]["cache_tokens"] == len(got.prompt_ids) + 39
        # cancel reaches the child's engine: a long turn stops early
        child.submit("Once upon a time", GenParams(max_tokens=5000, ignore_eos=True,
                                                   max_kv_size=128))
        while not isinstance(events.get(timeout=120), TextDelta):
            pass
        child.cancel()
        while not isinstance(ev := events.get(timeout=120), Done):
            pass
        assert ev.finish_reason == "cancelled" and len(ev.ids) < 5000
        assert not child.busy
    finally:
        child.close()
    assert child._proc.poll() == 0


def test_child_death_is_reported(stories260k: Path) -> None:
    events: queue.Queue[Event] = queue.Queue()
    child = EngineProcess(events.put, stories260k)
    _loaded(events)
    child.submit("Once upon a time", GenParams(max_tokens=100000, ignore_eos=True,
                                               max_kv_size=128))
    while not isinstance(events.get(timeout=120), TextDelta):
        pass
    child._proc.kill()
    while not isinstance(ev := events.get(timeout=120), Done) or ev.finish_reason != "error":
        pass
    assert "engine process exited" in (ev.error or "")
    child.close()


def test_kernels_switch_where_the_model_runs(stories260k: Path) -> None:
    """The palette's switch goes to the child: its next turn runs on the new backend (this
    process's own backend is not what decodes), with the same greedy ids."""
    import kvchat.metal_kernels as metal_kernels
    from kvchat.model.runtime.events import KernelsSwitched

    params = GenParams(max_tokens=20, ignore_eos=True)
    events: queue.Queue[Event] = queue.Queue()
    child = EngineProcess(events.put, stories260k)
    try:
        _loaded(events)
        here = metal_kernels.backend()  # fast off Apple silicon, metal on it
        assert here != "ops"
        before, _ = _turn(child, events, "Once upon a time", params)
        assert before.stats.kernels_backend == here  # the child starts on this backend
        child.set_kernels("ops")
        while not isinstance(ev := events.get(timeout=120), KernelsSwitched):
            pass
        assert ev.backend == "ops" and ev.message == "kernels: ops"
        assert metal_kernels.backend() == here  # this process did not switch
        child.reset()
        after, _ = _turn(child, events, "Once upon a time", params)
        assert after.stats.kernels_backend == "ops" and after.ids == before.ids
        child.set_kernels("nope")
        while not isinstance(ev := events.get(timeout=120), KernelsSwitched):
            pass
        assert ev.backend == "ops" and ev.message.startswith("unknown kernels backend 'nope'")
    finally:
        child.close()


def test_child_starts_on_this_process_backend_from_any_folder(
    stories260k: Path, tmp_path: Path, monkeypatch
) -> None:
    """The `kernels` setting is applied in this process (app.main: metal_kernels.configure);
    the child decodes on it. And the child imports from any working directory (the
    installed package, not the checkout's folders)."""
    import kvchat.metal_kernels as metal_kernels

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KVCHAT_KERNELS", raising=False)
    before = metal_kernels.backend()
    metal_kernels.set_backend("ops")  # as configure() does for a settings entry
    events: queue.Queue[Event] = queue.Queue()
    child = EngineProcess(events.put, stories260k)
    try:
        _loaded(events)
        done, _ = _turn(child, events, "Once upon a time", GenParams(max_tokens=4))
        assert done.finish_reason in ("length", "eos") and done.stats.kernels_backend == "ops"
    finally:
        child.close()
        metal_kernels.set_backend(before)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_engine_process_runs_at_the_nice_value_asked_for() -> None:
    """`EngineOptions.nice` (the chat's engine_nice setting): the child and every thread
    of it run at it, OpenBLAS's pool included, which starts as the library loads, before
    any Python code where OpenBLAS is in LD_PRELOAD (as CI runs); this process stays where
    it was."""
    import glob

    from kvchat.app.core.engine_service import EngineOptions, EngineService

    def nice_of(stat: str) -> int:
        return int(Path(stat).read_text().rsplit(")", 1)[1].split()[16])

    before = os.nice(0)
    service = EngineService("process", EngineOptions(nice=5))
    seen: queue.Queue[Event] = queue.Queue()
    engine = service.build(seen.put, str(STORIES))
    try:
        ev = seen.get(timeout=120)
        while not isinstance(ev, (Loaded, LoadFailed)):
            ev = seen.get(timeout=120)
        assert isinstance(ev, Loaded)  # the child's Python has run
        pid = engine._proc.pid  # type: ignore[attr-defined]
        threads = glob.glob(f"/proc/{pid}/task/*/stat")
        assert len(threads) > 1 and {nice_of(t) for t in threads} == {before + 5}
        assert os.nice(0) == before
    finally:
        service.close()


def test_native_stderr_goes_to_the_log_and_a_death_names_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """The child's fd 2 is the log (set by the OS before its interpreter starts): text a
    C library writes there never reaches the parent's stderr, and the one line that
    reports the child's death says where the log is."""
    flag = tmp_path / "die"
    for name, value in noisy_child_env(tmp_path / "site", flag).items():
        monkeypatch.setenv(name, value)
    log = tmp_path / "log" / "engine.log"
    log.parent.mkdir()
    events: queue.Queue[Event] = queue.Queue()
    child = EngineProcess(events.put, None, stderr_log=log)
    try:
        deadline = time.monotonic() + 120
        while AT_START not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        flag.touch()
        ev = events.get(timeout=120)
        assert isinstance(ev, LoadFailed)
        assert ev.message == (f"the engine process exited with status {DIE_STATUS};"
                              f" its messages are in {log}")
    finally:
        child.close()
    text = log.read_text()
    assert AT_START in text and PANIC in text
    out, err = capfd.readouterr()
    assert "NATIVE-NOISE" not in out + err
