# Copyright: vllm-fleet contributors
# Apache-2.0
"""Engine of the hf_snapshot module: plan, fetch and prove a hub snapshot byte for byte.

The hub transport. The local proof it builds on (the manifest, digests and stat stamps,
which the plan reads without the hub) is hf_manifest.py; that module never imports this.

Pure Python on purpose (unit-testable without Ansible). huggingface_hub is imported
lazily, after HF_ENDPOINT / HF_HUB_DISABLE_XET / HF_TOKEN are set in the environment,
because the library reads them at import time.

Layout: files land in ``local_dir`` (the checkpoint vLLM reads) and nothing else does;
bookkeeping lives in ``state_dir`` beside it: ``manifest.json``, ``progress.json``,
``download.lock`` and ``partial/<sha>/<path>.part`` (kept across killed runs and resumed
with an HTTP Range request from their partial bytes).

Proof: every file's digest (sha256 for LFS files, git blob sha1 otherwise) is computed
from the bytes as they arrive (resumed bytes included) and must equal the listing's
before the file is moved into place. The manifest records size, digest and a stat stamp
per file, so a rerun proves "unchanged" with one stat per file and re-hashes only files
whose stamp moved. Names from the hub are validated before anything is written or deleted.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import importlib.util
import json
import os
import re
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ansible.module_utils.hf_manifest import (  # noqa: F401 (re-exported for callers of the whole client)
    CHECK_JOB_PREFIX,
    DISK_FULL_ERRNOS,
    HASH_CHUNK,
    INDEX_FILE,
    MANIFEST_VERSION,
    NO_LOCK_ERRNOS,
    REFETCH,
    DownloadError,
    Entry,
    HashProgress,
    Options,
    _alive,
    assess,
    check_job_dir,
    check_names,
    feed_file,
    find_extras,
    free_bytes,
    hash_file,
    hash_many,
    human,
    job_result,
    load_manifest,
    local_files,
    manifest_entries,
    manifest_path,
    new_digest,
    open_own,
    own_dir,
    progress_path,
    progress_record,
    read_manifest,
    read_progress,
    recorded_entries,
    resolved,
    stat_stamp,
    unsafe_reason,
    verify_local,
    view_stamp,
    wait_progress,
    write_json_atomic,
)


@dataclass
class Plan:
    sha: str
    entries: list[Entry]
    status: dict[str, str]
    digests: dict[str, str]
    partial_bytes: int
    free_bytes: int
    recorded: bool = False
    notes: list[str] = field(default_factory=list)
    extras: list[str] = field(default_factory=list)
    hashed: int = 0
    # verify=full only: files no download recorded (reported, moved aside by a download)
    # and one finding per bad file (path, problem, expected and actual digest and size).
    strays: list[str] = field(default_factory=list)
    findings: list[dict[str, Any]] = field(default_factory=list)

    @property
    def to_fetch(self) -> list[Entry]:
        return [e for e in self.entries if self.status[e.path] in REFETCH]

    @property
    def bytes_total(self) -> int:
        return sum(e.size for e in self.entries)

    @property
    def complete(self) -> bool:
        return not (self.extras or self.strays) and all(s == "ok" for s in self.status.values())


# --- environment and hub ---------------------------------------------------------------


def xet_importable() -> bool:
    return importlib.util.find_spec("hf_xet") is not None


def setup_environment(opts: Options) -> None:
    """Configure the client through the environment (never argv) before importing it.

    Only the http transport switches Xet off: auto and xet leave the library's own
    choice (Xet where the hub advertises it and hf_xet is installed).
    """
    if opts.transport == "http":
        os.environ["HF_HUB_DISABLE_XET"] = "1"
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
    if opts.endpoint:
        os.environ["HF_ENDPOINT"] = opts.endpoint.rstrip("/")
    if opts.token:
        os.environ["HF_TOKEN"] = opts.token


def check_transport(opts: Options) -> None:
    if opts.transport == "xet" and not xet_importable():
        raise DownloadError(
            "model_download_transport=xet, but hf_xet is not installed in the toolkit venv: "
            "install it (pip install hf_xet) or use transport auto or http. Nothing was downloaded."
        )


def _hub_failure(err: Exception, opts: Options) -> DownloadError:
    name = type(err).__name__
    where = opts.endpoint or "https://huggingface.co"
    if name == "RepositoryNotFoundError":
        return DownloadError(
            f"Repository {opts.repo_id} not found on {where} (or private/gated and the token "
            "does not grant access): check vllm_fleet_model_repo and vllm_fleet_hf_token."
        )
    if name == "RevisionNotFoundError":
        return DownloadError(
            f"Revision {opts.revision!r} not found in {opts.repo_id} on {where}: check "
            "vllm_fleet_model_revision (a branch, tag or 40-hex commit sha)."
        )
    if name in ("ConnectError", "ConnectTimeout", "ReadTimeout", "TimeoutException"):
        return DownloadError(
            f"Cannot reach the hub at {where} ({name}): nothing was downloaded or trusted. "
            "Check vllm_fleet_hf_endpoint and the network, then rerun."
        )
    return DownloadError(f"Hub request for {opts.repo_id}@{opts.revision} failed: {name}: {err}")


def patterns(opts: Options) -> dict[str, list[str] | None]:
    """The file selection, as the manifest records it."""
    return {"include": opts.allow_patterns or None, "exclude": opts.ignore_patterns or None}


def recorded_listing(opts: Options, manifest: dict[str, Any], sha: str) -> list[Entry] | None:
    """The listing a complete manifest recorded for ``sha`` with the same file selection.

    A commit's tree never changes, so the hub need not list it again; a full
    verification trusts no local record and lists anew.
    """
    if (
        opts.verify == "full"
        or not manifest.get("complete")
        or manifest.get("sha") != sha
        or manifest.get("patterns") != patterns(opts)
        or not manifest.get("files")
    ):
        return None
    return recorded_entries(manifest["files"])


def resolve_and_list(
    opts: Options, recorded_sha: str | None, manifest: dict[str, Any] | None = None
) -> tuple[str, list[Entry], list[str]]:
    """Resolve the revision to a commit sha and list the (filtered) tree at that sha.

    The listing comes from ``manifest`` when it recorded this very commit and selection.
    """
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile
    from huggingface_hub.utils import filter_repo_objects

    api = HfApi(endpoint=opts.endpoint or None, token=opts.token or None)
    notes: list[str] = []
    try:
        sha = api.repo_info(opts.repo_id, revision=opts.revision).sha
        if recorded_sha and sha != recorded_sha and not opts.update:
            notes.append(
                f"{opts.revision} now points to {sha}; keeping the recorded {recorded_sha} "
                "(set model_download_update=true to move)"
            )
            sha = recorded_sha
        recorded = recorded_listing(opts, manifest or {}, sha)
        tree = (
            []
            if recorded is not None
            else api.list_repo_tree(opts.repo_id, recursive=True, revision=sha)
        )
        files = [f for f in tree if isinstance(f, RepoFile)]
    except Exception as err:
        if type(err).__module__.startswith(("huggingface_hub", "httpx")):
            raise _hub_failure(err, opts) from err
        raise
    if not sha or not re.fullmatch(r"[0-9a-f]{40}", sha):
        # The sha names a directory of partial files: nothing else may reach the disk.
        raise DownloadError(
            f"The hub returned no valid commit sha for {opts.repo_id}@{opts.revision}: {sha!r}"
        )
    if recorded is not None:
        return sha, recorded, notes
    by_path = {f.path: f for f in files}
    selected = filter_repo_objects(
        items=list(by_path),
        allow_patterns=opts.allow_patterns,
        ignore_patterns=opts.ignore_patterns,
    )
    entries = []
    for path in sorted(selected):
        f = by_path[path]
        entries.append(Entry(path, f.size, f.blob_id, f.lfs.sha256 if f.lfs else None))
    if not entries:
        raise DownloadError(
            f"No file of {opts.repo_id}@{sha} matches include={opts.allow_patterns} "
            f"exclude={opts.ignore_patterns}"
        )
    return sha, entries, notes


# --- names from the hub ------------------------------------------------------------------


def check_listing_names(opts: Options, sha: str, entries: list[Entry]) -> None:
    where = f"the hub listing of {opts.repo_id}@{sha}"
    paths = [e.path for e in entries]
    own_dir(os.path.join(opts.state_dir, "partial"), make=False)
    own_dir(partial_dir(opts, sha), make=False)
    check_names(opts.local_dir, paths, where)
    check_names(partial_dir(opts, sha), [p + ".part" for p in paths], where)


# --- local state -------------------------------------------------------------------------
# The state dir is on shared storage that every node can write, and this runs as root:
# an entry the toolkit makes is never reached through a symlink someone else planted.


def partial_dir(opts: Options, sha: str) -> str:
    return os.path.join(opts.state_dir, "partial", sha)


def partial_path(opts: Options, sha: str, path: str) -> str:
    return os.path.join(partial_dir(opts, sha), path + ".part")


def make_plan(opts: Options, report_hashing: bool = False) -> Plan:
    """Resolve and list, validate every name, then compare the disk with the listing.

    ``report_hashing``: a full verify writes its hashing progress to progress.json (the
    download job, which a wait task follows; never a plan, which may be check mode).
    """
    raw = read_manifest(opts)
    manifest = load_manifest(opts)
    same_rev = raw.get("revision") == opts.revision
    sha, entries, notes = resolve_and_list(opts, raw.get("sha") if same_rev else None, manifest)
    check_listing_names(opts, sha, entries)
    full = opts.verify == "full"
    actual: dict[str, str | None] = {}
    strays: list[str] = []
    with HashProgress(opts, entries, report_hashing) as tick:
        status, digests, hashed = assess(opts, entries, manifest, actual, tick)
    extras = find_extras(opts, entries, raw, strays if full else None)
    partial = 0
    for entry in entries:
        if status[entry.path] in REFETCH:
            with contextlib.suppress(OSError):
                partial += min(os.path.getsize(partial_path(opts, sha, entry.path)), entry.size)
    plan = Plan(sha, entries, status, digests, partial, free_bytes(opts.local_dir), notes=notes)
    plan.extras, plan.hashed = extras, hashed
    if full:
        plan.strays = strays
        plan.findings = findings(opts, entries, status, actual, strays)
    plan.recorded = bool(manifest.get("complete")) and manifest.get("sha") == sha and not hashed
    return plan


def findings(
    opts: Options,
    entries: list[Entry],
    status: dict[str, str],
    actual: dict[str, str | None],
    strays: list[str],
) -> list[dict[str, Any]]:
    """One record per bad file of a full verify: what the listing says and what is there."""
    problems = {"missing": "missing", "size": "truncated", "corrupt": "content"}
    found: list[dict[str, Any]] = []
    for entry in entries:
        problem = problems.get(status[entry.path])
        if problem is None:
            continue
        algorithm, want = entry.reference()
        full = os.path.join(opts.local_dir, entry.path)
        stamp = stat_stamp(full)
        got = actual.get(entry.path)
        if problem == "truncated":
            with contextlib.suppress(OSError):
                got = hash_file(full, algorithm)
            if stamp is not None and stamp["size"] > entry.size:
                problem = "size"  # longer than listed: not truncated, still wrong
        found.append(
            {
                "path": entry.path,
                "problem": problem,
                "algorithm": algorithm,
                "expected_digest": want,
                "actual_digest": got,
                "expected_size": entry.size,
                "actual_size": None if stamp is None else stamp["size"],
            }
        )
    for path in strays:
        stamp = stat_stamp(os.path.join(opts.local_dir, path))
        found.append(
            {
                "path": path,
                "problem": "extra",
                "algorithm": None,
                "expected_digest": None,
                "actual_digest": None,
                "expected_size": None,
                "actual_size": None if stamp is None else stamp["size"],
            }
        )
    return found


def set_aside(opts: Options, sha: str, paths: list[str]) -> str:
    """Move files the listing does not name out of the checkpoint, into the state dir.

    Not deleted: nobody recorded them, so they may be someone's data; not left: a
    stray ``*.safetensors`` in the checkpoint is loaded by vLLM's glob. A rename on
    the same storage costs no copy. Returns the directory they are now in.
    """
    where = os.path.join(
        own_dir(os.path.join(opts.state_dir, "set-aside")), f"{sha[:12]}-{time.time_ns()}"
    )
    for path in paths:
        target = os.path.join(where, path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.replace(os.path.join(opts.local_dir, path), target)
        remove_file(opts.local_dir, path)  # gone already: this removes its emptied parents
    return where


def check_space(opts: Options, plan: Plan) -> None:
    need = sum(e.size for e in plan.to_fetch) - plan.partial_bytes
    if need > 0 and need + opts.space_margin_bytes > plan.free_bytes:
        raise DownloadError(
            f"Not enough free space for {opts.repo_id}@{plan.sha[:12]} in {opts.local_dir}: "
            f"need {need} bytes ({human(need)}) + margin {opts.space_margin_bytes} bytes "
            f"({human(opts.space_margin_bytes)}), free {plan.free_bytes} bytes "
            f"({human(plan.free_bytes)}). Nothing was downloaded."
        )


# --- lock ----------------------------------------------------------------------------------


class DirLock:
    """flock on ``state_dir/download.lock``: the kernel drops it when its holder dies,
    so a killed run never leaves a stale lock; the file names the holder and since when."""

    def __init__(self, opts: Options) -> None:
        self.path = os.path.join(opts.state_dir, "download.lock")
        self.timeout = opts.lock_timeout
        self.fd: int | None = None

    def _fail(self, fd: int, err: OSError) -> DownloadError:
        if err.errno in NO_LOCK_ERRNOS:
            os.close(fd)
            return DownloadError(
                f"The filesystem of {os.path.dirname(self.path)} refuses file locks (flock: "
                f"{os.strerror(err.errno or 0)}), so two downloads could not be kept apart: "
                "put model_download_state_dir on a filesystem with working locks (local disk, "
                "NFSv4, or NFSv3 with lockd). Nothing was downloaded."
            )
        holder = os.pread(fd, 300, 0).decode(errors="replace").strip()
        os.close(fd)
        return DownloadError(
            f"Another download holds {self.path} ({holder or 'holder unknown'}); waited "
            f"{self.timeout:.0f} s (model_download_lock_timeout). Let it finish, or stop "
            "that process if it is stuck; the kernel frees the lock when it dies."
        )

    def __enter__(self) -> DirLock:
        fd = open_own(self.path, os.O_RDWR | os.O_CREAT)
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as err:
                busy = err.errno in (errno.EAGAIN, errno.EACCES)
                if not busy or time.monotonic() > deadline:
                    raise self._fail(fd, err) from err
                time.sleep(1)
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"host={socket.gethostname()} pid={os.getpid()} since={since}\n".encode(), 0)
        self.fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)


# --- progress ------------------------------------------------------------------------------


class Progress:
    """Counts bytes from every worker; a thread writes progress.json once a second."""

    def __init__(self, opts: Options, plan: Plan) -> None:
        self.path = progress_path(opts)
        self.lock = threading.Lock()
        self.files_total = len(plan.entries)
        self.files_done = len(plan.entries) - len(plan.to_fetch)
        self.bytes_total = plan.bytes_total
        self.bytes_done = plan.bytes_total - sum(e.size for e in plan.to_fetch) + plan.partial_bytes
        self.fetched_bytes = 0
        self.started = time.monotonic()
        self.state = "running"
        self.error = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def add(self, n: int) -> None:
        with self.lock:
            self.bytes_done += n
            self.fetched_bytes += n

    def rewind(self, n: int) -> None:
        """Bytes counted as done that were dropped (a digest mismatch)."""
        with self.lock:
            self.bytes_done -= n

    def file_done(self) -> None:
        with self.lock:
            self.files_done += 1

    def snapshot(self) -> dict[str, Any]:
        return progress_record(self, self.state, self.fetched_bytes, self.started, self.error)

    def write(self) -> None:
        # Advisory: a full disk must not hide the transfer's own error behind this one.
        with contextlib.suppress(OSError):
            write_json_atomic(self.path, self.snapshot())

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            self.write()

    def __enter__(self) -> Progress:
        self.write()
        self._thread.start()
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self._stop.set()
        self._thread.join()
        if exc is not None:
            self.state, self.error = "failed", str(exc)
        elif self.state == "running":
            self.state = "done"
        self.write()


def make_counter(progress: Progress) -> type:
    """A tqdm stand-in for huggingface_hub.http_get that feeds Progress."""

    class Counter:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def __enter__(self) -> Counter:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def update(self, n: float | None = 1) -> None:
            progress.add(int(n or 0))

        def close(self) -> None:
            pass

    return Counter


class HashingWriter:
    """The file object handed to http_get: hashes every byte it writes.

    http_get rewinds (seek + truncate) when a server ignores the Range request; the
    digest then restarts from the bytes the file keeps.
    """

    def __init__(self, fh: Any, path: str, algorithm: str, size: int) -> None:
        self.fh, self.path, self.algorithm, self.size = fh, path, algorithm, size
        self.digest = new_digest(algorithm, size)

    def prefill(self, nbytes: int) -> None:
        """Hash the bytes already in the partial file, before new ones are appended."""
        feed_file(self.digest, self.path, nbytes)

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data)
        while view:  # an unbuffered file may take part of it
            view = view[self.fh.write(view) :]
        self.digest.update(data)
        return len(data)

    def tell(self) -> int:
        return self.fh.tell()

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.fh.seek(offset, whence)

    def truncate(self, size: int | None = None) -> int:
        self.fh.flush()
        kept = self.fh.truncate(size)
        self.digest = new_digest(self.algorithm, self.size)
        self.prefill(kept)
        return kept

    def flush(self) -> None:
        self.fh.flush()


# --- fetching ------------------------------------------------------------------------------


@dataclass
class Fetched:
    path: str
    resumed_from: int
    digest: str
    transport: str


def disk_full(opts: Options, entry: Entry, part: str, progress: Progress) -> DownloadError:
    have = os.path.getsize(part) if os.path.exists(part) else 0
    with progress.lock:
        left = progress.bytes_total - progress.bytes_done
    return DownloadError(
        f"Disk full writing {part} ({entry.path}): this file needs {entry.size - have} more "
        f"bytes, the whole download about {max(left, 0)} ({human(max(left, 0))}), "
        f"{free_bytes(part)} bytes are free there. The {have} bytes received are kept in "
        "the partial file: free space (or move to a larger disk) and rerun to resume."
    )


def transfer(opts: Options, sha: str, entry: Entry, progress: Progress) -> Fetched:
    """One HEAD + GET (or Xet) of ``entry`` into its .part; returns the digest of its bytes."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    # http_get writes in chunks of this size: smaller than the library's 10 MB, so a
    # killed run leaves at most one chunk per file unwritten and progress is smooth.
    constants.DOWNLOAD_CHUNK_SIZE = opts.chunk_bytes

    url = hf_hub_url(opts.repo_id, entry.path, revision=sha, endpoint=opts.endpoint or None)
    meta = get_hf_file_metadata(url, token=opts.token or None, endpoint=opts.endpoint or None)
    if meta.commit_hash and meta.commit_hash != sha:
        raise DownloadError(f"{entry.path}: hub served commit {meta.commit_hash}, expected {sha}")
    if meta.size is not None and meta.size != entry.size:
        raise DownloadError(f"{entry.path}: hub says {meta.size} bytes, listing says {entry.size}")
    part = partial_path(opts, sha, entry.path)
    own_dir(os.path.join(opts.state_dir, "partial"))
    own_dir(partial_dir(opts, sha))
    os.makedirs(os.path.dirname(part), exist_ok=True)
    hub = hub_origin(opts)
    headers = build_hf_headers(token=opts.token or None)
    algorithm = entry.reference()[0]
    if meta.xet_file_data is not None and opts.transport != "http" and xet_importable():
        # The library sends these to the Xet token route and strips them for storage.
        xet_headers = headers_for(meta.xet_file_data.refresh_route or "", headers, hub)
        return transfer_xet(entry, part, meta.xet_file_data, xet_headers, progress)
    resume = os.path.getsize(part) if os.path.exists(part) else 0
    if resume > entry.size:
        os.truncate(part, 0)
        resume = 0
    # Unbuffered: each chunk is one write(2), hashed from the same buffer.
    with os.fdopen(open_own(part, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "ab", 0) as fh:
        writer = HashingWriter(fh, part, algorithm, entry.size)
        writer.prefill(resume)
        if resume < entry.size and direct_http(meta.location):
            stream_get(meta.location, headers, writer, entry, progress, opts.chunk_bytes, hub)
        elif resume < entry.size:  # behind a proxy: the library's GET
            # httpx drops Authorization on a cross-origin hop; the first request is ours.
            http_get(
                meta.location,
                writer,  # type: ignore[arg-type]
                resume_size=resume,
                headers=headers_for(meta.location, headers, hub),
                expected_size=entry.size,
                tqdm_class=make_counter(progress),
            )
    return Fetched(entry.path, resume, writer.digest.hexdigest(), "http")


# --- the plain-HTTP stream --------------------------------------------------------------
# huggingface_hub's http_get parses every body byte in Python (httpx and h11): on a
# 2-core node it spends 4 to 5 times the CPU of http.client reading straight into one
# reused buffer (measured, bench/download). Metadata and redirects to the file's
# location stay with the library; only the body is streamed here, its Authorization sent
# to the hub endpoint's origin alone (headers_for), as the library sends it. Behind a proxy the
# library's http_get is used (http.client does not read the proxy environment).

STREAM_ATTEMPTS = 5
STREAM_BACKOFF_S = 1.0  # doubled per attempt, at most 8 s
TRANSIENT_STATUSES = (429, 500, 502, 503, 504)
REDIRECTS = (301, 302, 303, 307, 308)


class Transient(Exception):
    """A failure worth another attempt from the bytes already kept."""


Origin = tuple[str, str, int]
DEFAULT_PORTS = {"http": 80, "https": 443}


def url_origin(url: str) -> Origin:
    """(scheme, host, port), the default port filled in: huggingface_hub's _url_origin."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    return (scheme, (parts.hostname or "").lower(), parts.port or DEFAULT_PORTS.get(scheme, 0))


def hub_origin(opts: Options) -> Origin:
    """The one origin the token is for: the endpoint's (the library's default without one)."""
    from huggingface_hub import constants

    return url_origin(opts.endpoint or constants.ENDPOINT)


def headers_for(url: str, headers: dict[str, str], hub: Origin) -> dict[str, str]:
    """``headers`` for a request to ``url``: without Authorization unless it is the hub's.

    Stricter than huggingface_hub, which also trusts huggingface.co and hf.co behind a
    mirror: a CDN's signed URL needs no token, and S3-style ones refuse a request with both.
    """
    if url_origin(url) == hub:
        return headers
    return {k: v for k, v in headers.items() if k.lower() != "authorization"}


def direct_http(url: str) -> bool:
    """http.client can fetch ``url`` itself: http(s), no proxy configured for its host."""
    import urllib.request
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        return False
    proxies = urllib.request.getproxies()
    if not (proxies.get(parts.scheme) or proxies.get("all")):
        return True
    return bool(urllib.request.proxy_bypass(parts.hostname or ""))


def shown_url(url: str) -> str:
    """The URL without query or user info (signed CDN URLs carry credentials there)."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


