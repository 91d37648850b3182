"""The shipped `.metal` kernels, executed on the CPU emulator through the real `metal`
backend code (`MetalBackend(factory=tests.metal_emulator.metal_kernel)`).

1. Parity: every kernel equals the `ops` reference and `mx.fast` on the cases of
   tests/helpers/kernels.py (hidden 1 … 8193, rows 1 … 512, float32/float16/bfloat16, offsets
   0 and 1000 and arrays, both RoPE layouts, llama3 periods, linear scale, partial rotary,
   GQA 8/2, 32/8, 4/1), with the tolerances stated there per dtype: (rtol, atol) float32
   (1e-5, 1e-6), float16 (2^-9, 2^-14), bfloat16 (2^-6, 2^-14), plus RoPE's angle allowance.
   Rows 512 run with hidden sizes up to 576 here (hidden 4096 and 8193 with 1 and 3 rows):
   the same code path, at a cost the CI budget allows.
2. Mutants: textual edits of the real sources (each barrier removed, loop bounds, lane
   and pair indices shifted by one, a row bound past the end, Q read as if contiguous)
   must give a wrong answer or an emulator error already in plain thread order, while the
   unedited sources pass the same inputs in every thread order.
3. The whole model: stories260K decoded greedily for 20 tokens with every norm and RoPE
   call executed by the emulator (plain and shuffled thread order) gives the same ids as
   `fast`; and the generated kernel sources are the text MLX itself writes.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from kvchat import metal_kernels
from kvchat.metal_kernels.metal import MetalBackend, read_source
from tests import metal_emulator as me
from tests.helpers.greedy import greedy_ids
from tests.helpers.kernels import (
    NORM_CASES,
    ROPE_CASES,
    assert_close,
    case_id,
    run_norm,
    run_rope,
)

pytestmark = pytest.mark.skipif(not me.available(), reason=str(me.unavailable_reason()))

# The fast tier runs the kernels through the emulator on one RMSNorm and one RoPE case;
# every other case, thread order, mutant and the whole model run in the slow tier.
FAST_NORM = dict(rows=3, hidden=576, dtype=mx.float32)
FAST_ROPE = dict(B=2, hq=8, hk=2, T=17, D=64, dims=64, traditional=False, offset=1000,
                 freqs=False, scale=1.0, dtype=mx.float32)


def cases(found: list[dict], fast: dict) -> list:
    """`found` as test parameters, all but `fast` marked slow."""
    assert fast in found
    return [pytest.param(c, id=case_id(c), marks=() if c == fast else pytest.mark.slow)
            for c in found]

EMU = "emulated"
ORDERS = [("sequential", 0), ("reversed", 0), ("shuffled", 7)]

# Rows 512 only where a row is small: the emulator runs every GPU thread on one CPU core.
EMU_NORM_CASES = [c for c in NORM_CASES if c["rows"] * c["hidden"] <= 512 * 576]
# The biggest shapes also run in the reversed and shuffled orders.
ORDER_NORM_CASES = [
    dict(rows=3, hidden=8193, dtype=mx.float32),
    dict(rows=512, hidden=576, dtype=mx.bfloat16),
]


class Counting:
    """A backend wrapper that counts entry-point calls (to compare with kernel launches)."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.inner, name)

        def counted(*args: Any, **kw: Any) -> Any:
            self.calls[name] += 1
            return fn(*args, **kw)

        return counted


@pytest.fixture(scope="module")
def emulated():
    backend = Counting(MetalBackend(factory=me.metal_kernel, name=EMU))
    metal_kernels.register_backend(EMU, backend)
    yield backend
    metal_kernels.unregister_backend(EMU)


def check_norm(case: dict, backend: str = EMU) -> None:
    got = run_norm(backend, **case)
    for reference in ("ops", "fast"):
        for g, r in zip(got, run_norm(reference, **case), strict=True):
            assert_close(g, r, case["dtype"])


def check_rope(case: dict, backend: str = EMU) -> None:
    *got, allowance = run_rope(backend, **case)
    for reference in ("ops", "fast"):
        *ref, _ = run_rope(reference, **case)
        for g, r in zip(got, ref, strict=True):
            assert_close(g, r, case["dtype"], allowance)


# ----------------------------------------------------------------------------- parity


@pytest.mark.parametrize("case", cases(EMU_NORM_CASES, FAST_NORM))
def test_norm_kernels_equal_ops_and_fast(emulated, case: dict) -> None:
    before = me.launches["kvchat_rms_norm"], me.launches["kvchat_add_rms_norm"]
    check_norm(case)
    after = me.launches["kvchat_rms_norm"], me.launches["kvchat_add_rms_norm"]
    assert after == (before[0] + 1, before[1] + 1)  # both ran on the emulator


