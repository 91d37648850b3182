"""How pipeline ranks find, check and watch each other (the transport is mx.distributed).

- `join()`: `mx.distributed.init` bounded in time (a rank that never comes makes the
  ring's accept wait forever), then a side TCP channel to rank 0 from every other rank:
  heartbeats one way, "stop" the other. It is plain Python sockets, so it keeps working
  while a thread is blocked inside an MLX receive.
- Rank 0's monitor names the rank that failed: its channel closed (the process died) or
  went silent (the host hung or the network dropped). It then shuts down the ring's
  sockets, so a receive blocked in MLX fails at once instead of hanging, and closes the
  channels, so every other rank exits.
- A rank whose channel to rank 0 closes exits too: nothing outlives the chat.
- `check_same_model()`: every rank hashes its model folder; a rank with a different
  config.json or weights is refused at start-up, by rank number and host.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import hashlib
import json
import os
import select
import socket
import stat
import struct
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx

from kvchat.model.decoder.weights import weight_files
from kvchat.model.errors import KVChatError, ModelLoadError

CONNECT_TIMEOUT_S = float(os.environ.get("KVCHAT_CONNECT_TIMEOUT", "30"))
HEARTBEAT_S = 0.5
HEARTBEAT_TIMEOUT_S = float(os.environ.get("KVCHAT_HEARTBEAT_TIMEOUT", "10"))
FULL_HASH_BYTES = 256 << 20  # weight files up to this size are hashed whole
SAMPLE_BLOCKS, BLOCK = 64, 1 << 20  # larger ones: headers + 64 evenly spaced 1 MiB blocks


class PipelineError(KVChatError):
    """A rank failed or disagrees; the message names it."""


def launched() -> bool:
    """Was this process started as one rank of several (mlx.launch, mpirun, kvchat --hosts)?"""
    env = os.environ
    if "MLX_RANK" in env:
        return bool(env.get("MLX_HOSTFILE")) or "MLX_JACCL_COORDINATOR" in env \
            or "MLX_IBV_DEVICES" in env
    return "OMPI_COMM_WORLD_SIZE" in env and env["OMPI_COMM_WORLD_SIZE"] != "1"


def ring_hosts() -> list[str]:
    """Each rank's address as the ring hostfile lists it (empty for other backends)."""
    path = os.environ.get("MLX_HOSTFILE")
    try:
        nodes = json.loads(Path(path).read_text()) if path else []
        return [str(n[0]).rsplit(":", 1)[0] for n in nodes]
    except (OSError, ValueError, IndexError, TypeError):
        return []


def _socket_fds() -> set[int]:
    out = set()
    for name in os.listdir("/dev/fd"):
        try:
            fd = int(name)
            if stat.S_ISSOCK(os.fstat(fd).st_mode):
                out.add(fd)
        except (ValueError, OSError):
            continue
    return out


