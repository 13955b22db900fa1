# Copyright: vllm-fleet contributors
# Apache-2.0
"""Engine of the hf_snapshot module: plan, fetch and prove a hub snapshot complete.

Pure Python on purpose (unit-testable without Ansible). huggingface_hub is imported
lazily, after HF_ENDPOINT / HF_HUB_DISABLE_XET / HF_TOKEN are set in the environment,
because the library reads them at import time.

Layout: files land in ``local_dir`` (the checkpoint vLLM reads) and nothing else does;
bookkeeping lives in ``state_dir`` beside it: ``manifest.json``, ``progress.json``,
``download.lock`` and ``partial/<sha>/<path>.part`` (kept across killed runs and resumed
with an HTTP Range request from their partial bytes).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

MANIFEST_VERSION = 1
HASH_CHUNK = 8 << 20
INDEX_FILE = "model.safetensors.index.json"


class DownloadError(Exception):
    """A failure with a message meant for the operator."""


@dataclass
class Entry:
    """One file of the tree listing."""

    path: str
    size: int
    oid: str
    sha256: str | None = None

    def reference(self) -> tuple[str, str]:
        """(algorithm, digest) the content must match: sha256 for LFS, git blob sha1 otherwise."""
        return ("sha256", self.sha256) if self.sha256 else ("git-sha1", self.oid)


@dataclass
class Options:
    repo_id: str
    revision: str
    local_dir: str
    state_dir: str
    endpoint: str | None = None
    token: str | None = None
    allow_patterns: list[str] | None = None
    ignore_patterns: list[str] | None = None
    max_workers: int = 8
    verify: str = "size"
    hash_workers: int = 4
    space_margin_bytes: int = 1 << 30
    patched_files: list[str] = field(default_factory=list)
    lock_timeout: float = 3600.0
    update: bool = False
    chunk_bytes: int = 1 << 20


@dataclass
class Plan:
    sha: str
    entries: list[Entry]
    status: dict[str, str]
    hashes: dict[str, str]
    partial_bytes: int
    free_bytes: int
    recorded: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def to_fetch(self) -> list[Entry]:
        return [e for e in self.entries if self.status[e.path] != "ok"]

    @property
    def bytes_total(self) -> int:
        return sum(e.size for e in self.entries)

    @property
    def complete(self) -> bool:
        return not self.to_fetch


# --- environment and hub ---------------------------------------------------------------


def setup_environment(opts: Options) -> None:
    """Configure the client through the environment (never argv) before importing it."""
    os.environ["HF_HUB_DISABLE_XET"] = "1"
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
    if opts.endpoint:
        os.environ["HF_ENDPOINT"] = opts.endpoint.rstrip("/")
    if opts.token:
        os.environ["HF_TOKEN"] = opts.token


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


def resolve_and_list(opts: Options, recorded_sha: str | None) -> tuple[str, list[Entry], list[str]]:
    """Resolve the revision to a commit sha and list the (filtered) tree at that sha."""
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
        files = [
            f
            for f in api.list_repo_tree(opts.repo_id, recursive=True, revision=sha)
            if isinstance(f, RepoFile)
        ]
    except Exception as err:
        if type(err).__module__.startswith(("huggingface_hub", "httpx")):
            raise _hub_failure(err, opts) from err
        raise
    if not sha:
        raise DownloadError(f"The hub returned no commit sha for {opts.repo_id}@{opts.revision}")
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


# --- local state -------------------------------------------------------------------------


def manifest_path(opts: Options) -> str:
    return os.path.join(opts.state_dir, "manifest.json")


def progress_path(opts: Options) -> str:
    return os.path.join(opts.state_dir, "progress.json")


def partial_path(opts: Options, sha: str, path: str) -> str:
    return os.path.join(opts.state_dir, "partial", sha, path + ".part")


def load_manifest(opts: Options) -> dict[str, Any]:
    try:
        with open(manifest_path(opts)) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return {}
    same = data.get("repo_id") == opts.repo_id and data.get("version") == MANIFEST_VERSION
    return data if same else {}


def stat_signature(path: str) -> dict[str, int] | None:
    """Size, mtime, ctime, inode: ctime cannot be set back, so a rewrite is always seen."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return {
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "ino": st.st_ino,
    }