@pytest.mark.parametrize("case", cases(ROPE_CASES, FAST_ROPE))
def test_rope_kernel_equals_ops_and_fast(emulated, case: dict) -> None:
    before = me.launches["kvchat_rope"]
    check_rope(case)
    assert me.launches["kvchat_rope"] == before + 2  # rope_qk and rope


@pytest.mark.slow
@pytest.mark.parametrize("order", ORDERS[1:], ids=lambda o: o[0])
@pytest.mark.parametrize("case", ORDER_NORM_CASES, ids=case_id)
def test_norm_kernels_do_not_depend_on_thread_order(emulated, case: dict, order) -> None:
    with me.schedule(*order):
        check_norm(case)


# ----------------------------------------------------------------------------- mutants

BARRIER = "threadgroup_barrier(mem_flags::mem_threadgroup);"


def _mutate(text: str, old: str, new: str, occurrence: int) -> str:
    """Replace the `occurrence`-th `old` (fails loudly if the sources changed under us)."""
    starts = [m.start() for m in re.finditer(re.escape(old), text)]
    assert len(starts) > occurrence, f"mutation target {old!r} #{occurrence} not in the source"
    at = starts[occurrence]
    return text[:at] + new + text[at + len(old) :]


NORM_SMALL = dict(rows=3, hidden=576, dtype=mx.float32)  # 160 threads: 5 simdgroups
NORM_LONG = dict(rows=3, hidden=8193, dtype=mx.float32)  # 1024 threads x 3 chunks
ROPE_HALF = {  # partial rotary: 16 of 64 features pass through
    **dict(B=1, hq=4, hk=1, T=5, D=64, dims=48, traditional=False, offset=3),
    **dict(freqs=False, scale=1.0, dtype=mx.float32),
}
ROPE_TRAD = {**ROPE_HALF, "traditional": True}

# (name, old text, new text, which occurrence, cases that expose it)
NORM_MUTANTS = [
    *[
        (f"barrier {i + 1} removed", BARRIER, "", i, [NORM_LONG, NORM_SMALL])
        for i in range(read_source("rms_norm").count(BARRIER))
    ],
    ("read loop: c < N_CHUNKS - 1", "c < N_CHUNKS", "c < N_CHUNKS - 1", 0, [NORM_LONG]),
    ("write loop: c < N_CHUNKS - 1", "c < N_CHUNKS", "c < N_CHUNKS - 1", 1, [NORM_LONG]),
    ("read loop: i < N_READS - 1", "i < N_READS", "i < N_READS - 1", 0, [NORM_SMALL]),
    ("write loop: i < N_READS - 1", "i < N_READS", "i < N_READS - 1", 1, [NORM_SMALL]),
    ("reduction: lane < n_sg - 1", "lane < n_sg", "lane < n_sg - 1", 0, [NORM_SMALL]),
    ("reduction: lane <= n_sg", "lane < n_sg", "lane <= n_sg", 0, [NORM_SMALL]),
    ("reduction: partial[lane + 1]", "partial[lane]", "partial[lane + 1]", 0, [NORM_SMALL]),
    ("reduction: partial[sg + 1]", "partial[sg]", "partial[sg + 1]", 0, [NORM_SMALL]),
    ("row bound: j <= D", "j < D", "j <= D", 1, [NORM_SMALL]),
]
ROPE_MUTANTS = [
    ("rope pair: j + half_dims - 1", "j + half_dims;", "j + half_dims - 1;", 0, [ROPE_HALF]),
    ("rope pair: 2 * j + 2", "2 * j + 1", "2 * j + 2", 0, [ROPE_TRAD]),
    ("rope slots: j <= half_dims", "j < half_dims", "j <= half_dims", 0, [ROPE_HALF]),
    # Q arrives as a transposed view (B, T, H, D) -> (B, H, T, D): its head stride is D
    ("rope: q heads as if contiguous", "head * q_strides[1]", "head * T_len * D", 0, [ROPE_HALF]),
]
MUTANTS = [("rms_norm", *m) for m in NORM_MUTANTS] + [("rope", *m) for m in ROPE_MUTANTS]


def _wrong(kind: str, text: str, case: dict) -> list[str]:
    """The thread orders in which the mutated kernel gives a wrong answer or an error."""
    name = f"mutant_{len(text)}_{hash(text) & 0xFFFF:x}"
    metal_kernels.register_backend(
        name, MetalBackend(factory=me.metal_kernel, name=name, sources={kind: text})
    )
    check = check_norm if kind == "rms_norm" else check_rope
    failed = []
    try:
        for order in ORDERS:
            with me.schedule(*order):
                try:
                    check(case, backend=name)
                except (AssertionError, me.EmulatorError):
                    failed.append(order[0])
    finally:
        metal_kernels.unregister_backend(name)
    return failed


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["rms_norm", "rope"])
def test_unmutated_sources_pass_the_mutant_inputs_in_every_order(emulated, kind: str) -> None:
    for k, *_, cases in MUTANTS:
        if k == kind:
            for case in cases:
                assert _wrong(kind, read_source(kind), case) == []


