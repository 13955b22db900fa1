"""Unit tests of module_utils/hf_download.py: the parts that need no hub."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import socket
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "module_utils"))

import hf_download as hd

from tests.support.ansible_module import (
    fail_module,
    load_module,
    patch_ansible_module,
    run_module,
)
from tests.support.hub_server import HubServer, commit_files

__all__ = ["patch_ansible_module"]  # the autouse fixture, re-exported for pytest


def opts(tmp_path: Path, **kw: object) -> hd.Options:
    return hd.Options(
        repo_id="org/model",
        revision="main",
        local_dir=str(tmp_path / "model"),
        state_dir=str(tmp_path / "state"),
        **kw,  # type: ignore[arg-type]
    )


def entry_for(base: Path, name: str, data: bytes, lfs: bool) -> hd.Entry:
    (base / name).write_bytes(data)
    blob = hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()
    return hd.Entry(name, len(data), blob, hashlib.sha256(data).hexdigest() if lfs else None)


@pytest.fixture
def checkpoint(tmp_path: Path) -> tuple[hd.Options, list[hd.Entry]]:
    o = opts(tmp_path)
    base = Path(o.local_dir)
    base.mkdir()
    Path(o.state_dir).mkdir()
    entries = [
        entry_for(base, "model-00001-of-00002.safetensors", b"a" * 4096, lfs=True),
        entry_for(base, "model-00002-of-00002.safetensors", b"b" * 4096, lfs=True),
        entry_for(base, "config.json", b'{"x": 1}\n', lfs=False),
    ]
    return o, entries


def record(o: hd.Options, entries: list[hd.Entry], sha: str = "a" * 40) -> None:
    plan = hd.Plan(sha, entries, dict.fromkeys((e.path for e in entries), "ok"), {}, 0, 0)
    hd.write_manifest(o, plan, {e.path: e.reference()[1] for e in entries})


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("../escape", "'..' segment"),
        ("/abs/escape", "absolute path"),
        ("a/../../escape", "'..' segment"),
        ("a\\..\\escape", "backslash"),
        ("a\0b", "NUL byte"),
        ("a//b", "empty or '.' segment"),
        ("./a", "empty or '.' segment"),
        ("", "empty name"),
    ],
)
def test_unsafe_names_are_refused_naming_the_entry(tmp_path: Path, name: str, reason: str) -> None:
    with pytest.raises(hd.DownloadError) as err:
        hd.check_names(str(tmp_path / "model"), ["config.json", name], "the listing")
    assert repr(name) in str(err.value) and reason in str(err.value)


def test_a_symlinked_parent_pointing_outside_is_refused(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "model" / "sub").symlink_to(tmp_path / "outside")
    (tmp_path / "model" / "inner").symlink_to(tmp_path / "model")  # stays inside: fine
    hd.check_names(str(tmp_path / "model"), ["inner/config.json", "docs/a.md"], "the listing")
    with pytest.raises(hd.DownloadError, match=r"'sub/escape'.*outside"):
        hd.check_names(str(tmp_path / "model"), ["sub/escape"], "the listing")


def test_a_symlinked_file_or_nested_parent_pointing_outside_is_refused(tmp_path: Path) -> None:
    model = tmp_path / "model"
    (model / "a" / "b").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (model / "a" / "link.json").symlink_to(tmp_path / "outside" / "x.json")
    (model / "a" / "b" / "up").symlink_to(tmp_path / "outside")
    (model / "a" / "b" / "self").symlink_to(model / "a")  # stays inside: fine
    # Parents are resolved once per directory: a safe sibling first must not hide a bad one.
    hd.check_names(str(model), ["a/b/x", "a/b/self/y", "a/z"], "the listing")
    with pytest.raises(hd.DownloadError, match=r"'a/link.json'.*outside"):
        hd.check_names(str(model), ["a/z", "a/link.json"], "the listing")
    with pytest.raises(hd.DownloadError, match=r"'a/b/up/v'.*outside"):
        hd.check_names(str(model), ["a/b/x", "a/b/up/v"], "the listing")


def test_unrecorded_present_files_are_hashed_never_trusted_by_size(checkpoint) -> None:
    o, entries = checkpoint
    os.unlink(Path(o.local_dir) / entries[1].path)
    (Path(o.local_dir) / entries[0].path).write_bytes(b"z" * 4096)  # right size, wrong bytes
    status, digests, hashed = hd.assess(o, entries, {})
    assert status == {
        entries[0].path: "corrupt",
        entries[1].path: "missing",
        entries[2].path: "ok",
    }
    assert digests == {entries[2].path: entries[2].oid} and hashed == 2


def test_recorded_files_with_their_stamp_are_proved_without_hashing(checkpoint) -> None:
    o, entries = checkpoint
    record(o, entries)
    status, digests, hashed = hd.assess(o, entries, hd.load_manifest(o))
    assert set(status.values()) == {"ok"} and hashed == 0
    assert digests == {e.path: e.reference()[1] for e in entries}
    # A record with another digest (a new commit changed the file) is never trusted.
    changed = hd.Entry(entries[0].path, 4096, "0" * 40, "f" * 64)
    status, _, hashed = hd.assess(o, [changed], hd.load_manifest(o))
    assert status == {changed.path: "corrupt"} and hashed == 1


def test_rewrite_with_restored_mtime_is_seen_through_ctime(checkpoint) -> None:
    o, entries = checkpoint
    record(o, entries)
    shard = Path(o.local_dir) / entries[0].path
    st = shard.stat()
    shard.write_bytes(b"A" + b"a" * 4095)  # same size
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    status, digests, _ = hd.assess(o, entries, hd.load_manifest(o))
    assert status[entries[0].path] == "corrupt"
    assert status[entries[1].path] == "ok" and status[entries[2].path] == "ok"
    assert entries[0].path not in digests


def test_touched_but_intact_file_is_rehashed_and_kept(checkpoint) -> None:
    o, entries = checkpoint
    record(o, entries)
    os.utime(Path(o.local_dir) / entries[2].path, ns=(1, 1))
    status, digests, hashed = hd.assess(o, entries, hd.load_manifest(o))
    assert set(status.values()) == {"ok"} and hashed == 1
    assert digests[entries[2].path] == entries[2].oid  # git blob sha1 for non-LFS files


def test_quick_plan_leaves_moved_stamps_unproven(checkpoint) -> None:
    o, entries = checkpoint
    o.quick = True
    status, _, hashed = hd.assess(o, entries, {})
    assert set(status.values()) == {"unproven"} and hashed == 0


def test_full_verification_hashes_everything(checkpoint) -> None:
    o, entries = checkpoint
    record(o, entries)
    o.verify = "full"
    status, digests, hashed = hd.assess(o, entries, hd.load_manifest(o))
    assert set(status.values()) == {"ok"} and hashed == len(entries)
    assert digests == {e.path: e.reference()[1] for e in entries}


def test_full_verify_names_each_bad_file(checkpoint) -> None:
    o, entries = checkpoint
    record(o, entries)
    o.verify = "full"
    for entry in entries[:2]:
        path = Path(o.local_dir) / entry.path
        path.write_bytes(b"c" * entry.size)
    with pytest.raises(hd.DownloadError) as err:
        hd.verify_local(o)
    text = str(err.value)
    assert "2 bad file(s)" in text
    bad = hashlib.sha256(b"c" * 4096).hexdigest()
    assert all(f"{e.path} (sha256 {bad}, manifest {e.sha256})" in text for e in entries[:2])
    assert entries[2].path + " (" not in text


def test_host_view_check_finds_a_changed_stamp(checkpoint) -> None:
    o, entries = checkpoint
    record(o, entries)
    assert hd.verify_local(o)["files_total"] == 3
    os.utime(Path(o.local_dir) / "config.json", ns=(1, 1))
    with pytest.raises(hd.DownloadError, match=r"config\.json \(changed since"):
        hd.verify_local(o)


def test_an_older_manifest_is_never_trusted(checkpoint) -> None:
    o, entries = checkpoint
    record(o, entries)
    data = json.loads(Path(hd.manifest_path(o)).read_text())
    data["version"] = 1
    Path(hd.manifest_path(o)).write_text(json.dumps(data))
    assert hd.load_manifest(o) == {}
    _, _, hashed = hd.assess(o, entries, hd.load_manifest(o))
    assert hashed == len(entries)


def test_the_recorded_listing_serves_only_its_commit_and_selection(checkpoint) -> None:
    """A commit's tree never changes: the manifest's listing replaces the hub's tree
    call for that sha and file selection, never for another, nor for a full verify."""
    o, entries = checkpoint
    record(o, entries)
    manifest = hd.load_manifest(o)
    listed = hd.recorded_listing(o, manifest, "a" * 40)
    assert sorted(listed or [], key=lambda e: e.path) == sorted(entries, key=lambda e: e.path)
    assert hd.recorded_listing(o, manifest, "b" * 40) is None
    assert hd.recorded_listing(o, {**manifest, "complete": False}, "a" * 40) is None
    narrowed = hd.Options(**{**o.__dict__, "allow_patterns": ["*.json"]})
    assert hd.recorded_listing(narrowed, manifest, "a" * 40) is None
    full = hd.Options(**{**o.__dict__, "verify": "full"})
    assert hd.recorded_listing(full, manifest, "a" * 40) is None
    # A manifest written before the selection was recorded lists anew.
    del manifest["patterns"]
    assert hd.recorded_listing(o, manifest, "a" * 40) is None


def test_recorded_extras_are_listed_unknown_ones_refused(checkpoint) -> None:
    o, entries = checkpoint
    record(o, entries)
    manifest = hd.load_manifest(o)
    assert hd.find_extras(o, entries[1:], manifest) == [entries[0].path]
    (Path(o.local_dir) / "notes.txt").write_text("mine\n")
    with pytest.raises(hd.DownloadError, match=r"notes\.txt.*nothing was deleted"):
        hd.find_extras(o, entries, manifest)
    assert (Path(o.local_dir) / "notes.txt").exists()


def test_proof_needs_every_digest_and_nothing_extra(checkpoint) -> None:
    o, entries = checkpoint
    digests = {e.path: e.reference()[1] for e in entries}
    hd.prove_complete(o, entries, digests)
    with pytest.raises(hd.DownloadError, match=r"config\.json has no proved git-sha1 digest"):
        hd.prove_complete(o, entries, {**digests, "config.json": "0" * 40})
    (Path(o.local_dir) / "stale.py").write_text("#\n")
    with pytest.raises(hd.DownloadError, match=r"stale\.py is not part of the commit"):
        hd.prove_complete(o, entries, digests)


def test_hashing_writer_covers_resumed_bytes_and_rewinds(tmp_path: Path) -> None:
    data = os.urandom(5000)
    part = tmp_path / "f.part"
    part.write_bytes(data[:1200])  # bytes of an earlier, killed run
    with part.open("ab") as fh:
        writer = hd.HashingWriter(fh, str(part), "git-sha1", len(data))
        writer.prefill(1200)
        writer.write(data[1200:])
    want = hashlib.sha1(b"blob 5000\0" + data, usedforsecurity=False).hexdigest()
    assert writer.digest.hexdigest() == want
    # A server that ignores Range: http_get rewinds and truncates, then writes it all.
    part.write_bytes(data[:1200])
    with part.open("ab") as fh:
        writer = hd.HashingWriter(fh, str(part), "sha256", len(data))
        writer.prefill(1200)
        writer.seek(writer.tell() - 1200)
        writer.truncate()
        writer.write(data)
    assert writer.digest.hexdigest() == hashlib.sha256(data).hexdigest()
    assert part.read_bytes() == data


def test_short_space_fails_with_both_numbers(checkpoint) -> None:
    o, entries = checkpoint
    plan = hd.Plan(
        "a" * 40, entries, dict.fromkeys((e.path for e in entries), "missing"), {}, 96, 5000
    )
    o.space_margin_bytes = 1000
    with pytest.raises(hd.DownloadError) as err:
        hd.check_space(o, plan)
    need = sum(e.size for e in entries) - 96
    assert f"need {need} bytes" in str(err.value) and "free 5000 bytes" in str(err.value)
    assert "margin 1000 bytes" in str(err.value)


def test_second_lock_holder_fails_naming_host_pid_and_since(checkpoint) -> None:
    o, _ = checkpoint
    o.lock_timeout = 1
    holder = f"host={socket.gethostname()} pid={os.getpid()} since=20"
    # flock locks belong to the open file description: a second open conflicts.
    with hd.DirLock(o), pytest.raises(hd.DownloadError, match=holder), hd.DirLock(o):
        pass
    with hd.DirLock(o):  # released on exit
        pass


def test_a_filesystem_refusing_locks_is_named_as_such(checkpoint, monkeypatch) -> None:
    # Fake: flock failing as on an NFSv3 mount without lockd (no such mount here).
    def no_locks(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    o, _ = checkpoint
    monkeypatch.setattr(hd.fcntl, "flock", no_locks)
    with pytest.raises(hd.DownloadError) as err, hd.DirLock(o):
        pass
    assert "refuses file locks" in str(err.value) and "Another download" not in str(err.value)


def test_index_naming_an_unlisted_shard_is_incomplete(checkpoint) -> None:
    o, entries = checkpoint
    index = {"weight_map": {"w1": entries[0].path, "w2": "model-00003-of-00003.safetensors"}}
    entries.append(entry_for(Path(o.local_dir), hd.INDEX_FILE, json.dumps(index).encode(), False))
    digests = {e.path: e.reference()[1] for e in entries}
    with pytest.raises(hd.DownloadError, match=r"model-00003-of-00003\.safetensors"):
        hd.prove_complete(o, entries, digests)


def test_http_transport_alone_disables_xet(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("HF_HUB_DISABLE_XET", raising=False)
    hd.setup_environment(opts(tmp_path, transport="auto"))
    assert "HF_HUB_DISABLE_XET" not in os.environ
    hd.setup_environment(opts(tmp_path, transport="http"))
    assert os.environ["HF_HUB_DISABLE_XET"] == "1"


def test_plan_with_another_hub_version_plans_nothing_and_names_the_installed_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The module imports its module_utils as Ansible ships them; here that is hf_download.
    monkeypatch.setitem(sys.modules, "ansible.module_utils.hf_download", hd)
    snapshot = load_module("hf_snapshot", "roles/model_download/library")
    installed = version("huggingface_hub")
    args = {
        "mode": "plan",
        "repo_id": "org/model",
        "local_dir": tmp_path / "model",
        "state_dir": tmp_path / "state",
        # Nothing listens here: a plan would fail, the version check must answer first.
        "endpoint": "http://127.0.0.1:9",
        "hub_version": f"{installed}.post999",
    }
    result = run_module(snapshot, args)
    assert result["hub_ready"] is False
    assert result["hub_version"] == installed
    assert "sha" not in result and not result["changed"]
    assert not (tmp_path / "state").exists()
    # Without the check the same arguments do plan, and fail on the unreachable hub.
    assert "127.0.0.1:9" in fail_module(snapshot, {**args, "hub_version": ""})


def test_a_started_job_runs_detached_and_reports_its_failure(tmp_path: Path) -> None:
    # Nothing listens on port 9: the job's own plan fails; start_job has already returned.
    o = opts(tmp_path, endpoint="http://127.0.0.1:9")
    started = hd.start_job(o, timeout_s=60)
    assert started["started"] is True
    job_file = started["results_file"]
    assert Path(job_file).parent == Path(o.state_dir) / "jobs"
    result = hd.wait_progress(o, 60, job_file)
    assert result["ended"] is True
    assert result["job"]["failed"] is True
    assert "127.0.0.1:9" in result["job"]["msg"]
    assert not Path(o.local_dir).exists()  # nothing written into the checkpoint


def test_a_job_past_its_timeout_ends_as_failed_naming_the_variable(tmp_path: Path) -> None:
    # A hub that accepts the connection and never answers: only the timeout ends the job.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        o = opts(tmp_path, endpoint=f"http://127.0.0.1:{port}")
        job_file = hd.start_job(o, timeout_s=1)["results_file"]
        result = hd.wait_progress(o, 30, job_file)
    assert result["ended"] is True and result["job"]["failed"] is True
    assert "model_download_timeout (1 s)" in result["job"]["msg"]


def test_a_job_gone_without_a_result_has_failed_naming_its_pid(tmp_path: Path) -> None:
    proc = subprocess.Popen(["true"])  # its pid, once reaped, is a dead one
    proc.wait()
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps({"started": 1, "finished": 0, "pid": proc.pid}))
    result = hd.job_result(str(job_file))
    assert result is not None and result["failed"] is True
    assert f"pid {proc.pid}" in result["msg"]
    job_file.write_text(json.dumps({"started": 1, "finished": 0, "pid": os.getpid()}))
    assert hd.job_result(str(job_file)) is None  # alive: still running


def test_urls_in_messages_carry_no_credentials() -> None:
    url = "https://user:secret@cdn.example:8443/repo/file.safetensors?X-Amz-Signature=abc&t=1"
    assert hd.shown_url(url) == "https://cdn.example:8443/repo/file.safetensors"
    assert hd.shown_url("http://127.0.0.1/a/b") == "http://127.0.0.1/a/b"


def test_a_proxy_for_the_scheme_keeps_the_library_get(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    assert hd.direct_http("https://cdn.example/f") and hd.direct_http("http://127.0.0.1:9/f")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    assert not hd.direct_http("https://cdn.example/f")
    assert hd.direct_http("http://127.0.0.1:9/f")  # no proxy for plain http
    monkeypatch.setenv("NO_PROXY", "cdn.example")
    assert hd.direct_http("https://cdn.example/f")


def test_one_tls_context_serves_every_file_per_ca_bundle() -> None:
    first = hd.tls_context(None)
    assert hd.tls_context(None) is first  # built once, not per file (CA bundle load)
    assert first.verify_mode.name == "CERT_REQUIRED" and first.check_hostname


# --- the hub token goes to the hub's host only -------------------------------------------

TOKEN = "hf_" + "tokenthatmuststayonthehub0123"


@pytest.fixture
def cdn_hub(tmp_path: Path) -> Any:
    """Our hub at 127.0.0.1 sending every file body to a CDN of ours at 127.0.0.2 (another
    host name), which answers with one more redirect on its own host before the bytes."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.safetensors").write_bytes(os.urandom(300_000))
    (src / "config.json").write_text('{"x": 1}\n')
    commit_files(tmp_path / "hub" / "org" / "model", src)
    with HubServer(tmp_path / "hub") as hub, HubServer(tmp_path / "hub", host="127.0.0.2") as cdn:
        hub.add_fault(kind="redirect", method="*", target=cdn.endpoint)
        cdn.add_fault(kind="redirect", method="*", target=cdn.endpoint, times=2)
        yield hub, cdn, src


