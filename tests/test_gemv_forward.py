"""The one-row forwarding (app/core/gemv_forward.c) and OpenBLAS's kernel choice.

The forwarding replaces `cblas_sgemm` in the process, so each check runs in a child with
it preloaded ahead of the BLAS, exactly as `kvchat` starts (`blas.fast_blas_env`), and
compares against numpy in float64."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvchat.app.core import blas
from tests.helpers import processes

REPO = Path(__file__).resolve().parents[1]
AVX512 = blas.CORE_NEEDS["skylakex"]

# every row-major layout a one-row product can come in: (M, N, K, trans_a, trans_b),
# leading dimensions padded past the minimum, C prefilled with NaN where beta == 0
_DIRECT = r"""
import ctypes, json, sys
import numpy as np
proc = ctypes.CDLL(None)
f, p = ctypes.c_float, ctypes.c_void_p
rng = np.random.default_rng(0)
calls = ctypes.c_long.in_dll(proc, "kvchat_gemv_calls")
worst, n_cases = 0.0, 0
for M, N, K in ((1, 37, 19), (1, 300, 64), (23, 1, 41), (1, 1, 8)):
    for ta in (111, 112):
        for tb in (111, 112):
            for alpha, beta in ((1.0, 0.0), (2.0, 0.0), (0.5, 1.0)):
                pad = 3
                a = rng.standard_normal((M, K) if ta == 111 else (K, M))
                b = rng.standard_normal((K, N) if tb == 111 else (N, K))
                A = np.zeros((a.shape[0], a.shape[1] + pad), np.float32); A[:, :a.shape[1]] = a
                B = np.zeros((b.shape[0], b.shape[1] + pad), np.float32); B[:, :b.shape[1]] = b
                C0 = rng.standard_normal((M, N + pad)).astype(np.float32)
                C = C0.copy()
                if beta == 0.0:
                    C[:, :N] = np.nan
                proc.cblas_sgemm(101, ta, tb, M, N, K, f(alpha), A.ctypes.data_as(p),
                                 A.shape[1], B.ctypes.data_as(p), B.shape[1], f(beta),
                                 C.ctypes.data_as(p), C.shape[1])
                opa = A[:, :a.shape[1]].astype(np.float64)
                opb = B[:, :b.shape[1]].astype(np.float64)
                opa = opa if ta == 111 else opa.T
                opb = opb if tb == 111 else opb.T
                ref = alpha * opa @ opb + beta * C0[:, :N].astype(np.float64)
                worst = max(worst, float(np.abs(C[:, :N] - ref).max()))
                assert np.array_equal(C[:, N:], C0[:, N:]), "wrote past the row"
                n_cases += 1
print(json.dumps({"worst": worst, "cases": n_cases, "forwarded": calls.value}))
"""

# MLX's own matmuls, the shapes a decode step makes, with the forwarding on and off
_MLX = r"""
import ctypes, json
import numpy as np
import mlx.core as mx
proc = ctypes.CDLL(None)
on = ctypes.c_int.in_dll(proc, "kvchat_gemv_forward")
calls = ctypes.c_long.in_dll(proc, "kvchat_gemv_calls")
rng = np.random.default_rng(1)
w = rng.standard_normal((3072, 192)).astype(np.float32)
x = rng.standard_normal((1, 192)).astype(np.float32)
big = rng.standard_normal((5, 192)).astype(np.float32)
cases = {"x @ w.T": lambda: mx.array(x) @ mx.array(w).T,
         "w @ x.T": lambda: mx.array(w) @ mx.array(x).T,
         "x @ w[:, :96].T (strided)": lambda: mx.array(x[:, :96]) @ mx.array(w)[:, :96].T,
         "batched rows": lambda: mx.array(x)[None] @ mx.array(w).T[None],
         "five rows (GEMM)": lambda: mx.array(big) @ mx.array(w).T}
