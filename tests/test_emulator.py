"""The CPU Metal emulator itself, on small kernels written here.

References are independent of the emulator: MLX's own generated kernel source (MLX
writes it even without Metal while exporting a function, with verbose=True), hand-written
signatures, numpy and mlx for half/bfloat16 rounding, and sums computed in numpy.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tests import metal_emulator as me
from tests.metal_emulator.compiler import rewrite_threadgroup_decls

pytestmark = pytest.mark.skipif(not me.available(), reason=str(me.unavailable_reason()))

ORDERS = [("sequential", 0), ("reversed", 0), ("shuffled", 1), ("shuffled", 2)]


def run(kernel, *, order=("sequential", 0), **kw) -> list[mx.array]:
    with me.schedule(*order):
        return kernel(**kw)


def run1(
    name: str,
    body: str,
    grid: int,
    tg: int,
    shape: tuple,
    *,
    inputs: dict | None = None,
    dtype=mx.float32,
    template=(),
    order=("sequential", 0),
) -> np.ndarray:
    """Run `body` as a kernel with inputs `inputs` (name -> value) and one output `out`,
    over a 1-D grid; the output as numpy."""
    inputs = inputs or {}
    k = me.metal_kernel(name, list(inputs), ["out"], body)
    (out,) = run(
        k,
        order=order,
        inputs=list(inputs.values()),
        template=list(template),
        grid=(grid, 1, 1),
        threadgroup=(tg, 1, 1),
        output_shapes=[shape],
        output_dtypes=[dtype],
    )
    return np.array(out)


# ----------------------------------------------------------------------------- signature

MYEXP = """
uint elem = thread_position_in_grid.x;
T tmp = inp[elem];
out[elem] = metal::exp(tmp);
"""

# Hand-written from MLX's write_signature for the docs' `myexp` example.
MYEXP_EXPECTED = """template <typename T>
[[kernel]] void custom_kernel_myexp__float_float_float(
  const device float* inp [[buffer(0)]],
  device float* out [[buffer(1)]],
  uint3 thread_position_in_grid [[thread_position_in_grid]]) {

uint elem = thread_position_in_grid.x;
T tmp = inp[elem];
out[elem] = metal::exp(tmp);

}

template [[host_name("custom_kernel_myexp__float_float_float")]] [[kernel]] decltype(custom_kernel_myexp__float_float_float<float>) custom_kernel_myexp__float_float_float<float>;
"""  # noqa: E501

MIXED = """
uint i = thread_index_in_threadgroup;
uint s = simdgroup_index_in_threadgroup + threads_per_threadgroup.x + thread_position_in_grid.x;
out[i] = x[i] * w[0] + eps + float(x_shape[0] + x_strides[0] + x_ndim) + float(N) + float(B) + s;
"""

# Small input (< 8 elements) -> constant; 0-d input -> reference; x_shape/_strides/_ndim
# mentioned -> extra buffers; int and bool template values; two outputs, atomic.
MIXED_EXPECTED = (
    """// helpers
template <int N, bool B>
[[kernel]] void custom_kernel_mixed__3_0_float16_t_float16_tc_floats_float_int32_t(
  const device float16_t* x [[buffer(0)]],
  const constant int* x_shape [[buffer(1)]],
  const constant int64_t* x_strides [[buffer(2)]],
  const constant int& x_ndim [[buffer(3)]],
  const constant float16_t* w [[buffer(4)]],
  const constant float& eps [[buffer(5)]],
  device atomic<float>* out [[buffer(6)]],
  device atomic<int32_t>* cnt [[buffer(7)]],
  uint simdgroup_index_in_threadgroup [[simdgroup_index_in_threadgroup]],
  uint thread_index_in_threadgroup [[thread_index_in_threadgroup]],
  uint3 thread_position_in_grid [[thread_position_in_grid]],
  uint3 threads_per_threadgroup [[threads_per_threadgroup]]) {
"""
    + MIXED
    + """
}