@functools.lru_cache(maxsize=4)
def tls_context(cafile: str | None) -> Any:
    """One TLS context per CA bundle for every file and worker (loading the bundle costs
    about 50 ms of CPU; an SSLContext is safe to share between threads)."""
    import ssl

    return ssl.create_default_context(cafile=cafile)


def open_stream(url: str, headers: dict[str, str], timeout: float, hub: Origin) -> tuple[Any, Any]:
    """GET ``url``, following redirects hop by hop: Authorization goes only to the hub's
    origin, and never again once a hop has left it."""
    import http.client
    from urllib.parse import urljoin, urlsplit

    for _hop in range(10):
        headers = headers_for(url, headers, hub)
        parts = urlsplit(url)
        if parts.scheme == "https":
            cafile = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("SSL_CERT_FILE")
            conn: Any = http.client.HTTPSConnection(
                parts.hostname or "",
                parts.port,
                timeout=timeout,
                context=tls_context(cafile or None),
            )
        else:
            conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request("GET", target, headers=headers)
        resp = conn.getresponse()
        if resp.status not in REDIRECTS:
            return conn, resp
        location = resp.getheader("Location") or ""
        resp.close()
        conn.close()
        if not location:
            break
        url = urljoin(url, location)
    raise DownloadError(f"{shown_url(url)}: too many redirects, or one without a Location")


