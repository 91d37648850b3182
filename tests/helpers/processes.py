"""Processes that tests start end with the test that started them.

Each child runs in its own session, so it leads its own process group, and the whole group
(the child and whatever it started: an engine process, MLX ranks) is killed when the test
ends, passed or failed (conftest's autouse `_end_started_processes`), or at once when `run`
times out or is interrupted. Without this a failing test left `generate --max-tokens
1000000` children running, and every later test slowed down.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Sequence
from typing import Any

_started: list[subprocess.Popen[Any]] = []


def popen(argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
    """subprocess.Popen in a new session; the group is killed when the test ends."""
    proc = subprocess.Popen(list(argv), start_new_session=True, **kwargs)
    _started.append(proc)
    return proc


def run(argv: Sequence[str], *, input: Any = None, timeout: float | None = None,
        capture_output: bool = False, check: bool = False,
        **kwargs: Any) -> subprocess.CompletedProcess[Any]:
    """subprocess.run, except that a timeout or an interrupt kills the whole process group
    (subprocess.run kills only the child, and a grandchild keeps running)."""
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    proc = popen(argv, **kwargs)
    try:
        out, err = proc.communicate(input, timeout=timeout)
    finally:
        kill_group(proc)  # also ends anything the child left behind when it exited
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


def kill_group(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL the process group `proc` leads, then reap `proc` and close its pipes."""
    kill_process_group(proc.pid)
    if proc.poll() is None:
        proc.wait()
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()
    if proc in _started:
        _started.remove(proc)


def kill_process_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group has ended already
        pass


def end_all() -> None:
    """Kill every group started since the last call (the test's teardown)."""
    while _started:
        kill_group(_started[-1])
