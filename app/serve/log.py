"""The server's log: one line per request (text for people, `--json-logs` for machines).

Everything a request controls (its path, a model name in an error) is data: control
characters and newlines are shown, never obeyed by the terminal, and a line stays a line.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, TextIO

from kvchat.app.core.text import visible


def one_line(text: object) -> str:
    return visible(text).replace("\n", "␤").replace("\t", " ")


class RequestLog:
    def __init__(self, json_lines: bool = False, stream: TextIO | None = None):
        self.json_lines = json_lines
        self.stream = stream

    def write(self, **fields: Any) -> None:
        """One record: client, method, path, status, duration_s, and for a generation
        prompt/reused/generated tokens, tok/s, why the cache gave no more (`miss_reason`)
        and the finish reason; `error` on failure."""
        fields = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + "Z",
                  **{k: v for k, v in fields.items() if v is not None}}
        if self.json_lines:
            line = json.dumps(fields, ensure_ascii=True)
        else:
            line = self._text(fields)
        out = self.stream or sys.stderr
        print(line, file=out, flush=True)

    @staticmethod
    def _text(f: dict[str, Any]) -> str:
        parts = [f["time"], f.get("client", "-"), f.get("method", "-"), f.get("path", "-"),
                 str(f.get("status", "-"))]
        if "model" in f:
            parts.append(f"model={f['model']}")
        if "prompt_tokens" in f:
            parts += [f"prompt={f['prompt_tokens']}", f"reused={f.get('reused_tokens', 0)}",
                      f"generated={f.get('generated_tokens', 0)}",
                      f"prefill={f.get('prefill_tps', 0):.1f}tok/s",
                      f"decode={f.get('decode_tps', 0):.1f}tok/s"]
        if "miss_reason" in f:  # why the cache gave no more (model/cache/misses.py)
            at = f.get("differs_at")
            parts.append(f"miss={f['miss_reason']}" + (f"@{at}" if at is not None else ""))
        if "finish_reason" in f:
            parts.append(f"finish={f['finish_reason']}")
        if "duration_s" in f:
            parts.append(f"{f['duration_s']:.3f}s")
        line = " ".join(one_line(p) for p in parts)
        if "error" in f:
            line += f" error: {one_line(f['error'])}"
        return line

    def notice(self, message: str) -> None:
        """A server event that is not a request (start-up, ready, stopping)."""
        if self.json_lines:
            self.write(event=message)
        else:
            print(f"kvchat serve: {one_line(message)}", file=self.stream or sys.stderr,
                  flush=True)


RATE_LIMIT_S = 10.0  # one line per kind of server warning this often, at most


class RateLimit(logging.Filter):
    """At most one record per message text every `period_s` seconds; the next one that
    passes says how many were held back. A client can make the server warn (a malformed
    request, a full descriptor table makes every accept() fail): the log stays readable
    and the disk stays free whatever it sends."""

    def __init__(self, period_s: float = RATE_LIMIT_S, clock: Any = time.monotonic):
        super().__init__()
        self.period_s, self.clock = period_s, clock
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = str(record.msg)
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.period_s:
            self._held[key] = self._held.get(key, 0) + 1
            return False
        if len(self._last) > 256:  # messages with a client's text in them: forget old ones
            self._last = {k: t for k, t in self._last.items() if now - t < self.period_s}
        self._last[key] = now
        held = self._held.pop(key, 0)
        if held:
            record.held_back = held
        return True


class _Handler(logging.Handler):
    def __init__(self, log: RequestLog):
        super().__init__(logging.WARNING)
        self.log = log

    def emit(self, record: logging.LogRecord) -> None:
        try:
            # asyncio's messages go on with the objects involved, a line each: the first
            line = f"{record.levelname.lower()}: {record.getMessage().splitlines()[0]}"
            if record.exc_info and record.exc_info[1] is not None:  # the error, not its trace
                line += f": {record.exc_info[1]}"
            if held := getattr(record, "held_back", 0):
                line += f" (and {held} more like it in the last {RATE_LIMIT_S:g} s)"
            self.log.notice(line)
        except Exception:  # logging must never take the server down
            self.handleError(record)


def route_uvicorn_logs(log: RequestLog) -> None:
    """uvicorn's own warnings (a malformed HTTP request, say) and asyncio's (accept()
    failing when descriptors run out) in this log's format: one line each, JSON with
    --json-logs, rate-limited per message; no traceback reaches the terminal."""
    handler = _Handler(log)
    handler.addFilter(RateLimit())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.asgi", "asyncio"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(logging.WARNING)
        logger.propagate = False