refs = {"x @ w.T": x.astype(np.float64) @ w.T, "w @ x.T": w.astype(np.float64) @ x.T,
        "x @ w[:, :96].T (strided)": x[:, :96].astype(np.float64) @ w[:, :96].T,
        "batched rows": (x.astype(np.float64) @ w.T)[None],
        "five rows (GEMM)": big.astype(np.float64) @ w.T}
out = {}
for name, fn in cases.items():
    row = {}
    for flag in (1, 0):
        on.value = flag
        before = calls.value
        got = np.array(fn())
        row[str(flag)] = {"err": float(np.abs(got - refs[name]).max()),
                          "forwarded": calls.value - before}
    out[name] = row
print(json.dumps(out))
"""


def _child(code: str, env: dict[str, str]) -> dict:
    out = processes.run([sys.executable, "-c", code], env=env, cwd=REPO,
                        capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture
def kvchat_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, str]:
    """The environment `kvchat` re-executes itself in, built from scratch in a fresh
    cache (the forwarding compiled there)."""
    if sys.platform != "linux":
        pytest.skip("the forwarding is for Linux's OpenBLAS")
    for k in ("LD_PRELOAD", "LD_LIBRARY_PATH", "KVCHAT_BLAS_PRELOADED", "KVCHAT_GEMV",
              "OPENBLAS_CORETYPE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    env = blas.fast_blas_env()
    if env is None:
        pytest.skip("no OpenBLAS on this machine")
    lib = blas.gemv_forward_lib()
    if lib is None:
        pytest.skip("no C compiler to build the forwarding")
    assert env["LD_PRELOAD"].split()[0] == str(lib)
    return {**env, "PYTHONPATH": str(REPO)}


def test_every_layout_matches_numpy(kvchat_env: dict[str, str]) -> None:
    r = _child(_DIRECT, kvchat_env)
    assert r["cases"] == 48
    assert r["forwarded"] == 48  # each of them went to GEMV
    assert r["worst"] < 1e-4  # float32 sums of at most 64 products of N(0,1) values


def test_mlx_matmuls_forwarded_only_for_one_row(kvchat_env: dict[str, str]) -> None:
    r = _child(_MLX, kvchat_env)
    for name, row in r.items():
        assert row["1"]["err"] < 1e-3 and row["0"]["err"] < 1e-3, (name, row)
        assert row["0"]["forwarded"] == 0, name  # switched off: plain GEMM
    for name in ("x @ w.T", "w @ x.T", "x @ w[:, :96].T (strided)", "batched rows"):
        assert r[name]["1"]["forwarded"] >= 1, name
    assert r["five rows (GEMM)"]["1"]["forwarded"] == 0


def test_version_reports_the_forwarding_and_kernels(kvchat_env: dict[str, str]) -> None:
    out = processes.run([sys.executable, "-m", "kvchat.app", "--version"], env=kvchat_env,
                        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("BLAS: "))
    assert line.endswith("one-row products as GEMV"), line
    core = line.split(", ")[1]
    assert core.endswith(" kernels"), line
    found = blas.find_fast_blas()
    assert found is not None
    probe = blas.probe_openblas(*found)
    assert probe is not None
    override = blas.core_override(probe)
    # the library's own choice, or the better set named for it when that was the fallback
    assert core.split()[0].lower() == (override or probe["core"]).lower()


def test_switched_off_or_unbuildable_leaves_plain_gemm(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("KVCHAT_GEMV", "0")
    assert blas.gemv_forward_lib() is None
    monkeypatch.delenv("KVCHAT_GEMV")
    monkeypatch.setenv("CC", "false")  # a compiler that always fails
    assert blas.gemv_forward_lib() is None
    assert not list(tmp_path.rglob("*.so")) and not list(tmp_path.rglob("*.tmp"))


def _fake_probe(config: str, core: str):
    return lambda lib, lib_dir=None: {"config": config, "core": core}


def test_generic_fallback_gets_the_best_kernels_the_flags_allow(monkeypatch) -> None:
    dynamic = {"config": "OpenBLAS 0.3.21 NO_LAPACKE DYNAMIC_ARCH NO_AFFINITY Prescott",
               "core": "Prescott"}
    for flags, want in ((AVX512 | {"avx2", "fma", "avx"}, "SkylakeX"),
                        (frozenset({"avx2", "fma", "avx"}), "Haswell"),
                        (frozenset({"avx"}), "SandyBridge"), (frozenset({"sse3"}), None)):
        monkeypatch.setattr(blas, "cpu_flags", lambda flags=flags: flags)
        assert blas.core_override(dynamic) == want, flags
    # a library that knew the CPU, or one built for a single target, is left alone
    monkeypatch.setattr(blas, "cpu_flags", lambda: AVX512)
    assert blas.core_override({**dynamic, "core": "Haswell"}) is None
    assert blas.core_override({"config": "OpenBLAS 0.3.31 SKYLAKEX", "core": "Prescott"}) is None


def test_a_build_this_cpu_cannot_run_is_skipped(monkeypatch, tmp_path) -> None:
    """cmeel's wheel is an AVX-512-only build: on an AVX2 machine it would die with
    SIGILL at the first matmul, so the search passes it over."""
    lib = tmp_path / "libopenblas.so.0"
    lib.write_bytes(b"")
    monkeypatch.delenv("KVCHAT_BLAS", raising=False)
    monkeypatch.setattr(blas, "_system_openblas", lambda: [])
    monkeypatch.setattr(blas, "_pip_openblas", lambda: lib)
    monkeypatch.setattr(blas.ctypes.util, "find_library", lambda name: "libgfortran.so.5")
    monkeypatch.setattr(blas, "probe_openblas",
                        _fake_probe("OpenBLAS 0.3.31 NO_AFFINITY SKYLAKEX", "SKYLAKEX"))
    monkeypatch.setattr(blas, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx"}))
    assert blas.find_fast_blas() is None
    monkeypatch.setattr(blas, "cpu_flags", lambda: AVX512)
    assert blas.find_fast_blas() == (lib, None)


def test_probe_reads_the_library_once_per_cpu(tmp_path, monkeypatch) -> None:
    found = blas.find_fast_blas() if sys.platform == "linux" else None
    if found is None:
        pytest.skip("no OpenBLAS on this machine")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = blas.probe_openblas(*found)
    assert first is not None and first["config"].startswith("OpenBLAS ")
    assert first["core"]  # what openblas_get_corename said in the child
    cached = list((tmp_path / "kvchat" / "blas-shim").glob("probe-*.json"))
    assert len(cached) == 1 and json.loads(cached[0].read_text()) == first
    monkeypatch.setattr(blas.subprocess, "run", lambda *a, **k: pytest.fail("probed again"))
    assert blas.probe_openblas(*found) == first


def test_damaged_cache_files_are_rebuilt(monkeypatch, tmp_path) -> None:
    """A probe result or compiled forwarding damaged in the cache is made again, not
    trusted: startup neither crashes on it nor preloads a file that cannot load."""
    found = blas.find_fast_blas() if sys.platform == "linux" else None
    if found is None:
        pytest.skip("no OpenBLAS on this machine")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("KVCHAT_GEMV", raising=False)
    first = blas.probe_openblas(*found)
    (cached,) = (tmp_path / "kvchat" / "blas-shim").glob("probe-*.json")
    for damage in ('{"core": 5}', "[1, 2]", "{not json"):
        cached.write_text(damage)
        assert blas.probe_openblas(*found) == first
        assert json.loads(cached.read_text()) == first
    lib = blas.gemv_forward_lib()
    if lib is None:
        pytest.skip("no C compiler to build the forwarding")
    lib.write_bytes(b"not a shared library")
    again = blas.gemv_forward_lib()
    assert again == lib and again.read_bytes()[:4] == b"\x7fELF"
