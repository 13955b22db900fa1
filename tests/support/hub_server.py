"""A small Hugging Face Hub-compatible HTTP server for tests, on loopback only.

It implements what huggingface_hub 2.4 calls for ``snapshot_download`` /
``hf_hub_download`` (read from its source, not guessed):

- ``GET /api/models/{repo}[/revision/{rev}]``: repo info with ``sha`` and ``siblings``.
- ``GET /api/models/{repo}/tree/{rev}[/{path}]?recursive=true``: the tree listing,
  paginated with a GitHub-style ``Link: <...>; rel="next"`` header, LFS entries carrying
  ``lfs.oid`` (sha256), ``lfs.size`` and ``lfs.pointerSize``.
- ``HEAD|GET /{repo}/resolve/{rev}/{path}``: ``X-Repo-Commit``, ``ETag`` (git blob sha1),
  ``X-Linked-Etag`` / ``X-Linked-Size`` for LFS files, ``Content-Length``,
  ``Accept-Ranges`` and ``Range: bytes=N-[M]`` answered with 206.
- 404 with ``X-Error-Code``: ``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``.

Repository layout under ``--root``::

    <org>/<name>/refs.json             {"main": "<40-hex sha>", "v1.0": "<sha>"}
    <org>/<name>/commits/<sha>/<files> the files of that commit

Tests drive it in-process (``HubServer``) or, when run as
``python -m tests.support.hub_server --root DIR --port P``, through ``/_control/*``:
``GET /_control/requests``, ``POST /_control/reset``, ``POST /_control/faults`` (a JSON
list of fault rules, see ``Fault``), ``DELETE /_control/faults``.
Unreachable hub = ``HubServer.stop()`` (nothing listens on the port any more).
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

LOOPBACK = "127.0.0.1"
SHA_RE = re.compile(r"^[0-9a-f]{40}$")
# Files stored with Git LFS on the real hub: large binaries and safetensors.
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf", ".model")
LFS_POINTER_SIZE = 134
CHUNK = 1 << 20


@dataclass
class Fault:
    """One fault rule, matched against resolve requests (GET and HEAD).

    kind:
      ``status``      answer ``status`` (e.g. 500) instead of the file.
      ``close_after`` send full headers, then ``bytes`` body bytes, then drop the connection.
      ``short``       declare and send ``bytes`` fewer bytes than the file has (truncated body).
      ``throttle``    send the body at ``rate`` bytes per second.
      ``ignore_range`` answer a ``Range`` request with 200 and the whole file.
      ``corrupt``     send the file with the byte at offset ``bytes`` flipped: same size,
                      same headers (the listing's true digest), wrong content.
      ``redirect``    answer 302 with the file's headers (``X-Repo-Commit``, ``ETag``,
                      ``X-Linked-*``) and ``Location: <target><same path>?X-Amz-Signature=..``,
                      as the real hub sends a file body to its CDN: ``target`` is another
                      server of ours (``HubServer(root, host="127.0.0.2")``), which records
                      the headers it gets.
    ``times``: how many requests it applies to (-1: all). ``method``: GET, HEAD or ``*``.
    """

    kind: str
    path: str = "*"
    method: str = "GET"
    status: int = 500
    bytes: int = 0
    rate: float = 0.0
    times: int = -1
    target: str = ""

    def matches(self, method: str, path: str) -> bool:
        if self.times == 0:
            return False
        return self.method in ("*", method) and fnmatch.fnmatch(path, self.path)


@dataclass
class Request:
    method: str
    path: str
    file: str | None
    range: str | None
    status: int
    sent: int = 0
    auth: str | None = None


@dataclass
class FileMeta:
    size: int
    oid: str
    sha256: str | None


@dataclass
class HubState:
    root: Path
    page_size: int = 1000
    faults: list[Fault] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    active: int = 0  # requests being served now
    meta_cache: dict[tuple[str, str], dict[str, FileMeta]] = field(default_factory=dict)

    def take_fault(self, method: str, path: str) -> Fault | None:
        with self.lock:
            for fault in self.faults:
                if fault.matches(method, path):
                    if fault.times > 0:
                        fault.times -= 1
                    return fault
        return None

    def record(self, req: Request) -> None:
        with self.lock:
            self.requests.append(req)

    def quiesce(self, timeout: float = 10.0) -> None:
        """Wait until no request is being served (a throttled body an earlier client gave up
        on is still sent, and recorded when it ends)."""
        deadline = time.monotonic() + timeout
        while self.active and time.monotonic() < deadline:
            time.sleep(0.02)

    def serving(self, delta: int) -> None:
        with self.lock:
            self.active += delta


def git_blob_sha1(path: Path) -> str:
    digest = hashlib.sha1(usedforsecurity=False)
    digest.update(b"blob %d\0" % path.stat().st_size)
    with path.open("rb") as fh:
        while chunk := fh.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def commit_files(
    repo_dir: Path, source: Path, tags: tuple[str, ...] = (), *, move: bool = False
) -> str:
    """Record ``source``'s files as the ``main`` revision of ``repo_dir``; return its sha.

    Writes the layout this server serves: ``commits/<sha>/``, ``<sha>.meta.json``
    (sizes, git blob ids, LFS sha256, so the server need not hash) and ``refs.json``
    (``main`` and ``tags`` -> sha). The sha derives from the files' blob ids, so the
    same files give the same sha. ``move`` renames ``source`` into place (replacing
    an earlier copy); otherwise it is copied there unless that sha already exists.
    """
    meta = {
        f.relative_to(source).as_posix(): FileMeta(
            size=f.stat().st_size,
            oid=git_blob_sha1(f),
            sha256=sha256_file(f) if f.name.endswith(LFS_SUFFIXES) else None,
        )
        for f in sorted(p for p in source.rglob("*") if p.is_file())
    }
    digest = json.dumps({p: m.oid for p, m in meta.items()}, sort_keys=True).encode()
    sha = hashlib.sha1(digest, usedforsecurity=False).hexdigest()
    final = repo_dir / "commits" / sha
    final.parent.mkdir(parents=True, exist_ok=True)
    if move:
        if final.exists():
            shutil.rmtree(final)
        source.rename(final)
    elif not final.is_dir():
        staging = Path(tempfile.mkdtemp(prefix=f".{sha}.", dir=final.parent))
        shutil.copytree(source, staging, dirs_exist_ok=True)
        staging.rename(final)
    (repo_dir / "commits" / f"{sha}.meta.json").write_text(
        json.dumps({p: m.__dict__ for p, m in meta.items()})
    )
    refs_path = repo_dir / "refs.json"
    refs = json.loads(refs_path.read_text()) if refs_path.is_file() else {}
    refs.update({"main": sha, **dict.fromkeys(tags, sha)})
    refs_path.write_text(json.dumps(refs, indent=2) + "\n")
    return sha


def is_lfs(path: str) -> bool:
    return path.endswith(LFS_SUFFIXES)


def commit_meta(state: HubState, repo: str, sha: str) -> dict[str, FileMeta]:
    """Sizes and hashes of every file of a commit; from ``<sha>.meta.json`` when present."""
    key = (repo, sha)
    if key in state.meta_cache:
        return state.meta_cache[key]
    base = state.root / repo / "commits" / sha
    cached = base.parent / f"{sha}.meta.json"
    if cached.is_file():
        raw = json.loads(cached.read_text())
        meta = {p: FileMeta(**m) for p, m in raw.items()}
    else:
        meta = {}
        for file in sorted(p for p in base.rglob("*") if p.is_file()):
            rel = file.relative_to(base).as_posix()
            lfs_sha = sha256_file(file) if is_lfs(rel) else None
            meta[rel] = FileMeta(size=file.stat().st_size, oid=git_blob_sha1(file), sha256=lfs_sha)
    state.meta_cache[key] = meta
    return meta


class HubError(Exception):
    def __init__(self, status: int, code: str | None, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes: with Nagle on, a keep-alive client's
    # delayed ACK stalls every small answer by 40 ms (a real hub's front end does not).
    disable_nagle_algorithm = True
    server: HubHTTPServer

    def log_message(self, format: str, *args: Any) -> None:
        # Quiet: tests read the request log instead.
        return

    @property
    def state(self) -> HubState:
        return self.server.state

    # --- dispatch ---------------------------------------------------------
    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        path = unquote(url.path)
        req = Request(method, path, None, self.headers.get("Range"), 0)
        req.auth = self.headers.get("Authorization")
        control = path.startswith("/_control/")
        if not control:
            self.state.serving(1)
        try:
            if control:
                self._control(method, path)
                req.status = 200
                return
            if path.startswith("/api/models/"):
                req.status = self._api(method, path[len("/api/models/") :], parse_qs(url.query))
            elif "/resolve/" in path:
                req.status = self._resolve(method, path, req)
            else:
                raise HubError(404, None, f"no route for {path}")
        except HubError as err:
            req.status = err.status
            self._send_json({"error": err.message}, err.status, {"X-Error-Code": err.code})
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        finally:
            if not control:
                self.state.record(req)
                self.state.serving(-1)

    # --- repo resolution --------------------------------------------------
    def _repo_dir(self, repo: str) -> Path:
        repo_dir = self.state.root / repo
        if repo.count("/") != 1 or ".." in repo or not (repo_dir / "refs.json").is_file():
            raise HubError(404, "RepoNotFound", f"Repository Not Found for url: {repo}")
        return repo_dir

    def _resolve_rev(self, repo: str, rev: str) -> str:
        repo_dir = self._repo_dir(repo)
        refs = json.loads((repo_dir / "refs.json").read_text())
        sha = refs.get(rev) or (rev if SHA_RE.match(rev) else None)
        if sha is None or not (repo_dir / "commits" / sha).is_dir():
            raise HubError(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return sha

    # --- /api/models ------------------------------------------------------
    def _api(self, method: str, rest: str, query: dict[str, list[str]]) -> int:
        if method != "GET":
            raise HubError(405, None, "method not allowed")
        parts = rest.split("/")
        repo = "/".join(parts[:2])
        if len(parts) == 2:
            return self._repo_info(repo, "main")
        if len(parts) >= 4 and parts[2] == "revision":
            return self._repo_info(repo, "/".join(parts[3:]))
        if len(parts) >= 4 and parts[2] == "tree":
            return self._tree(repo, parts[3], "/".join(parts[4:]), query)
        raise HubError(404, None, f"no api route for {rest}")

    def _repo_info(self, repo: str, rev: str) -> int:
        sha = self._resolve_rev(repo, rev)
        meta = commit_meta(self.state, repo, sha)
        body = {
            "id": repo,
            "modelId": repo,
            "sha": sha,
            "private": False,
            "siblings": [{"rfilename": p} for p in meta],
        }
        self._send_json(body, 200)
        return 200

    def _tree(self, repo: str, rev: str, prefix: str, query: dict[str, list[str]]) -> int:
        sha = self._resolve_rev(repo, rev)
        meta = commit_meta(self.state, repo, sha)
        recursive = query.get("recursive", ["false"])[0].lower() == "true"
        entries = tree_entries(meta, prefix.strip("/"), recursive)
        start = int(query.get("cursor", ["0"])[0])
        page = entries[start : start + self.state.page_size]
        headers = {}
        if start + self.state.page_size < len(entries):
            nxt = start + self.state.page_size
            host = self.headers.get("Host", f"{LOOPBACK}:{self.server.server_port}")
            rec = "true" if recursive else "false"
            url = f"http://{host}/api/models/{repo}/tree/{quote(rev, safe='')}"
            if prefix:
                url += "/" + quote(prefix, safe="")
            headers["Link"] = f'<{url}?recursive={rec}&cursor={nxt}>; rel="next"'
        self._send_json(page, 200, headers)
        return 200

    # --- /{repo}/resolve/{rev}/{file} -------------------------------------
    def _resolve(self, method: str, path: str, req: Request) -> int:
        repo, _, rest = path.lstrip("/").partition("/resolve/")
        rev, _, file = rest.partition("/")
        sha = self._resolve_rev(repo, rev)
        meta = commit_meta(self.state, repo, sha).get(file)
        req.file = file
        if meta is None:
            raise HubError(404, "EntryNotFound", f"{file} does not exist at {rev}")
        fault = self.state.take_fault(method, file)
        if fault is not None and fault.kind == "status":
            raise HubError(fault.status, None, f"injected {fault.status}")
        if fault is not None and fault.kind == "redirect":
            return self._redirect(sha, meta, fault.target)
        start, end = 0, meta.size - 1
        status = 200
        rng = self.headers.get("Range") if method == "GET" else None
        if fault is not None and fault.kind == "ignore_range":
            rng = None  # a server (or proxy) that answers 200 with the whole file
        if rng:
            match = re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip())
            if not match or int(match.group(1)) >= meta.size:
                raise HubError(416, None, f"bad range {rng}")
            start = int(match.group(1))
            end = min(int(match.group(2)), end) if match.group(2) else end
            status = 206
        length = end - start + 1
        if fault is not None and fault.kind == "short":
            length = max(0, length - fault.bytes)
        headers = {
            "X-Repo-Commit": sha,
            "ETag": f'"{meta.oid}"',
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
        }
        if meta.sha256:
            headers["X-Linked-Etag"] = f'"{meta.sha256}"'
            headers["X-Linked-Size"] = str(meta.size)
        if status == 206:
            headers["Content-Range"] = f"bytes {start}-{start + length - 1}/{meta.size}"
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(length if method == "GET" else meta.size))
        self.end_headers()
        if method == "GET":
            local = self.state.root / repo / "commits" / sha / file
            req.sent = self._send_body(local, start, length, fault)
        return status

    def _redirect(self, sha: str, meta: FileMeta, target: str) -> int:
        headers = {"X-Repo-Commit": sha, "ETag": f'"{meta.oid}"'}
        if meta.sha256:
            headers["X-Linked-Etag"] = f'"{meta.sha256}"'
            headers["X-Linked-Size"] = str(meta.size)
        # A signed URL: the CDN needs no token, and a real one refuses a request with both.
        headers["Location"] = f"{target.rstrip('/')}{urlsplit(self.path).path}?X-Amz-Signature=t"
        self.send_response(302)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", "0")
        self.end_headers()
        return 302

    def _send_body(self, local: Path, start: int, length: int, fault: Fault | None) -> int:
        limit = length
        if fault is not None and fault.kind == "close_after":
            limit = min(length, fault.bytes)
        rate = fault.rate if fault is not None and fault.kind == "throttle" else 0.0
        sent = 0
        if fault is not None and fault.kind == "corrupt":
            return self._send_corrupt(local, start, limit, fault.bytes)
        with local.open("rb") as fh:
            if rate <= 0:
                # sendfile keeps the server off the CPU the client needs (2-core machines).
                self.wfile.flush()
                sent = self.connection.sendfile(fh, start, limit) if limit else 0
            else:
                fh.seek(start)
                began = time.monotonic()
                step = max(1024, int(rate / 20))
                while sent < limit:
                    chunk = fh.read(min(step, limit - sent))
                    if not chunk:
                        break
                    self.wfile.write(chunk)
                    self.wfile.flush()
                    sent += len(chunk)
                    ahead = sent / rate - (time.monotonic() - began)
                    if ahead > 0:
                        time.sleep(ahead)
        if limit < length:
            self.close_connection = True
            self.connection.shutdown(2)
        return sent

    def _send_corrupt(self, local: Path, start: int, length: int, offset: int) -> int:
        with local.open("rb") as fh:
            fh.seek(start)
            body = bytearray(fh.read(length))
        if start <= offset < start + len(body):
            body[offset - start] ^= 0xFF
        self.wfile.write(bytes(body))
        return len(body)

    # --- control ------------------------------------------------------------
    def _control(self, method: str, path: str) -> None:
        name = path[len("/_control/") :]
        if name == "requests" and method == "GET":
            with self.state.lock:
                body: Any = [asdict(r) for r in self.state.requests]
            self._send_json(body, 200)
            return
        if name == "reset" and method == "POST":
            with self.state.lock:
                self.state.requests.clear()
                self.state.faults.clear()
        elif name == "faults" and method == "POST":
            raw = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
            with self.state.lock:
                self.state.faults.extend(Fault(**f) for f in raw)
        elif name == "faults" and method == "DELETE":
            with self.state.lock:
                self.state.faults.clear()
        else:
            raise HubError(404, None, f"no control route {name}")
        self._send_json({"ok": True}, 200)

    def _send_json(
        self, body: Any, status: int, headers: dict[str, str | None] | None = None
    ) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            if value is not None:
                self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)


def tree_entries(meta: dict[str, FileMeta], prefix: str, recursive: bool) -> list[dict[str, Any]]:
    """The hub's tree listing: folders and files under ``prefix``, sorted by path."""
    files: list[dict[str, Any]] = []
    folders: set[str] = set()
    for path, m in meta.items():
        if prefix and not path.startswith(prefix + "/"):
            continue
        rel = path[len(prefix) + 1 :] if prefix else path
        parts = rel.split("/")
        for depth in range(1, len(parts)):
            if not recursive and depth > 1:
                break
            folders.add("/".join(([prefix] if prefix else []) + parts[:depth]))
        if not recursive and len(parts) > 1:
            continue
        entry: dict[str, Any] = {"type": "file", "path": path, "size": m.size, "oid": m.oid}
        if m.sha256:
            entry["lfs"] = {"oid": m.sha256, "size": m.size, "pointerSize": LFS_POINTER_SIZE}
        files.append(entry)
    dirs = [{"type": "directory", "path": p, "oid": "0" * 40} for p in sorted(folders)]
    return dirs + sorted(files, key=lambda e: e["path"])


class HubHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, state: HubState, port: int, host: str = LOOPBACK) -> None:
        self.state = state
        super().__init__((host, port), Handler)


class HubServer:
    """In-process hub for tests: ``with HubServer(root) as hub: hub.endpoint``.

    ``host`` is a loopback address (never anything else): a second server at
    ``127.0.0.2`` is another host name to the client, the CDN of a ``redirect`` fault.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        port: int = 0,
        page_size: int = 1000,
        host: str = LOOPBACK,
    ) -> None:
        if not host.startswith("127."):
            raise ValueError(f"the test hub binds loopback only, not {host}")
        self.state = HubState(root=Path(root), page_size=page_size)
        self.port = port
        self.host = host
        self._httpd: HubHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> HubServer:
        self._httpd = HubHTTPServer(self.state, self.port, self.host)
        self.port = self._httpd.server_port
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop listening: the hub becomes unreachable (connection refused) on its port."""
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- test API -------------------------------------------------------------
    def add_fault(self, **kwargs: Any) -> Fault:
        fault = Fault(**kwargs)
        with self.state.lock:
            self.state.faults.append(fault)
        return fault

    def clear_faults(self) -> None:
        with self.state.lock:
            self.state.faults.clear()

    def reset(self) -> None:
        self.state.quiesce()
        with self.state.lock:
            self.state.faults.clear()
            self.state.requests.clear()

    def requests(self, method: str | None = None, file: str | None = None) -> list[Request]:
        """Recorded requests, filtered by method and file glob (resolve requests only for file)."""
        with self.state.lock:
            reqs = list(self.state.requests)
        return [
            r
            for r in reqs
            if (method is None or r.method == method)
            and (file is None or (r.file is not None and fnmatch.fnmatch(r.file, file)))
        ]

    def count(self, method: str | None = None, file: str | None = None) -> int:
        return len(self.requests(method, file))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", required=True, help="directory of repos (<org>/<name>/...)")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--page-size", type=int, default=1000)
    parser.add_argument("--port-file", type=Path, help="write the endpoint URL here once listening")
    parser.add_argument("--pid-file", type=Path, help="write this process's pid here")
    args = parser.parse_args(argv)
    state = HubState(root=Path(args.root), page_size=args.page_size)
    httpd = HubHTTPServer(state, args.port)
    endpoint = f"http://{LOOPBACK}:{httpd.server_port}"
    if args.pid_file:
        args.pid_file.write_text(f"{os.getpid()}\n")
    if args.port_file:
        args.port_file.write_text(endpoint + "\n")
    print(endpoint, flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()


if __name__ == "__main__":
    main()