def assert_token_stayed_on_the_hub(hub: HubServer, cdn: HubServer) -> None:
    cdn_gets = cdn.requests("GET")
    assert {r.file for r in cdn_gets if r.status in (200, 206)} == {
        "model.safetensors",
        "config.json",
    }
    assert len(cdn_gets) >= 4  # both files, each through a redirect on the CDN's host
    leaked = [(r.method, r.path) for r in cdn.requests() if r.auth]
    assert not leaked, f"the token reached the CDN host: {leaked}"
    assert hub.requests() and all(r.auth == f"Bearer {TOKEN}" for r in hub.requests())


@pytest.mark.parametrize("path", ["stream", "library GET (behind a proxy)"])
def test_the_token_never_reaches_the_host_a_file_body_redirects_to(
    tmp_path: Path, cdn_hub: Any, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    hub, cdn, src = cdn_hub
    if path != "stream":
        monkeypatch.setattr(hd, "direct_http", lambda url: False)  # the proxy branch
    o = opts(tmp_path, endpoint=hub.endpoint, token=TOKEN, space_margin_bytes=0)
    result = hd.download(o)
    assert result["complete"] and result["fetched"] == ["config.json", "model.safetensors"]
    for name in ("model.safetensors", "config.json"):
        assert (Path(o.local_dir) / name).read_bytes() == (src / name).read_bytes(), name
    assert_token_stayed_on_the_hub(hub, cdn)


def test_the_hub_client_itself_keeps_the_token_off_the_redirect_host(
    tmp_path: Path, cdn_hub: Any
) -> None:
    # The behaviour the toolkit matches, and proof the server's redirect is a real one.
    from huggingface_hub import snapshot_download

    hub, cdn, src = cdn_hub
    out = snapshot_download(
        "org/model", endpoint=hub.endpoint, token=TOKEN, local_dir=tmp_path / "d"
    )
    assert (Path(out) / "model.safetensors").read_bytes() == (
        src / "model.safetensors"
    ).read_bytes()
    assert_token_stayed_on_the_hub(hub, cdn)


@pytest.mark.parametrize(
    ("url", "kept"),
    [
        ("http://127.0.0.1:8000/org/m/resolve/x/f", True),
        ("HTTP://127.0.0.1:8000/other", True),  # scheme and host compare case-blind
        ("http://127.0.0.1:8001/org/m/resolve/x/f", False),  # another port
        ("https://127.0.0.1:8000/f", False),  # another scheme
        ("http://localhost:8000/f", False),  # another host name for the same address
        ("http://127.0.0.2:8000/f", False),
    ],
)
def test_authorization_goes_to_the_hub_origin_only(url: str, kept: bool) -> None:
    hub = hd.url_origin("http://127.0.0.1:8000/")
    headers = {"authorization": f"Bearer {TOKEN}", "user-agent": "x"}
    sent = hd.headers_for(url, headers, hub)
    assert ("authorization" in sent) is kept and sent["user-agent"] == "x"
    assert hd.url_origin("https://huggingface.co") == hd.url_origin("https://HuggingFace.co:443/")


# --- no link planted in the shared state dir is followed ----------------------------------


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A file and a directory outside the state dir that a planted link points at."""
    (tmp_path / "outside" / "dir").mkdir(parents=True)
    (tmp_path / "outside" / "dir" / "precious").write_text("keep me\n")
    (tmp_path / "outside" / "file").write_text("keep me\n")
    return tmp_path / "outside"


def test_a_symlink_at_the_lock_path_is_refused_naming_it(tmp_path: Path, outside: Path) -> None:
    o = opts(tmp_path)
    Path(o.state_dir).mkdir()
    (Path(o.state_dir) / "download.lock").symlink_to(outside / "file")
    with pytest.raises(hd.DownloadError) as err, hd.DirLock(o):
        pass
    assert f"Refusing {o.state_dir}/download.lock: a symlink" in str(err.value)
    assert (outside / "file").read_text() == "keep me\n"


def test_a_link_planted_at_a_temp_file_name_is_not_written_through(
    tmp_path: Path, outside: Path
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    # The names a writer could guess: the pid-suffixed one, and mkstemp's prefix.
    (state / f"manifest.json.{os.getpid()}.tmp").symlink_to(outside / "file")
    hd.write_json_atomic(str(state / "manifest.json"), {"a": 1})
    assert json.loads((state / "manifest.json").read_text()) == {"a": 1}
    assert not (state / "manifest.json").is_symlink()
    assert (outside / "file").read_text() == "keep me\n"


@pytest.mark.parametrize("name", ["jobs", "partial", "set-aside"])
def test_a_symlinked_state_directory_is_refused_and_nothing_outside_changes(
    tmp_path: Path, outside: Path, name: str
) -> None:
    o = opts(tmp_path, endpoint="http://127.0.0.1:9")
    Path(o.state_dir).mkdir()
    (Path(o.state_dir) / name).symlink_to(outside / "dir")
    with pytest.raises(hd.DownloadError) as err:
        if name == "jobs":
            hd.start_job(o, timeout_s=5)
        elif name == "set-aside":
            hd.set_aside(o, "a" * 40, ["x"])
        else:  # the plan's name check, before anything is written
            hd.check_listing_names(o, "a" * 40, [hd.Entry("config.json", 1, "0" * 40)])
    assert f"Refusing {o.state_dir}/{name}: a symlink" in str(err.value)
    assert sorted(p.name for p in (outside / "dir").iterdir()) == ["precious"]
