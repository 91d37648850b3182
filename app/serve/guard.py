"""Who may talk to the server: requests naming this server in their Host header, and no
web page from another origin unless `--allow-origin` lets it (docs/serve.md, Who can
reach the server).

A browser is the client to fear on a loopback server: any page the user opens can send
it requests. With DNS rebinding, the page's own name (attacker.example) comes to resolve
to 127.0.0.1, and the browser then lets the page read our answers, as same-origin ones;
those requests say `Host: attacker.example`, so the Host check refuses them. A page that
posts to us directly says where it comes from in `Origin` (or, for an <img> or a form
that sends none, `Sec-Fetch-Site: cross-site`); refused unless allowed. What is left is
refused by the JSON-only bodies (server.py's read_json): a form cannot send one without
a CORS preflight, which the Origin check answers.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from kvchat.app.serve.errors import ApiError

LOCAL_NAMES = ("localhost", "127.0.0.1", "[::1]")
# Sec-Fetch-Site values a page on another site never gets: the user typed the address,
# or the page is this server's own (it serves none)
NOT_A_PAGE = ("same-origin", "none")
_HOST_NAME = re.compile(r"[a-z0-9_]([a-z0-9_.-]*[a-z0-9_])?\.?")


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        return None


def split_host(value: str) -> tuple[str, int | None] | None:
    """("name", port or None) of a Host header value, lowercased, IPv6 in brackets;
    None when it is malformed."""
    value = value.strip().lower()
    if value.startswith("["):
        name, sep, rest = value.partition("]")
        name += sep
        if not sep or _ip(name) is None or rest and not rest.startswith(":"):
            return None
        port = rest[1:]
    else:
        name, _, port = value.partition(":")
        if ":" in port:
            return None  # an IPv6 address without brackets
    if port and not (port.isascii() and port.isdigit() and len(port) <= 5):
        return None
    if not name.startswith("[") and not _HOST_NAME.fullmatch(name):
        return None
    return name, int(port) if port else None


def _bracketed(name: str) -> str:
    ip = _ip(name)
    return f"[{ip}]" if ip is not None and ip.version == 6 else name.lower()


@dataclass(frozen=True)
class HostPolicy:
    """The Host header values this server answers."""

    port: int
    names: frozenset[str]  # "name:port", lowercase, IPv6 names in brackets
    any_ip: bool = False  # bound to every address: an IP literal is the page's own origin
    any_host: bool = False  # --allow-host '*' (a proxy in front checks Host)

    @classmethod
    def build(cls, bound: str, port: int, given: str, allowed: Iterable[str] = ()
              ) -> HostPolicy:
        """The local names, the bound address (and the --host name it came from) with
        the port, plus `allowed` (NAME: with the port; NAME:PORT as it is; '*': any)."""
        names = set()
        for name in (*LOCAL_NAMES, bound, given):
            names.add(f"{_bracketed(name)}:{port}")
        any_host = False
        for item in allowed:
            if item == "*":
                any_host = True
                continue
            parsed = split_host(item if _ip(item) is None else _bracketed(item))
            if parsed is None:
                raise ValueError(f"--allow-host {item!r} is not a host name or NAME:PORT")
            name, p = parsed
            names.add(f"{name}:{port if p is None else p}")
        ip = _ip(bound)
        return cls(port, frozenset(names), ip is not None and ip.is_unspecified, any_host)

    def allows(self, host: str | None) -> bool:
        if host is None or self.any_host:  # no Host: HTTP/1.0, never a browser
            return True
        parsed = split_host(host)
        if parsed is None:
            return False
        name, port = parsed
        port = 80 if port is None else port
        if f"{name}:{port}" in self.names:
            return True
        return self.any_ip and port == self.port and _ip(name) is not None


@dataclass(frozen=True)
class OriginPolicy:
    """Web origins that may call the API (--allow-origin; '*' = any)."""

    origins: frozenset[str]

    @classmethod
    def build(cls, allowed: Iterable[str]) -> OriginPolicy:
        return cls(frozenset(o.strip().lower().rstrip("/") for o in allowed))

    def allows(self, origin: str | None, fetch_site: str | None) -> bool:
        if "*" in self.origins:
            return True
        if origin is not None:
            return origin.strip().lower() in self.origins
        # no Origin: a no-cors request (an <img>, a <script>) says where it comes from here
        return fetch_site is None or fetch_site.strip().lower() in NOT_A_PAGE


class RequestGuard:
    """ASGI middleware in front of everything: Host, then Origin; a refusal is the route's
    error object (no CORS headers: the page may not read it) and one log line."""

    def __init__(self, app: ASGIApp, hosts: HostPolicy, origins: OriginPolicy,
                 on_refused: Callable[[Scope, ApiError], None],
                 shape: Callable[[Scope, ApiError], dict[str, Any]] | None = None):
        """`shape`: the error object a route answers with (default: OpenAI's)."""
        self.app, self.hosts, self.origins, self.on_refused = app, hosts, origins, on_refused
        self.shape = shape or (lambda scope, e: e.body())

    def check(self, headers: Headers) -> ApiError | None:
        if not self.hosts.allows(headers.get("host")):
            return ApiError(400, "the Host header does not name this server (kvchat serve"
                            " --allow-host NAME accepts another name)", code="invalid_host")
        if not self.origins.allows(headers.get("origin"), headers.get("sec-fetch-site")):
            return ApiError(403, "requests from web pages on other origins are refused"
                            " (kvchat serve --allow-origin ORIGIN lets one in)",
                            code="origin_not_allowed")
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (error := self.check(Headers(scope=scope))):
            self.on_refused(scope, error)
            await JSONResponse(self.shape(scope, error), error.status)(scope, receive, send)
            return
        await self.app(scope, receive, send)
