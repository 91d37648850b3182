"""Entry points for the two kernels the decoder calls on every layer: RMSNorm and RoPE.

`model/` calls only these four functions — `rms_norm`, `add_rms_norm`, `rope`,
`rope_qk` — so a backend can be swapped with no change in the model. Backends:

- `metal`: our `.metal` sources through `mx.fast.metal_kernel` (default where Metal exists);
- `fast`:  `mx.fast.rms_norm` / `mx.fast.rope` (default elsewhere; on the CPU, where
           `mx.fast.rope` is a composite of ops, a leaner rotation: `fast.py`);
- `ops`:   plain mlx ops written from the formulas — the readable reference.

`KVCHAT_KERNELS=metal|fast|ops` forces one (and wins over the settings entry, see
`configure`); `set_backend()` switches at run time. Tests register more backends with
`register_backend` (the CPU Metal emulator running the same `.metal` sources); a CUDA
twin (`mx.fast.cuda_kernel`) would register the same way. Every backend gets the same
shape checks (`shapes.py`) first, so a bad shape is one line, never a kernel crash.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

import mlx.core as mx

from . import fast, ops
from .errors import KernelError
from .shapes import check_norm, check_rope

BACKENDS = ("metal", "fast", "ops")  # the built-in names KVCHAT_KERNELS accepts

__all__ = [
    "BACKENDS", "Backend", "KernelError", "add_rms_norm", "available_backends", "backend",
    "configure", "register_backend", "rms_norm", "rope", "rope_qk", "set_backend",
    "switch_backend", "switch_commands", "unregister_backend", "using",
]


class Backend(Protocol):
    """What a backend provides (a module or an object): the four entry points, on inputs
    that already passed the shape checks."""

    def rms_norm(self, x: mx.array, weight: mx.array, eps: float) -> mx.array: ...
    def add_rms_norm(self, x: mx.array, residual: mx.array, weight: mx.array,
                     eps: float) -> tuple[mx.array, mx.array]: ...
    def rope(self, x: mx.array, dims: int, traditional: bool, base: float | None,
             scale: float, offset: int | mx.array, freqs: mx.array | None) -> mx.array: ...
    def rope_qk(self, q: mx.array, k: mx.array, dims: int, traditional: bool,
                base: float | None, scale: float, offset: int | mx.array,
                freqs: mx.array | None) -> tuple[mx.array, mx.array]: ...


_REGISTERED: dict[str, Backend] = {"fast": fast, "ops": ops}  # "metal" is built on first use
_BACKEND: str | None = None


def _impl(name: str) -> Backend:
    if name == "metal" and "metal" not in _REGISTERED:
        from .metal import MetalBackend

        _REGISTERED["metal"] = MetalBackend()
    return _REGISTERED[name]


def _names() -> list[str]:
    return list(BACKENDS) + [n for n in _REGISTERED if n not in BACKENDS]


def _check(name: str) -> str:
    if name not in _names():
        raise KernelError(f"unknown kernels backend {name!r}; allowed: {', '.join(_names())}")
    if name == "metal" and not mx.metal.is_available():
        raise KernelError("kernels backend 'metal' needs Metal, which this machine lacks")
    return name


def _default_backend() -> str:
    forced = os.environ.get("KVCHAT_KERNELS")
    if forced:
        return _check(forced)
    return "metal" if mx.metal.is_available() else "fast"


def backend() -> str:
    """Name of the backend that serves the kernels now (shown in the UI and stats)."""
    global _BACKEND
    if _BACKEND is None:
        _BACKEND = _default_backend()
    return _BACKEND


def set_backend(name: str) -> str:
    """Switch backend at run time; raises KernelError (one line) for an unusable name."""
    global _BACKEND
    _BACKEND = _check(name)
    return _BACKEND


def available_backends() -> list[str]:
    """The names `set_backend` accepts on this machine (for a picker or palette)."""
    return [n for n in _names() if n != "metal" or mx.metal.is_available()]


def switch_backend(name: str) -> str:
    """The UI's run-time switch: one line to show, for success and failure alike.

    Takes effect from the next kernel call; the model needs no rebuild. (A decode step
    traced by `mx.compile` captures the backend: key it on `backend()` to re-trace.)"""
    before = backend()
    try:
        now = set_backend(name)
    except KernelError as e:
        return str(e)
    return f"kernels: {now}" + ("" if now != before else " (unchanged)")


def switch_commands(
    switch: Callable[[str], object],
) -> list[tuple[str, str, Callable[[], object]]]:
    """Command-palette entries `(title, help, callback)`, one per usable backend; the
    callback asks `switch` for that backend (the engine switches where the model runs,
    and reports the one-line outcome)."""
    return [
        (f"Kernels: use {name}", f"run RMSNorm and RoPE on the {name!r} backend from the next"
         " token on (compare decode tok/s on the same chat)",
         lambda name=name: switch(name))
        for name in available_backends()
    ]


def configure(setting: str | None = None) -> str:
    """Pick the backend at start-up: KVCHAT_KERNELS, else the settings entry (`kernels`),
    else the machine's default. Raises KernelError for an unknown or unusable name."""
    global _BACKEND
    _BACKEND = None
    if not os.environ.get("KVCHAT_KERNELS") and setting:
        return set_backend(setting)
    return backend()