def stream_attempt(
    url: str,
    headers: dict[str, str],
    writer: HashingWriter,
    entry: Entry,
    progress: Progress,
    buf: bytearray,
    timeout: float,
    hub: Origin,
) -> None:
    """One GET from the bytes the partial file already has to the end of the file."""
    import http.client

    have = writer.tell()
    ranged = dict(headers, **({"Range": f"bytes={have}-"} if have else {}))
    try:
        conn, resp = open_stream(url, ranged, timeout, hub)
    except (OSError, http.client.HTTPException) as err:
        raise Transient(f"{type(err).__name__}: {err}") from err
    try:
        status = resp.status
        if status in TRANSIENT_STATUSES:
            raise Transient(f"HTTP {status} {resp.reason}")
        if status == 200 and have:  # the server ignored the Range: start over
            writer.seek(0)
            writer.truncate()
            progress.rewind(have)
            have = 0
        elif status not in (200, 206):
            raise DownloadError(
                f"{entry.path}: the hub answered HTTP {status} {resp.reason} for {shown_url(url)}"
            )
        declared = resp.getheader("Content-Length")
        if declared is not None and int(declared) != entry.size - have:
            raise DownloadError(
                f"{entry.path}: the hub sends {declared} bytes from offset {have}, the listing "
                f"says the file has {entry.size} (nothing of it is in the checkpoint)"
            )
        view = memoryview(buf)
        left = entry.size - have
        while left > 0:
            try:
                got = resp.readinto(view[: min(len(buf), left)])
            except (OSError, http.client.HTTPException) as err:
                raise Transient(f"{type(err).__name__}: {err}") from err
            if not got:
                raise Transient(f"connection closed {left} bytes before the end")
            writer.write(view[:got])
            progress.add(got)
            left -= got
    finally:
        # A response that will close holds the socket itself: conn.close() alone leaves it
        # open until the garbage collector, and the hub keeps sending into it meanwhile.
        resp.close()
        conn.close()


