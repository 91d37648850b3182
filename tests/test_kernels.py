"""Kernel entry points: every backend equals the `ops` reference (the formulas in plain mlx
ops) on the shapes and dtypes the decoder meets; dispatch and bad input are one line.

Which pairs run where: `fast` vs `ops` everywhere; the custom Metal kernels (`metal`) vs
`ops` and `fast` on Apple silicon only (skipped elsewhere: `mx.metal.is_available()` is
false). The same .metal sources run on the CPU emulator in tests/test_emulator*.py, on
the same cases (tests/helpers/kernels.py).

Tolerances: tests/helpers/kernels.py.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from kvchat import metal_kernels
from kvchat.metal_kernels import KernelError
from tests.helpers import processes
from tests.helpers.kernels import (
    EPS,
    NORM_CASES,
    ROPE_CASES,
    assert_close,
    case_id,
    norm_inputs,
    on,
    qk_inputs,
    run_norm,
    run_rope,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
METAL = pytest.mark.skipif(
    not mx.metal.is_available(), reason="mx.metal.is_available() is false: no Metal GPU"
)


def big_norm(case: dict) -> bool:
    return case["rows"] * case["hidden"] > 512 * 576


def big_rope(case: dict) -> bool:
    return case["T"] == 512


def cases(found: list[dict], big: Callable[[dict], bool]) -> list:
    """`found` as test parameters; the biggest shapes (512 rows of 4,096 features or
    more, RoPE over 512 positions) run in the slow tier: the code paths of the smaller
    ones, at many times their cost."""
    return [pytest.param(c, id=case_id(c), marks=pytest.mark.slow if big(c) else ())
            for c in found]


def check_norm_pair(backend: str, reference: str, case: dict) -> None:
    got, ref = run_norm(backend, **case), run_norm(reference, **case)
    for g, r in zip(got, ref, strict=True):
        assert_close(g, r, case["dtype"])


def check_rope_pair(backend: str, reference: str, case: dict) -> None:
    *got, allowance = run_rope(backend, **case)
    *ref, _ = run_rope(reference, **case)
    for g, r in zip(got, ref, strict=True):
        assert_close(g, r, case["dtype"], allowance)


# ----------------------------------------------------------------------------- parity


@pytest.mark.parametrize("case", cases(NORM_CASES, big_norm))
def test_norms_fast_equal_ops(case: dict) -> None:
    check_norm_pair("fast", "ops", case)


@pytest.mark.parametrize("case", cases(ROPE_CASES, big_rope))
def test_rope_fast_equals_ops(case: dict) -> None:
    check_rope_pair("fast", "ops", case)


@pytest.fixture
def mlx_fast_rope():
    from kvchat.metal_kernels import fast

    metal_kernels.register_backend("mlx_fast_rope", fast.WithMlxRope())
    yield "mlx_fast_rope"
    metal_kernels.unregister_backend("mlx_fast_rope")


@pytest.mark.parametrize("case", cases(ROPE_CASES, big_rope))
def test_rope_fast_on_cpu_equals_mlx_fast_rope(case: dict, mlx_fast_rope: str) -> None:
    with mx.stream(mx.cpu):
        check_rope_pair("fast", mlx_fast_rope, case)


def test_rope_fast_compiled_shares_angles_and_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU the `fast` backend rotates without `mx.fast.rope`; four layers'
    rotations in one compiled function (the angles merged into one computation) give what
    four separate calls give."""
    if mx.default_device().type != mx.cpu:
        pytest.skip("the CPU rotation")

    def refuse(*a, **k):
        raise AssertionError("mx.fast.rope called on the CPU")
    q, k = qk_inputs(1, 8, 2, 1, 24, mx.float32)
    rows = mx.array([[150, 3]], dtype=mx.int32)

    def layers(q: mx.array, k: mx.array, rows: mx.array) -> tuple[mx.array, mx.array]:
        for _ in range(4):
            q, k = metal_kernels.rope_qk(q, k, 24, traditional=False, base=10000.0,
                                         scale=1.0, offset=rows[0, 0], freqs=None)
        return q, k

    with metal_kernels.using("fast"), monkeypatch.context() as m:
        m.setattr(mx.fast, "rope", refuse)
        got = mx.compile(layers)(q, k, rows)
        ref = layers(q, k, rows)
    with metal_kernels.using("ops"):
        ops = layers(q, k, rows)
    for g, r, o in zip(got, ref, ops, strict=True):
        assert mx.array_equal(g, r)
        assert mx.allclose(g, o, atol=2e-5).item()


