"""How many threads OpenBLAS may use for one model call, and telling OpenBLAS so.

Why: OpenBLAS starts one thread per core and splits every GEMM/GEMV across them. A
small model's decode step multiplies a single row by matrices of a few hundred columns;
split two ways, each half is microseconds of work and the threads spend longer waking and
synchronising than computing, and on a core shared with anything else (the chat's UI
process, a browser, a build) one of them waits for a time slice while the other spins.
Measured on a 2-core machine (docs/performance.md, "BLAS threads"): on free cores a
second thread pays for a 135M-class model's decode and for prefill chunks of a few
million multiply-adds and up; on a core another program holds it is 2-10x slower.

So the count follows the work and the load. A prefill chunk: one thread per
`MIN_WORK_PER_THREAD` multiply-adds of its largest matmul (tokens × rows × columns); a
decode step: one per `DECODE_MIN_WORK` of the model's multiply-adds per token
(`step_work`); either way at least one, and at most the cores this process may run on
minus the programs running on the machine at this instant (`/proc/loadavg`'s runnable
count, less this process's own running threads), read before each chunk and every
`RECHECK_TOKENS` tokens of a decode that could use more than one.
`KVCHAT_THREADS` (or the settings entry `threads`) fixes the count for every call
instead ("auto" keeps the table).

The count is set with OpenBLAS's own runtime call, `openblas_set_num_threads`, found in
the library `load` put in this process (app/core/linux_blas.py chooses it and, where
OpenBLAS does not know the CPU, its kernel set: `reload`; the engine's child process loads
the same library with the same set from `child_env`); with any other BLAS, or none,
`apply` does nothing and `describe` says so.

Whether reading the load earns its place is measured by `python -m tests.benchmarks.threads`
against fixed counts and against the same table blind to the load (`Policy.reads_load`);
its last line says which rule the numbers support.
"""

from __future__ import annotations

import _ctypes
import ctypes
import os
from collections.abc import Callable
from dataclasses import dataclass

ENV = "KVCHAT_THREADS"
LIB_ENV = "KVCHAT_BLAS_LIB"  # the bound library's path, handed to the engine's child process
CORE_ENV = "KVCHAT_BLAS_CORE"  # the kernel set kvchat loaded it with, for the child's load
_SOURCE_ENV = "KVCHAT_THREADS_FROM"  # so the child's label names the parent's source
AUTO = "auto"
# multiply-adds of a prefill chunk's largest matmul per thread. Measured on an idle
# 2-core machine (docs/performance.md, "BLAS threads"): two threads prefilled a 135M-class model's
# 128-token chunk (1.1e8) 1.5x faster than one and kvchat-mini's 256-token prompt (2.5e7)
# 1.2x faster, stories260K's (2.8e6) no faster; 1e7 puts the line between. On a core
# another program holds, a second thread ran 2-10x slower at every size: the count is
# capped by the free cores (`runnable_others`), read per call.
MIN_WORK_PER_THREAD = 1.0e7
# a decode step runs every matmul of the model once for one row: its work is the model's
# multiply-adds per token (`step_work`). Measured on an idle 2-core machine
# (docs/performance.md, "BLAS threads"): a 135M-class model (1.3e8 per token) decoded
# at 10.5-12.3 tok/s on two threads against 7.4-8.5 on one, while kvchat-mini (2.1e6)
# and stories260K (2.6e5) gained nothing; 5e7 per thread puts the line between them.
DECODE_MIN_WORK = 5.0e7
# how often (tokens) a multi-threaded decode re-reads the machine's load
RECHECK_TOKENS = 32
# OpenBLAS's idle threads spin 2^28 cycles (~0.1 s) after each threaded call before they
# sleep; on a shared core that spin steals the time slice of the single-threaded decode
# steps that follow a prefill. 2^14 cycles is a few µs. Read by OpenBLAS when it loads.
THREAD_TIMEOUT = 14


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


def _own_running(tasks: str = "/proc/self/task") -> int:
    """This process's threads that are runnable now (MLX's stream thread computing while
    Python asks, OpenBLAS's spinning workers): they are not "other programs"."""
    n = 0
    try:
        names = os.listdir(tasks)
    except OSError:
        return 1
    for name in names:
        try:
            with open(f"{tasks}/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        end = stat.rfind(b")")  # the state follows the command name, which may hold spaces
        n += stat[end + 2 : end + 3] == b"R"
    return max(1, n)