def hash_file(path: str, algorithm: str) -> str:
    if algorithm == "sha256":
        digest = hashlib.sha256()
    else:
        digest = hashlib.sha1(usedforsecurity=False)
        digest.update(b"blob %d\0" % os.path.getsize(path))
    with open(path, "rb") as fh:
        while chunk := fh.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def assess(
    opts: Options, entries: list[Entry], manifest: dict[str, Any]
) -> tuple[dict[str, str], dict[str, str]]:
    """Classify each file in O(files) stats; hash only files whose stat changed or never hashed.

    Returns (status, hashes): status is ok | missing | size | corrupt; hashes are the
    verified digests (path -> digest) to record in the manifest.
    """
    recorded = manifest.get("files", {})
    status: dict[str, str] = {}
    hashes: dict[str, str] = {}
    to_hash: list[Entry] = []
    for entry in entries:
        local = os.path.join(opts.local_dir, entry.path)
        sig = stat_signature(local)
        rec = recorded.get(entry.path, {})
        known = rec.get("stat") == sig and rec.get("oid") == entry.oid
        if sig is None:
            status[entry.path] = "missing"
        elif entry.path in opts.patched_files and rec:
            status[entry.path] = "ok"  # patched in place on purpose by a later step
        elif sig["size"] != entry.size:
            status[entry.path] = "size"
        elif known and (opts.verify != "full" or rec.get("hash")):
            status[entry.path] = "ok"
            if rec.get("hash"):
                hashes[entry.path] = rec["hash"]
        elif known or opts.verify == "full" or rec:
            to_hash.append(entry)  # changed since recorded, or never hashed under full
        else:
            status[entry.path] = "ok"  # present with its size, no record: size mode trusts it
    for entry, digest in zip(to_hash, hash_many(opts, to_hash, opts.local_dir), strict=True):
        good = digest == entry.reference()[1]
        status[entry.path] = "ok" if good else "corrupt"
        if good:
            hashes[entry.path] = digest
    return status, hashes


def hash_many(opts: Options, entries: list[Entry], base: str) -> list[str]:
    def one(entry: Entry) -> str:
        return hash_file(os.path.join(base, entry.path), entry.reference()[0])

    with ThreadPoolExecutor(max(1, opts.hash_workers)) as pool:
        return list(pool.map(one, entries))


def free_bytes(path: str) -> int:
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    st = os.statvfs(probe)
    return st.f_bavail * st.f_frsize


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


