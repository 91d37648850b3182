"""Download a model folder from the Hugging Face Hub into the HF cache, resumably.

Uses huggingface_hub's own requests (model info, the file HEAD with X-Repo-Commit / ETag /
size, and `http_get` with a Range header) but keeps partial files itself: the installed
huggingface_hub deletes a partial download when it fails, and a user pulling a large
model on a flaky link expects the next `kvchat pull` to continue where it stopped.

Layout is the HF cache's (so `huggingface-cli`, mlx-lm and transformers see the same
files): `models--org--name/blobs/<etag>`, `snapshots/<commit>/<file>` -> the blob,
`refs/<revision>` = commit; a partial file is `blobs/<etag>.incomplete`.

Only what kvchat loads is fetched (top-level config, tokenizer, template and safetensors
files); a repo whose weights are only pickles is refused before any byte of them is
downloaded, with the loader's own message.

Nothing the server says chooses a path: the commit must be 40 lowercase hex, a blob is
named by the ETag only when that is a plain hex digest (else by a hash of it), the
revision must be a ref name, file names must be plain relative names, and every path is
checked to resolve inside the cache before it is opened, created, deleted or linked. The
token goes only to the endpoint's own host. A pull is bounded: connect and read timeouts,
a retry budget per file and per pull, every answer bounded once decoded (hub_http.py: API
and error answers, files at their announced size), writing stops at the announced size,
a size or sha256 mismatch deletes the file, and free disk space is checked before the
first byte. Refused before any weight is downloaded: a file name the disk cannot hold
(over 255 bytes), and a config.json kvchat cannot load (its quantization block, say):
config.json comes first and is checked as the loader checks it.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import posixpath
import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvchat.app.core.discovery import hf_cache_dir
from kvchat.model.errors import KVChatError, one_line
from kvchat.model.files import PICKLE_PATTERNS

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# what kvchat reads from a model folder; everything else (onnx/, gguf, pickles, images) is skipped
WANTED = ("*.json", "*.safetensors", "tokenizer.model", "*.jinja", "*.txt", "*.tiktoken")
DEFAULT_ENDPOINT = "https://huggingface.co"
CHUNK = 64 * 1024  # progress and cancel granularity
# a server that stops sending is given up on after READ_TIMEOUT_S (one line; partials stay)
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 20.0
# dropped or short responses: a budget per file and one per pull, never reset by progress
# (a server that cuts every response without Range support would otherwise loop forever)
FILE_RETRIES = 5
PULL_RETRIES = 12
RETRY_WAIT_S = 0.5  # times the attempt number
# a stall (ReadTimeout) is not retried: the next attempt would stall the same way
TRANSIENT = ("ConnectError", "ConnectTimeout", "ReadError", "RemoteProtocolError",
             "WriteError", "PoolTimeout")
HEX_DIGEST = re.compile(r"^(?:[0-9a-f]{40}|[0-9a-f]{64})$")  # git sha1 or sha256 ETags
# git's ref-name rules, as far as a path is concerned (git check-ref-format)
_REF_PART = re.compile(r"^[A-Za-z0-9_+@-][A-Za-z0-9_.+@-]*$")


class PullError(KVChatError):
    """A pull that cannot go on; one line."""


class PullCancelled(PullError):
    """The user stopped the pull; partial files stay for the next one."""


def looks_like_repo_id(text: str) -> bool:
    """org/name, and not an existing local path (those are folders to load)."""
    t = text.strip()
    return bool(REPO_ID.match(t)) and not Path(t).expanduser().exists()


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def offline() -> bool:
    flag = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return flag.strip().lower() in ("1", "true", "yes", "on")


def repo_folder(repo_id: str, cache: Path | None = None) -> Path:
    return (cache or hf_cache_dir()) / ("models--" + repo_id.replace("/", "--"))


# ---- names from the server or the user, checked before they reach the file system ---


def check_commit(sha: object, where: str) -> str:
    """A commit hash as huggingface_hub requires one: 40 lowercase hex digits."""
    from huggingface_hub.file_download import REGEX_COMMIT_HASH

    if not isinstance(sha, str) or not REGEX_COMMIT_HASH.fullmatch(sha):
        raise PullError(f"{where} named commit {str(sha)!r:.60}, not a 40-digit hex hash;"
                        " refusing to use it")
    return sha


def check_revision(revision: str) -> str:
    """A branch, tag or commit name that is also a safe relative path under refs/: parts
    split by '/' (a branch's own namespace, e.g. refs/pr/1), none empty, '.' or '..',
    no backslash, control character, leading dot or '.lock' end."""
    parts = revision.split("/")
    if (not revision or len(revision) > 255 or revision.endswith(".lock")
            or not all(_REF_PART.fullmatch(p) and ".." not in p for p in parts)):
        raise PullError(f"not a valid revision name: {revision!r:.80}"
                        " (a branch, tag or commit, without '..' or absolute paths)")
    return revision


def blob_name(etag: str) -> str:
    """The ETag when it is a plain hex digest (what the Hub sends: a git sha1 or the LFS
    sha256), else a sha256 of it: never a path."""
    if HEX_DIGEST.fullmatch(etag):
        return etag
    return hashlib.sha256(etag.encode("utf-8", "surrogatepass")).hexdigest()


NAME_MAX_BYTES = 255  # what a file name may take on the file systems kvchat runs on


def check_file_name(name: object) -> str:
    """A repo file name: relative, normalised, no backslash or NUL, each part short
    enough for a file system to store."""
    if (not isinstance(name, str) or not name or name.startswith("/") or "\\" in name
            or "\0" in name or posixpath.normpath(name) != name
            or name.split("/")[0] == ".."):
        raise PullError(f"the Hub listed a file named {str(name)!r:.80}; refusing to write it")
    longest = max(name.split("/"), key=lambda part: len(part.encode("utf-8", "surrogatepass")))
    if (n := len(longest.encode("utf-8", "surrogatepass"))) > NAME_MAX_BYTES:
        raise PullError(f"the Hub listed a file whose name is {n:,} bytes long ({name!r:.60}…),"
                        f" over the {NAME_MAX_BYTES} a file system stores; refusing the pull")
    return name


def inside(root: Path, path: Path) -> Path:
    """`path` if it resolves inside `root` (its last component is not followed: a link
    there is replaced, never written through); PullError otherwise."""
    real_root = os.path.realpath(root)
    real = os.path.join(os.path.realpath(path.parent), path.name)
    if os.path.commonpath([real_root, real]) != real_root or real == real_root:
        raise PullError(f"refusing to write {path}: it resolves outside the cache {root}")
    return path


def same_origin(url: str, base: str) -> bool:
    from urllib.parse import urlsplit

    a, b = urlsplit(url), urlsplit(base)
    return (a.scheme, a.hostname, a.port) == (b.scheme, b.hostname, b.port)


# ---- progress -------------------------------------------------------------------------


@dataclass
class PullProgress:
    """What the renderers show. Updated from the download thread, read from any."""

    repo_id: str
    files_total: int = 0
    files_done: int = 0
    bytes_total: int = 0
    bytes_done: int = 0  # including bytes found on disk (cached blobs, resumed parts)
    file: str = ""
    file_total: int = 0
    file_done: int = 0
    resumed_bytes: int = 0  # bytes a partial file already held when its download started
    started: float = field(default_factory=time.monotonic)
    _fetched: int = 0  # bytes received over the network this run (for the speed)
    _window: list[tuple[float, int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def received(self, n: int) -> None:
        with self.lock:
            self.file_done += n
            self.bytes_done += n
            self._fetched += n
            now = time.monotonic()
            self._window.append((now, self._fetched))
            # a few seconds of samples: the speed follows the link, not the whole run
            while len(self._window) > 2 and now - self._window[0][0] > 3.0:
                self._window.pop(0)

    @property
    def speed(self) -> float:
        """Bytes a second over the last few seconds of this run."""
        with self.lock:
            if len(self._window) < 2:
                elapsed = time.monotonic() - self.started
                return self._fetched / elapsed if elapsed > 0 else 0.0
            (t0, b0), (t1, b1) = self._window[0], self._window[-1]
            return (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0

    @property
    def eta(self) -> float | None:
        s = self.speed
        left = self.bytes_total - self.bytes_done
        return left / s if s > 0 else None


ProgressFn = Callable[[PullProgress], None]


# ---- the pull -------------------------------------------------------------------------


@dataclass
class Retries:
    """What is left of the pull's retry budget; each file starts its own, smaller one."""

    pull_left: int = PULL_RETRIES
    file_left: int = FILE_RETRIES

    def spend(self, name: str, why: str) -> None:
        if self.file_left <= 0 or self.pull_left <= 0:
            raise PullError(f"{name}: gave up after {FILE_RETRIES - self.file_left} retries"
                            f" ({why}); the partial file is kept, run it again to resume")
        self.file_left -= 1
        self.pull_left -= 1
        time.sleep(RETRY_WAIT_S * (FILE_RETRIES - self.file_left))


def _fetch(url: str, part: Path, name: str, size: int, headers: dict[str, str],
           progress: PullProgress, on_progress: ProgressFn, cancel: threading.Event,
           retries: Retries) -> None:
    """Append the rest of the file to `part` (Range: bytes=N-), retrying a dropped or
    short response from where it stopped, within `retries`; never past `size` bytes."""
    import httpx2
    from huggingface_hub.utils import get_session, hf_raise_for_status

    from kvchat.app.core import hub_http  # httpx: imported only when pulling

    timeout = httpx2.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
    part.touch()  # an empty file is complete as it is
    first = True
    while (have := part.stat().st_size) < size:
        if not first:  # the last response ended short, cleanly or not
            retries.spend(name, "the server's responses end early")
        first = False
        h = {**headers, "Accept-Encoding": "identity"}
        if have:
            h["Range"] = f"bytes={have}-"
        try:
            with get_session().stream("GET", url, headers=h, follow_redirects=True,
                                      timeout=timeout,
                                      # a backstop: the loop below stops at `size` itself
                                      extensions=hub_http.max_bytes(size + 2**20)) as r:
                hf_raise_for_status(r)
                if r.status_code == 206 and _range_start(r) != have:  # not the part we asked
                    progress.received(-have)
                    part.unlink()  # start over; the next attempt asks for all of it
                    part.touch()
                    continue
                resumed = r.status_code == 206
                if not resumed and have:  # 200: the server sends it all again
                    progress.received(-have)
                    have = 0
                with open(part, "ab" if resumed else "wb") as f:
                    for chunk in r.iter_bytes(CHUNK):
                        if cancel.is_set():
                            raise PullCancelled("pull stopped; run it again to resume")
                        if have + len(chunk) > size:
                            f.close()
                            part.unlink()
                            raise PullError(f"{name}: the server sent more than the {size:,}"
                                            " bytes it announced; the download was deleted")
                        f.write(chunk)
                        have += len(chunk)
                        progress.received(len(chunk))
                        on_progress(progress)
                        if have == size:  # all announced bytes: never wait for more
                            break
        except PullError:
            raise
        except Exception as e:
            if type(e).__name__ not in TRANSIENT:
                raise


def _range_start(r: Any) -> int | None:
    m = re.match(r"bytes (\d+)-", r.headers.get("Content-Range", ""))
    return int(m.group(1)) if m else None


def _check_sha256(part: Path, name: str, expected: str | None, ep: str) -> None:
    """Delete the file and say so when the Hub's sha256 for it does not match."""
    if not expected:
        return
    h = hashlib.sha256()
    with open(part, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    if h.hexdigest() != expected.lower():
        part.unlink()
        raise PullError(f"{name}: its sha256 does not match what {ep} announced;"
                        " the download was deleted")


def _check_space(folder: Path, need: int) -> None:
    """Refuse before the first byte when the files cannot fit."""
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return  # cannot tell: the writes will say
    if need > free:
        from kvchat.app.core.discovery import human_bytes

        raise PullError(f"not enough disk space in {probe}: the download needs"
                        f" {human_bytes(need)}, {human_bytes(free)} is free")


def _wanted(name: str) -> bool:
    return "/" not in name and any(fnmatch.fnmatch(name, p) for p in WANTED)


def _check_listing(repo_id: str, names: list[str]) -> None:
    """Refuse before downloading what kvchat could not load anyway."""
    if "config.json" not in names:
        raise PullError(f"{repo_id} has no config.json at its top level: not a model folder")
    if not any(n.endswith(".safetensors") for n in names):
        pickles = [n for n in names for p in PICKLE_PATTERNS if fnmatch.fnmatch(n, p)]
        if pickles:
            raise PullError(
                f"refusing pickle checkpoint {pickles[0]} in {repo_id}: kvchat never unpickles;"
                " pick a repo with safetensors weights"
            )
        raise PullError(f"{repo_id} has no *.safetensors weights")
    if "tokenizer.json" not in names and "tokenizer.model" not in names:
        raise PullError(f"{repo_id} has no tokenizer.json or tokenizer.model")


def _check_config(snapshot: Path) -> None:
    """config.json as the loader will read it, before the weights come: a model kvchat
    cannot build (an unknown family, a quantization block it cannot load) is refused."""
    from kvchat.model.decoder.config import load_config
    from kvchat.model.decoder.weights import validate_quantization

    try:
        cfg = load_config(snapshot)
        if cfg.quantization:
            validate_quantization(cfg.quantization)
    except KVChatError as e:
        raise PullError(f"refusing the pull before its weights: {e}") from None


def _has_partials(repo_id: str, cache: Path) -> bool:
    """Whether the cache holds a partial file of `repo_id` (one a next pull resumes)."""
    try:
        blobs = inside(cache, repo_folder(repo_id, cache) / "blobs")
        return any(p.name.endswith(".incomplete") for p in blobs.iterdir())
    except (OSError, KVChatError):
        return False


def _one_line(e: BaseException, repo_id: str, partials: bool = False) -> str:
    """huggingface_hub's and httpx's errors as one line a user can act on; `partials`:
    the cache holds partial files of the repo (said only then: a pull that never reached
    the server has nothing to keep)."""
    from huggingface_hub import errors as hf

    kept = "; partial files are kept, run it again to resume" if partials else ""
    name = type(e).__name__
    if isinstance(e, hf.GatedRepoError):
        return f"{repo_id} is gated: accept its terms on the Hub and log in (hf auth login)"
    if isinstance(e, hf.RevisionNotFoundError):
        return f"{repo_id} has no such revision"
    if isinstance(e, hf.RepositoryNotFoundError):
        return f"no model {repo_id} on {endpoint()} (or it is private: log in first)"
    if isinstance(e, hf.OfflineModeIsEnabled):
        return f"offline mode (HF_HUB_OFFLINE) is on and {repo_id} is not in the cache"
    if name in ("ReadTimeout", "TimeoutException"):
        return f"{endpoint()} stopped sending for {READ_TIMEOUT_S:.0f} s ({name}){kept}"
    if name in ("ConnectError", "ConnectTimeout",
                "RemoteProtocolError", "ReadError", "NetworkError") or isinstance(
        e, ConnectionError
    ):
        return f"cannot reach {endpoint()} ({name}): no network?{kept}"
    if isinstance(e, hf.HfHubHTTPError):
        first = str(e).strip().splitlines()[0] if str(e).strip() else name
        return f"{endpoint()} answered with an error: {first}"
    if isinstance(e, OSError):
        where = f" {e.filename}" if e.filename else ""
        return f"cannot write the download{where}: {e.strerror or e}"
    return f"{name}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")


def _link(cache: Path, snapshot: Path, name: str, blob: Path) -> None:
    dest = inside(cache, snapshot / name)
    inside(cache, dest.parent).mkdir(parents=True, exist_ok=True)
    inside(cache, dest)  # again: the folders now exist and could hold a link
    if dest.is_symlink() or dest.exists():
        dest.unlink()
    try:
        dest.symlink_to(os.path.relpath(blob, dest.parent))
    except OSError:  # no symlinks (some Windows setups): a copy works the same
        shutil.copyfile(blob, dest)


def cached_snapshot(repo_id: str, revision: str = "main", cache: Path | None = None) -> Path | None:
    """The cached snapshot folder for repo@revision, if the cache knows it."""
    cache = cache or hf_cache_dir()
    folder = repo_folder(repo_id, cache)
    sha = revision = check_revision(revision)
    ref = inside(cache, folder / "refs" / revision)
    if ref.is_file():
        from kvchat.model.files import read_regular_text

        try:
            sha = check_commit(read_regular_text(ref, 1024).strip(), str(ref))
        except (OSError, ValueError, KVChatError):
            return None
    snap = inside(cache, folder / "snapshots" / sha)
    return snap if snap.is_dir() else None


def pull(
    repo_id: str,
    revision: str | None = None,
    *,
    on_progress: ProgressFn = lambda p: None,
    cancel: threading.Event | None = None,
    cache: Path | None = None,
) -> Path:
    """Download repo_id@revision into the HF cache; returns the snapshot folder (not yet
    verified: see verify_pulled). Raises PullError (one line)."""
    repo_id = repo_id.strip()
    if not REPO_ID.match(repo_id):
        raise PullError(f"not a Hugging Face repo id: {repo_id!r} (expected org/name)")
    revision = check_revision(revision or "main")
    cache = cache or hf_cache_dir()
    if offline():
        snap = cached_snapshot(repo_id, revision, cache)
        if snap is None:
            raise PullError(
                f"offline mode (HF_HUB_OFFLINE) is on and {repo_id}@{revision} is not in the cache"
            )
        return snap
    try:
        return _pull(repo_id, revision, cache, on_progress, cancel or threading.Event())
    except KVChatError:  # ours, one line already (an answer past its bound too)
        raise
    except Exception as e:  # httpx / huggingface_hub errors -> one line
        raise PullError(_one_line(e, repo_id, _has_partials(repo_id, cache))) from None


def _pull(
    repo_id: str, revision: str, cache: Path, on_progress: ProgressFn, cancel: threading.Event
) -> Path:
    from huggingface_hub import HfApi, constants
    from huggingface_hub.file_download import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.utils import build_hf_headers

    from kvchat.app.core import hub_http

    # huggingface_hub reads HF_HUB_OFFLINE once, at import; pull() has just read it from
    # the environment as it is now (and returned from the cache if it is set)
    constants.HF_HUB_OFFLINE = False
    hub_http.install()  # every answer bounded once decoded
    ep = endpoint()
    try:
        info = HfApi(endpoint=ep).model_info(repo_id, revision=revision, files_metadata=True,
                                             timeout=READ_TIMEOUT_S)
    except (KeyError, TypeError, AttributeError, ValueError) as e:  # a body of another shape
        raise PullError(f"{ep} answered about {repo_id} in a form kvchat cannot read"
                        f" ({type(e).__name__}: {one_line(e, 80)})") from None
    if not info.sha:
        raise PullError(f"{ep} did not say which commit {repo_id}@{revision} is")
    sha = check_commit(info.sha, ep)
    siblings = info.siblings or []
    _check_listing(repo_id, [s.rfilename for s in siblings])
    # config.json first: it is checked before any weight is fetched
    files = sorted((s for s in siblings if _wanted(s.rfilename)),
                   key=lambda s: s.rfilename != "config.json")
    for s in files:
        check_file_name(s.rfilename)
    progress = PullProgress(
        repo_id, files_total=len(files), bytes_total=sum(s.size or 0 for s in files)
    )
    folder = repo_folder(repo_id, cache)
    blobs = inside(cache, folder / "blobs")
    snapshot = inside(cache, folder / "snapshots" / sha)
    # what is not in the cache yet (an LFS blob is named by its sha256, which the listing
    # gives; small files are counted whole)
    _check_space(blobs, sum(s.size or 0 for s in files if not (
        s.lfs and HEX_DIGEST.fullmatch(s.lfs.sha256 or "") and (blobs / s.lfs.sha256).is_file())))
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    headers = build_hf_headers()
    retries = Retries()
    on_progress(progress)
    for s in files:
        if cancel.is_set():
            raise PullCancelled("pull stopped; run it again to resume")
        name = s.rfilename
        meta = get_hf_file_metadata(hf_hub_url(repo_id, name, revision=sha, endpoint=ep),
                                    timeout=READ_TIMEOUT_S)
        if not meta.etag:
            raise PullError(f"{ep} sent no ETag for {name}; cannot cache it")
        if meta.size is not None and s.size is not None and meta.size != s.size:
            raise PullError(f"{ep} announced two sizes for {name} ({s.size:,} and"
                            f" {meta.size:,} bytes); refusing it")
        size = meta.size if meta.size is not None else (s.size or 0)
        blob = inside(cache, blobs / blob_name(meta.etag))
        with progress.lock:
            progress.file, progress.file_total, progress.file_done = name, size, 0
            progress.bytes_total += size - (s.size or 0)  # a size only the HEAD gave
        if not (blob.is_file() and blob.stat().st_size == size):
            part = inside(cache, blob.with_name(blob.name + ".incomplete"))
            if part.is_symlink() or (part.exists() and not part.is_file()):
                part.unlink()
            have = part.stat().st_size if part.is_file() else 0
            if have > size:  # a different file once had this name: start over
                part.unlink()
                have = 0
            with progress.lock:
                progress.file_done = have
                progress.bytes_done += have
                progress.resumed_bytes += have
            on_progress(progress)
            # the token goes to the endpoint's own host, never to a CDN it redirects to
            h = headers if same_origin(meta.location, ep) else {
                k: v for k, v in headers.items() if k.lower() != "authorization"}
            retries.file_left = FILE_RETRIES
            _fetch(meta.location, part, name, size, h, progress, on_progress, cancel, retries)
            _check_sha256(part, name, s.lfs.sha256 if s.lfs else None, ep)
            os.replace(part, blob)
        else:
            with progress.lock:
                progress.file_done = size
                progress.bytes_done += size
        _link(cache, snapshot, name, blob)
        if name == "config.json":
            _check_config(snapshot)
        with progress.lock:
            progress.files_done += 1
        on_progress(progress)
    if revision != sha:
        ref = inside(cache, folder / "refs" / revision)
        ref.parent.mkdir(parents=True, exist_ok=True)
        if ref.is_symlink():
            ref.unlink()
        ref.write_text(sha, encoding="utf-8")
    return snapshot


def verify_pulled(folder: Path) -> dict[str, Any]:
    """The checks the loader makes, without loading weights: config, tokenizer, weight
    headers (pickles refused). Returns a summary; raises KVChatError (one line)."""
    from kvchat.model.explain.facts import check_model_folder

    facts = check_model_folder(folder)
    return facts.to_dict()


__all__ = [
    "PullCancelled",
    "PullError",
    "PullProgress",
    "cached_snapshot",
    "endpoint",
    "looks_like_repo_id",
    "offline",
    "pull",
    "repo_folder",
    "verify_pulled",
]