@METAL
@pytest.mark.parametrize("reference", ["ops", "fast"])
@pytest.mark.parametrize("case", NORM_CASES, ids=case_id)
def test_norms_metal_equal_reference(case: dict, reference: str) -> None:
    check_norm_pair("metal", reference, case)


@METAL
@pytest.mark.parametrize("reference", ["ops", "fast"])
@pytest.mark.parametrize("case", ROPE_CASES, ids=case_id)
def test_rope_metal_equals_reference(case: dict, reference: str) -> None:
    check_rope_pair("metal", reference, case)


def test_ops_reference_matches_hand_computed_values() -> None:
    """The reference itself against numbers worked out by hand, not against mlx."""
    x = mx.array([[3.0, 4.0]])  # mean square 12.5
    y = on("ops", metal_kernels.rms_norm, x, mx.array([1.0, 2.0]), 0.0)
    np.testing.assert_allclose(np.array(y), [[3 / math.sqrt(12.5), 8 / math.sqrt(12.5)]],
                               rtol=1e-6)
    # one head, one position at offset 1, dims 4 of D 6, base 100: pair periods 1 and 10
    v = mx.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).reshape(1, 1, 1, 6)
    got = np.array(on("ops", metal_kernels.rope, v, 4, traditional=False, base=100.0,
                      scale=1.0, offset=1)).ravel()
    c0, s0, c1, s1 = math.cos(1), math.sin(1), math.cos(0.1), math.sin(0.1)
    want = [1 * c0 - 3 * s0, 2 * c1 - 4 * s1, 1 * s0 + 3 * c0, 2 * s1 + 4 * c1, 5, 6]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    got_t = np.array(on("ops", metal_kernels.rope, v, 4, traditional=True, base=100.0,
                        scale=1.0, offset=1)).ravel()
    want_t = [1 * c0 - 2 * s0, 1 * s0 + 2 * c0, 3 * c1 - 4 * s1, 3 * s1 + 4 * c1, 5, 6]
    np.testing.assert_allclose(got_t, want_t, rtol=1e-6)


def test_norm_output_dtype_follows_the_weight() -> None:
    """A float16 activation with a float32 weight gives float32, as mx.fast does."""
    x, _, w = norm_inputs(2, 64, mx.float16)
    for name in ("ops", "fast"):
        assert on(name, metal_kernels.rms_norm, x, w.astype(mx.float32), EPS).dtype == mx.float32


# ----------------------------------------------------------------------------- dispatch


def test_default_backend_is_fast_without_metal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVCHAT_KERNELS", raising=False)
    metal_kernels.configure()
    assert metal_kernels.backend() == ("metal" if mx.metal.is_available() else "fast")


