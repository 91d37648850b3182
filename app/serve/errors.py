"""A refused request: its HTTP status and message, as OpenAI's error object or Anthropic's.

Every problem with a request is an `ApiError` with a 4xx status (a 5xx for the server's
own), one line naming the field where there is one. The route decides the shape: the
OpenAI routes answer `{"error": {message, type, param, code}}`, `/v1/messages` answers
`{"type": "error", "error": {type, message}}` (docs/serve.md, Anthropic's Messages API).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Anthropic's error types by HTTP status (its API reference, Errors)
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                   403: "permission_error", 404: "not_found_error", 408: "timeout_error",
                   413: "request_too_large", 415: "invalid_request_error",
                   429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


class ApiError(Exception):
    """An error answer with its HTTP status (OpenAI's fields; `anthropic_body` maps them)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code = param, code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        kind = ANTHROPIC_TYPES.get(self.status)
        if kind is None:
            kind = "api_error" if self.status >= 500 else "invalid_request_error"
        return {"type": "error", "error": {"type": kind, "message": self.message}}


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)