def make_plan(opts: Options) -> Plan:
    manifest = load_manifest(opts)
    same_rev = manifest.get("revision") == opts.revision
    sha, entries, notes = resolve_and_list(opts, manifest.get("sha") if same_rev else None)
    if manifest.get("sha") != sha:
        manifest = {**manifest, "files": {}}  # another commit: every record is stale
    status, hashes = assess(opts, entries, manifest)
    partial = 0
    for entry in entries:
        if status[entry.path] != "ok":
            with contextlib.suppress(OSError):
                partial += min(os.path.getsize(partial_path(opts, sha, entry.path)), entry.size)
    files = manifest.get("files", {})
    recorded = bool(manifest.get("complete")) and all(
        files.get(e.path, {}).get("stat") == stat_signature(os.path.join(opts.local_dir, e.path))
        for e in entries
    )
    return Plan(sha, entries, status, hashes, partial, free_bytes(opts.local_dir), recorded, notes)


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
    so a killed run never leaves a stale lock; the file names the last holder."""

    def __init__(self, opts: Options) -> None:
        self.path = os.path.join(opts.state_dir, "download.lock")
        self.timeout = opts.lock_timeout
        self.fd: int | None = None

    def __enter__(self) -> DirLock:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as err:
                if err.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() > deadline:
                    holder = os.pread(self.fd, 200, 0).decode(errors="replace").strip()
                    os.close(self.fd)
                    raise DownloadError(
                        f"Another download holds {self.path} ({holder or 'unknown holder'}) "
                        f"for more than {self.timeout:.0f} s"
                    ) from err
                time.sleep(1)
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"host={socket.gethostname()} pid={os.getpid()}\n".encode(), 0)
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

    def file_done(self) -> None:
        with self.lock:
            self.files_done += 1

    def snapshot(self) -> dict[str, Any]:
        elapsed = max(time.monotonic() - self.started, 1e-6)
        rate = self.fetched_bytes / elapsed
        left = self.bytes_total - self.bytes_done
        return {
            "state": self.state,
            "pid": os.getpid(),
            "files_done": self.files_done,
            "files_total": self.files_total,
            "bytes_done": self.bytes_done,
            "bytes_total": self.bytes_total,
            "rate_bytes_per_s": int(rate),
            "eta_s": int(left / rate) if rate > 0 else None,
            "elapsed_s": round(elapsed, 1),
            "error": self.error,
            "updated": time.time(),
        }

    def write(self) -> None:
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


def write_json_atomic(path: str, data: Any) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=1, sort_keys=True)
    os.replace(tmp, path)


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


# --- fetching ------------------------------------------------------------------------------


def fetch_one(opts: Options, sha: str, entry: Entry, progress: Progress) -> dict[str, Any]:
    """HEAD + GET one file into its .part (resumed by Range), check it, move it into place."""
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
    os.makedirs(os.path.dirname(part), exist_ok=True)
    resume = os.path.getsize(part) if os.path.exists(part) else 0
    if resume > entry.size:
        os.truncate(part, 0)
        resume = 0
    headers = build_hf_headers(token=opts.token or None)
    with open(part, "ab") as fh:
        if resume < entry.size:
            http_get(
                meta.location,
                fh,
                resume_size=resume,
                headers=headers,
                expected_size=entry.size,
                tqdm_class=make_counter(progress),
            )
    size = os.path.getsize(part)
    if size != entry.size:
        os.unlink(part)
        raise DownloadError(
            f"{entry.path}: got {size} bytes, expected {entry.size}; partial dropped"
        )
    digest = None
    if opts.verify == "full":
        algorithm, want = entry.reference()
        digest = hash_file(part, algorithm)
        if digest != want:
            os.unlink(part)
            raise DownloadError(f"{entry.path}: {algorithm} {digest} != listing {want}; dropped")
    dest = os.path.join(opts.local_dir, entry.path)
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    try:
        os.replace(part, dest)
    except OSError as err:
        if err.errno != errno.EXDEV:
            raise
        shutil.move(part, dest)
    progress.file_done()
    return {"path": entry.path, "resumed_from": resume, "hash": digest}


def fetch_all(opts: Options, plan: Plan, progress: Progress) -> list[dict[str, Any]]:
    # Largest first: the long shards start early and the tail is short files.
    todo = sorted(plan.to_fetch, key=lambda e: -e.size)
    for entry in todo:
        if plan.status[entry.path] != "missing":
            os.unlink(os.path.join(opts.local_dir, entry.path))  # wrong size or content
    results: list[dict[str, Any]] = []
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


def prove_complete(opts: Options, entries: list[Entry]) -> None:
    """Every listed file exists with its size; every shard of the index is listed and present."""
    problems = []
    for entry in entries:
        sig = stat_signature(os.path.join(opts.local_dir, entry.path))
        if sig is None:
            problems.append(f"{entry.path} missing")
        elif sig["size"] != entry.size and entry.path not in opts.patched_files:
            problems.append(f"{entry.path} has {sig['size']} bytes, listing says {entry.size}")
    listed = {e.path for e in entries}
    index = os.path.join(opts.local_dir, INDEX_FILE)
    if INDEX_FILE in listed:
        with open(index) as fh:
            shards = set(json.load(fh).get("weight_map", {}).values())
        for shard in sorted(shards):
            if shard not in listed:
                problems.append(f"index names {shard}, which is not downloaded (patterns or repo)")
            elif not os.path.isfile(os.path.join(opts.local_dir, shard)):
                problems.append(f"index names {shard}, which is missing")
    if problems:
        raise DownloadError(
            f"Checkpoint {opts.local_dir} is incomplete: " + "; ".join(problems[:10])
        )


def write_manifest(opts: Options, plan: Plan, hashes: dict[str, str]) -> None:
    old = load_manifest(opts)
    old_files = old.get("files", {}) if old.get("sha") == plan.sha else {}
    files = {}
    for entry in plan.entries:
        sig = stat_signature(os.path.join(opts.local_dir, entry.path))
        rec: dict[str, Any] = {"size": entry.size, "oid": entry.oid, "stat": sig}
        if entry.sha256:
            rec["sha256"] = entry.sha256
        if entry.path in hashes:
            rec["hash"] = hashes[entry.path]
        elif entry.path in opts.patched_files and old_files.get(entry.path, {}).get("hash"):
            rec["hash"] = old_files[entry.path]["hash"]
        files[entry.path] = rec
    write_json_atomic(
        manifest_path(opts),
        {
            "version": MANIFEST_VERSION,
            "repo_id": opts.repo_id,
            "revision": opts.revision,
            "sha": plan.sha,
            "complete": True,
            "verify": opts.verify if len(hashes) == len(plan.entries) else "size",
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
        "notes": plan.notes,
    }


def download(opts: Options) -> dict[str, Any]:
    """Plan, check space, fetch what is missing or damaged, prove completeness, record."""
    os.makedirs(opts.state_dir, exist_ok=True)
    with DirLock(opts):
        plan = make_plan(opts)  # after the lock: a concurrent run may have finished it
        check_space(opts, plan)
        os.makedirs(opts.local_dir, exist_ok=True)
        summary = plan_summary(plan)
        started = time.monotonic()
        progress = Progress(opts, plan)
        with progress:
            results = fetch_all(opts, plan, progress) if not plan.complete else []
            hashes = dict(plan.hashes)
            hashes.update({r["path"]: r["hash"] for r in results if r["hash"]})
            prove_complete(opts, plan.entries)
            write_manifest(opts, plan, hashes)
            shutil.rmtree(os.path.join(opts.state_dir, "partial"), ignore_errors=True)
        elapsed = time.monotonic() - started
        return {
            **summary,
            "complete": True,
            "changed": bool(results),
            "fetched": sorted(r["path"] for r in results),
            "fetched_bytes": progress.fetched_bytes,
            "resumed": sorted(r["path"] for r in results if r["resumed_from"]),
            "verified": "full" if len(hashes) == len(plan.entries) else "size",
            "elapsed_s": round(elapsed, 2),
            "rate_bytes_per_s": int(progress.fetched_bytes / elapsed) if elapsed > 0 else 0,
            "manifest": manifest_path(opts),
        }


def verify_local(opts: Options) -> dict[str, Any]:
    """This host's view of the checkpoint against the manifest (no network): O(files) stats."""
    manifest = load_manifest(opts)
    if not manifest.get("complete"):
        raise DownloadError(f"No complete download recorded in {manifest_path(opts)}")
    entries = [
        Entry(p, r["size"], r["oid"], r.get("sha256")) for p, r in sorted(manifest["files"].items())
    ]
    prove_complete(opts, entries)
    return {
        "changed": False,
        "sha": manifest["sha"],
        "complete": True,
        "files_total": len(entries),
        "bytes_total": sum(e.size for e in entries),
    }


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def job_result(job_file: str) -> dict[str, Any] | None:
    """The final result in Ansible's async results file, or None while the job runs."""
    try:
        with open(job_file) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None  # not written yet
    return None if data.get("started") and not data.get("finished") else data