def stream_get(
    url: str,
    headers: dict[str, str],
    writer: HashingWriter,
    entry: Entry,
    progress: Progress,
    chunk_bytes: int,
    hub: Origin,
) -> None:
    """Stream the rest of ``entry`` into ``writer``; transient failures resume by Range.
    ``hub``: the only origin that gets ``headers``' Authorization."""
    from huggingface_hub import constants

    buf = bytearray(max(chunk_bytes, 64 << 10))
    timeout = float(constants.HF_HUB_DOWNLOAD_TIMEOUT)
    for attempt in range(1, STREAM_ATTEMPTS + 1):
        try:
            stream_attempt(url, headers, writer, entry, progress, buf, timeout, hub)
            return
        except Transient as err:
            if attempt == STREAM_ATTEMPTS:
                raise DownloadError(
                    f"{entry.path}: {err} from {shown_url(url)}, {STREAM_ATTEMPTS} attempts "
                    f"({writer.tell()} of {entry.size} bytes kept in the partial file; a rerun "
                    "resumes)"
                ) from err
            time.sleep(min(STREAM_BACKOFF_S * 2 ** (attempt - 1), 8.0))


def transfer_xet(
    entry: Entry, part: str, xet_data: Any, headers: dict[str, str], progress: Progress
) -> Fetched:
    """huggingface_hub's own Xet path writes the file; it is hashed once it has landed
    (in this worker, while the other workers keep transferring)."""
    from pathlib import Path

    from huggingface_hub.file_download import xet_get

    xet_get(
        incomplete_path=Path(part),
        xet_file_data=xet_data,
        headers=headers,
        expected_size=entry.size,
        displayed_filename=entry.path,
    )
    progress.add(entry.size)
    return Fetched(entry.path, 0, hash_file(part, entry.reference()[0]), "xet")


