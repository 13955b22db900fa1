# Copyright: vllm-fleet contributors
# Apache-2.0
"""The local proof of a downloaded checkpoint: its manifest, digests and stat stamps.

What a node needs to prove a checkpoint on shared storage without the hub: read the
manifest that a download wrote beside the checkpoint (``state_dir/manifest.json``),
check each file against it (one stat per file when its stamp did not move, else a
digest: sha256 for LFS files, git blob sha1 otherwise) and report what differs. The
plan (module vllm_fleet_plan) reads this module only; the hub
transport (hf_download.py) builds on it, never the other way round.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import stat
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

MANIFEST_VERSION = 2

HASH_CHUNK = 8 << 20

INDEX_FILE = "model.safetensors.index.json"

# flock errors that mean "this filesystem does not do locks", not "someone holds it".
NO_LOCK_ERRNOS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS)

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)

# Statuses of a listed file: only these need bytes from the hub.
REFETCH = ("missing", "size", "corrupt")


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
    verify: str = "digest"
    hash_workers: int = 4
    space_margin_bytes: int = 1 << 30
    lock_timeout: float = 3600.0
    update: bool = False
    chunk_bytes: int = 1 << 20
    transport: str = "auto"
    quick: bool = False
    # Check mode's full verify writes its progress in a private temp dir, not state_dir.
    progress_file: str = ""


def recorded_entries(files: dict[str, Any]) -> list[Entry]:
    """The listing a manifest's per-file records describe, sorted by path."""
    return [Entry(p, r["size"], r["oid"], r.get("sha256")) for p, r in sorted(files.items())]


def unsafe_reason(path: str) -> str | None:
    """Why ``path`` is not a plain relative name inside a directory, or None."""
    if not path:
        return "empty name"
    if "\0" in path:
        return "NUL byte"
    if "\\" in path:
        return "backslash"
    if path.startswith("/"):
        return "absolute path"
    parts = path.split("/")
    if ".." in parts:
        return "'..' segment"
    if any(part in ("", ".") for part in parts):
        return "empty or '.' segment"
    return None


def resolved(root: str, path: str, parents: dict[str, str]) -> str:
    """realpath(root/path), each distinct parent directory resolved once (a listing of
    thousands of files has a handful); the last component costs one lstat."""
    parent, name = os.path.split(path)
    if parent not in parents:
        parents[parent] = os.path.realpath(os.path.join(root, parent)) if parent else root
    full = os.path.join(parents[parent], name)
    return os.path.realpath(full) if os.path.islink(full) else full


def check_names(base: str, paths: list[str], where: str) -> None:
    """Fail on the first name that is unsafe or resolves outside ``base`` (symlinks followed)."""
    root = os.path.realpath(base)
    inside = root if root.endswith(os.sep) else root + os.sep
    parents: dict[str, str] = {}
    for path in paths:
        reason = unsafe_reason(path)
        if reason is None:
            real = resolved(root, path, parents)
            if real != root and not real.startswith(inside):
                reason = f"resolves to {real}, outside {root} through a symlink"
        if reason:
            raise DownloadError(
                f"Refusing {where}: entry {path!r} is unsafe ({reason}). Nothing was written "
                f"or deleted; every name must be a relative path inside {base}."
            )


def own_dir(path: str, make: bool = True) -> str:
    """``path`` as a real directory (made when absent, if ``make``); a symlink or file
    there is refused, naming it."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if not make:
            return path
        os.makedirs(path, exist_ok=True)
        st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        what = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a directory"
        raise DownloadError(
            f"Refusing {path}: {what} where the toolkit keeps a directory of its own (someone "
            "else made it; it was not followed). Remove it and rerun."
        )
    return path


def open_own(path: str, flags: int, mode: int = 0o644) -> int:
    """os.open of a regular file the toolkit keeps, never through a symlink at ``path``."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as err:
        if err.errno != errno.ELOOP:
            raise
        raise DownloadError(
            f"Refusing {path}: a symlink where the toolkit keeps a file of its own (someone "
            "else made it; it was not followed). Remove it and rerun."
        ) from err
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise DownloadError(f"Refusing {path}: not a regular file. Remove it and rerun.")
    return fd


def manifest_path(opts: Options) -> str:
    return os.path.join(opts.state_dir, "manifest.json")