@pytest.mark.slow
@pytest.mark.parametrize("mutant", MUTANTS, ids=[m[1] for m in MUTANTS])
def test_broken_kernel_variants_fail(emulated, mutant) -> None:
    kind, _, old, new, occurrence, cases = mutant
    text = _mutate(read_source(kind), old, new, occurrence)
    failed = {o for case in cases for o in _wrong(kind, text, case)}
    # Caught deterministically in plain thread order (the default), whatever else catches it;
    # reversed and shuffled orders only add order-dependent catches (e.g. barrier 1 removed
    # is correct by luck when simdgroups run last-to-first).
    assert "sequential" in failed, f"the emulator did not notice the broken kernel ({failed})"


# ----------------------------------------------------------------------------- the model

STEPS = 20


def _greedy(folder: Path, backend: str) -> list[int]:
    with metal_kernels.using(backend):
        return greedy_ids(folder, STEPS)


@pytest.fixture(scope="module")
def fast_ids(stories260k: Path) -> list[int]:
    return _greedy(stories260k, "fast")


@pytest.mark.slow
@pytest.mark.parametrize("order", [ORDERS[0], ORDERS[2]], ids=lambda o: o[0])
def test_stories260k_decodes_the_same_on_the_emulated_kernels(
    emulated, stories260k: Path, fast_ids: list[int], order
) -> None:
    emulated.calls.clear()
    before = Counter(me.launches)
    with me.schedule(*order):
        got = _greedy(stories260k, EMU)
    launched = Counter(me.launches)
    launched.subtract(before)
    # every norm and RoPE call of the model ran the .metal sources on the emulator
    calls = emulated.calls
    assert calls["rms_norm"] > 0 and calls["add_rms_norm"] > 0 and calls["rope_qk"] > 0
    assert launched["kvchat_rms_norm"] == calls["rms_norm"]
    assert launched["kvchat_add_rms_norm"] == calls["add_rms_norm"]
    assert launched["kvchat_rope"] == calls["rope_qk"] + calls["rope"]
    assert got == fast_ids


# ----------------------------------------------------------------------------- MLX's own text


def _printed_sources(capfd, factory, run, trace: bool) -> str:
    """What the backend's kernel launches print with verbose=True; MLX's under an export
    trace (MLX writes and prints its kernel source there even without a Metal device)."""

    def verbose_factory(**spec):
        kernel = factory(**spec)
        return lambda **call: kernel(**{**call, "verbose": True})

    backend = MetalBackend(factory=verbose_factory, name="printing")
    capfd.readouterr()
    if not trace:
        mx.eval(run(backend, *SOURCE_INPUTS))
        return capfd.readouterr().out
    try:
        mx.export_function("/dev/null", lambda *a: run(backend, *a), *SOURCE_INPUTS)
    except Exception:  # noqa: BLE001 - exporting may fail after the sources were printed
        pass
    return capfd.readouterr().out


SOURCE_INPUTS = (
    mx.zeros((2, 7), mx.float16),  # hidden 7: the weight arrives in the constant space
    mx.zeros((3, 4096), mx.bfloat16),
    mx.zeros((2, 8, 5, 64), mx.float32),
    mx.zeros((2, 2, 5, 64), mx.float32),
)


def _launch_all(backend, x7, x4096, q, k):
    w7, w4096 = mx.ones((7,), mx.float16), mx.ones((4096,), mx.bfloat16)
    offsets = mx.array([3, 1000])
    return [
        backend.rms_norm(x7, w7, 1e-5),
        *backend.add_rms_norm(x4096, x4096, w4096, 1e-6),
        *backend.rope_qk(q, k, 48, True, None, 0.5, offsets, mx.full((24,), 7.0)),
    ]


@pytest.mark.slow
def test_shipped_kernel_sources_are_the_text_mlx_generates(capfd) -> None:
    theirs = _printed_sources(capfd, mx.fast.metal_kernel, _launch_all, trace=True)
    if "```" not in theirs:
        pytest.skip("this MLX build does not print custom kernel sources without Metal")
    ours = _printed_sources(capfd, me.metal_kernel, _launch_all, trace=False)
    assert theirs.count("Generated source code for") == 3
    assert ours == theirs
