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
        prompt/reused/generated tokens, tok/s and the finish reason; `error` on failure."""
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


class _Handler(logging.Handler):
    def __init__(self, log: RequestLog):
        super().__init__(logging.WARNING)
        self.log = log

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.log.notice(f"{record.levelname.lower()}: {record.getMessage()}")
        except Exception:  # logging must never take the server down
            self.handleError(record)


def route_uvicorn_logs(log: RequestLog) -> None:
    """uvicorn's own warnings (a malformed HTTP request, say) in this log's format: one
    line each, JSON with --json-logs; no traceback reaches the terminal."""
    handler = _Handler(log)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.asgi"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(logging.WARNING)
        logger.propagate = False
