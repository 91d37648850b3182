"""tests/helpers/processes.py: a child a test started, and what that child started, end with it."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import processes

# a child that starts a grandchild, prints its pid, and waits for it
PARENT = ["sh", "-c", "sleep 600 & echo $!; wait"]


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def gone_soon(pid: int) -> bool:
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not alive(pid)


pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")


def test_end_all_kills_the_child_and_its_grandchild() -> None:
    p = processes.popen(PARENT, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    grandchild = int(p.stdout.readline())
    assert alive(p.pid) and alive(grandchild)
    assert os.getpgid(grandchild) == p.pid  # its own group, not pytest's
    processes.end_all()  # what the autouse fixture runs when a test ends, failed or not
    assert p.returncode is not None
    assert gone_soon(grandchild)


def test_run_timeout_kills_the_whole_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    with pytest.raises(subprocess.TimeoutExpired):
        processes.run(["sh", "-c", f"sleep 600 & echo $! > {pid_file}; wait"], timeout=1)
    assert gone_soon(int(pid_file.read_text()))


def test_run_is_subprocess_run() -> None:
    r = processes.run(["sh", "-c", "cat; echo err >&2; exit 3"], input="in\n",
                      capture_output=True, text=True, timeout=30)
    assert (r.returncode, r.stdout, r.stderr) == (3, "in\n", "err\n")
    with pytest.raises(subprocess.CalledProcessError):
        processes.run(["false"], check=True, timeout=30)
