"""The HTTP client `kvchat pull` talks to the Hub with: every answer bounded once decoded.

huggingface_hub reads API answers and error answers whole (`response.json()`, the error
text), and httpx decodes gzip/deflate as it reads, so a small compressed answer could
grow to gigabytes in memory (a gzip bomb: 1 MB on the wire, 1 GiB decoded). This client's
transport decodes answers itself, counting what comes out, and refuses one past its
bound in one line before the next piece is decoded:

- an API or error answer: `ANSWER_MAX_BYTES` decoded;
- a file (`max_bytes(n)` in the request's extensions): its announced size; a file asked
  for with `Accept-Encoding: identity` that comes encoded anyway is refused before any
  byte is written (its offsets and size would mean nothing);
- encodings other than gzip and deflate are not asked for, and refused when sent.

`install()` makes this huggingface_hub's client (its `set_client_factory`), so its own
calls (`HfApi.model_info`, file metadata) go through it too.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Iterator
from typing import Any

import httpx2

from kvchat.model.errors import KVChatError

ANSWER_MAX_BYTES = 32 * 1024 * 1024  # a repo listing of thousands of files is a few MB
PIECE = 64 * 1024  # the most one decompress call may produce
_EXTENSION = "kvchat_max_bytes"
_ASKED = "gzip, deflate"
_installed = False
_lock = threading.Lock()


class AnswerTooLarge(KVChatError):
    """An answer past its bound once decoded, or in an encoding kvchat does not read."""


def max_bytes(n: int) -> dict[str, Any]:
    """Request extensions bounding a (successful) answer to `n` decoded bytes."""
    return {_EXTENSION: n}


def _decoders(encoding: str) -> list[Any] | None:
    """zlib decompressors for a Content-Encoding (applied last first); None: unknown."""
    names = [e.strip().lower() for e in encoding.split(",") if e.strip()]
    out = []
    for name in reversed(names):
        if name in ("gzip", "x-gzip"):
            out.append(zlib.decompressobj(zlib.MAX_WBITS | 16))
        elif name == "deflate":
            out.append(_Deflate())
        elif name != "identity":
            return None
    return out


class _Deflate:
    """HTTP's deflate: zlib-wrapped as the RFC says, or raw as some servers send it."""

    def __init__(self) -> None:
        self._d: Any = None
        self._first = b""

    def decompress(self, data: bytes, limit: int) -> bytes:
        if self._d is None:
            try:
                d = zlib.decompressobj()
                out = d.decompress(data, limit)
            except zlib.error:
                d = zlib.decompressobj(-zlib.MAX_WBITS)
                out = d.decompress(data, limit)
            self._d = d
            return out
        return self._d.decompress(data, limit)

    @property
    def unconsumed_tail(self) -> bytes:
        return self._d.unconsumed_tail if self._d is not None else b""


def _pieces(d: Any, data: bytes) -> Iterator[bytes]:
    """What `data` decodes to, at most PIECE bytes at a time."""
    out = d.decompress(data, PIECE)
    while out:
        yield out
        out = d.decompress(d.unconsumed_tail, PIECE)


class _BoundedBody(httpx2.SyncByteStream):
    def __init__(self, raw: httpx2.SyncByteStream, decoders: list[Any], cap: int,
                 where: str) -> None:
        self._raw, self._decoders, self._cap, self._where = raw, decoders, cap, where

    def _decode(self, data: bytes, i: int = 0) -> Iterator[bytes]:
        if i == len(self._decoders):
            yield data
            return
        try:
            for piece in _pieces(self._decoders[i], data):
                yield from self._decode(piece, i + 1)
        except zlib.error as e:
            raise AnswerTooLarge(f"{self._where}: the answer is not valid compressed data"
                                 f" ({e})") from None

    def __iter__(self) -> Iterator[bytes]:
        total = 0
        for chunk in self._raw:
            for piece in self._decode(chunk):
                total += len(piece)
                if total > self._cap:
                    raise AnswerTooLarge(
                        f"{self._where} sent more than {self._cap:,} bytes"
                        f"{' once decompressed' if self._decoders else ''}; refused")
                yield piece

    def close(self) -> None:
        self._raw.close()


class BoundedTransport(httpx2.BaseTransport):
    """Wraps a transport: answers decoded here, within their bound (module docstring)."""

    def __init__(self, inner: httpx2.BaseTransport) -> None:
        self._inner = inner

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        identity = request.headers.get("accept-encoding", "").strip().lower() == "identity"
        if not identity:
            request.headers["Accept-Encoding"] = _ASKED
        response = self._inner.handle_request(request)
        where = f"{request.url.host or 'the server'}{request.url.path}"[:120]
        encoding = response.headers.get("content-encoding", "")
        decoders = _decoders(encoding)
        if decoders is None or (identity and decoders):
            response.close()
            why = "it was asked for none" if identity else "kvchat reads gzip and deflate"
            raise AnswerTooLarge(f"{where}: answered in {encoding!r} encoding, but {why};"
                                 " refused")
        bound = request.extensions.get(_EXTENSION)
        cap = bound if isinstance(bound, int) and response.status_code < 400 else \
            ANSWER_MAX_BYTES
        headers = response.headers.copy()
        if decoders:  # decoded here: the client must not decode again
            del headers["content-encoding"]
            headers.pop("content-length", None)
        return httpx2.Response(response.status_code, headers=headers,
                               stream=_BoundedBody(response.stream, decoders, cap, where),
                               extensions=response.extensions, request=request)

    def close(self) -> None:
        self._inner.close()


def client() -> httpx2.Client:
    """huggingface_hub's default client (its request hook, redirects followed, no
    client-wide timeout) on a bounded transport; proxy transports wrapped the same."""
    from huggingface_hub.utils._http import hf_request_event_hook

    c = httpx2.Client(event_hooks={"request": [hf_request_event_hook]}, follow_redirects=True,
                      timeout=None, transport=BoundedTransport(httpx2.HTTPTransport()))
    mounts = getattr(c, "_mounts", None)
    if isinstance(mounts, dict):
        for pattern, transport in list(mounts.items()):
            if transport is not None and not isinstance(transport, BoundedTransport):
                mounts[pattern] = BoundedTransport(transport)
    return c


def install() -> None:
    """Make `client()` the one huggingface_hub uses (once per process)."""
    global _installed
    with _lock:
        if _installed:
            return
        from huggingface_hub import set_client_factory

        set_client_factory(client)
        _installed = True
