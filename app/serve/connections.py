"""The connections the server holds: each must send its request within a deadline, and
there are never so many that the process runs out of file descriptors.

uvicorn closes a connection idle between requests (`timeout_keep_alive`) but waits for
ever on one that connects and sends nothing, or half a request; and once descriptors run
out, accept() fails, the server stops answering and asyncio logs a traceback per try.
`GuardedH11Protocol` is uvicorn's h11 protocol with two additions:

- a request deadline: from the moment a connection waits for a request (opened, or its
  last answer sent), its headers must arrive within `idle_timeout_s`, else it is closed
  (the body has its own deadline in server.py's read_json, the answer in JobResponse);
- a connection cap below the descriptor limit: past it, the connection that has waited
  longest for a request is closed to make room; when every one is busy with a request,
  the newcomer gets 503 and is closed. A flood of half-open connections then costs the
  flooder its oldest ones, never the server its accept().
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
from dataclasses import dataclass, field
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

RESERVED_FDS = 32  # descriptors kept for the rest of the process (files, pipes, logs)
MIN_CONNECTIONS = 4
BACKLOG = 128  # connections waiting to be accepted (the listening socket's queue)
MAX_HEADER_BYTES = 16 * 1024  # h11's bound on an incomplete request head (uvicorn's default)
_BUSY_BODY = json.dumps({"error": {
    "message": "too many connections: every one is busy with a request; retry shortly",
    "type": "server_error", "param": None, "code": "too_many_connections"}}).encode()
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        b"connection: close\r\nretry-after: 1\r\ncontent-length: %d\r\n\r\n%s"
        % (len(_BUSY_BODY), _BUSY_BODY))


def default_max_connections() -> int:
    """The descriptor limit less those open now and a reserve."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 65536
    try:
        open_now = len(os.listdir("/proc/self/fd"))
    except OSError:
        open_now = 16
    return max(MIN_CONNECTIONS, soft - open_now - RESERVED_FDS)


@dataclass
class ConnectionLimits:
    """Settings and counters shared by every connection of one server."""

    idle_timeout_s: float
    max_connections: int
    open: int = 0
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("timed_out", "evicted", "refused"), 0))

    def stats(self) -> dict[str, Any]:
        return {"open": self.open, "max": self.max_connections, **self.counters}


def protocol_class(limits: ConnectionLimits) -> type[asyncio.Protocol]:
    """uvicorn's `http=` protocol class for `limits` (uvicorn builds one per connection)."""

    class Protocol(GuardedH11Protocol):
        pass

    Protocol.limits = limits
    return Protocol


class GuardedH11Protocol(H11Protocol):
    limits: ConnectionLimits

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        self._waiting_since = self.loop.time()
        self.limits.open += 1
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections and not self._make_room():
            self.limits.counters["refused"] += 1
            transport.write(BUSY)
            transport.close()
            return
        self._await_request()

    def _make_room(self) -> bool:
        """Close the connection that has waited longest for a request; False when every
        other one is busy with a request."""
        waiting = [c for c in self.connections if c is not self and isinstance(
            c, GuardedH11Protocol) and c._deadline is not None]
        if not waiting:
            return False
        oldest = min(waiting, key=lambda c: c._waiting_since)
        self.limits.counters["evicted"] += 1
        oldest._close()
        return True

    def _await_request(self) -> None:
        self._cancel_deadline()
        self._waiting_since = self.loop.time()
        self._deadline = self.loop.call_later(self.limits.idle_timeout_s, self._too_slow)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        self.limits.counters["timed_out"] += 1
        self._close()

    def _close(self) -> None:
        self._cancel_deadline()
        if not self.transport.is_closing():
            self.transport.close()

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not before:  # a request's head arrived: the app has it now
            self._cancel_deadline()

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self._await_request()  # a pipelined request already read cancels it again
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        self.limits.open -= 1
        super().connection_lost(exc)


def uvicorn_options(limits: ConnectionLimits) -> dict[str, Any]:
    """uvicorn.Config's arguments for `limits`."""
    # backlog: uvicorn listens again with it (2048 by default), and asyncio accepts up to
    # that many connections in one go, before any of them reaches the cap here
    return {"http": protocol_class(limits), "timeout_keep_alive": limits.idle_timeout_s,
            "h11_max_incomplete_event_size": MAX_HEADER_BYTES, "backlog": BACKLOG}