class Link:
    """This rank's place in the pipeline: group, neighbours, streams, control channel."""

    def __init__(self, group: Any, ring_fds: set[int]):
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.right = (self.rank + 1) % self.size
        self.left = (self.rank - 1) % self.size
        self._hosts = ring_hosts()
        self._ring_fds = ring_fds
        self._streams: tuple[Any, Any] | None = None
        self._failure: str | None = None
        self._failed = threading.Event()
        self._closing = False
        self._conns: dict[int, socket.socket] = {}
        self._lock = threading.Lock()

    def host(self, rank: int) -> str:
        return self._hosts[rank] if rank < len(self._hosts) else f"rank {rank}"

    # ---- data path (MLX; called from the one thread that owns this rank's MLX work) ----
    def _io_streams(self) -> tuple[Any, Any]:
        # streams are thread-local in MLX: made lazily by the thread that uses them
        if self._streams is None:
            self._streams = (mx.new_stream(mx.cpu), mx.new_stream(mx.cpu))
        return self._streams

    def send_async(self, ctrl: mx.array, payload: mx.array | None) -> None:
        """Queue both messages on the send stream, in order (one eval each: MLX may
        run independent outputs of one eval in either order)."""
        s = self._io_streams()[0]
        for a in (ctrl, payload):
            if a is not None:
                mx.async_eval(mx.distributed.send(a, self.right, group=self.group, stream=s))

    def send_wait(self, ctrl: mx.array, payload: mx.array | None) -> None:
        for a in (ctrl, payload):
            if a is not None:
                mx.eval(mx.distributed.send(a, self.right, group=self.group))

    def recv(self, shape: tuple[int, ...], dtype: Any) -> mx.array:
        kw = {"stream": self._io_streams()[1]} if self.rank == 0 else {}
        return mx.distributed.recv(shape, dtype, self.left, group=self.group, **kw)

    # ---- failures -------------------------------------------------------------------
    def fail(self, rank: int, why: str) -> None:
        """Record the first failure, unblock MLX receives, let every other rank go."""
        with self._lock:
            if self._failure is not None or self._closing:
                return
            self._failure = f"rank {rank} ({self.host(rank)}) {why}"
        for fd in self._ring_fds:  # a blocked ring receive now fails instead of hanging
            try:
                socket.socket(fileno=os.dup(fd)).shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._close_channels(b"")
        self._failed.set()

    def check_alive(self) -> None:
        if self._failure is not None:
            raise PipelineError(f"{self._failure}; the distributed model is gone"
                                " (restart it with every host up)")

    def failure_error(self, e: Exception) -> PipelineError:
        """The one line for an MLX error on the ring: the monitor's verdict when it has
        one (it names the rank), else MLX's own message."""
        self._failed.wait(2.0)
        if self._failure is None:
            self.fail(self.left, f"lost: {str(e).splitlines()[0]}")
        return PipelineError(f"{self._failure}; the distributed model is gone"
                             " (restart it with every host up)")

    # ---- control channel ------------------------------------------------------------
    def _close_channels(self, goodbye: bytes) -> None:
        for c in list(self._conns.values()):
            try:
                if goodbye:
                    c.sendall(goodbye)
                c.close()
            except OSError:
                pass
        self._conns.clear()

    def close(self) -> None:
        """Rank 0 at exit: tell the other ranks to stop (their exit status is 0)."""
        with self._lock:
            self._closing = True
        self._close_channels(b"s")

    def _serve_channels(self, server: socket.socket) -> None:
        """Rank 0: accept every rank's channel, then watch the heartbeats."""
        server.settimeout(CONNECT_TIMEOUT_S)
        try:
            while len(self._conns) < self.size - 1:
                conn, _ = server.accept()
                conn.settimeout(CONNECT_TIMEOUT_S)
                (r,) = struct.unpack("!i", conn.recv(4))
                conn.setblocking(False)
                self._conns[r] = conn
        except OSError:
            missing = [r for r in range(1, self.size) if r not in self._conns]
            self.fail(missing[0] if missing else 1, "did not open its control channel")
            return
        finally:
            server.close()
        self._watch()

    def _watch(self) -> None:
        seen = {r: time.monotonic() for r in self._conns}
        while self._conns:
            by_sock = {c: r for r, c in list(self._conns.items())}
            try:
                ready, _, _ = select.select(list(by_sock), [], [], HEARTBEAT_S)
            except (OSError, ValueError):
                return  # closed under us (shutdown)
            now = time.monotonic()
            for c in ready:
                try:
                    data = c.recv(256)
                except OSError:
                    data = b""
                if not data:
                    self.fail(by_sock[c], "exited")
                    return
                seen[by_sock[c]] = now
            for r, t in seen.items():
                if now - t > HEARTBEAT_TIMEOUT_S and r in self._conns:
                    self.fail(r, f"stopped responding (no heartbeat for {HEARTBEAT_TIMEOUT_S:g} s)")
                    return

    def _client(self, host: str, port: int) -> None:
        """Ranks 1..N-1: heartbeat to rank 0; exit when it says stop or goes away."""
        try:
            sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
            sock.sendall(struct.pack("!i", self.rank))
        except OSError:
            os._exit(1)
        while True:
            try:
                ready, _, _ = select.select([sock], [], [], HEARTBEAT_S)
                if ready:
                    data = sock.recv(16)
                    os._exit(0 if data.startswith(b"s") else 1)
                sock.sendall(b"h")
            except OSError:
                os._exit(1)


_current: Link | None = None


def current_link() -> Link | None:
    """This process's link when it joined a group with `join()`, else None."""
    return _current


def join() -> Link:
    """Join the group (bounded: a missing rank ends this process with one line) and open
    the control channel. Call from the main thread before any other MLX work."""
    before = _socket_fds()
    with _deadline(CONNECT_TIMEOUT_S):
        group = mx.distributed.init(
            strict=True, backend=os.environ.get("KVCHAT_BACKEND", "any")
        )
    link = Link(group, _socket_fds() - before)
    global _current
    _current = link
    if link.size < 2:
        return link
    server = None
    port = 0
    if link.rank == 0:
        server = socket.create_server(("", 0))
        port = server.getsockname()[1]
    port = int(mx.distributed.all_sum(mx.array([port], dtype=mx.int32), group=group).item())
    if server is not None:
        threading.Thread(target=link._serve_channels, args=(server,), daemon=True,
                         name="kvchat-ranks").start()
        atexit.register(link.close)
    else:
        rank0 = link.host(0) if link._hosts else _coordinator_host()
        threading.Thread(target=link._client, args=(rank0, port), daemon=True,
                         name="kvchat-heartbeat").start()
    return link


