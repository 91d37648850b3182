"""An OpenAI-compatible server as a child process in its own process group: `kvchat serve
--port 0` (its "ready" line says where it listens), or mlx-lm's server on a free port.
The benchmark and the tests start servers this way; `stop()` ends the whole group."""

from __future__ import annotations

import http.client
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any
from urllib.parse import urlsplit

START_TIMEOUT_S = 120


class ServerFailed(RuntimeError):
    """The server exited or did not become ready in time (its last lines attached)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    def __init__(self, model: str, *extra: str, mlx_lm: bool = False,
                 timeout_s: float = START_TIMEOUT_S, env: dict[str, str] | None = None,
                 max_open_files: int | None = None):
        """`max_open_files`: the child's descriptor limit (`ulimit -n`), set before it runs."""
        self.lines: list[str] = []  # its stderr (kvchat's log), as it comes
        self.name = "mlx_lm.server" if mlx_lm else "serve"
        port = free_port() if mlx_lm else 0
        if mlx_lm:
            cmd = [sys.executable, "-m", "mlx_lm.server", "--model", model, "--port", str(port)]
        else:
            cmd = [sys.executable, "-m", "kvchat.app", "serve", "--model", model, "--port", "0"]
        def limit_files() -> None:  # in the child, before exec
            if max_open_files is not None:
                hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
                resource.setrlimit(resource.RLIMIT_NOFILE, (max_open_files, hard))

        self.proc = subprocess.Popen([*cmd, *extra], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True,
                                     env={**os.environ, **(env or {})},
                                     preexec_fn=limit_files if max_open_files else None)
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while not (self._answers(port) if mlx_lm else self._ready_line()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise ServerFailed(f"{self.name} did not start:\n" + "\n".join(self.lines[-20:]))
            time.sleep(0.05)
        if mlx_lm:
            self.url = f"http://127.0.0.1:{port}/v1"
        else:
            self.url = self._ready_line().split(" at ")[1].split()[0]  # http://H:P/v1
        parts = urlsplit(self.url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80

    def _ready_line(self) -> str:
        return next((x for x in self.lines if "ready:" in x), "")

    @staticmethod
    def _answers(port: int) -> bool:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/v1/models")
            ok = conn.getresponse().status == 200
            conn.close()
            return ok
        except OSError:
            return False

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def stop(self) -> int:
        """SIGTERM to the group (SIGKILL after 20 s); the exit status."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


def side_by_side(url: str, calls: list[Any]) -> tuple[list[Any], int]:
    """`calls` (each a function of no arguments making its requests to the kvchat server
    at `url`, ".../v1") run at once, one thread each, released together: their results in
    order, and the most requests the server said it ran at once meanwhile (its own count
    in /v1/kvchat/stats, polled: a loaded machine can start a client late, so client
    timing cannot show it; the stats' list of running requests must agree with that
    count). A call's exception is raised here."""
    import json
    import urllib.request

    results: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []
    start, done, most = threading.Barrier(len(calls)), threading.Event(), [0]

    def watch() -> None:
        while not done.is_set():
            with urllib.request.urlopen(f"{url.rstrip('/')}/kvchat/stats", timeout=30) as r:
                body = json.load(r)
            n = body["queue"]["running_requests"]
            most[0] = max(most[0], n)
            if len(body["running_requests"]) != n:  # a server without keys shows them all
                errors.append(AssertionError(f"{n} running, stats list {body['running_requests']}"))
                return
            time.sleep(0.005)

    def run(i: int) -> None:
        try:
            start.wait(60)
            results[i] = calls[i]()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    watcher = threading.Thread(target=watch)
    watcher.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    done.set()
    watcher.join(60)
    if errors:
        raise errors[0]
    return results, most[0]
