"""Kernel cases and tolerances shared by the backend tests (tests/test_kernels.py) and the
Metal emulator's (tests/test_emulator_kernels.py): inputs, the shapes and dtypes the
decoder meets, and running a case on a named backend.

Tolerances, per element: |got - ref| <= atol + rtol * |ref|, with (rtol, atol)
  float32 (1e-5, 1e-6): summation order and rsqrt/exp2/pow rounding;
  float16 (2^-9, 2^-14) and bfloat16 (2^-6, 2^-14): two units in the last place, as the
  normalised value is rounded to the dtype once and then scaled by the weight (a
  reduction in another order can move it across a rounding boundary);
plus, for RoPE, (2.4e-7 * max position + rtol) * max |x|: the angle pos / period is a
float32 whose rounding (one ulp is 1.2e-7 relative) grows with the position and that
backends form differently (pow vs exp2 for the periods); and a rotation mixes two inputs,
so an output near 0 can carry the rounding of a large input (mx.fast's CPU path also
rounds cos, sin and each product to the dtype).
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np

from kvchat import metal_kernels
from kvchat.model.decoder.layers import rope_periods

HIDDEN = (1, 7, 64, 576, 4096, 8193)
ROWS = (1, 3, 512)
DTYPES = (mx.float32, mx.float16, mx.bfloat16)
TOL = {mx.float32: (1e-5, 1e-6), mx.float16: (2**-9, 2**-14), mx.bfloat16: (2**-6, 2**-14)}
EPS = 1e-5
# GQA head counts (query heads, KV heads) as the issue lists them
GQA = ((8, 2), (32, 8), (4, 1))

def assert_close(got: mx.array, ref: mx.array, dtype: mx.Dtype, extra: float = 0.0) -> None:
    """The tolerance above; `extra` is an absolute allowance (RoPE angles)."""
    assert got.shape == ref.shape and got.dtype == ref.dtype, (got.shape, got.dtype, ref.dtype)
    g, r = np.array(got.astype(mx.float32)), np.array(ref.astype(mx.float32))
    rtol, atol = TOL[dtype]
    bound = atol + extra + rtol * np.abs(r)
    worst = float(np.max(np.abs(g - r) - bound)) if g.size else -1.0
    assert np.isfinite(g).all(), "non-finite output"
    assert worst <= 0, f"max excess over tolerance {worst:.3g} ({dtype})"


def rope_allowance(x: mx.array, max_pos: int) -> float:
    """RoPE's extra absolute allowance (above): angle rounding, and the
    relative tolerance taken against max |x| as well as the element."""
    return (2.4e-7 * max_pos + TOL[x.dtype][0]) * float(mx.abs(x.astype(mx.float32)).max())


def on(name: str, fn: Callable, *args, **kw):
    with metal_kernels.using(name):
        out = fn(*args, **kw)
        mx.eval(out)
        return out


# ----------------------------------------------------------------------------- inputs


def norm_inputs(rows: int, hidden: int, dtype: mx.Dtype, seed: int = 0):
    key = mx.random.key(seed + 7 * hidden + rows)
    k1, k2, k3 = mx.random.split(key, 3)
    x = (2.0 * mx.random.normal((rows, hidden), key=k1)).astype(dtype)
    residual = mx.random.normal((rows, hidden), key=k2).astype(dtype)
    weight = (1.0 + 0.2 * mx.random.normal((hidden,), key=k3)).astype(dtype)
    return x, residual, weight


def qk_inputs(B: int, hq: int, hk: int, T: int, D: int, dtype: mx.Dtype, seed: int = 0):
    """Q and K as the attention makes them: (B, T, H, D) projections viewed as (B, H, T, D)."""
    k1, k2 = mx.random.split(mx.random.key(seed + hq * 100 + T), 2)
    q = mx.random.normal((B, T, hq, D), key=k1).astype(dtype).transpose(0, 2, 1, 3)
    k = mx.random.normal((B, T, hk, D), key=k2).astype(dtype).transpose(0, 2, 1, 3)
    return q, k


def llama3_periods(dims: int) -> mx.array:
    from kvchat.model.decoder.rope import RopeConfig

    return rope_periods(dims, RopeConfig(type="llama3", theta=500000.0, factor=8.0,
                                         low_freq_factor=1.0, high_freq_factor=4.0,
                                         original_max_position_embeddings=64))


# ----------------------------------------------------------------------------- cases
# (each case is a dict of keyword arguments)

NORM_CASES = [
    dict(rows=rows, hidden=hidden, dtype=dtype)
    for hidden in HIDDEN
    for rows in ROWS
    for dtype in DTYPES
    if not (rows == 512 and hidden == 8193 and dtype != mx.float32)  # same path as fp32
]

ROPE_CASES = (
    # both layouts x offsets (0, 1000, an int array, one per batch row) x dtypes
    [
        dict(B=2, hq=8, hk=2, T=T, D=64, dims=64, traditional=trad, offset=off,
             freqs=False, scale=1.0, dtype=dtype)
        for trad in (False, True)
        for off in (0, 1000, "array", "per_batch")
        for dtype in DTYPES
        for T in (1, 17)
    ]
    # GQA head counts at decode (T = 1) and prefill (T = 512) shapes
    + [
        dict(B=1, hq=hq, hk=hk, T=T, D=128, dims=128, traditional=False, offset=off,
             freqs=False, scale=1.0, dtype=dtype)
        for hq, hk in GQA
        for T, off in ((1, 1000), (512, 0))
        for dtype in (mx.float32, mx.bfloat16)
    ]
    # llama3 periods, linear scale, partial rotary (pass-through features)
    + [
        dict(B=1, hq=4, hk=1, T=33, D=64, dims=64, traditional=False, offset=off,
             freqs=True, scale=1.0, dtype=dtype)
        for off in (0, 1000)
        for dtype in DTYPES
    ]
    + [
        dict(B=1, hq=4, hk=2, T=9, D=D, dims=dims, traditional=trad, offset=7,
             freqs=False, scale=0.25, dtype=dtype)
        for D, dims in ((64, 32), (80, 64), (96, 24), (8, 2))
        for trad in (False, True)
        for dtype in (mx.float32, mx.float16)
    ]
)


def case_id(case: dict) -> str:
    return "-".join(f"{k}={getattr(v, 'name', str(v).replace('mlx.core.', ''))}"
                    for k, v in case.items())


def run_norm(backend: str, rows: int, hidden: int, dtype: mx.Dtype):
    x, residual, weight = norm_inputs(rows, hidden, dtype)
    y = on(backend, metal_kernels.rms_norm, x, weight, EPS)
    h, y2 = on(backend, metal_kernels.add_rms_norm, x, residual, weight, EPS)
    return y, h, y2


def run_rope(backend: str, *, B: int, hq: int, hk: int, T: int, D: int, dims: int,
             traditional: bool, offset, freqs: bool, scale: float, dtype: mx.Dtype):
    """(q_out, k_out, single-tensor rope of q, allowance for the angle rounding)."""
    q, k = qk_inputs(B, hq, hk, T, D, dtype)
    off = {"array": mx.array(1000), "per_batch": mx.array([0, 1000] * (B // 2) + [5] * (B % 2))
           }.get(offset, offset)
    kw = dict(traditional=traditional, scale=scale, offset=off,
              base=None if freqs else 10000.0, freqs=llama3_periods(dims) if freqs else None)
    qo, ko = on(backend, metal_kernels.rope_qk, q, k, dims, **kw)
    single = on(backend, metal_kernels.rope, q, dims, **kw)
    max_pos = int(np.max(np.array(off))) + T if isinstance(off, mx.array) else off + T
    allowance = rope_allowance(mx.concatenate([q.flatten(), k.flatten()]), max_pos)
    return qo, ko, single, allowance
