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
"""

from __future__ import annotations

import fnmatch
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvchat.app.core.discovery import hf_cache_dir
from kvchat.model.errors import KVChatError
from kvchat.model.files import PICKLE_PATTERNS

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# what kvchat reads from a model folder; everything else (onnx/, gguf, pickles, images) is skipped
WANTED = ("*.json", "*.safetensors", "tokenizer.model", "*.jinja", "*.txt", "*.tiktoken")
DEFAULT_ENDPOINT = "https://huggingface.co"
CHUNK = 64 * 1024  # progress and cancel granularity
MAX_RETRIES = 5  # dropped connections in a row before giving up (the partial file stays)
TRANSIENT = ("ConnectError", "ConnectTimeout", "ReadTimeout", "ReadError", "RemoteProtocolError",
             "WriteError", "PoolTimeout")


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


def _fetch(url: str, part: Path, size: int, headers: dict[str, str], progress: PullProgress,
           on_progress: ProgressFn, cancel: threading.Event) -> None:
    """Append the rest of the file to `part` (Range: bytes=N-), retrying a dropped
    connection from where it stopped; the partial file survives any failure."""
    from huggingface_hub.utils import get_session, hf_raise_for_status

    retries = 0
    while (have := part.stat().st_size if part.exists() else 0) < size:
        h = {**headers, "Accept-Encoding": "identity"}
        if have:
            h["Range"] = f"bytes={have}-"
        try:
            with get_session().stream("GET", url, headers=h, follow_redirects=True) as r:
                hf_raise_for_status(r)
                mode = "ab" if r.status_code == 206 else "wb"  # 200: the server restarted it
                if mode == "wb" and have:
                    progress.received(-have)
                with open(part, mode) as f:
                    for chunk in r.iter_bytes(CHUNK):
                        if cancel.is_set():
                            raise PullCancelled("pull stopped; run it again to resume")
                        f.write(chunk)
                        progress.received(len(chunk))
                        on_progress(progress)
                        retries = 0
        except PullCancelled:
            raise
        except Exception as e:
            if type(e).__name__ not in TRANSIENT or retries >= MAX_RETRIES:
                raise
            retries += 1
            time.sleep(0.5 * retries)
    if part.stat().st_size != size:
        raise PullError(f"{part.name}: got {part.stat().st_size} bytes, expected {size}")


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


def _one_line(e: BaseException, repo_id: str) -> str:
    """huggingface_hub's and httpx's errors as one line a user can act on."""
    from huggingface_hub import errors as hf

    name = type(e).__name__
    if isinstance(e, hf.GatedRepoError):
        return f"{repo_id} is gated: accept its terms on the Hub and log in (hf auth login)"
    if isinstance(e, hf.RevisionNotFoundError):
        return f"{repo_id} has no such revision"
    if isinstance(e, hf.RepositoryNotFoundError):
        return f"no model {repo_id} on {endpoint()} (or it is private: log in first)"
    if isinstance(e, hf.OfflineModeIsEnabled):
        return f"offline mode (HF_HUB_OFFLINE) is on and {repo_id} is not in the cache"
    if name in ("ConnectError", "ConnectTimeout", "ReadTimeout", "TimeoutException",
                "RemoteProtocolError", "ReadError", "NetworkError") or isinstance(
        e, ConnectionError
    ):
        return f"cannot reach {endpoint()} ({name}): no network? Partial files are kept"
    if isinstance(e, hf.HfHubHTTPError):
        first = str(e).strip().splitlines()[0] if str(e).strip() else name
        return f"{endpoint()} answered with an error: {first}"
    if isinstance(e, OSError):
        return f"cannot write the download: {e.strerror or e}"
    return f"{name}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")


def _link(snapshot: Path, name: str, blob: Path) -> None:
    dest = snapshot / name
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.is_symlink() or dest.exists():
        dest.unlink()
    try:
        dest.symlink_to(os.path.relpath(blob, dest.parent))
    except OSError:  # no symlinks (some Windows setups): a copy works the same
        import shutil

        shutil.copyfile(blob, dest)


def cached_snapshot(repo_id: str, revision: str = "main", cache: Path | None = None) -> Path | None:
    """The cached snapshot folder for repo@revision, if the cache knows it."""
    folder = repo_folder(repo_id, cache)
    sha = revision
    ref = folder / "refs" / revision
    if ref.is_file():
        sha = ref.read_text(encoding="utf-8").strip()
    snap = folder / "snapshots" / sha
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
    revision = revision or "main"
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
    except PullError:
        raise
    except Exception as e:  # httpx / huggingface_hub errors -> one line
        raise PullError(_one_line(e, repo_id)) from None


def _pull(
    repo_id: str, revision: str, cache: Path, on_progress: ProgressFn, cancel: threading.Event
) -> Path:
    from huggingface_hub import HfApi, constants
    from huggingface_hub.file_download import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.utils import build_hf_headers

    # huggingface_hub reads HF_HUB_OFFLINE once, at import; pull() has just read it from
    # the environment as it is now (and returned from the cache if it is set)
    constants.HF_HUB_OFFLINE = False
    ep = endpoint()
    info = HfApi(endpoint=ep).model_info(repo_id, revision=revision, files_metadata=True)
    sha = info.sha
    if not sha:
        raise PullError(f"{ep} did not say which commit {repo_id}@{revision} is")
    siblings = info.siblings or []
    _check_listing(repo_id, [s.rfilename for s in siblings])
    files = [s for s in siblings if _wanted(s.rfilename)]
    progress = PullProgress(
        repo_id, files_total=len(files), bytes_total=sum(s.size or 0 for s in files)
    )
    folder = repo_folder(repo_id, cache)
    blobs, snapshot = folder / "blobs", folder / "snapshots" / sha
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    headers = build_hf_headers()
    on_progress(progress)
    for s in files:
        if cancel.is_set():
            raise PullCancelled("pull stopped; run it again to resume")
        name = s.rfilename
        meta = get_hf_file_metadata(hf_hub_url(repo_id, name, revision=sha, endpoint=ep))
        if not meta.etag:
            raise PullError(f"{ep} sent no ETag for {name}; cannot cache it")
        size = meta.size if meta.size is not None else (s.size or 0)
        blob = blobs / meta.etag
        with progress.lock:
            progress.file, progress.file_total, progress.file_done = name, size, 0
            progress.bytes_total += size - (s.size or 0)  # the HEAD's size is the one served
        if not (blob.is_file() and blob.stat().st_size == size):
            part = blob.with_name(blob.name + ".incomplete")
            have = part.stat().st_size if part.is_file() else 0
            if have > size:  # a different file once had this name: start over
                part.unlink()
                have = 0
            with progress.lock:
                progress.file_done = have
                progress.bytes_done += have
                progress.resumed_bytes += have
            on_progress(progress)
            _fetch(meta.location, part, size, headers, progress, on_progress, cancel)
            os.replace(part, blob)
        else:
            with progress.lock:
                progress.file_done = size
                progress.bytes_done += size
        _link(snapshot, name, blob)
        with progress.lock:
            progress.files_done += 1
        on_progress(progress)
    if revision != sha:
        refs = folder / "refs"
        refs.mkdir(parents=True, exist_ok=True)
        (refs / revision).write_text(sha, encoding="utf-8")
    return snapshot


def verify_pulled(folder: Path) -> dict[str, Any]:
    """The checks the loader makes, without loading weights: config, tokenizer, weight
    headers (pickles refused). Returns a summary; raises KVChatError (one line)."""
    from kvchat.model.facts import check_model_folder

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