def read_progress(opts: Options, job_file: str | None) -> dict[str, Any]:
    """progress.json, unless it is older than the followed job (left by an earlier run)."""
    try:
        with open(progress_path(opts)) as fh:
            progress = json.load(fh)
        if job_file and progress.get("updated", 0) < os.path.getmtime(job_file) - 1:
            return {}
        return progress
    except (OSError, ValueError):
        return {}


def wait_progress(opts: Options, wait_s: float, job_file: str | None = None) -> dict[str, Any]:
    """Wait up to wait_s for the download job to end; return its latest progress.

    With ``job_file`` (the async task's results_file) the job has ended once Ansible wrote
    its final result there; without, once progress.json says done/failed or its writer died.
    """
    deadline = time.monotonic() + wait_s
    job = None
    while True:
        progress = read_progress(opts, job_file)
        state = progress.get("state")
        dead = state == "running" and not _alive(int(progress.get("pid", 0)))
        job = job_result(job_file) if job_file else None
        ended = job is not None if job_file else state in ("done", "failed") or dead
        if ended or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    if dead:
        progress["state"] = "killed"
    rate = progress.get("rate_bytes_per_s") or 0
    msg = (
        f"{progress.get('files_done', '?')}/{progress.get('files_total', '?')} files, "
        f"{human(progress.get('bytes_done', 0))}/{human(progress.get('bytes_total', 0))}, "
        f"{human(rate)}/s, ETA {progress.get('eta_s', '?')} s ({state or 'starting'})"
    )
    result = {"changed": False, "ended": ended, "progress": progress, "msg": msg}
    if job is not None:
        result["job"] = {k: v for k, v in job.items() if k != "invocation"}
    return result