template [[host_name("custom_kernel_mixed__3_0_float16_t_float16_tc_floats_float_int32_t")]] [[kernel]] decltype(custom_kernel_mixed__3_0_float16_t_float16_tc_floats_float_int32_t<3, 0>) custom_kernel_mixed__3_0_float16_t_float16_tc_floats_float_int32_t<3, 0>;
"""  # noqa: E501
)


def test_signature_matches_hand_written_myexp():
    k = me.metal_kernel("myexp", ["inp"], ["out"], MYEXP)
    name, src = k.generated_source([mx.zeros((16,))], [mx.float32], [("T", mx.float32)])
    assert name == "custom_kernel_myexp__float_float_float"
    assert src == MYEXP_EXPECTED


def test_signature_matches_hand_written_mixed_inputs():
    k = me.metal_kernel(
        "mixed",
        ["x", "w", "eps"],
        ["out", "cnt"],
        MIXED,
        header="// helpers\n",
        atomic_outputs=True,
    )
    inputs = [mx.zeros((4, 8), mx.float16), mx.zeros((3,), mx.float16), mx.array(1e-5)]
    _, src = k.generated_source(inputs, [mx.float32, mx.int32], [("N", 3), ("B", False)])
    assert src == MIXED_EXPECTED


def _mlx_generated_source(
    capfd, name, input_names, output_names, source, header, inputs, output_dtypes, template
) -> str:
    """The source MLX itself generates: it prints it (verbose) while tracing an export,
    which works without a Metal device."""
    kernel = mx.fast.metal_kernel(name, input_names, output_names, source, header)

    def fn(*args):
        return kernel(
            inputs=list(args),
            template=template,
            grid=(32, 1, 1),
            threadgroup=(32, 1, 1),
            output_shapes=[(4,)] * len(output_names),
            output_dtypes=output_dtypes,
            verbose=True,
        )

    capfd.readouterr()
    try:
        mx.export_function("/dev/null", fn, *inputs)
    except Exception:  # noqa: BLE001 - writing the export may fail; the print came first
        pass
    out = capfd.readouterr().out
    if "```" not in out:
        pytest.skip("this MLX build does not print custom kernel sources without Metal")
    return out.split("```\n", 1)[1].rsplit("\n```", 1)[0]


@pytest.mark.parametrize(
    "case",
    [
        (
            "myexp",
            ["inp"],
            ["out"],
            MYEXP,
            "",
            [mx.zeros((16,))],
            [mx.float32],
            [("T", mx.float32)],
        ),
        (
            "mixed",
            ["x", "w", "eps"],
            ["out", "cnt"],
            MIXED.replace("atomic", ""),
            "// helpers\n",
            [mx.zeros((4, 8), mx.float16), mx.zeros((3,), mx.float16), mx.array(1e-5)],
            [mx.float32, mx.int32],
            [("N", 3), ("B", False)],
        ),
        # every attribute name, grid_size included; no template; bfloat16 and int inputs
        (
            "attrs",
            ["a", "b"],
            ["o"],
            " ".join(a for a, _ in me.signature.METAL_ATTRIBUTES) + " a_ndim b_strides",
            "",
            [mx.zeros((2, 3, 4), mx.bfloat16), mx.zeros((9,), mx.int32)],
            [mx.bfloat16],
            [],
        ),
    ],
    ids=["myexp", "mixed", "attributes"],
)
def test_signature_equals_what_mlx_writes(capfd, case):
    name, ins, outs, src, header, inputs, out_dtypes, template = case
    expected = _mlx_generated_source(
        capfd, name, ins, outs, src, header, inputs, out_dtypes, template
    )
    k = me.metal_kernel(name, ins, outs, src, header=header)
    assert k.generated_source(inputs, out_dtypes, template)[1].rstrip("\n") == expected.rstrip("\n")


def test_verbose_prints_the_generated_source(capsys):
    k = me.metal_kernel("myexp", ["inp"], ["out"], MYEXP)
    k(
        inputs=[mx.zeros((16,))],
        template=[("T", mx.float32)],
        grid=(16, 1, 1),
        threadgroup=(16, 1, 1),
        output_shapes=[(16,)],
        output_dtypes=[mx.float32],
        verbose=True,
    )
    assert (
        capsys.readouterr().out
        == f"Generated source code for `myexp`:\n```\n{MYEXP_EXPECTED}\n```\n"
    )


def test_threadgroup_declarations_become_shared_arena_places():
    src = (
        "threadgroup float a[32];\nthreadgroup T b;\nthreadgroup float c[N][4];\n"
        "threadgroup float* p = a; // threadgroup memory\n"
        "threadgroup_barrier(mem_flags::mem_threadgroup);"
    )
    assert rewrite_threadgroup_decls(src) == (
        "auto& a = KVEMU_TG(float[32]);\nauto& b = KVEMU_TG(T);\nauto& c = KVEMU_TG(float[N][4]);\n"
        "threadgroup float* p = a; // threadgroup memory\n"
        "threadgroup_barrier(mem_flags::mem_threadgroup);"
    )
    with pytest.raises(me.EmulatorError, match="unsupported threadgroup declaration, line 2"):
        rewrite_threadgroup_decls("\nthreadgroup float a[4], b[4];")


def test_bad_calls_are_one_line_errors():
    k = me.metal_kernel("myexp", ["inp"], ["out"], MYEXP)
    with pytest.raises(ValueError, match="Expected `inputs` to have size 1 but got size 2"):
        k(
            inputs=[mx.zeros(4), mx.zeros(4)],
            grid=(4, 1, 1),
            threadgroup=(4, 1, 1),
            output_shapes=[(4,)],
            output_dtypes=[mx.float32],
        )
    with pytest.raises(ValueError, match="Must specify at least one output"):
        me.metal_kernel("k", ["a"], [], "")
    with pytest.raises(me.EmulatorError, match="maximum allowed threads per threadgroup"):
        k(
            inputs=[mx.zeros(2048)],
            template=[("T", mx.float32)],
            grid=(2048, 1, 1),
            threadgroup=(2048, 1, 1),
            output_shapes=[(2048,)],
            output_dtypes=[mx.float32],
        )
    broken = me.metal_kernel("broken", ["inp"], ["out"], "out[0] = undeclared_name;")
    with pytest.raises(me.EmulatorError, match="undeclared_name"):
        broken(
            inputs=[mx.zeros(4)],
            grid=(1, 1, 1),
            threadgroup=(1, 1, 1),
            output_shapes=[(1,)],
            output_dtypes=[mx.float32],
        )


# ----------------------------------------------------------------------------- grid


IDS = """
uint3 p = thread_position_in_grid;
uint i = p.x + threads_per_grid.x * (p.y + threads_per_grid.y * p.z);
out[5 * i + 0] = threads_per_threadgroup.x * 100 + threads_per_threadgroup.y;
out[5 * i + 1] = thread_index_in_threadgroup;
out[5 * i + 2] = simdgroup_index_in_threadgroup * 100 + thread_index_in_simdgroup;
out[5 * i + 3] = threadgroup_position_in_grid.x * 100 + threadgroup_position_in_grid.y;
out[5 * i + 4] = threadgroups_per_grid.x * 100 + threadgroups_per_grid.y
                 + simdgroups_per_threadgroup * 10000;