def runnable_others(path: str = "/proc/loadavg") -> int:
    """Tasks runnable on the machine right now outside this process (Linux; else 0)."""
    try:
        with open(path) as f:
            running = int(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return 0
    return max(0, running - _own_running())


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
    reads_load: bool = True  # False: the table by shape alone (the benchmark's `shape`)

    def threads_for(self, tokens: int, rows: int, cols: int, others: int = 0) -> int:
        """Threads for a call of `tokens` rows through a largest weight of rows × cols,
        while `others` other tasks are runnable on the machine."""
        if self.fixed is not None:
            return self.fixed
        work = float(tokens) * rows * cols
        return max(1, min(self.cores - others, int(work // self.min_work)))

    def decode_threads(self, work: float, others: int = 0) -> int:
        """Threads for decode steps of `work` multiply-adds per token (`step_work`)."""
        if self.fixed is not None:
            return self.fixed
        return max(1, min(self.cores - others, int(work // DECODE_MIN_WORK)))

    def adapts(self, work: float) -> bool:
        """Whether decode's count can change with the load (else it is fixed at 1 or N)."""
        return (self.fixed is None and self.reads_load and self.cores > 1
                and work >= 2 * DECODE_MIN_WORK)

    def label(self) -> str:
        """One line for --version, the side panel and bench."""
        if self.fixed is not None:
            return f"{self.fixed} fixed ({self.source})"
        if self.cores == 1:
            return "auto: 1 (one core)"
        return (f"auto: 1 for small models' decode, up to {self.cores} for large models'"
                " decode and large prefill chunks" + (" on free cores" if self.reads_load
                                                      else ""))

    def short_label(self) -> str:
        """For the side panel's narrow column."""
        if self.fixed is not None:
            return f"{self.fixed} fixed"
        return f"auto · 1–{self.cores} by shape" if self.cores > 1 else "auto · 1"


def _open(path: str | None, core: str | None = None) -> ctypes.CDLL:
    """`path` in this process's global scope (None: that scope itself). OpenBLAS reads its
    settings from the environment while it loads: its idle spin bounded (THREAD_TIMEOUT)
    and, given `core`, its kernel set (OPENBLAS_CORETYPE), each unless the variable is the
    user's, and each set only for the load, so no child process inherits it."""
    if path is None:
        return ctypes.CDLL(None)
    wanted = {"OPENBLAS_THREAD_TIMEOUT": str(THREAD_TIMEOUT),
              **({"OPENBLAS_CORETYPE": core} if core else {})}
    ours = {k: v for k, v in wanted.items() if k not in os.environ}
    os.environ.update(ours)
    try:
        return ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    finally:
        for k in ours:
            del os.environ[k]


def mapped(path: str, maps: str = "/proc/self/maps") -> bool:
    """Whether the file at `path` is mapped into this process (True where unreadable)."""
    real = os.path.realpath(path)
    try:
        with open(maps) as f:
            return any(line.split(maxsplit=5)[5:] == [real] for line in f.read().splitlines())
    except OSError:
        return True


class _Blas:
    """The process's OpenBLAS thread control, or nothing."""

    def __init__(self) -> None:
        self.path: str | None = None
        self.core: str | None = None  # the OPENBLAS_CORETYPE kvchat loaded it with
        self.lib: ctypes.CDLL | None = None  # the handle kvchat opened (`reload` closes it)
        self._set: Callable[[int], None] | None = None
        self.current: int | None = None

    def bind(self, path: str | None, core: str | None = None) -> bool:
        """Find `openblas_set_num_threads` in `path`, loading it into the global scope (with
        kernel set `core`) if it is not there yet (None: the global scope as it is, where
        a user's LD_PRELOAD puts a library). True when found."""
        try:
            lib = _open(path, core)
        except OSError:
            self.forget()
            return False
        return self.adopt(lib, path, core)

    def forget(self) -> None:
        """Bound to nothing (no pointer into a library about to be closed)."""
        self.path, self.core, self.lib, self._set, self.current = None, None, None, None, None

    def adopt(self, lib: ctypes.CDLL, path: str | None, core: str | None) -> bool:
        """Thread control from `lib`, opened from `path` (None: the global scope)."""
        self.lib, self.core = (lib if path is not None else None), core
        try:
            fn = lib.openblas_set_num_threads
        except AttributeError:
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


def load(path: str, core: str | None = None) -> str | None:
    """Load the BLAS at `path` into this process's global scope (OpenBLAS's kernel set
    `core`, or its own pick) and bind its thread control. Before MLX's first import this
    makes MLX's `cblas_*` calls bind to it (app/core/linux_blas.py says why). None when it
    serves, else why not, in one line."""
    try:
        lib = _open(path, core)
    except OSError as e:
        return " ".join(str(e).split())
    if not hasattr(lib, "cblas_sgemm"):
        return "it exports no cblas_sgemm"
    _blas.adopt(lib, path, core)
    return None


def reload(core: str | None) -> str | None:
    """Close the library `load` opened and load a fresh copy with OpenBLAS's kernel set
    `core` (None: its own pick): OpenBLAS picks its kernels once, as it loads. Only before
    MLX's first import: nothing may point into the closed copy then (MLX binds its calls
    as it loads; app/core/linux_blas.py). None when a fresh copy serves, else why not."""
    lib, path, was = _blas.lib, _blas.path, _blas.core
    if lib is None or path is None:
        return "kvchat did not load it"
    _blas.forget()
    _ctypes.dlclose(lib._handle)
    if mapped(path):  # another reference holds it, or it is NODELETE: the same copy stays
        _blas.adopt(_open(path), path, was)
        return f"{path} stays loaded after dlclose"
    return load(path, core)


def bind(path: str) -> bool:
    """Thread control from the library at `path` (already loaded: the user's LD_PRELOAD)."""
    return _blas.bind(path)


def configure(setting: str | int | None = None, blas_path: str | None = None,
              core: str | None = None) -> Policy:
    """The process's policy: KVCHAT_THREADS, else `setting`, else automatic; bind the
    OpenBLAS at `blas_path`, loaded with kernel set `core` (None: keep the one `load`
    bound, else look in the global scope). The resolved value goes into the environment so
    the engine's child process makes the same choice (`child_env`). Raises ThreadsError."""
    global _policy
    raw = os.environ.get(ENV, "").strip()
    source = os.environ.get(_SOURCE_ENV) or (ENV if raw else "settings")
    fixed = parse(raw or setting)
    _policy = Policy(fixed=fixed, cores=available_cores(), source=source)
    if blas_path is not None or not _blas.bound:
        _blas.bind(blas_path, core if blas_path is not None else None)
    return _policy


def set_policy(p: Policy) -> Policy:
    """Use `p` as it is (the thread-policy benchmark's columns)."""
    global _policy
    _policy = p
    return p


def child_env() -> dict[str, str]:
    """Environment for the engine's child process: the policy this process resolved and
    the OpenBLAS it bound with the kernel set kvchat chose (kvchat's own variables: the
    child sets OPENBLAS_CORETYPE only while it loads), so the child makes the same choice."""
    p = _policy
    return {ENV: str(p.fixed) if p.fixed is not None else AUTO, _SOURCE_ENV: p.source,
            LIB_ENV: _blas.path or "", CORE_ENV: _blas.core or ""}


def configure_from_env() -> Policy:
    """In the engine's child process, before MLX is imported: what the parent resolved
    (`child_env`), its OpenBLAS loaded here too, with the same kernel set."""
    lib, core = os.environ.get(LIB_ENV) or None, os.environ.get(CORE_ENV) or None
    try:
        return configure(None, lib, core)
    except ThreadsError:
        return configure(AUTO, lib, core)


def policy() -> Policy:
    return _policy


def apply(tokens: int, rows: int, cols: int) -> int:
    """Set OpenBLAS's thread count for a call of this shape; returns the count chosen."""
    p = _policy
    reads = p.fixed is None and p.reads_load and p.cores > 1 and tokens > 1
    n = p.threads_for(tokens, rows, cols, runnable_others() if reads else 0)
    _blas.set(n)
    return n


def apply_decode(work: float) -> int:
    """Set OpenBLAS's thread count for decode steps of `work` multiply-adds per token
    (call it while MLX is idle: between evaluations, never during one)."""
    p = _policy
    busy = runnable_others() if p.adapts(work) else 0
    n = p.decode_threads(work, busy)
    _blas.set(n)
    return n


def step_work(model: object) -> float:
    """Multiply-adds of one decode step: every layer's projections for one row (the
    routed experts' share only, for a mixture) plus the LM head. Reads kvchat's config
    or an mlx-lm model's `args` (bench gives mlx-lm the same count); 0 without either."""
    cfg = getattr(model, "config", None) or getattr(model, "args", None)

    def get(name: str) -> int:
        return int(getattr(cfg, name, 0) or 0)

    h, heads = get("hidden_size"), get("num_attention_heads")
    if not h or not heads:
        return 0.0
    hd = get("head_dim") or h // heads
    attn = h * hd * (2 * heads + 2 * (get("num_key_value_heads") or heads))
    moe = getattr(cfg, "moe", None)
    width = (moe.top_k * moe.expert_size + moe.shared_size if moe is not None
             else get("intermediate_size"))
    return float(get("num_hidden_layers") * (attn + 3 * h * width) + get("vocab_size") * h)


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