@pytest.mark.parametrize("name", ["ops", "fast"])
def test_env_forces_a_backend_and_wins_over_the_setting(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    monkeypatch.setenv("KVCHAT_KERNELS", name)
    try:
        assert metal_kernels.configure("ops" if name == "fast" else "fast") == name
        assert metal_kernels.backend() == name
    finally:
        monkeypatch.delenv("KVCHAT_KERNELS")
        metal_kernels.configure()


def test_setting_chooses_when_env_is_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVCHAT_KERNELS", raising=False)
    try:
        assert metal_kernels.configure("ops") == "ops"
        with pytest.raises(KernelError, match="allowed: metal, fast, ops"):
            metal_kernels.configure("cuda")
    finally:
        metal_kernels.configure()


def test_switch_at_run_time_reports_one_line() -> None:
    before = metal_kernels.backend()
    try:
        assert metal_kernels.switch_backend("ops") == "kernels: ops"
        assert metal_kernels.backend() == "ops"
        assert metal_kernels.switch_backend("ops") == "kernels: ops (unchanged)"
        msg = metal_kernels.switch_backend("nope")
        assert "\n" not in msg and "allowed: metal, fast, ops" in msg
        assert metal_kernels.backend() == "ops"  # a refused switch changes nothing
    finally:
        metal_kernels.set_backend(before)


@pytest.mark.skipif(mx.metal.is_available(), reason="this machine has Metal")
def test_metal_without_metal_is_an_error_not_a_fallback() -> None:
    with pytest.raises(KernelError, match="needs Metal"):
        metal_kernels.set_backend("metal")
    assert "metal" not in metal_kernels.available_backends()


@pytest.mark.parametrize(
    ("value", "needle"),
    [("bogus", "allowed: metal, fast, ops"), ("metal", "needs Metal")],
)
def test_cli_exits_2_on_an_unusable_kernels_env(value: str, needle: str) -> None:
    if value == "metal" and mx.metal.is_available():
        pytest.skip("this machine has Metal")
    env = {**os.environ, "KVCHAT_KERNELS": value, "PYTHONPATH": str(REPO_ROOT),
           "KVCHAT_NO_OPENBLAS": "1"}
    res = processes.run([sys.executable, "-m", "kvchat.app", "models"], env=env, cwd=REPO_ROOT,
                        capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], res.stderr


# ----------------------------------------------------------------------------- bad input

BAD_CALLS: list[tuple[str, Callable[[], object], str]] = [
    ("hidden 0", lambda: metal_kernels.rms_norm(mx.zeros((2, 0)), mx.zeros((0,)), EPS),
     "hidden size is 0"),
    ("hidden 0 fused", lambda: metal_kernels.add_rms_norm(
        mx.zeros((2, 0)), mx.zeros((2, 0)), mx.zeros((0,)), EPS), "hidden size is 0"),
    ("weight size", lambda: metal_kernels.rms_norm(mx.zeros((2, 8)), mx.zeros((7,)), EPS),
     "does not match hidden size 8"),
    ("residual shape", lambda: metal_kernels.add_rms_norm(
        mx.zeros((2, 8)), mx.zeros((3, 8)), mx.zeros((8,)), EPS), "residual of shape"),
    ("odd dims", lambda: metal_kernels.rope(
        mx.zeros((1, 2, 3, 8)), 5, traditional=False, base=1e4, scale=1.0, offset=0),
     "positive even"),
    ("dims > head", lambda: metal_kernels.rope(
        mx.zeros((1, 2, 3, 8)), 10, traditional=False, base=1e4, scale=1.0, offset=0),
     "exceed the head size 8"),
    ("freqs size", lambda: metal_kernels.rope(
        mx.zeros((1, 2, 3, 8)), 8, traditional=False, base=None, scale=1.0, offset=0,
        freqs=mx.ones((3,))), "dims/2 = 4"),
    ("base and freqs", lambda: metal_kernels.rope(
        mx.zeros((1, 2, 3, 8)), 8, traditional=False, base=1e4, scale=1.0, offset=0,
        freqs=mx.ones((4,))), "exactly one of base and freqs"),
    ("offset count", lambda: metal_kernels.rope(
        mx.zeros((2, 2, 3, 8)), 8, traditional=False, base=1e4, scale=1.0,
        offset=mx.array([1, 2, 3])), "1 or batch = 2"),
    ("float offset", lambda: metal_kernels.rope(
        mx.zeros((1, 2, 3, 8)), 8, traditional=False, base=1e4, scale=1.0,
        offset=mx.array([1.5])), "integer"),
    ("qk mismatch", lambda: metal_kernels.rope_qk(
        mx.zeros((1, 4, 3, 8)), mx.zeros((1, 2, 3, 16)), 8, traditional=False, base=1e4,
        scale=1.0, offset=0), "share batch, positions and head size"),
    ("2-d rope", lambda: metal_kernels.rope(
        mx.zeros((3, 8)), 8, traditional=False, base=1e4, scale=1.0, offset=0), "(B, ..., T, D)"),
]


@pytest.mark.parametrize("backend", ["ops", "fast"])
@pytest.mark.parametrize(("what", "call", "needle"), BAD_CALLS, ids=[b[0] for b in BAD_CALLS])
def test_bad_shapes_are_one_line_on_every_backend(
    backend: str, what: str, call: Callable[[], object], needle: str
) -> None:
    with metal_kernels.using(backend), pytest.raises(KernelError) as err:
        mx.eval(call())
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_palette_commands_switch_and_notify_one_line() -> None:
    asked: list[str] = []
    cmds = {title: cb for title, _help, cb in metal_kernels.switch_commands(asked.append)}
    assert set(cmds) == {f"Kernels: use {n}" for n in metal_kernels.available_backends()}
    cmds["Kernels: use ops"]()
    assert asked == ["ops"]  # the engine does the switch (where the model runs)


@pytest.mark.slow  # without the app: test_palette_commands_switch_and_notify_one_line
def test_chat_palette_switches_the_backend(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the real command palette of the chat app (scripted engine)."""
    from tests.helpers.app import SIZE, make_app, ready
    from tests.helpers.scripted_engine import async_test, wait_for

    monkeypatch.setenv("KVCHAT_CONFIG_DIR", str(tmp_path / "cfg"))
    monkeypatch.setenv("KVCHAT_DATA_DIR", str(tmp_path / "data"))
    before = metal_kernels.backend()

    @async_test
    async def run() -> None:
        app = make_app()
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            await pilot.press("ctrl+p")
            await pilot.press(*"Kernels: use ops")
            await pilot.pause(0.3)
            await pilot.press("enter")
            await wait_for(pilot, lambda: metal_kernels.backend() == "ops")
            # the engine reported it: the side panel names the backend it runs now
            await wait_for(pilot, lambda: "ops" in str(
                app.chat.panel.query_one("#runtime").render()))

    try:
        metal_kernels.set_backend("fast")
        run()
    finally:
        metal_kernels.set_backend(before)


# ----------------------------------------------------------------------------- metal launch


def _doc_params(fn: object) -> set[str]:
    """Parameter names from a nanobind function's signature line (its __doc__ head)."""
    import re

    head = (fn.__doc__ or "").strip().split("\n", 1)[0]
    return set(re.findall(r"(\w+):", head.split("(", 1)[1].rsplit(")", 1)[0]))


def test_metal_backend_calls_the_factory_as_mx_fast_metal_kernel_takes_it() -> None:
    """The seam the emulator plugs into: keywords that mx.fast.metal_kernel (and the
    kernel it returns) really accept, grids in threads, one threadgroup per norm row."""
    from kvchat.metal_kernels.metal import MetalBackend

    built: list[dict] = []
    calls: list[dict] = []

    def factory(**kw):
        built.append(kw)

        def kernel(**call):
            calls.append(call)
            shapes, dtypes = call["output_shapes"], call["output_dtypes"]
            return [mx.zeros(s, d) for s, d in zip(shapes, dtypes, strict=True)]

        return kernel

    be = MetalBackend(factory=factory)
    x, r, w = norm_inputs(3, 4096, mx.float16)
    be.rms_norm(x, w, EPS)
    be.add_rms_norm(x, r, w.astype(mx.float32), EPS)
    q, k = qk_inputs(2, 8, 2, 5, 64, mx.float32)
    be.rope_qk(q, k, 48, False, None, 1.0, 3, mx.ones((24,)))
    be.rms_norm(x, w, EPS)  # a second call builds nothing new

    factory_params = _doc_params(mx.fast.metal_kernel)
    assert len(built) == 3 and all(set(b) <= factory_params for b in built)
    real_kernel = mx.fast.metal_kernel(name="probe", input_names=["x"], output_names=["y"],
                                       source="")  # building one needs no GPU
    kernel_params = _doc_params(real_kernel)
    assert {"inputs", "grid", "threadgroup", "template"} <= kernel_params
    assert all(set(c) <= kernel_params for c in calls)
    norm, fused, rope, _ = calls
    assert norm["grid"] == (3 * 1024, 1, 1) and norm["threadgroup"] == (1024, 1, 1)
    assert dict(norm["template"]) == {"T": mx.float16, "W": mx.float16, "N_READS": 4,
                                      "N_CHUNKS": 1}
    assert dict(fused["template"])["W"] == mx.float32  # result_type(float16, float32)
    assert fused["output_dtypes"] == [mx.float16, mx.float32]
    # RoPE: 24 pairs + 16 pass-through features per row, 5 positions, 2 x (8 + 2) heads
    assert rope["grid"] == (64 - 24, 5, 2 * 10)
    assert [b["name"] for b in built] == ["kvchat_rms_norm", "kvchat_add_rms_norm",
                                          "kvchat_rope"]


def test_norm_launch_covers_any_hidden_size_and_refuses_past_the_limit() -> None:
    from kvchat.metal_kernels.metal import MAX_THREADS, N_READS, norm_launch

    for hidden in (1, 7, 64, 576, 4096, 4097, 8193, 32768):
        threads, chunks = norm_launch(hidden, 1)
        assert threads % 32 == 0 and threads <= MAX_THREADS
        assert threads * chunks * N_READS >= hidden  # every element has a thread
        assert threads * (chunks - 1) * N_READS < hidden  # and no step is wasted whole
    assert norm_launch(8193, 1) == (1024, 3)
    with pytest.raises(KernelError, match="hidden size 32769 exceeds"):
        norm_launch(32769, 1)
