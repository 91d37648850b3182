"""Checks run before any backend sees the arrays: a shape a kernel cannot serve is one
line (KernelError), never an out-of-bounds read inside a kernel. Every backend gets the
same checks, so `ops`, `fast` and `metal` refuse the same inputs."""

from __future__ import annotations

import mlx.core as mx

from .errors import KernelError


def check_norm(x: mx.array, weight: mx.array, residual: mx.array | None = None) -> None:
    name = "add_rms_norm" if residual is not None else "rms_norm"
    if x.ndim == 0:
        raise KernelError(f"{name}: input must have at least 1 dimension")
    if x.shape[-1] == 0:
        raise KernelError(f"{name}: hidden size is 0")
    if weight.ndim != 1 or weight.shape[0] != x.shape[-1]:
        raise KernelError(
            f"{name}: weight of shape {tuple(weight.shape)} does not match hidden size "
            f"{x.shape[-1]}"
        )
    if residual is not None and residual.shape != x.shape:
        raise KernelError(
            f"{name}: residual of shape {tuple(residual.shape)} differs from x "
            f"{tuple(x.shape)}"
        )
    for a in (x, weight) if residual is None else (x, residual, weight):
        if not mx.issubdtype(a.dtype, mx.floating):
            raise KernelError(f"{name}: needs floating-point arrays, got {a.dtype}")


def check_rope(
    xs: tuple[mx.array, ...],
    dims: int,
    base: float | None,
    offset: int | mx.array,
    freqs: mx.array | None,
) -> None:
    x = xs[0]
    if x.ndim < 3:
        raise KernelError(f"rope: input must be (B, ..., T, D), got {x.ndim} dimensions")
    for y in xs:
        if not mx.issubdtype(y.dtype, mx.floating):
            raise KernelError(f"rope: needs a floating-point array, got {y.dtype}")
    if len(xs) == 2:
        q, k = xs
        if q.ndim != k.ndim or q.shape[0] != k.shape[0] or q.shape[-2:] != k.shape[-2:]:
            raise KernelError(
                f"rope_qk: q {tuple(q.shape)} and k {tuple(k.shape)} must share batch, "
                "positions and head size"
            )
        if q.dtype != k.dtype:
            raise KernelError(f"rope_qk: q is {q.dtype} but k is {k.dtype}")
    head_dim = x.shape[-1]
    if not isinstance(dims, int) or dims <= 0 or dims % 2:
        raise KernelError(f"rope: rotary dims must be a positive even number, got {dims}")
    if dims > head_dim:
        raise KernelError(f"rope: rotary dims {dims} exceed the head size {head_dim}")
    if (base is None) == (freqs is None):
        raise KernelError("rope: give exactly one of base and freqs")
    if base is not None and not base > 0:
        raise KernelError(f"rope: base must be > 0, got {base}")
    if freqs is not None and (freqs.ndim != 1 or freqs.shape[0] != dims // 2):
        raise KernelError(
            f"rope: freqs must have dims/2 = {dims // 2} entries, got shape {tuple(freqs.shape)}"
        )
    if isinstance(offset, mx.array):
        batch = x.shape[0]  # mx.fast.rope's convention: axis 0 is the batch
        if not mx.issubdtype(offset.dtype, mx.integer):
            raise KernelError(f"rope: offset must be an integer array, got {offset.dtype}")
        if offset.ndim > 1 or offset.size not in (1, batch):
            raise KernelError(
                f"rope: offset array must hold 1 or batch = {batch} values, "
                f"got shape {tuple(offset.shape)}"
            )
    elif not isinstance(offset, int) or isinstance(offset, bool):
        raise KernelError(f"rope: offset must be an int or an integer array, got {offset!r}")