def place(opts: Options, part: str, entry: Entry) -> None:
    dest = os.path.join(opts.local_dir, entry.path)
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    try:
        os.replace(part, dest)
    except OSError as err:
        if err.errno != errno.EXDEV:
            raise
        shutil.move(part, dest)


def fetch_one(opts: Options, sha: str, entry: Entry, progress: Progress) -> Fetched:
    """Fetch, check the digest of the bytes received, then move into place.

    A mismatch never lands: the partial is dropped and the file fetched once more from
    its first byte; a second mismatch fails naming both digests.
    """
    part = partial_path(opts, sha, entry.path)
    algorithm, want = entry.reference()
    got = ""
    for attempt in (1, 2):
        try:
            fetched = transfer(opts, sha, entry, progress)
        except OSError as err:
            if err.errno in DISK_FULL_ERRNOS:
                raise disk_full(opts, entry, part, progress) from err
            raise
        got = fetched.digest
        if got == want:
            if attempt == 2:
                fetched.resumed_from = 0
            place(opts, part, entry)
            progress.file_done()
            return fetched
        os.unlink(part)
        progress.rewind(entry.size)
    raise DownloadError(
        f"{entry.path}: the hub's bytes do not match its listing: {algorithm} {got}, "
        f"expected {want} (fetched twice, both dropped; nothing of it is in the checkpoint)"
    )