def _coordinator_host() -> str:
    coord = os.environ.get("MLX_JACCL_COORDINATOR", "127.0.0.1:0")
    return coord.rsplit(":", 1)[0]


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """End the process (status 1) with one line on rank 0 if the block outlasts `seconds`.

    mx.distributed.init blocks in accept() holding the GIL, so no Python thread can act
    meanwhile: a forked child prints the line, faulthandler's C thread exits the process.
    """
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: wait for the parent to finish (it closes w) or time out
        os.close(w)
        ready, _, _ = select.select([r], [], [], seconds)
        if not ready and os.environ.get("MLX_RANK", "0") == "0":
            hosts = ", ".join(ring_hosts()) or "the hosts given"
            sys.stderr.write(f"kvchat: error: the other ranks did not connect within"
                             f" {seconds:g} s ({hosts}); is kvchat running on every host"
                             " with the same command?\n")
            sys.stderr.flush()
        os._exit(0)
    os.close(r)
    sink = open(os.devnull, "w")  # noqa: SIM115 (faulthandler needs it open meanwhile)
    faulthandler.dump_traceback_later(seconds + 0.5, exit=True, file=sink)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        sink.close()
        os.close(w)
        os.waitpid(pid, 0)


# ---- small collectives --------------------------------------------------------------------
def gather_ints(link: Link, values: list[int]) -> list[list[int]]:
    """All-gather non-negative ints (< 2**62) from every rank: one row per rank."""
    pairs = []
    for v in values:
        pairs += [v >> 31, v & 0x7FFFFFFF]
    flat = mx.distributed.all_gather(mx.array(pairs, dtype=mx.int32), group=link.group).tolist()
    k = len(pairs)
    rows = [flat[r * k : (r + 1) * k] for r in range(link.size)]
    return [[(row[i] << 31) | row[i + 1] for i in range(0, k, 2)] for row in rows]


def folder_fingerprint(folder: Path) -> tuple[int, bytes, bytes]:
    """(status, config digest, weights digest); status 0 ok, 1 no folder, 2 unreadable.

    The weights digest covers each file's name, size and header, and its data whole up
    to FULL_HASH_BYTES, beyond that SAMPLE_BLOCKS evenly spaced blocks (fast on 40 GB)."""
    if not folder.is_dir():
        return 1, bytes(32), bytes(32)
    try:
        cfg = json.loads((folder / "config.json").read_text())
        c = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).digest()
        w = hashlib.sha256()
        for f in sorted(weight_files(folder), key=lambda p: p.name):
            size = f.stat().st_size
            w.update(f"{f.name}:{size}".encode())
            with open(f, "rb") as fh:
                n = min(int.from_bytes(fh.read(8), "little"), max(size - 8, 0))
                w.update(fh.read(n))
                if size <= FULL_HASH_BYTES:
                    for block in iter(lambda: fh.read(BLOCK), b""):
                        w.update(block)
                else:
                    for i in range(SAMPLE_BLOCKS):
                        fh.seek(8 + n + max(size - 8 - n - BLOCK, 0) * i // (SAMPLE_BLOCKS - 1))
                        w.update(fh.read(BLOCK))
        return 0, c, w.digest()
    except (OSError, ValueError, KVChatError):
        return 2, bytes(32), bytes(32)


def check_same_model(link: Link, folder: Path) -> None:
    """Collective: refuse to start when a rank's model folder differs from rank 0's."""
    status, c, w = folder_fingerprint(folder)
    mine = mx.array([status, *c, *w], dtype=mx.uint8)
    rows = mx.distributed.all_gather(mine, group=link.group).reshape(link.size, -1).tolist()
    ref = rows[0]
    for r, row in enumerate(rows):
        who = f"rank {r} ({link.host(r)})"
        if row[0] == 1:
            raise ModelLoadError(f"{who}: model folder not found: {folder}")
        if row[0] == 2:
            raise ModelLoadError(f"{who}: cannot read the model folder {folder}")
        if row[1:33] != ref[1:33]:
            raise ModelLoadError(
                f"{who} has a different model: its config.json differs from rank 0's ({folder})"
            )
        if row[33:] != ref[33:]:
            raise ModelLoadError(
                f"{who} has a different model: its weights differ from rank 0's ({folder})"
            )