def register_backend(name: str, impl: Backend) -> None:
    """Add a backend under `name` (tests: the Metal emulator; a CUDA twin would too)."""
    if name in ("fast", "ops"):
        raise KernelError(f"kernels backend {name!r} is built in")
    _REGISTERED[name] = impl


def unregister_backend(name: str) -> None:
    """Remove a registered backend; the default is used again if it was the current one."""
    global _BACKEND
    if name in ("fast", "ops"):
        raise KernelError(f"kernels backend {name!r} is built in")
    _REGISTERED.pop(name, None)
    if _BACKEND == name:
        _BACKEND = None


@contextmanager
def using(name: str) -> Iterator[str]:
    """Run a block on one backend, then restore the previous one (tests, benchmarks)."""
    global _BACKEND
    before = _BACKEND
    set_backend(name)
    try:
        yield name
    finally:
        _BACKEND = before


# ----------------------------------------------------------------------------- entry points


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """y = x / sqrt(mean(x², last axis) + eps) * weight; dtype result_type(x, weight)."""
    check_norm(x, weight)
    return _impl(backend()).rms_norm(x, weight, eps)


def add_rms_norm(
    x: mx.array, residual: mx.array, weight: mx.array, eps: float
) -> tuple[mx.array, mx.array]:
    """h = x + residual; returns (h, rms_norm(h, weight, eps)) — one pass on `metal`."""
    check_norm(x, weight, residual)
    return _impl(backend()).add_rms_norm(x, residual, weight, eps)


def rope(
    x: mx.array,
    dims: int,
    *,
    traditional: bool,
    base: float | None,
    scale: float,
    offset: int | mx.array,
    freqs: mx.array | None = None,
) -> mx.array:
    """Rotate the first `dims` features of x (B, H, T, D) by position `offset + t`.

    `traditional=False` is the Hugging Face "rotate_half" layout (pairs i, i + dims/2);
    `freqs` (periods, one per pair) overrides `base` for scaled RoPE variants; `scale`
    multiplies positions (linear scaling); `offset` is an int or an integer array with one
    value per batch row. Features past `dims` pass through.
    """
    check_rope((x,), dims, base, offset, freqs)
    return _impl(backend()).rope(x, dims, traditional, base, scale, offset, freqs)


def rope_qk(
    q: mx.array,
    k: mx.array,
    dims: int,
    *,
    traditional: bool,
    base: float | None,
    scale: float,
    offset: int | mx.array,
    freqs: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """RoPE on Q and K of one attention call (their head counts differ under GQA);
    one launch on `metal`."""
    check_rope((q, k), dims, base, offset, freqs)
    return _impl(backend()).rope_qk(q, k, dims, traditional, base, scale, offset, freqs)
