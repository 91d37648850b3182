"""How many threads OpenBLAS may use for one model call, and telling OpenBLAS so.

Why: OpenBLAS starts one thread per core and splits every GEMM/GEMV across them. A
decode step multiplies a single row by matrices of a few hundred columns; split two
ways, each half is microseconds of work and the threads spend longer waking and
synchronising than computing, and on a core shared with anything else (the chat's UI
process, a browser, a build) one of them waits for a time slice while the other spins.
Measured (README, "Fast by default"): one thread decodes as fast or faster for every
model here; a prefill chunk of hundreds of tokens through a large model on free cores is
the one shape where a second thread can pay.

The policy is a table keyed on the work of the call's largest matmul (tokens × rows ×
columns of the largest weight) and on how many cores are free right now: below
`MIN_WORK_PER_THREAD` multiply-adds per thread, one thread; above, one more thread per
`MIN_WORK_PER_THREAD`, capped at the cores this process may run on minus the other
programs running at this instant (`/proc/loadavg`'s runnable count, read per call: a
second thread on a core another program holds waits a whole time slice, measured at
2-10x slower than one thread on this project's shared 2-core machine).
`KVCHAT_THREADS` (or the settings entry `threads`) fixes the count for every call
instead ("auto" keeps the table).

The count is set with OpenBLAS's own runtime call, `openblas_set_num_threads`, found in
the library the CLI preloaded (app/core/blas.py passes its path to `bind`); with any
other BLAS, or none found, `apply` does nothing and `describe` says so.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from dataclasses import dataclass

ENV = "KVCHAT_THREADS"
LIB_ENV = "KVCHAT_BLAS_LIB"  # the bound library's path, handed to the engine's child process
_SOURCE_ENV = "KVCHAT_THREADS_FROM"  # so the child's label names the parent's source
AUTO = "auto"
# multiply-adds of one matmul per thread. From the matmul timings in README ("Fast by
# default", 2 cores): a decode step (1 × 576 × 1536 = 8.8e5) gains little from a second
# thread even on free cores, and on busy ones every shape up to 4.5e8 ran 2-10x slower
# with two. 1e8 (a few ms per thread, OpenBLAS's own order of magnitude; no idle machine
# was available to measure the crossover) keeps kvchat-mini and stories260K on one
# thread for every call; a 135M-class model's chunks of >= 227 tokens (2e8) may use two.
MIN_WORK_PER_THREAD = 1.0e8


class ThreadsError(ValueError):
    """An unusable KVCHAT_THREADS / settings value; str(e) is one line."""


def parse(value: str | int | None) -> int | None:
    """None for automatic, else a fixed count ≥ 1. Raises ThreadsError."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", AUTO)):
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, str) and value.strip().isdigit():
        n = int(value)
    else:
        n = 0
    if n < 1:
        raise ThreadsError(f"threads must be 'auto' or a whole number >= 1 (got {value!r})")
    return n