def remove_file(base: str, path: str) -> None:
    """Remove ``base/path`` and the directories this leaves empty (up to ``base``)."""
    full = os.path.join(base, path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(full)
    parent = os.path.dirname(full)
    while os.path.realpath(parent) != os.path.realpath(base):
        try:
            os.rmdir(parent)
        except OSError:
            break
        parent = os.path.dirname(parent)


def fetch_all(opts: Options, plan: Plan, progress: Progress) -> list[Fetched]:
    # Largest first: the long shards start early and the tail is short files.
    todo = sorted(plan.to_fetch, key=lambda e: -e.size)
    for entry in todo:
        if plan.status[entry.path] != "missing":
            remove_file(opts.local_dir, entry.path)  # wrong bytes never stay in the checkpoint
    results: list[Fetched] = []
    errors: list[str] = []
    with ThreadPoolExecutor(max(1, opts.max_workers)) as pool:
        futures = [pool.submit(fetch_one, opts, plan.sha, e, progress) for e in todo]
        for fut in futures:
            try:
                results.append(fut.result())
            except Exception as err:
                errors.append(
                    str(_hub_failure(err, opts)) if not isinstance(err, DownloadError) else str(err)
                )
    if errors:
        more = f" (+{len(errors) - 5} more)" if len(errors) > 5 else ""
        raise DownloadError(
            f"{len(errors)} of {len(todo)} files failed; completed files are kept and a rerun "
            f"resumes: {'; '.join(errors[:5])}{more}"
        )
    return results


# --- proof and manifest --------------------------------------------------------------------


def prove_complete(opts: Options, entries: list[Entry], digests: dict[str, str]) -> None:
    """Every listed file is present with its size and a proved digest equal to the listing's;
    nothing else is in the directory; every shard of the index is listed and present."""
    problems = []
    for entry in entries:
        stamp = stat_stamp(os.path.join(opts.local_dir, entry.path))
        if stamp is None:
            problems.append(f"{entry.path} missing")
        elif stamp["size"] != entry.size:
            problems.append(f"{entry.path} has {stamp['size']} bytes, listing says {entry.size}")
        elif digests.get(entry.path) != entry.reference()[1]:
            problems.append(f"{entry.path} has no proved {entry.reference()[0]} digest")
    listed = {e.path for e in entries}
    problems += [
        f"{p} is not part of the commit" for p in local_files(opts.local_dir) if p not in listed
    ]
    if INDEX_FILE in listed:
        with open(os.path.join(opts.local_dir, INDEX_FILE)) as fh:
            shards = set(json.load(fh).get("weight_map", {}).values())
        for shard in sorted(shards):
            if shard not in listed:
                problems.append(f"index names {shard}, which is not downloaded (patterns or repo)")
    if problems:
        raise DownloadError(
            f"Checkpoint {opts.local_dir} is incomplete: " + "; ".join(problems[:10])
        )


def write_manifest(opts: Options, plan: Plan, digests: dict[str, str]) -> None:
    files = {}
    for entry in plan.entries:
        algorithm = entry.reference()[0]
        files[entry.path] = {
            "size": entry.size,
            "oid": entry.oid,
            "algorithm": algorithm,
            "digest": digests.get(entry.path, ""),
            "stat": stat_stamp(os.path.join(opts.local_dir, entry.path)),
        }
        if entry.sha256:
            files[entry.path]["sha256"] = entry.sha256
    write_json_atomic(
        manifest_path(opts),
        {
            "version": MANIFEST_VERSION,
            "repo_id": opts.repo_id,
            "revision": opts.revision,
            "sha": plan.sha,
            "patterns": patterns(opts),
            "complete": True,
            "files_total": len(plan.entries),
            "bytes_total": plan.bytes_total,
            "files": files,
            "written": time.time(),
        },
    )


def plan_summary(plan: Plan) -> dict[str, Any]:
    todo = plan.to_fetch
    return {
        "sha": plan.sha,
        "complete": plan.complete,
        "recorded": plan.recorded,
        "files_total": len(plan.entries),
        "bytes_total": plan.bytes_total,
        "files_to_fetch": len(todo),
        "bytes_to_fetch": sum(e.size for e in todo),
        "partial_bytes": plan.partial_bytes,
        "free_bytes": plan.free_bytes,
        "missing": sorted(e.path for e in todo if plan.status[e.path] == "missing")[:50],
        "damaged": sorted(e.path for e in todo if plan.status[e.path] in ("size", "corrupt")),
        "unproven": sum(1 for s in plan.status.values() if s == "unproven"),
        "extra": plan.extras[:50],
        "hashed": plan.hashed,
        "notes": plan.notes,
        "strays": plan.strays,
        "findings": plan.findings,
    }


def download(opts: Options) -> dict[str, Any]:
    """Plan, check space, fetch what is missing or damaged, prove every digest, record."""
    check_transport(opts)
    os.makedirs(opts.state_dir, exist_ok=True)
    opts.quick = False  # the download proves every file it keeps
    with DirLock(opts):
        # After the lock: a concurrent run may have finished it.
        plan = make_plan(opts, report_hashing=True)
        check_space(opts, plan)
        summary = plan_summary(plan)
        started = time.monotonic()
        progress = Progress(opts, plan)
        with progress:
            for path in plan.extras:
                remove_file(opts.local_dir, path)  # recorded by an earlier commit, gone now
            aside = set_aside(opts, plan.sha, plan.strays) if plan.strays else None
            os.makedirs(opts.local_dir, exist_ok=True)
            results = fetch_all(opts, plan, progress) if plan.to_fetch else []
            digests = dict(plan.digests)
            digests.update({r.path: r.digest for r in results})
            prove_complete(opts, plan.entries, digests)
            if results or plan.extras or not plan.recorded:
                write_manifest(opts, plan, digests)
            shutil.rmtree(os.path.join(opts.state_dir, "partial"), ignore_errors=True)
        elapsed = time.monotonic() - started
        return {
            **summary,
            "complete": True,
            "changed": bool(results or plan.extras or plan.strays),
            "fetched": sorted(r.path for r in results),
            "fetched_bytes": progress.fetched_bytes,
            "resumed": sorted(r.path for r in results if r.resumed_from),
            "removed": plan.extras,
            "set_aside": plan.strays,
            "set_aside_dir": aside,
            "transports": sorted({r.transport for r in results}),
            "verified": "digest",
            "elapsed_s": round(elapsed, 2),
            "rate_bytes_per_s": int(progress.fetched_bytes / elapsed) if elapsed > 0 else 0,
            "manifest": manifest_path(opts),
        }


def _job_main(
    work: Callable[[], dict[str, Any]], job_file: str, timeout_s: int, ready_fd: int
) -> None:
    """The detached job: work (a download), write the final result, exit (never returns)."""
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # the module's pipes must close for its run to end
        os.dup2(devnull, fd)
    rc = 1
    try:
        write_json_atomic(job_file, {"started": 1, "finished": 0, "pid": os.getpid()})
        os.write(ready_fd, b"1")
        os.close(ready_fd)

        def expire() -> None:
            msg = f"the job did not end within model_download_timeout ({timeout_s} s)"
            write_json_atomic(job_file, {"failed": True, "finished": 1, "msg": msg})
            os._exit(1)  # fetch threads die with the process; partials stay for a resume

        timer = threading.Timer(timeout_s, expire)
        timer.daemon = True
        timer.start()
        try:
            result = {**work(), "failed": False}
            rc = 0
        except DownloadError as err:
            result = {"failed": True, "msg": str(err)}
        except BaseException as err:  # any end of the job must be reported, even SystemExit
            result = {"failed": True, "msg": f"{type(err).__name__}: {err}"}
        write_json_atomic(job_file, {**result, "finished": 1})
    finally:
        os._exit(rc)  # never back into the module (or AnsiballZ's cleanup) in this process


def start_job(
    opts: Options,
    timeout_s: int,
    work: Callable[[], dict[str, Any]] | None = None,
    jobs_dir: str | None = None,
) -> dict[str, Any]:
    """Start work (download(opts)) in a detached process and return its results file.

    Double fork and setsid, as Ansible's async_wrapper does, so the job outlives this
    module run and the connection; one module run both plans and starts (no second
    AnsiballZ round trip). wait_progress follows the results file. ``jobs_dir``: a
    private dir of the caller's instead of state_dir's ``jobs`` (check mode's).
    """
    if jobs_dir is None:
        os.makedirs(opts.state_dir, exist_ok=True)
        jobs_dir = own_dir(os.path.join(opts.state_dir, "jobs"))
        for name in os.listdir(jobs_dir):  # earlier runs'; a running job holds the lock anyway
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(jobs_dir, name))
    job_file = os.path.join(jobs_dir, f"{time.time_ns()}-{os.getpid()}.json")
    ready_r, ready_w = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            os.close(ready_r)
            os.setsid()
            if os.fork() == 0:
                _job_main(work or functools.partial(download, opts), job_file, timeout_s, ready_w)
        finally:
            os._exit(0)
    os.close(ready_w)
    os.waitpid(child, 0)
    with os.fdopen(ready_r, "rb") as ready:
        if ready.read(1) != b"1":
            raise DownloadError(f"The download job did not start (see {job_file}).")
    return {"results_file": job_file, "started": True}


def start_check_job(
    opts: Options, timeout_s: int, work: Callable[[Options], dict[str, Any]]
) -> dict[str, Any]:
    """Check mode's full verify: work(opts) (the plan) as a job, so its hashing shows.

    Its results and progress go to a fresh 0700 temp dir, removed once the job's result
    is read: nothing is written in the shared state tree.
    """
    where = tempfile.mkdtemp(prefix=CHECK_JOB_PREFIX)
    job_opts = Options(**{**opts.__dict__, "progress_file": os.path.join(where, "progress.json")})
    started = start_job(job_opts, timeout_s, functools.partial(work, job_opts), where)
    return {**started, "check_job": True}