def progress_path(opts: Options) -> str:
    return opts.progress_file or os.path.join(opts.state_dir, "progress.json")


# Check mode's full verify runs as a job in a temp dir of this name (start_check_job):
# its results and progress live there, never in the shared state tree.
CHECK_JOB_PREFIX = "vllm-fleet-verify-"


def check_job_dir(job_file: str | None) -> str | None:
    """The private dir of a check mode job's results file, else None (a download's)."""
    where = os.path.dirname(job_file or "")
    return where if os.path.basename(where).startswith(CHECK_JOB_PREFIX) else None


def read_manifest(opts: Options) -> dict[str, Any]:
    """The manifest of this repo in any version ({} when absent or unreadable)."""
    try:
        with open(manifest_path(opts)) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) and data.get("repo_id") == opts.repo_id else {}


def load_manifest(opts: Options) -> dict[str, Any]:
    """The manifest when it is of this version: older ones hold no digests to trust."""
    data = read_manifest(opts)
    return data if data.get("version") == MANIFEST_VERSION else {}


def stat_stamp(path: str) -> dict[str, int] | None:
    """Size, mtime, ctime, inode, device of a regular file (None when absent or not one).

    ctime cannot be set back by a writer, so an in-place rewrite with a restored mtime
    is still seen; a replaced file has another inode.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return {
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "ino": st.st_ino,
        "dev": st.st_dev,
    }


def new_digest(algorithm: str, size: int) -> Any:
    if algorithm == "sha256":
        return hashlib.sha256()
    digest = hashlib.sha1(usedforsecurity=False)
    digest.update(b"blob %d\0" % size)
    return digest


def feed_file(digest: Any, path: str, limit: int | None = None) -> None:
    """Feed the first ``limit`` bytes of ``path`` (all when None) into ``digest``."""
    left = limit
    with open(path, "rb") as fh:
        while left is None or left > 0:
            chunk = fh.read(HASH_CHUNK if left is None else min(HASH_CHUNK, left))
            if not chunk:
                break
            digest.update(chunk)
            if left is not None:
                left -= len(chunk)


def hash_file(path: str, algorithm: str) -> str:
    digest = new_digest(algorithm, os.path.getsize(path))
    feed_file(digest, path)
    return digest.hexdigest()


def hash_many(opts: Options, entries: list[Entry], base: str, tick: Any = None) -> list[str | None]:
    """Digests of ``base/<path>`` by each entry's algorithm, in parallel (None: unreadable).

    ``tick(nbytes)`` (optional) is called after each file, from the worker threads.
    """

    def one(entry: Entry) -> str | None:
        try:
            return hash_file(os.path.join(base, entry.path), entry.reference()[0])
        except OSError:
            return None
        finally:
            if tick is not None:
                tick(entry.size)

    with ThreadPoolExecutor(max(1, opts.hash_workers)) as pool:
        return list(pool.map(one, entries))


def assess(
    opts: Options,
    entries: list[Entry],
    manifest: dict[str, Any],
    actual: dict[str, str | None] | None = None,
    tick: Any = None,
) -> tuple[dict[str, str], dict[str, str], int]:
    """Classify each file: one stat each; hash only files whose stamp is not the recorded one.

    A record is trusted only when its stamp equals the file's and its digest equals the
    listing's (so a record of another commit proves a file the new commit did not change).
    Returns (status, digests, hashed): status is ok | missing | size | corrupt | unproven
    (quick mode: would need hashing); digests are the proved ones. ``actual`` (optional)
    receives the digest found of each hashed file, for a report of what was wrong.
    """
    recorded = manifest.get("files", {})
    status: dict[str, str] = {}
    digests: dict[str, str] = {}
    to_hash: list[Entry] = []
    for entry in entries:
        stamp = stat_stamp(os.path.join(opts.local_dir, entry.path))
        rec = recorded.get(entry.path, {})
        want = entry.reference()[1]
        if stamp is None:
            status[entry.path] = "missing"
        elif stamp["size"] != entry.size:
            status[entry.path] = "size"
        elif rec.get("stat") == stamp and rec.get("digest") == want and opts.verify != "full":
            status[entry.path] = "ok"
            digests[entry.path] = want
        elif opts.quick:
            status[entry.path] = "unproven"
        else:
            to_hash.append(entry)
    hashed = hash_many(opts, to_hash, opts.local_dir, tick)
    for entry, digest in zip(to_hash, hashed, strict=True):
        if actual is not None:
            actual[entry.path] = digest
        good = digest == entry.reference()[1]
        status[entry.path] = "ok" if good else "corrupt"
        if good:
            digests[entry.path] = entry.reference()[1]
    return status, digests, len(to_hash)


def local_files(base: str) -> list[str]:
    """Every non-directory entry under ``base`` (symlinks not followed), relative, sorted."""
    found = []
    for top, dirs, files in os.walk(base):
        rel = os.path.relpath(top, base)
        for name in files + [d for d in dirs if os.path.islink(os.path.join(top, d))]:
            found.append(name if rel == "." else f"{rel}/{name}")
    return sorted(found)


def find_extras(
    opts: Options,
    entries: list[Entry],
    manifest: dict[str, Any],
    strays: list[str] | None = None,
) -> list[str]:
    """Files in the checkpoint that the listing lacks: left by an earlier commit.

    Only files an earlier download recorded are removed later; anything else is
    refused (it may be someone's data, and nothing is deleted on a guess); with
    ``strays`` (a verify) they are put there instead, for the verify to report.
    """
    listed = {e.path for e in entries}
    extras = [p for p in local_files(opts.local_dir) if p not in listed]
    known = set(manifest.get("files", {}))
    unknown = [p for p in extras if p not in known]
    if unknown and strays is not None:
        strays.extend(unknown)
        return [p for p in extras if p in known]
    if unknown:
        more = f" (+{len(unknown) - 10} more)" if len(unknown) > 10 else ""
        raise DownloadError(
            f"{opts.local_dir} holds files that are not part of {opts.repo_id} at this "
            f"commit and that no earlier download recorded: {', '.join(unknown[:10])}{more}. "
            "Move them out of the checkpoint directory and rerun; nothing was deleted."
        )
    return extras


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


def progress_record(
    counts: Any, state: str, moved_bytes: int, started: float, error: str
) -> dict[str, Any]:
    """progress.json's record (the CLI and the progress callback read it): ``counts``
    carries files_done/_total and bytes_done/_total; the rate is of ``moved_bytes``
    (hashed, or fetched from the hub) since ``started`` (time.monotonic)."""
    elapsed = max(time.monotonic() - started, 1e-6)
    rate = moved_bytes / elapsed
    left = counts.bytes_total - counts.bytes_done
    return {
        "state": state,
        "pid": os.getpid(),
        "files_done": counts.files_done,
        "files_total": counts.files_total,
        "bytes_done": counts.bytes_done,
        "bytes_total": counts.bytes_total,
        "rate_bytes_per_s": int(rate),
        "eta_s": int(left / rate) if rate > 0 else None,
        "elapsed_s": round(elapsed, 1),
        "error": error,
        "updated": time.time(),
    }


class HashProgress:
    """progress.json while a full verify hashes (files and bytes hashed), once a second.

    Only for a download with ``verify=full``: the run that hashes every file of a large
    checkpoint, which takes minutes; other runs hash little and write nothing here.
    """

    def __init__(self, opts: Options, entries: list[Entry], wanted: bool) -> None:
        self.path = progress_path(opts)
        self.active = wanted and opts.verify == "full" and os.path.isdir(os.path.dirname(self.path))
        self.lock = threading.Lock()
        self.files_total = len(entries)
        self.bytes_total = sum(e.size for e in entries)
        self.files_done = self.bytes_done = 0
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def tick(self, nbytes: int) -> None:
        with self.lock:
            self.files_done += 1
            self.bytes_done += nbytes

    def write(self) -> None:
        with contextlib.suppress(OSError):
            write_json_atomic(
                self.path,
                progress_record(self, "hashing", self.bytes_done, self.started, ""),
            )

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            self.write()

    def __enter__(self) -> Any:
        if not self.active:
            return None
        self.write()
        self._thread.start()
        return self.tick

    def __exit__(self, *exc: object) -> None:
        if self.active:
            self._stop.set()
            self._thread.join()
            self.write()


def write_json_atomic(path: str, data: Any) -> None:
    # mkstemp: a new name (O_EXCL), so no link planted at a guessable one is written through.
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=os.path.dirname(path))
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def manifest_entries(opts: Options) -> tuple[dict[str, Any], list[Entry]]:
    manifest = load_manifest(opts)
    if not manifest.get("complete"):
        raise DownloadError(
            f"No complete download recorded in {manifest_path(opts)} (missing, unreadable or "
            "written by an older version): run the download (deploy --tags download) first."
        )
    files = manifest["files"]
    check_names(opts.local_dir, list(files), f"the manifest {manifest_path(opts)}")
    return manifest, recorded_entries(files)


def view_stamp(stamp: dict[str, int] | None) -> dict[str, int] | None:
    """The stamp as every host sees it on shared storage (device numbers are per host)."""
    return None if stamp is None else {k: v for k, v in stamp.items() if k != "dev"}


def verify_local(opts: Options) -> dict[str, Any]:
    """This host's view of the checkpoint against the manifest (no network).

    Default: one stat per file, each stamp equal to the recorded one. ``verify=full``:
    re-hash every file in parallel against the manifest's digests, naming each bad file.
    """
    manifest, entries = manifest_entries(opts)
    files = manifest["files"]
    bad: list[str] = []
    if opts.verify == "full":
        for entry, got in zip(entries, hash_many(opts, entries, opts.local_dir), strict=True):
            want = files[entry.path].get("digest")
            if got != want or want != entry.reference()[1]:
                bad.append(
                    f"{entry.path} ({entry.reference()[0]} {got or 'unreadable'}, manifest {want})"
                )
    else:
        for entry in entries:
            stamp = view_stamp(stat_stamp(os.path.join(opts.local_dir, entry.path)))
            if stamp is None:
                bad.append(f"{entry.path} (missing)")
            elif stamp != view_stamp(files[entry.path].get("stat")):
                bad.append(f"{entry.path} (changed since the download proved it)")
    if bad:
        more = f" (+{len(bad) - 20} more)" if len(bad) > 20 else ""
        raise DownloadError(
            f"Checkpoint {opts.local_dir} differs from {opts.repo_id}@{manifest['sha']}: "
            f"{len(bad)} bad file(s): {'; '.join(bad[:20])}{more}. Rerun the download "
            "(deploy --tags download) to repair them from the hub."
        )
    return {
        "changed": False,
        "sha": manifest["sha"],
        "complete": True,
        "verified": opts.verify,
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
    """The job's final result from its results file, or None while the job runs.

    A job whose process is gone without a final result (killed, node crash) has ended:
    that is reported as its failure, naming the pid.
    """
    try:
        with open(job_file) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None  # not written yet
    if data.get("started") and not data.get("finished"):
        pid = int(data.get("pid", 0))
        if pid and not _alive(pid):
            msg = f"the download job (pid {pid}) died without a result"
            return {"failed": True, "finished": 1, "msg": msg}
        return None
    return data


def read_progress(opts: Options, job_file: str | None) -> dict[str, Any]:
    """progress.json, unless it is older than the followed job (left by an earlier run)."""
    private = check_job_dir(job_file)
    path = os.path.join(private, "progress.json") if private else progress_path(opts)
    try:
        with open(path) as fh:
            progress = json.load(fh)
        if job_file and progress.get("updated", 0) < os.path.getmtime(job_file) - 1:
            return {}
        return progress
    except (OSError, ValueError):
        return {}


def wait_progress(opts: Options, wait_s: float, job_file: str | None = None) -> dict[str, Any]:
    """Wait up to wait_s for the download job to end; return its latest progress.

    With ``job_file`` (start_job's results file) the job has ended once its final result is
    there or its process is gone; without, once progress.json says done/failed or its
    writer died.
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
        time.sleep(0.2)
    if dead:
        progress["state"] = "killed"
    rate = progress.get("rate_bytes_per_s") or 0
    msg = (
        f"{progress.get('files_done', '?')}/{progress.get('files_total', '?')} files, "
        f"{human(progress.get('bytes_done', 0))}/{human(progress.get('bytes_total', 0))}, "
        f"{human(rate)}/s, ETA {progress.get('eta_s', '?')} s ({state or 'starting'})"
    )
    result = {
        "changed": False,
        "ended": ended,
        "progress": progress,
        "msg": msg,
        "vllm_fleet_poll": msg,
    }
    if job is not None:
        result["job"] = {k: v for k, v in job.items() if k != "invocation"}
        private = check_job_dir(job_file)
        if private:
            shutil.rmtree(private, ignore_errors=True)
    return result