def runnable_others(path: str = "/proc/loadavg") -> int:
    """Tasks runnable on the machine right now besides the caller (Linux; else 0)."""
    try:
        with open(path) as f:
            running = int(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return 0
    return max(0, running - 1)


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@dataclass(frozen=True)
class Policy:
    """`fixed` None: the table decides per call; else that many threads always."""

    fixed: int | None = None
    cores: int = 1
    min_work: float = MIN_WORK_PER_THREAD
    source: str = ENV  # where a fixed count came from (the label says)

    def threads_for(self, tokens: int, rows: int, cols: int, others: int = 0) -> int:
        """Threads for a call of `tokens` rows through a largest weight of rows × cols,
        while `others` other tasks are runnable on the machine."""
        if self.fixed is not None:
            return self.fixed
        work = float(tokens) * rows * cols
        return max(1, min(self.cores - others, int(work // self.min_work)))

    def label(self) -> str:
        """One line for --version, the side panel and bench."""
        if self.fixed is not None:
            return f"{self.fixed} fixed ({self.source})"
        if self.cores == 1:
            return "auto: 1 (one core)"
        return (f"auto: 1 for decode, up to {self.cores} for large prefill chunks"
                " on free cores")


    def short_label(self) -> str:
        """For the side panel's narrow column."""
        if self.fixed is not None:
            return f"{self.fixed} fixed"
        return f"auto · 1–{self.cores} by shape" if self.cores > 1 else "auto · 1"


class _Blas:
    """The process's OpenBLAS thread control, or nothing."""

    def __init__(self) -> None:
        self.path: str | None = None
        self._set: Callable[[int], None] | None = None
        self.current: int | None = None

    def bind(self, path: str | None) -> bool:
        """Find `openblas_set_num_threads` in `path` (None: the process's global scope,
        where an LD_PRELOADed OpenBLAS lives). True when found."""
        try:
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL) if path else ctypes.CDLL(None)
            fn = lib.openblas_set_num_threads
        except (OSError, AttributeError):
            self.path, self._set = None, None
            return False
        fn.argtypes, fn.restype = [ctypes.c_int], None
        self.path, self._set, self.current = path, fn, None
        return True

    @property
    def bound(self) -> bool:
        return self._set is not None

    def set(self, n: int) -> None:
        if self._set is not None and n != self.current:
            self._set(n)
            self.current = n


_blas = _Blas()
_policy = Policy(cores=available_cores())


def configure(setting: str | int | None = None, blas_path: str | None = None) -> Policy:
    """The process's policy: KVCHAT_THREADS, else `setting`, else automatic; bind the
    OpenBLAS at `blas_path`. The resolved value goes into the environment so the
    engine's child process makes the same choice (`child_env`). Raises ThreadsError."""
    global _policy
    raw = os.environ.get(ENV, "").strip()
    source = os.environ.get(_SOURCE_ENV) or (ENV if raw else "settings")
    fixed = parse(raw or setting)
    _policy = Policy(fixed=fixed, cores=available_cores(), source=source)
    _blas.bind(blas_path)
    return _policy


def child_env() -> dict[str, str]:
    """Environment for the engine's child process: the policy this process resolved and
    the OpenBLAS it bound, so the child makes the same choice."""
    p = _policy
    return {ENV: str(p.fixed) if p.fixed is not None else AUTO, _SOURCE_ENV: p.source,
            LIB_ENV: _blas.path or ""}


def configure_from_env() -> Policy:
    """In the engine's child process: what the parent resolved (`child_env`)."""
    try:
        return configure(None, os.environ.get(LIB_ENV) or None)
    except ThreadsError:
        return configure(AUTO, os.environ.get(LIB_ENV) or None)


def policy() -> Policy:
    return _policy


def apply(tokens: int, rows: int, cols: int) -> int:
    """Set OpenBLAS's thread count for a call of this shape; returns the count chosen."""
    p = _policy
    busy = runnable_others() if p.fixed is None and p.cores > 1 and tokens > 1 else 0
    n = p.threads_for(tokens, rows, cols, busy)
    _blas.set(n)
    return n


def matmul_shape(model: object) -> tuple[int, int]:
    """(rows, cols) of the largest weight a prefill chunk multiplies every token by: the
    MLP's hidden × intermediate (the LM head sees only the last token). (0, 0) for a
    model without a config (one thread)."""
    cfg = getattr(model, "config", None)
    return (int(getattr(cfg, "hidden_size", 0) or 0),
            int(getattr(cfg, "intermediate_size", 0) or 0))


def set_threads(n: int) -> None:
    """Set a count directly (the thread-policy benchmark's fixed columns)."""
    _blas.set(n)


def bound() -> bool:
    return _blas.bound


def describe() -> str:
    """`kvchat --version` / bench: the policy, or why it cannot act."""
    if not _blas.bound:
        return f"{_policy.label()} (no OpenBLAS thread control in this process)"
    return _policy.label()
