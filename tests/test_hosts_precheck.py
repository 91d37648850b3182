"""`kvchat --hosts` checks before it starts any rank: a host without the model
folder, or more hosts than the model has layers, is one line naming the host or the
count, at once (it used to wait 65-100 s for a ring that never formed)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from kvchat.app.core.hosts import HostsError, check_hosts, read_hostfile
from tests.helpers import processes
from tests.helpers.paths import REPO_ROOT

MINI = REPO_ROOT / "assets" / "kvchat-mini"  # 4 layers


def _hostfile(tmp: Path, n: int, models: dict[int, str] | None = None) -> Path:
    hs = [{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]} for _ in range(n)]
    for r, m in (models or {}).items():
        hs[r]["model"] = m
    f = tmp / "hosts.json"
    f.write_text(json.dumps({"hosts": hs}))
    return f


def test_missing_model_folder_on_a_host_is_named(tmp_path: Path) -> None:
    spec = read_hostfile(_hostfile(tmp_path, 3, {2: str(tmp_path / "nowhere")}))
    with pytest.raises(HostsError, match=r"^host 127.0.0.1 \(rank 2\): no model folder at .*"
                                         r"nowhere \(no config.json there\)$"):
        check_hosts(spec, str(MINI))


def test_more_hosts_than_layers_is_refused(tmp_path: Path) -> None:
    spec = read_hostfile(_hostfile(tmp_path, 5))
    with pytest.raises(HostsError, match="lists 5 hosts but kvchat-mini has 4 layers"):
        check_hosts(spec, str(MINI))
    check_hosts(read_hostfile(_hostfile(tmp_path, 4)), str(MINI))  # 4 fit


def test_remote_host_checked_over_ssh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in `ssh` on PATH: exit 1 = no such file there, 255 = ssh itself failed."""
    calls = tmp_path / "calls"
    fake = tmp_path / "bin" / "ssh"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\necho "$@" >> {calls}\ncase "$*" in *gone*) exit 1;;'
                    ' *down*) echo "ssh: connect to host down: No route to host" >&2;'
                    ' exit 255;; esac\nexit 0\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    spec = {"hosts": [{"ssh": "127.0.0.1", "ips": ["a"]}, {"ssh": "mac-b", "ips": ["b"]}]}
    check_hosts(spec, str(MINI))
    assert "BatchMode=yes" in calls.read_text() and "config.json" in calls.read_text()
    spec["hosts"][1]["model"] = "/Volumes/gone/M"
    with pytest.raises(HostsError, match=r"host mac-b \(rank 1\): no model folder at /Volumes"):
        check_hosts(spec, str(MINI))
    spec["hosts"][1] = {"ssh": "down", "ips": ["c"]}
    with pytest.raises(HostsError, match=r"host down \(rank 1\): ssh failed \(ssh: connect"):
        check_hosts(spec, str(MINI))


def test_cli_says_it_in_one_line_before_starting_ranks(tmp_path: Path) -> None:
    t0 = time.monotonic()
    r = processes.run(
        [sys.executable, "-m", "kvchat.app", "--hosts",
         str(_hostfile(tmp_path, 2, {1: str(tmp_path / "nowhere")})), "--model", str(MINI)],
        capture_output=True, text=True, cwd=REPO_ROOT, timeout=60,
        env={**os.environ, "KVCHAT_CONFIG_DIR": str(tmp_path / "c"),
             "KVCHAT_DATA_DIR": str(tmp_path / "d")})
    assert time.monotonic() - t0 < 30  # no ring waited for
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    assert r.stderr.startswith("kvchat: error: host 127.0.0.1 (rank 1): no model folder at")
