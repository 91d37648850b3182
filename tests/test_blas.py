"""BLAS detection: what `active_blas` reports is the library that really serves
`cblas_sgemm`, and the pip-only route (cmeel-openblas + the mlx wheel's libgfortran)
loads on a machine without a system OpenBLAS or libgfortran."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from kvchat.app.core import blas
from tests.helpers import processes

REPO = Path(__file__).resolve().parents[1]
PROBE = ("import json, mlx.core as mx; from kvchat.app.core.blas import active_blas;"
         " mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64))); print(json.dumps(active_blas()))")


def _probe(env: dict[str, str]) -> dict:
    out = processes.run([sys.executable, "-c", PROBE], env=env, cwd=REPO,
                        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "LD_LIBRARY_PATH")}
    env["PYTHONPATH"] = str(REPO)
    return {**env, **extra}


@pytest.mark.skipif(sys.platform != "linux", reason="the reference-BLAS wheel is Linux's")
def test_reference_blas_is_reported_slow_with_a_hint() -> None:
    got = _probe(_env())
    assert got["name"] == "reference BLAS" and got["fast"] is False
    assert "mlx_cpu.libs" in got["path"]


@pytest.mark.skipif(blas._pip_openblas() is None, reason="cmeel-openblas not installed")
def test_pip_openblas_route_without_system_libraries(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(blas, "_system_openblas", lambda: [])
    monkeypatch.setattr(blas.ctypes.util, "find_library", lambda name: None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    found = blas.find_fast_blas()
    if found is None:  # only when the wheel's single-target build cannot run on this CPU
        shim = blas._gfortran_shim()
        probe = blas.probe_openblas(blas._pip_openblas(), shim)
        assert probe is not None and not blas.runs_here(probe)
        pytest.skip(f"cmeel's OpenBLAS is built for {probe['core']}, which this CPU lacks")
    lib, shim = found
    assert "cmeel.prefix" in str(lib)
    assert shim is not None and (shim / "libgfortran.so.5").exists()
    got = _probe(_env(LD_PRELOAD=str(lib), LD_LIBRARY_PATH=str(shim)))
    probe = blas.probe_openblas(lib, shim)
    assert probe is not None
    assert got == {"name": "OpenBLAS", "path": str(lib), "fast": True, "core": probe["core"],
                   "gemv_forward": False}


def test_version_names_mlx_device_and_blas(capsys) -> None:
    from kvchat.app.main import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("kvchat ") and "mlx " in out
    assert f"BLAS: {blas.active_blas()['name']}" in out
