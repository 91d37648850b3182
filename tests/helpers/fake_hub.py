"""A small stand-in for the Hugging Face Hub on 127.0.0.1, serving model folders the way
huggingface_hub talks to the real one:

- GET  /api/models/{repo}[/revision/{rev}][?blobs=True] -> {id, sha, siblings[{rfilename,
  size, blobId, lfs}]}; unknown repo -> 404 with X-Error-Code: RepoNotFound, unknown
  revision -> 404 RevisionNotFound;
- HEAD /{repo}/resolve/{rev}/{file} -> X-Repo-Commit, ETag, Content-Length for small files;
  for LFS files (safetensors) a 302 to /cdn/{sha256} with X-Linked-Etag / X-Linked-Size,
  as the Hub redirects to its CDN;
- GET of either -> the bytes, honouring `Range: bytes=N-` with 206 + Content-Range.

Bounded: it stops itself after `max_requests` requests or `lifetime_s` seconds, so a
test that forgets it cannot hang CI. `throttle_bps` slows the CDN (to watch the bar), and
`cut_after` drops the connection after that many bytes of one CDN response (once).

Hostile modes (tests/test_pull_bad_server.py), each off by default: `etag` and `sha` replace
the ETag / commit the hub announces (path-shaped ones), `cdn_url` sends the LFS redirect
to another server, `stall_after` holds a CDN response after that many bytes, `cut_always`
drops every CDN response after that many bytes and ignores Range, `endless` sends a CDN
body with no Content-Length that never ends, `corrupt` flips a byte of what the CDN sends,
`info` replaces the model-info body, `bad_range` answers a Range with 206 from half the
offset asked, `bomb` sends `bomb_body` (gzip, Content-Encoding: gzip) as the model-info
answer ("api"), as a 500 error answer to it ("error") or as a CDN file ("cdn").

Run standalone for a demo: python -m tests.helpers.fake_hub REPO_ID FOLDER [--throttle BPS]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".model")


@dataclass
class FakeRepo:
    files: dict[str, bytes]
    sha: str = "0123456789abcdef0123456789abcdef01234567"

    @classmethod
    def from_folder(cls, folder: Path, skip: tuple[str, ...] = ()) -> FakeRepo:
        files = {p.name: p.read_bytes() for p in sorted(folder.iterdir())
                 if p.is_file() and p.name not in skip}
        digest = hashlib.sha1(b"".join(files.values())).hexdigest()
        return cls(files, sha=digest)

    def is_lfs(self, name: str) -> bool:
        return name.endswith(LFS_SUFFIXES)

    def etag(self, name: str) -> str:
        data = self.files[name]
        if self.is_lfs(name):
            return hashlib.sha256(data).hexdigest()
        return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git blob id


@dataclass
class FakeHub:
    repos: dict[str, FakeRepo]
    max_requests: int = 400
    lifetime_s: float = 120.0
    throttle_bps: int | None = None
    cut_after: int | None = None  # bytes into the first CDN response, then drop it
    etag: str | None = None
    sha: str | None = None
    cdn_url: str | None = None
    stall_after: int | None = None
    cut_always: int | None = None
    endless: bool = False
    corrupt: bool = False
    info: object = None  # the model-info body to send instead (any JSON value)
    bad_range: bool = False  # answer a Range request with 206 from half the offset asked
    bomb: str | None = None  # "api", "error" or "cdn": that answer is `bomb_body`, gzipped
    bomb_body: bytes = b""
    requests: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self, port: int = 0) -> FakeHub:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                hub._handle(self, "GET")

            def do_HEAD(self) -> None:
                hub._handle(self, "HEAD")

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        timer = threading.Timer(self.lifetime_s, self.stop)
        timer.daemon = True
        timer.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            server, self._server = self._server, None
            threading.Thread(target=server.shutdown, daemon=True).start()
            server.server_close()

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- routing --------------------------------------------------------------------
    def _handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        path = unquote(urlsplit(h.path).path)
        self.requests.append((method, path, dict(h.headers)))
        if len(self.requests) > self.max_requests:
            self._send(h, 503, b"too many requests for the fake hub", method)
            self.stop()
            return
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"]:
            self._api(h, parts[2:], method)
        elif parts[0] == "cdn" and len(parts) == 2:
            self._cdn(h, parts[1], method)
        elif len(parts) >= 5 and parts[2] == "resolve":
            self._resolve(h, "/".join(parts[:2]), parts[3], "/".join(parts[4:]), method)
        else:
            self._send(h, 404, b"not found", method)

    def _repo(self, h: BaseHTTPRequestHandler, repo_id: str, rev: str, method: str
              ) -> FakeRepo | None:
        repo = self.repos.get(repo_id)
        if repo is None:
            self._send(h, 404, b"Repository not found", method,
                       {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"})
            return None
        if rev not in ("main", repo.sha):
            self._send(h, 404, b"Revision not found", method,
                       {"X-Error-Code": "RevisionNotFound",
                        "X-Error-Message": "Invalid rev id: " + rev})
            return None
        return repo

    def _api(self, h: BaseHTTPRequestHandler, rest: list[str], method: str) -> None:
        repo_id = "/".join(rest[:2])
        rev = rest[3] if len(rest) >= 4 and rest[2] == "revision" else "main"
        repo = self._repo(h, repo_id, rev, method)
        if repo is None:
            return
        if self.bomb in ("api", "error"):
            self._send(h, 200 if self.bomb == "api" else 500, self.bomb_body, method,
                       {"Content-Type": "application/json", "Content-Encoding": "gzip"})
            return
        if self.info is not None:
            self._send(h, 200, json.dumps(self.info).encode(), method,
                       {"Content-Type": "application/json"})
            return
        siblings = []
        for name, data in repo.files.items():
            s: dict[str, object] = {"rfilename": name, "size": len(data),
                                    "blobId": hashlib.sha1(data).hexdigest()}
            if repo.is_lfs(name):
                s["lfs"] = {"size": len(data), "sha256": repo.etag(name), "pointerSize": 134}
            siblings.append(s)
        body = json.dumps({"_id": "x", "id": repo_id, "modelId": repo_id,
                           "sha": self.sha or repo.sha,
                           "private": False, "siblings": siblings}).encode()
        self._send(h, 200, body, method, {"Content-Type": "application/json"})

    def _resolve(self, h: BaseHTTPRequestHandler, repo_id: str, rev: str, name: str,
                 method: str) -> None:
        repo = self._repo(h, repo_id, rev, method)
        if repo is None:
            return
        if name not in repo.files:
            self._send(h, 404, b"Entry not found", method, {"X-Error-Code": "EntryNotFound"})
            return
        etag = f'"{self.etag or repo.etag(name)}"'
        common = {"X-Repo-Commit": repo.sha}
        if repo.is_lfs(name):
            # the Hub redirects LFS files to its CDN and names the blob in X-Linked-*
            h.send_response(302)
            cdn = self.cdn_url or self.url
            for k, v in {**common, "Location": f"{cdn}/cdn/{repo.etag(name)}",
                         "X-Linked-Etag": etag, "X-Linked-Size": str(len(repo.files[name])),
                         "Content-Length": "0"}.items():
                h.send_header(k, v)
            h.end_headers()
            return
        self._send(h, 200, repo.files[name], method, {**common, "ETag": etag}, ranged=True)

    def _cdn(self, h: BaseHTTPRequestHandler, digest: str, method: str) -> None:
        for repo in self.repos.values():
            for name, data in repo.files.items():
                if repo.is_lfs(name) and repo.etag(name) == digest:
                    if self.corrupt:
                        data = data[:-1] + bytes([data[-1] ^ 1])
                    if self.endless and method == "GET":
                        self._endless(h, data)
                        return
                    if self.bomb == "cdn" and method == "GET":
                        self._send(h, 200, self.bomb_body, method, {
                            "ETag": f'"{digest}"', "Content-Encoding": "gzip"})
                        return
                    self._send(h, 200, data, method, {"ETag": f'"{digest}"'},
                               ranged=self.cut_always is None, slow=True)
                    return
        self._send(h, 404, b"no such blob", method)

    # ---- responses ------------------------------------------------------------------
    def _endless(self, h: BaseHTTPRequestHandler, data: bytes) -> None:
        """The file, then zeros, with no Content-Length, until the client hangs up (at
        most 64 MiB, so a broken client cannot fill the disk of the test machine)."""
        h.send_response(200)
        h.send_header("Connection", "close")
        h.end_headers()
        h.close_connection = True
        sent = 0
        try:
            h.wfile.write(data)
            while sent < 64 * 1024 * 1024:
                h.wfile.write(bytes(64 * 1024))
                sent += 64 * 1024
        except OSError:
            pass

    def _send(self, h: BaseHTTPRequestHandler, status: int, body: bytes, method: str,
              headers: dict[str, str] | None = None, *, ranged: bool = False,
              slow: bool = False) -> None:
        start = 0
        rng = h.headers.get("Range")
        if ranged and rng and rng.startswith("bytes=") and rng.endswith("-"):
            start = int(rng[len("bytes="):-1]) // (2 if self.bad_range else 1)
            if start >= len(body):
                h.send_response(416)
                h.send_header("Content-Range", f"bytes */{len(body)}")
                h.send_header("Content-Length", "0")
                h.end_headers()
                return
            status = 206
        payload = body[start:]
        h.send_response(status)
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        if status == 206:
            h.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("Content-Length", str(len(payload)))
        h.end_headers()
        if method == "HEAD":
            return
        cut = self.cut_after if slow else None
        if cut is not None:
            self.cut_after = None  # once
        if slow and self.cut_always is not None:
            cut = self.cut_always
        stall = self.stall_after if slow else None
        step = 16 * 1024
        sent = 0
        for i in range(0, len(payload), step):
            chunk = payload[i:i + step]
            if cut is not None and sent + len(chunk) > cut:
                h.wfile.write(chunk[: cut - sent])
                h.wfile.flush()
                h.close_connection = True
                h.connection.shutdown(2)
                return
            h.wfile.write(chunk)
            sent += len(chunk)
            if stall is not None and sent >= stall:
                h.wfile.flush()
                deadline = time.monotonic() + self.lifetime_s
                while self._server is not None and time.monotonic() < deadline:
                    time.sleep(0.1)  # holds the connection open, sending nothing
                return
            if slow and self.throttle_bps:
                time.sleep(len(chunk) / self.throttle_bps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("repo_id")
    ap.add_argument("folder", type=Path)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--throttle", type=int, default=None, help="CDN bytes per second")
    ap.add_argument("--lifetime", type=float, default=300.0)
    a = ap.parse_args()
    hub = FakeHub({a.repo_id: FakeRepo.from_folder(a.folder)}, lifetime_s=a.lifetime,
                  throttle_bps=a.throttle).start(a.port)
    print(hub.url, flush=True)
    deadline = time.monotonic() + a.lifetime
    while hub._server is not None and time.monotonic() < deadline:
        time.sleep(0.2)


if __name__ == "__main__":
    main()