"""


def test_grid_is_in_threads_and_edge_threadgroups_are_partial():
    k = me.metal_kernel("ids", [], ["out"], IDS)
    gx, gy, tx, ty = 10, 7, 4, 3
    (out,) = k(
        inputs=[],
        grid=(gx, gy, 1),
        threadgroup=(tx, ty, 1),
        output_shapes=[(gy, gx, 5)],
        output_dtypes=[mx.int32],
    )
    out = np.array(out)
    for y in range(gy):
        for x in range(gx):
            sx, sy = min(tx, gx - x // tx * tx), min(ty, gy - y // ty * ty)  # partial at the edge
            lin = x % tx + (y % ty) * sx
            assert list(out[y, x]) == [
                sx * 100 + sy,
                lin,
                lin // 32 * 100 + lin % 32,
                x // tx * 100 + y // ty,
                3 * 100 + 3 + (sx * sy + 31) // 32 * 10000,
            ], (x, y)


def test_threadgroup_is_clamped_to_the_grid_like_mlx():
    k = me.metal_kernel("ids", [], ["out"], IDS)
    (out,) = k(
        inputs=[],
        grid=(5, 1, 1),
        threadgroup=(64, 1, 1),
        output_shapes=[(5, 5)],
        output_dtypes=[mx.int32],
    )
    assert np.array(out)[:, 0].tolist() == [501] * 5


def test_unwritten_outputs_are_poison_unless_init_value():
    k = me.metal_kernel(
        "half_write",
        ["inp"],
        ["out"],
        "uint i = thread_position_in_grid.x; if (i % 2 == 0) out[i] = inp[i];",
    )
    kw = dict(
        inputs=[mx.ones((8,))],
        grid=(8, 1, 1),
        threadgroup=(8, 1, 1),
        output_shapes=[(8,)],
        output_dtypes=[mx.float32],
    )
    (out,) = k(**kw)
    assert np.isnan(np.array(out)[1::2]).all() and (np.array(out)[::2] == 1).all()
    (out,) = k(**kw, init_value=3.0)
    assert np.array(out).tolist() == [1, 3] * 4


# ----------------------------------------------------------------------------- barriers

# Each thread writes its slot, then reads its neighbour's (a classic exchange).
EXCHANGE = """
threadgroup float buf[256];
uint i = thread_position_in_threadgroup.x;
uint n = threads_per_threadgroup.x;
buf[i] = inp[thread_position_in_grid.x];
BARRIER
out[thread_position_in_grid.x] = buf[(i + SHIFT) % n];
"""


def _exchange(shift: int, barrier: bool, order) -> tuple[np.ndarray, np.ndarray]:
    src = EXCHANGE.replace("SHIFT", str(shift)).replace(
        "BARRIER", "threadgroup_barrier(mem_flags::mem_threadgroup);" if barrier else ""
    )
    k = me.metal_kernel(f"exchange_{shift}_{int(barrier)}", ["inp"], ["out"], src)
    x = np.arange(200, dtype=np.float32)
    (out,) = run(
        k,
        order=order,
        inputs=[mx.array(x)],
        grid=(200, 1, 1),
        threadgroup=(64, 1, 1),
        output_shapes=[(200,)],
        output_dtypes=[mx.float32],
    )
    want = np.concatenate([np.roll(x[s : s + 64], -shift) for s in range(0, 200, 64)])
    return np.array(out), want


@pytest.mark.parametrize("order", ORDERS)
def test_barrier_exchanges_threadgroup_memory(order):
    for shift in (1, 63):
        out, want = _exchange(shift, True, order)
        np.testing.assert_array_equal(out, want)


def test_missing_barrier_reads_unwritten_memory():
    # Reading the next thread's slot: in thread order that thread has not run yet.
    out, want = _exchange(1, False, ("sequential", 0))
    assert np.isnan(out).sum() >= 190  # all but each group's last thread read poison
    # Reading the previous thread's slot works in order by luck; reversed order exposes it.
    out, want = _exchange(63, False, ("sequential", 0))
    np.testing.assert_array_equal(out[1:64], want[1:64])
    out, _ = _exchange(63, False, ("reversed", 0))
    assert np.isnan(out).sum() >= 190


@pytest.mark.parametrize("template", [[], [("T", mx.float32)]], ids=["plain", "template"])
def test_threadgroup_memory_is_poisoned_for_every_threadgroup(template):
    # Threadgroup 1 must not see what threadgroup 0 left behind (in template kernels too).
    src = """
    threadgroup TYPE buf[4];
    uint g = threadgroup_position_in_grid.x;
    if (g == 0) { buf[thread_position_in_threadgroup.x] = 7.0f; }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[thread_position_in_grid.x] = buf[thread_position_in_threadgroup.x];
    """
    out = run1(
        "leak", src.replace("TYPE", "T" if template else "float"), 8, 4, (8,), template=template
    )
    assert (out[:4] == 7).all() and np.isnan(out[4:]).all()


def test_barrier_in_divergent_code_is_reported():
    src = """
    if (thread_index_in_simdgroup == 0) { threadgroup_barrier(mem_flags::mem_threadgroup); }
    else { out[0] = simd_sum(1.0f); }
    """
    with pytest.raises(me.EmulatorError, match="deadlock"):
        run1("diverge", src, 32, 32, (1,))


def test_order_dependent_kernel_differs_between_orders():
    # Last writer wins: the result names whichever thread ran last.
    src = """
    threadgroup uint last[1];
    last[0] = thread_index_in_threadgroup;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[thread_index_in_threadgroup] = last[0];
    """
    seen = {
        int(run1("last_writer", src, 64, 64, (64,), dtype=mx.uint32, order=o)[0]) for o in ORDERS
    }
    assert {63, 0} <= seen and len(seen) >= 3


# ----------------------------------------------------------------------------- SIMD collectives

SIMD = """
uint i = thread_position_in_grid.x;
uint lane = thread_index_in_simdgroup;
float v = inp[i];
out[8 * i + 0] = simd_sum(v);
out[8 * i + 1] = simd_max(v);
out[8 * i + 2] = simd_min(v);
out[8 * i + 3] = simd_prefix_inclusive_sum(v);
out[8 * i + 4] = simd_prefix_exclusive_sum(v);
out[8 * i + 5] = simd_shuffle_down(v, 3);
out[8 * i + 6] = simd_shuffle_xor(v, 5) + 1000.0f * simd_shuffle_up(v, 2);
out[8 * i + 7] = simd_broadcast(v, 4) + 1000.0f * simd_shuffle(v, (lane * 7) % 32);
"""


def _simd_reference(x: np.ndarray, n: int) -> np.ndarray:
    want = np.full((len(x), 8), np.nan, np.float64)
    for s in range(0, len(x), 32):
        g = x[s : min(s + 32, n)]
        m = len(g)
        for lane in range(m):
            i = s + lane
            down = (
                g[lane + 3]
                if lane + 3 < 32 and lane + 3 < m
                else (g[lane] if lane + 3 >= 32 else np.nan)
            )
            up = g[lane - 2] if lane >= 2 else g[lane]
            xr = g[lane ^ 5] if (lane ^ 5) < m else np.nan
            sh = g[lane * 7 % 32] if lane * 7 % 32 < m else np.nan
            bc = g[4] if m > 4 else np.nan
            want[i] = [
                g.sum(),
                g.max(),
                g.min(),
                g[: lane + 1].sum(),
                g[:lane].sum(),
                down,
                xr + 1000 * up,
                bc + 1000 * sh,
            ]
    return want


@pytest.mark.parametrize("order", ORDERS[:3])
def test_simd_collectives_match_numpy(order):
    k = me.metal_kernel("simd", ["inp"], ["out"], SIMD)
    n = 80  # threadgroup of 48 + a partial one of 32; simdgroups of 32, 16, 32
    x = np.random.default_rng(0).integers(-50, 50, n).astype(np.float32)  # exact sums
    (out,) = run(
        k,
        order=order,
        inputs=[mx.array(x)],
        grid=(n, 1, 1),
        threadgroup=(48, 1, 1),
        output_shapes=[(n, 8)],
        output_dtypes=[mx.float32],
    )
    out = np.array(out)
    for s, e in ((0, 48), (48, 80)):  # reference per threadgroup (its simdgroups)
        np.testing.assert_array_equal(out[s:e], _simd_reference(x[s:e], e - s).astype(np.float32))


def test_simd_sum_counts_only_live_lanes():
    # Lanes that returned early do not take part (Metal's active-lane semantics).
    src = """
    if (thread_index_in_simdgroup >= 20) { return; }
    out[thread_position_in_grid.x] = simd_sum(1.0f);
    """
    out = run1("live", src, 32, 32, (32,))
    assert (out[:20] == 20).all() and np.isnan(out[20:]).all()


def test_reduction_through_simd_and_threadgroup_memory():
    src = """
    threadgroup float partial[32];
    float s = simd_sum(inp[thread_position_in_grid.x]);
    if (thread_index_in_simdgroup == 0) { partial[simdgroup_index_in_threadgroup] = s; }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (thread_index_in_threadgroup == 0) {
      float t = 0.0f;
      for (uint j = 0; j < simdgroups_per_threadgroup; ++j) { t += partial[j]; }
      out[threadgroup_position_in_grid.x] = t;
    }
    """
    k = me.metal_kernel("tgsum", ["inp"], ["out"], src)
    x = np.arange(3 * 1024, dtype=np.float32) % 97
    for order in ORDERS:
        (out,) = run(
            k,
            order=order,
            inputs=[mx.array(x)],
            grid=(x.size, 1, 1),
            threadgroup=(1024, 1, 1),
            output_shapes=[(3,)],
            output_dtypes=[mx.float32],
        )
        np.testing.assert_array_equal(np.array(out), x.reshape(3, 1024).sum(1))


# ----------------------------------------------------------------------------- half / bfloat16

CAST = """
uint i = thread_position_in_grid.x;
out[i] = static_cast<T>(inp[i]);
back[i] = static_cast<float>(out[i]);
prod[i] = static_cast<T>(inp[i]) * static_cast<T>(inp[(i + 1) % n]);
"""


def _hard_floats() -> np.ndarray:
    rng = np.random.default_rng(1)
    specials = np.array(
        [
            0.0,
            -0.0,
            1.0,
            65504.0,
            65519.9,
            65520.0,
            1e6,
            -1e6,
            6e-8,
            3e-8,
            2.9802322e-08,
            5.96e-8,
            1e-45,
            6.1e-5,
            np.inf,
            -np.inf,
            np.nan,
            3.3895314e38,
            3.4e38,
        ],
        np.float32,
    )
    # ties for half (13 dropped bits = 0x1000) and for bfloat16 (16 dropped bits = 0x8000)
    bits = rng.integers(0, 2**32, 4000, dtype=np.uint64).astype(np.uint32)
    ties = np.concatenate(
        [
            (bits & ~np.uint32(0x1FFF)) | np.uint32(0x1000),
            (bits & ~np.uint32(0xFFFF)) | np.uint32(0x8000),
        ]
    )
    x = np.concatenate(
        [
            specials,
            ties.view(np.float32),
            rng.standard_normal(2000).astype(np.float32),
            (rng.standard_normal(2000) * 1e-6).astype(np.float32),
        ]
    )
    return x[np.isfinite(x) | np.isnan(x)]


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_and_bfloat16_round_to_nearest_even_like_mlx(dtype):
    x = _hard_floats()
    n = x.size
    k = me.metal_kernel("cast", ["inp", "n"], ["out", "back", "prod"], CAST)
    out, back, prod = k(
        inputs=[mx.array(x), n],
        template=[("T", dtype)],
        grid=(n, 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(n,)] * 3,
        output_dtypes=[dtype, mx.float32, dtype],
    )
    xm = mx.array(x)
    want = xm.astype(dtype)
    bits = lambda a: np.array(a.view(mx.uint16))  # noqa: E731
    nan = np.isnan(x)
    assert (bits(out)[~nan] == bits(want)[~nan]).all()
    assert np.isnan(np.array(back)[nan]).all()
    np.testing.assert_array_equal(np.array(back)[~nan], np.array(want.astype(mx.float32))[~nan])
    # h * h is rounded once to h (float products of two halves are exact)
    want_prod = (want * mx.roll(want, -1)).astype(mx.float32)
    got = np.array(prod.astype(mx.float32))
    ok = ~np.isnan(np.array(want_prod))
    np.testing.assert_array_equal(got[ok], np.array(want_prod)[ok])


def test_half_arithmetic_matches_numpy_float16():
    src = """
    uint i = thread_position_in_grid.x;
    half a = inp[2 * i], b = inp[2 * i + 1];
    out[4 * i + 0] = a + b;
    out[4 * i + 1] = a - b;
    out[4 * i + 2] = a / b;
    half c = a; c *= b; out[4 * i + 3] = c;
    """
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(2000) * 100).astype(np.float16)
    out = run1("harith", src, 1000, 250, (1000, 4), inputs={"inp": mx.array(x)}, dtype=mx.float16)
    a, b = x[0::2], x[1::2]
    with np.errstate(over="ignore"):
        want = np.stack([a + b, a - b, a / b, a * b], 1)
    np.testing.assert_array_equal(out, want)


# ----------------------------------------------------------------------------- strides


STRIDED_GOOD = """
uint i = thread_position_in_grid.x, j = thread_position_in_grid.y;
out[i * out_cols + j] = inp[i * inp_strides[0] + j * inp_strides[1]];
"""
STRIDED_BAD = """
uint i = thread_position_in_grid.x, j = thread_position_in_grid.y;
out[i * out_cols + j] = inp[i * out_cols + j] + 0 * inp_strides[0];
"""


def _copy2d(src: str, x: mx.array, contiguous: bool) -> mx.array:
    k = me.metal_kernel(
        "copy2d", ["inp", "out_cols"], ["out"], src, ensure_row_contiguous=contiguous
    )
    (out,) = k(
        inputs=[x, x.shape[1]],
        grid=(*x.shape, 1),
        threadgroup=(4, 4, 1),
        output_shapes=[x.shape],
        output_dtypes=[x.dtype],
    )
    return out


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_inputs_keep_their_layout_without_ensure_row_contiguous(dtype):
    base = mx.arange(60, dtype=mx.float32).reshape(6, 10).astype(dtype)
    views = {
        "contiguous": base,
        "transposed": base.T,
        "sliced": base[1:5, 2:9:3],
        "broadcast": mx.broadcast_to(base[2:3], (6, 10)),
        "reversed": base[::-1],
    }
    for name, x in views.items():
        assert mx.array_equal(_copy2d(STRIDED_GOOD, x, False), x), name
        # MLX copies to row order when asked: then even a kernel ignoring strides is right
        assert mx.array_equal(_copy2d(STRIDED_BAD, x, True), x), name
        # ... and passes the view as it lies when not asked (a contiguous input is re-laid
        # with gaps, so the assumption shows there too)
        assert not mx.array_equal(_copy2d(STRIDED_BAD, x, False), x), name


def test_vectors_math_and_constant_inputs():
    src = """
    uint i = thread_position_in_grid.x;
    float4 v = float4(inp[4 * i], inp[4 * i + 1], inp[4 * i + 2], inp[4 * i + 3]);
    half4 h = half4(v);
    float4 w = float4(h) * 2.0f + c[0];
    out[i] = dot(w, float4(1.0f)) + metal::precise::rsqrt(4.0f) + metal::fast::exp(0.0f)
           + metal::clamp(v.x, 0.0f, 1.0f) + metal::max(v.y, v.z) + metal::fma(v.w, 2.0f, 1.0f);
    """
    x = np.linspace(-2, 2, 16).astype(np.float32)
    out = run1("vec", src, 4, 4, (4,), inputs={"inp": mx.array(x), "c": mx.array([0.5])})
    v = x.reshape(4, 4)
    h = v.astype(np.float16).astype(np.float32)
    want = (
        (h * 2 + 0.5).sum(1)
        + 0.5
        + 1
        + np.clip(v[:, 0], 0, 1)
        + np.maximum(v[:, 1], v[:, 2])
        + v[:, 3] * 2
        + 1
    )
    np.testing.assert_allclose(out, want, rtol=1e-6)


def test_writes_past_an_output_are_caught_and_reads_past_an_input_are_poison():
    src = "uint i = thread_position_in_grid.x; out[i] = inp[i + 1];"
    k = me.metal_kernel("past", ["inp"], ["out"], src)
    kw = dict(grid=(8, 1, 1), threadgroup=(8, 1, 1), output_dtypes=[mx.float32])
    (out,) = k(inputs=[mx.arange(8, dtype=mx.float32)], output_shapes=[(8,)], **kw)
    assert np.array(out)[:7].tolist() == list(range(1, 8)) and np.isnan(np.array(out)[7])
    with pytest.raises(me.EmulatorError, match="wrote past the end of `out`"):
        k(inputs=[mx.arange(9, dtype=mx.float32)], output_shapes=[(7,)], **kw)


def test_schedule_setting_is_checked_and_restored():
    with pytest.raises(ValueError, match="unknown schedule 'backwards'"):
        me.set_schedule("backwards")
    before = me._schedule
    with me.schedule("shuffled", 5):
        assert me._schedule == ("shuffled", 5)
    assert me._schedule == before


def test_literals_are_float_and_half_as_in_msl():
    # MSL has no double: 2^24 + 1 + 1 in float stays 2^24 (in double it would be 2^24 + 2).
    src = """
    out[0] = 16777216.0 + 1.0 + 1.0;
    out[1] = 0.1h;
    out[2] = .5h + 1e1h + 2.h;
    """
    out = run1("literals", src, 1, 1, (3,))
    assert out.tolist() == [16777216.0, float(np.float16(0.1)), 12.5]


def test_lanes_at_different_collectives_are_reported():
    src = """
    float v = 1.0f;
    out[thread_index_in_simdgroup] = thread_index_in_simdgroup < 16 ? simd_sum(v) : simd_max(v);
    """
    with pytest.raises(me.EmulatorError, match="different SIMD collectives"):
        run1("mixed_collectives", src, 32, 32, (32,))


def test_threadgroup_memory_beyond_32_kb_is_an_error_not_a_crash():
    src = "threadgroup float big[9000]; big[0] = 1.0f; out[0] = big[0];"
    with pytest.raises(me.EmulatorError, match="threadgroup memory exceeds 32 KB"):
        run1("big_tg", src, 1, 1, (1,))


def test_collectives_carry_vectors_and_halves():
    src = """
    uint lane = thread_index_in_simdgroup;
    float4 v = float4(float(lane), 1.0f, -float(lane), 2.0f);
    float4 s = simd_sum(v);
    half h = simd_shuffle_xor(half(lane) * 0.5h, 1);
    out[lane] = s.x + 10000.0f * s.y + s.z * 0.001f + s.w + float(h) * 1000000.0f;
    """
    out = run1("vec_collectives", src, 32, 32, (32,))
    lanes = np.arange(32)
    want = 496 + 10000 * 32 - 0.496 + 64 + (lanes ^ 1) * 0.5 * 1e6
    np.testing.assert_allclose(out, want.astype(np.float32), rtol=1e-7)


def test_atomic_outputs():
    src = """
    uint i = thread_position_in_grid.x;
    atomic_fetch_add_explicit(&hist[bins[i]], 1.0f, memory_order_relaxed);
    """
    k = me.metal_kernel("hist", ["bins"], ["hist"], src, atomic_outputs=True)
    bins = np.random.default_rng(4).integers(0, 10, 500)
    (out,) = k(
        inputs=[mx.array(bins, dtype=mx.uint32)],
        grid=(500, 1, 1),
        threadgroup=(128, 1, 1),
        output_shapes=[(10,)],
        output_dtypes=[mx.float32],
        init_value=0.0,
    )
    np.testing.assert_array_equal(np.array(out), np.bincount(bins, minlength=10))


def test_threadgroup_declarations_in_a_template_helper_get_a_place_per_type():
    header = """
    template <typename U> U roundtrip(U v, uint i) {
      threadgroup U slot[64];
      slot[i] = v;
      threadgroup_barrier(mem_flags::mem_threadgroup);
      return slot[63 - i];
    }
    """
    src = """
    uint i = thread_index_in_threadgroup;
    out[i] = float(roundtrip<half>(half(i), i)) + float(roundtrip<float4>(float4(i), i).w);
    """
    k = me.metal_kernel("tg_helper", [], ["out"], src, header=header)
    (out,) = k(
        inputs=[],
        grid=(64, 1, 1),
        threadgroup=(64, 1, 1),
        output_shapes=[(64,)],
        output_dtypes=[mx.float32],
    )
    np.testing.assert_array_equal(np.array(out), 2.0 * (63 - np.arange(64)))
