"""roles/model_download through ansible-runner against tests/support/hub_server.py.

Real parts only: the real huggingface_hub client (in the role's toolkit venv), our
hub-compatible server on loopback serving a Kimi-K2.5-NVFP4-shaped repo (119 small
shards), real filesystems (a real tmpfs for the too-small case). The hub counts
requests per file, so "fetched nothing" and "did not refetch" are measured, not assumed.
"""

from __future__ import annotations

import contextlib
import filecmp
import hashlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import ansible_runner
import pytest

from tests.support.hub_server import HubServer
from tests.support.runner_events import task_hosts
from tests.support.synthetic_repo import (
    KIMI_REPO,
    SHARDS,
    add_hostile_listing,
    build_repo,
    shard_name,
    update_repo,
)

ROOT = Path(__file__).resolve().parents[2]
PLAYBOOK = ROOT / "tests" / "integration" / "playbooks" / "download.yml"
LOCAL_INVENTORY = ROOT / "inventory" / "local" / "hosts.yml"
SHARD_BYTES = 256 * 1024
DOWNLOAD_INCLUDE = "Download on the storage domain's downloader"
FOLLOW_TASK = "Follow the download"  # runs only when the plan started a job
VERIFY_TASK = "Check that this host sees the complete checkpoint"
CACHE = Path(os.environ.get("VLLM_FLEET_CACHE", Path.home() / ".cache" / "vllm-fleet"))
# Small repos of their own for the tests that change a repo or fill a disk.
UPDATE_REPO = "nvidia/Kimi-Update-Test"
SMALL_REPO = "nvidia/Kimi-Small-Test"

sys.path.insert(0, str(ROOT / "module_utils"))
import hf_download as hd  # noqa: E402


@pytest.fixture(scope="session")
def repo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("hub")
    sha = build_repo(root, KIMI_REPO, shard_bytes=SHARD_BYTES)
    build_repo(root, SMALL_REPO, shard_bytes=1 << 20, shards=6)
    return root, sha


@pytest.fixture(scope="session")
def hub(repo: tuple[Path, str]) -> Any:
    # Page size 50: the 133-entry listing takes 3 pages, so pagination is exercised too.
    with HubServer(repo[0], page_size=50) as server:
        yield server


@pytest.fixture
def fresh_hub(hub: HubServer) -> HubServer:
    hub.reset()
    return hub


def source(repo: tuple[Path, str]) -> Path:
    return repo[0] / KIMI_REPO / "commits" / repo[1]


def run(
    tmp_path: Path,
    hub: HubServer | None,
    *,
    inventory: Path = LOCAL_INVENTORY,
    verbosity: int = 0,
    check: bool = False,
    wait: bool = True,
    **extravars: Any,
) -> Any:
    storage = tmp_path / "shared"
    storage.mkdir(exist_ok=True)
    variables = {
        "vllm_fleet_model": "kimi-k2.5-nvfp4",
        "vllm_fleet_storage_root": str(storage),
        "vllm_fleet_hf_endpoint": hub.endpoint if hub else "http://127.0.0.1:9",
        "model_download_space_margin_bytes": 0,
        "model_download_poll_interval": 1,
        "model_download_chunk_bytes": 64 * 1024,
        # One toolkit venv for the whole suite, kept across runs like other heavy artifacts.
        "model_download_venv": str(CACHE / "model-download-tools-venv"),
        **extravars,
    }
    private = tmp_path / f"runner-{time.monotonic_ns()}"
    private.mkdir()
    kwargs = {
        "private_data_dir": str(private),
        "project_dir": str(ROOT),
        "playbook": str(PLAYBOOK),
        "inventory": str(inventory),
        "extravars": variables,
        "verbosity": verbosity,
        "cmdline": "--check --diff" if check else None,
        "quiet": True,
        "envvars": {
            "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        },
    }
    if not wait:
        return ansible_runner.run_async(**kwargs)
    return ansible_runner.run(**kwargs)


def model_dir(tmp_path: Path) -> Path:
    return tmp_path / "shared" / "kimi-k2.5-nvfp4"


def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "shared" / ".vllm-fleet" / "kimi-k2.5-nvfp4"


def failure_messages(runner: Any) -> list[str]:
    return [
        str(ev["event_data"]["res"].get("msg", ""))
        for ev in runner.events
        if ev["event"] == "runner_on_failed"
    ]


def changed_count(runner: Any) -> int:
    return sum(runner.stats.get("changed", {}).values())


def job_result(runner: Any) -> dict[str, Any]:
    """The download job's own result, as the last follow round returned it."""
    jobs = [
        ev["event_data"]["res"]["job"]
        for ev in runner.events
        if ev["event"] == "runner_on_ok" and "job" in ev["event_data"].get("res", {})
    ]
    return jobs[-1]


def assert_identical(tmp_path: Path, repo: tuple[Path, str], src: Path | None = None) -> None:
    src = src or source(repo)
    files = sorted(p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file())
    got = sorted(
        p.relative_to(model_dir(tmp_path)).as_posix()
        for p in model_dir(tmp_path).rglob("*")
        if p.is_file()
    )
    assert got == files  # nothing extra inside the checkpoint (bookkeeping lives beside it)
    _match, mismatch, errors = filecmp.cmpfiles(src, model_dir(tmp_path), files, shallow=False)
    assert (mismatch, errors) == ([], [])


def test_fresh_download_verifies_and_second_run_fetches_nothing(
    tmp_path: Path, fresh_hub: HubServer, repo: tuple[Path, str]
) -> None:
    token = "hf_" + secrets.token_hex(16)
    first = run(
        tmp_path, fresh_hub, verbosity=3, vllm_fleet_hf_token=token, model_download_verify="full"
    )
    assert first.status == "successful", failure_messages(first)
    assert_identical(tmp_path, repo)
    # The token reached the hub (so the leak check below is not vacuous) ...
    gets = fresh_hub.requests("GET", "*.safetensors")
    assert len(gets) == SHARDS and all(r.auth == f"Bearer {token}" for r in gets)
    # ... and never the runner's output or events, even at -vvv.
    assert token not in first.stdout.read()
    assert token not in json.dumps(list(first.events))
    manifest = json.loads((state_dir(tmp_path) / "manifest.json").read_text())
    assert manifest["sha"] == repo[1] and manifest["version"] == 2
    assert all(rec["digest"] and rec["stat"] for rec in manifest["files"].values())
    # Progress was reported while it ran, from the progress file, by one retried
    # task (no include per round).
    rounds = [
        ev for ev in first.events
        if ev["event"] in ("runner_retry", "runner_on_ok")
        and ev["event_data"].get("task") == "Follow the download"
    ]  # fmt: skip
    progress = [ev["event_data"]["res"]["vllm_fleet_poll"] for ev in rounds]
    assert progress and f"{len(manifest['files'])}/{len(manifest['files'])} files" in progress[-1]
    assert len({ev["event_data"]["task_uuid"] for ev in rounds}) == 1
    # Polling includes nothing: the one include is the downloader's download.yml
    # (and venv.yml once, when the cache's toolkit venv is built by this run).
    includes = [ev for ev in first.events if ev["event"] == "playbook_on_include"]
    included = [Path(ev["event_data"]["included_file"]).name for ev in includes]
    assert [name for name in included if name != "venv.yml"] == ["download.yml"], included
    assert included.count("venv.yml") <= 1, included

    fresh_hub.reset()
    started = time.monotonic()
    second = run(tmp_path, fresh_hub)
    print(f"no-op rerun: {time.monotonic() - started:.1f} s (playbook incl. venv check)")
    assert second.status == "successful", failure_messages(second)
    assert changed_count(second) == 0
    assert fresh_hub.count(file="*") == 0  # no HEAD, no GET of any file
    # A commit's tree never changes: the rerun resolved the revision and took the
    # listing from the manifest that recorded this commit.
    calls = [r.path for r in fresh_hub.requests("GET")]
    assert any("/revision/" in c for c in calls), calls
    assert not any("/tree/" in c for c in calls), calls
    assert task_hosts(second, FOLLOW_TASK, "runner_on_skipped") == ["localhost"]
    facts = [
        ev["event_data"]["res"].get("ansible_facts", {})
        for ev in second.events
        if ev["event"] == "runner_on_ok"
    ]
    assert {"model_download_sha": repo[1]} in facts


def test_check_mode_reports_and_writes_nothing(
    tmp_path: Path, fresh_hub: HubServer, repo: tuple[Path, str]
) -> None:
    result = run(tmp_path, fresh_hub, check=True)
    assert result.status == "successful", failure_messages(result)
    assert changed_count(result) >= 1
    assert not model_dir(tmp_path).exists()
    assert fresh_hub.count("GET", "*") == 0


def test_killed_download_resumes_without_refetching_completed_shards(
    tmp_path: Path, fresh_hub: HubServer, repo: tuple[Path, str]
) -> None:
    # ~1 s per shard, 8 in parallel: the run is mid-way after a few seconds.
    fresh_hub.add_fault(kind="throttle", path="model-*", rate=SHARD_BYTES)
    thread, runner = run(tmp_path, fresh_hub, wait=False)
    progress_file = state_dir(tmp_path) / "progress.json"
    deadline = time.monotonic() + 120
    progress: dict[str, Any] = {}
    while time.monotonic() < deadline:
        if progress_file.exists():
            progress = json.loads(progress_file.read_text())
            # Kill once shards are done AND one is part-way (bytes on disk),
            # so the rerun has a partial shard to resume.
            if progress["files_done"] >= 30 and partial_bytes(state_dir(tmp_path)) > 0:
                break
        time.sleep(0.2)
    assert progress.get("files_done", 0) >= 30, progress
    os.kill(progress["pid"], signal.SIGKILL)  # the download process dies, as on a node crash
    thread.join(120)
    assert runner.status == "failed"  # a killed download is never reported ok
    done_before = {p.name for p in model_dir(tmp_path).glob("model-*.safetensors")}
    partials = {
        p.name.removesuffix(".part"): p.stat().st_size
        for p in (state_dir(tmp_path) / "partial").rglob("*.part")
    }
    assert 0 < len(done_before) < SHARDS
    assert any(partials.values())

    fresh_hub.reset()
    rerun = run(tmp_path, fresh_hub)
    assert rerun.status == "successful", failure_messages(rerun)
    assert_identical(tmp_path, repo)
    refetched = {r.file for r in fresh_hub.requests("GET", "model-*")}
    # A shard whose bytes had all arrived when the kill came (not yet verified and moved)
    # is finished from its partial: the rerun verifies it and needs no GET for it.
    all_in_partial = {
        name
        for name, size in partials.items()
        if size == (model_dir(tmp_path) / name).stat().st_size
    }
    shards = {p.name for p in model_dir(tmp_path).glob("model-*.safetensors")}
    assert len(shards) == SHARDS
    # Exactly the shards not yet finished were fetched; completed ones were not fetched again.
    assert refetched == shards - done_before - all_in_partial
    ranged = [r for r in fresh_hub.requests("GET", "model-*") if r.range]
    assert ranged and all(r.status == 206 for r in ranged)  # partial shards resumed by Range
    assert not (state_dir(tmp_path) / "partial").exists()


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("unreachable", "Cannot reach the hub at http://127.0.0.1:9"),
        ("unknown repo", "Repository nvidia/No-Such-Model not found"),
        ("unknown revision", "Revision 'no-such-branch' not found"),
    ],
)
def test_hub_failures_are_clear_and_never_ok(
    tmp_path: Path, fresh_hub: HubServer, case: str, expected: str
) -> None:
    # A non-empty checkpoint dir: huggingface_hub alone returns "success" here when offline.
    model_dir(tmp_path).mkdir(parents=True)
    (model_dir(tmp_path) / "config.json").write_text("{}")
    extra: dict[str, Any] = {}
    if case == "unknown repo":
        extra["vllm_fleet_model_repo"] = "nvidia/No-Such-Model"
    if case == "unknown revision":
        extra["vllm_fleet_model_revision"] = "no-such-branch"
    result = run(tmp_path, None if case == "unreachable" else fresh_hub, **extra)
    assert result.status == "failed"
    messages = failure_messages(result)
    assert any(expected in m for m in messages), messages
    assert fresh_hub.count("GET", "*") == 0
    assert not (state_dir(tmp_path) / "manifest.json").exists()


def test_truncated_or_corrupted_shard_is_detected_and_repaired(
    tmp_path: Path, fresh_hub: HubServer, repo: tuple[Path, str]
) -> None:
    assert run(tmp_path, fresh_hub).status == "successful"
    truncated = model_dir(tmp_path) / shard_name(5, SHARDS)
    flipped = model_dir(tmp_path) / shard_name(6, SHARDS)
    os.truncate(truncated, SHARD_BYTES // 2)
    # Same size, one byte flipped, mtime put back: huggingface_hub would trust this file.
    st = flipped.stat()
    with flipped.open("r+b") as fh:
        fh.seek(SHARD_BYTES // 3)
        byte = fh.read(1)
        fh.seek(SHARD_BYTES // 3)
        fh.write(bytes([byte[0] ^ 0xFF]))
    os.utime(flipped, ns=(st.st_atime_ns, st.st_mtime_ns))

    fresh_hub.reset()
    repair = run(tmp_path, fresh_hub)
    assert repair.status == "successful", failure_messages(repair)
    assert {r.file for r in fresh_hub.requests("GET") if r.file} == {truncated.name, flipped.name}
    assert_identical(tmp_path, repo)
    job = job_result(repair)
    assert job["damaged"] == sorted([truncated.name, flipped.name]) and job["hashed"] == 1

    # Without the manifest nothing is trusted: every file is re-hashed, none refetched.
    (state_dir(tmp_path) / "manifest.json").unlink()
    fresh_hub.reset()
    rehash = run(tmp_path, fresh_hub)
    assert rehash.status == "successful", failure_messages(rehash)
    assert fresh_hub.count("GET", "*") == 0 and changed_count(rehash) == 0
    job = job_result(rehash)
    assert job["hashed"] == job["files_total"] and job["fetched"] == []
    manifest = json.loads((state_dir(tmp_path) / "manifest.json").read_text())
    assert all(rec["digest"] for rec in manifest["files"].values())


def test_same_size_corrupt_bytes_from_the_hub_never_land(
    tmp_path: Path, fresh_hub: HubServer, repo: tuple[Path, str]
) -> None:
    bad = shard_name(7, SHARDS)
    fresh_hub.add_fault(kind="corrupt", path=bad, bytes=SHARD_BYTES // 2)
    result = run(tmp_path, fresh_hub)
    assert result.status == "failed"
    want = hashlib.sha256((source(repo) / bad).read_bytes()).hexdigest()
    corrupt = bytearray((source(repo) / bad).read_bytes())
    corrupt[SHARD_BYTES // 2] ^= 0xFF
    got = hashlib.sha256(corrupt).hexdigest()
    messages = failure_messages(result)
    assert any(bad in m and f"sha256 {got}, expected {want}" in m for m in messages), messages
    assert fresh_hub.count("GET", bad) == 2  # dropped, fetched once more, then failed
    assert not (model_dir(tmp_path) / bad).exists()
    assert not list((state_dir(tmp_path) / "partial").rglob(bad + ".part"))
    assert not (state_dir(tmp_path) / "manifest.json").exists()


def test_revision_update_follows_digests_not_sizes(
    tmp_path: Path, fresh_hub: HubServer, repo: tuple[Path, str]
) -> None:
    root = repo[0]
    build_repo(root, UPDATE_REPO, shard_bytes=64 * 1024, shards=4)
    first = run(tmp_path, fresh_hub, vllm_fleet_model_repo=UPDATE_REPO)
    assert first.status == "successful", failure_messages(first)
    code, shard = "modeling_kimi_k25.py", shard_name(2, 4)
    old = (
        root
        / UPDATE_REPO
        / "commits"
        / json.loads((root / UPDATE_REPO / "refs.json").read_text())["main"]
    )
    changed_code = (old / code).read_bytes().replace(b"synthetic", b"SYNTHETIC")
    changed_shard = (old / shard).read_bytes()[:-8] + b"newbytes"
    new = update_repo(
        root,
        UPDATE_REPO,
        {code: changed_code, shard: changed_shard},
        drop=("docs/deploy_guidance.md",),
    )
    fresh_hub.reset()
    moved = run(tmp_path, fresh_hub, vllm_fleet_model_repo=UPDATE_REPO, model_download_update=True)
    assert moved.status == "successful", failure_messages(moved)
    assert {r.file for r in fresh_hub.requests("GET") if r.file} == {code, shard}
    assert_identical(tmp_path, repo, root / UPDATE_REPO / "commits" / new)
    assert not (model_dir(tmp_path) / "docs").exists()
    assert job_result(moved)["removed"] == ["docs/deploy_guidance.md"]


def tree_snapshot(top: Path, skip: set[Path]) -> dict[str, tuple[str, int, str]]:
    """Every entry under ``top``: kind, mtime and content digest (or link target)."""
    snap = {}
    for path in sorted(top.rglob("*")):
        if path in skip:
            continue
        st = path.lstat()
        if path.is_symlink():
            kind, what = "link", os.readlink(path)
        elif path.is_dir():
            kind, what = "dir", ""
        else:
            kind, what = "file", hashlib.sha256(path.read_bytes()).hexdigest()
        snap[path.relative_to(top).as_posix()] = (kind, st.st_mtime_ns, what)
    return snap


@pytest.mark.parametrize("name", ["../escape", "/abs/escape", "a/../../escape", "sub/escape"])
def test_hostile_names_fail_before_any_write_or_delete(
    tmp_path: Path, fresh_hub: HubServer, repo: tuple[Path, str], name: str
) -> None:
    ref = "hostile-" + hashlib.sha1(name.encode()).hexdigest()[:8]
    add_hostile_listing(repo[0], KIMI_REPO, ref, [name])
    storage = tmp_path / "shared"
    (storage / "outside").mkdir(parents=True)
    (storage / "escape").write_text("not yours\n")  # what ../escape would overwrite
    (storage / "outside" / "escape").write_text("not yours either\n")
    model_dir(tmp_path).mkdir()
    (model_dir(tmp_path) / "sub").symlink_to(storage / "outside")  # a symlinked parent
    state_dir(tmp_path).mkdir(parents=True)
    opts = hd.Options(
        repo_id=KIMI_REPO,
        revision=ref,
        local_dir=str(model_dir(tmp_path)),
        state_dir=str(state_dir(tmp_path)),
        endpoint=fresh_hub.endpoint,
        space_margin_bytes=0,
    )
    lock = state_dir(tmp_path) / "download.lock"
    lock.touch()  # the tool's own bookkeeping: only its holder line may change
    before = tree_snapshot(tmp_path, {lock})
    with pytest.raises(hd.DownloadError) as err:
        hd.download(opts)
    assert f"entry {name!r} is unsafe" in str(err.value), err.value
    assert "Nothing was written or deleted" in str(err.value)
    assert tree_snapshot(tmp_path, {lock}) == before
    assert not Path("/abs/escape").exists()
    assert fresh_hub.count("GET", "*") == 0 and fresh_hub.count("HEAD", "*") == 0


def test_hostile_name_fails_the_play_naming_the_entry(
    tmp_path: Path, fresh_hub: HubServer, repo: tuple[Path, str]
) -> None:
    add_hostile_listing(repo[0], KIMI_REPO, "hostile-play", ["a/../../escape"])
    result = run(tmp_path, fresh_hub, vllm_fleet_model_revision="hostile-play")
    assert result.status == "failed"
    messages = failure_messages(result)
    assert any("entry 'a/../../escape' is unsafe ('..' segment)" in m for m in messages), messages
    assert not (tmp_path / "escape").exists() and not model_dir(tmp_path).exists()


def test_storage_too_small_fails_before_downloading(
    tmp_path: Path, fresh_hub: HubServer, repo: tuple[Path, str]
) -> None:
    storage = tmp_path / "shared"
    storage.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(storage)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        result = run(tmp_path, fresh_hub)
        assert result.status == "failed"
        messages = failure_messages(result)
        need = sum(p.stat().st_size for p in source(repo).rglob("*") if p.is_file())
        assert any(
            "Not enough free space" in m and f"need {need} bytes" in m and "free 4194304 bytes" in m
            for m in messages
        ), messages
        assert fresh_hub.count("GET", "*") == 0 and fresh_hub.count("HEAD", "*") == 0
        assert not model_dir(tmp_path).exists() or not any(model_dir(tmp_path).iterdir())
    finally:
        subprocess.run(["umount", str(storage)], check=True)


def small_options(tmp_path: Path, hub: HubServer) -> hd.Options:
    return hd.Options(
        repo_id=SMALL_REPO,
        revision="main",
        local_dir=str(model_dir(tmp_path)),
        state_dir=str(state_dir(tmp_path)),
        endpoint=hub.endpoint,
        space_margin_bytes=0,
        chunk_bytes=64 * 1024,
    )


SMALL_SHARD = "model-00001-of-00006.safetensors"


@pytest.mark.parametrize(
    ("case", "faults", "statuses"),
    [
        # The connection drops mid-body: the next GET asks for the rest by Range.
        ("dropped", [{"kind": "close_after", "bytes": 300_000, "times": 1}], [200, 206]),
        ("503 once", [{"kind": "status", "status": 503, "times": 1}], [503, 200]),
        # Dropped, then the server ignores the Range: the file starts over from byte 0.
        (
            "range ignored",
            [
                {"kind": "close_after", "bytes": 300_000, "times": 1},
                {"kind": "ignore_range", "times": 1},
            ],
            [200, 200],
        ),
    ],
)
def test_the_stream_resumes_after_transient_failures(
    tmp_path: Path,
    fresh_hub: HubServer,
    repo: tuple[Path, str],
    monkeypatch: pytest.MonkeyPatch,
    case: str,
    faults: list[dict[str, Any]],
    statuses: list[int],
) -> None:
    monkeypatch.setattr(hd, "STREAM_BACKOFF_S", 0.01)
    for fault in faults:
        fresh_hub.add_fault(path=SMALL_SHARD, **fault)
    result = hd.download(small_options(tmp_path, fresh_hub))
    assert result["complete"] and SMALL_SHARD in result["fetched"], case
    gets = fresh_hub.requests("GET", SMALL_SHARD)
    assert [r.status for r in gets] == statuses, case
    assert gets[0].range is None and gets[1].range == (
        "bytes=300000-" if case != "503 once" else None
    )
    sha = json.loads((repo[0] / SMALL_REPO / "refs.json").read_text())["main"]
    assert_identical(tmp_path, repo, repo[0] / SMALL_REPO / "commits" / sha)


@pytest.mark.parametrize(
    ("fault", "expected"),
    [
        (
            {"kind": "short", "bytes": 10},
            SMALL_SHARD + ": the hub sends {short} bytes from offset 0, the listing says the "
            "file has {size}",
        ),
        ({"kind": "status", "status": 500}, f"{SMALL_SHARD}: HTTP 500 "),
        ({"kind": "status", "status": 403}, f"{SMALL_SHARD}: the hub answered HTTP 403 "),
    ],
)
def test_the_stream_fails_naming_the_file_and_lands_nothing(
    tmp_path: Path,
    fresh_hub: HubServer,
    repo: tuple[Path, str],
    monkeypatch: pytest.MonkeyPatch,
    fault: dict[str, Any],
    expected: str,
) -> None:
    monkeypatch.setattr(hd, "STREAM_BACKOFF_S", 0.01)
    fresh_hub.add_fault(path=SMALL_SHARD, **fault)
    with pytest.raises(hd.DownloadError) as err:
        hd.download(small_options(tmp_path, fresh_hub))
    sha = json.loads((repo[0] / SMALL_REPO / "refs.json").read_text())["main"]
    size = (repo[0] / SMALL_REPO / "commits" / sha / SMALL_SHARD).stat().st_size
    expected = expected.format(size=size, short=size - fault.get("bytes", 0))
    assert expected in str(err.value), str(err.value)
    assert not (model_dir(tmp_path) / SMALL_SHARD).exists()
    gets = fresh_hub.count("GET", SMALL_SHARD)
    # Transient statuses are tried STREAM_ATTEMPTS times, a refusal or a wrong length once.
    assert gets == (hd.STREAM_ATTEMPTS if fault.get("status") == 500 else 1)


def partial_bytes(state: Path) -> int:
    """Bytes in the partial files now (a finished file's .part is renamed away meanwhile)."""
    total = 0
    for part in (state / "partial").rglob("*.part"):
        with contextlib.suppress(FileNotFoundError):
            total += part.stat().st_size
    return total


def test_disk_full_mid_transfer_keeps_partials_and_resumes_on_a_bigger_disk(
    tmp_path: Path, fresh_hub: HubServer, repo: tuple[Path, str]
) -> None:
    storage = tmp_path / "shared"
    storage.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(storage)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        opts = small_options(tmp_path, fresh_hub)
        # 6 shards of 1 MB at 1 MB/s each: the disk fills (another writer) mid-transfer.
        fresh_hub.add_fault(kind="throttle", path="model-*", rate=1 << 20)
        filler = storage / "filler"

        def fill_when_started() -> None:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if partial_bytes(state_dir(tmp_path)) > 1 << 20:
                    break
                time.sleep(0.05)
            with filler.open("wb") as fh, contextlib.suppress(OSError):
                while True:
                    fh.write(b"\0" * (64 * 1024))
                    fh.flush()

        filling = threading.Thread(target=fill_when_started)
        filling.start()
        with pytest.raises(hd.DownloadError) as err:
            hd.download(opts)
        filling.join()
        text = str(err.value)
        assert "Disk full writing " + str(state_dir(tmp_path) / "partial") in text, text
        assert "more bytes" in text and "bytes are free there" in text and "rerun to resume" in text
        kept = {p.name: p.stat().st_size for p in (state_dir(tmp_path) / "partial").rglob("*.part")}
        assert any(size > 0 for size in kept.values()), kept

        # A bigger disk (same filesystem, grown): the rerun resumes and completes.
        filler.unlink()
        subprocess.run(["mount", "-o", "remount,size=64m", str(storage)], check=True)
        fresh_hub.reset()
        result = hd.download(opts)
        assert result["complete"] and result["resumed"]
        sha = json.loads((repo[0] / SMALL_REPO / "refs.json").read_text())["main"]
        assert_identical(tmp_path, repo, repo[0] / SMALL_REPO / "commits" / sha)
    finally:
        subprocess.run(["umount", str(storage)], check=True)


@pytest.fixture(scope="session")
def wheelhouse() -> Path:
    """huggingface_hub and its dependencies as wheels, for the nodes' offline venv."""
    dest = CACHE / "wheels" / "model-download-huggingface_hub-2.4.0"
    if not (dest / "huggingface_hub-2.4.0-py3-none-any.whl").is_file():
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:",
             "--python-version", "3.11", "-d", str(dest), "huggingface_hub==2.4.0"],
            check=True,
        )  # fmt: skip
    return dest


@pytest.fixture
def two_nodes(tmp_path: Path, wheelhouse: Path) -> Any:
    """Two podman nodes (systemd PID 1, host network) sharing one storage directory."""
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed")
    from tests.support import fleet

    storage = tmp_path / "node-storage"
    nodes = fleet.up(
        2,
        prefix="vf-md-node",
        storage_dir=storage,
        fresh=True,
        extra_volumes=[f"{wheelhouse}:/srv/wheels:ro"],
    )
    try:
        inventory = tmp_path / "fleet.yml"
        inventory.write_text(json.dumps(nodes.inventory()))
        yield nodes, inventory
    finally:
        fleet.down(nodes.prefix)


def test_two_nodes_one_storage_domain_download_once(
    tmp_path: Path, fresh_hub: HubServer, repo: tuple[Path, str], two_nodes: Any
) -> None:
    nodes, inventory = two_nodes
    result = run(
        tmp_path,
        fresh_hub,
        inventory=inventory,
        vllm_fleet_storage_root=nodes.storage_path,
        model_download_venv="/opt/vllm-fleet/venvs/tools",
        model_download_pip_extra_args="--no-index --find-links /srv/wheels",
    )
    assert result.status == "successful", failure_messages(result)
    first, second = nodes.nodes
    assert task_hosts(result, FOLLOW_TASK) == [first]
    assert task_hosts(result, DOWNLOAD_INCLUDE, "runner_on_skipped") == [second]
    assert second not in task_hosts(result, FOLLOW_TASK, "runner_on_skipped")
    # The downloader's job proved its view; the other host checks its own.
    assert task_hosts(result, VERIFY_TASK) == [second]
    facts = [
        (ev["event_data"]["host"], ev["event_data"]["res"].get("ansible_facts", {}))
        for ev in result.events
        if ev["event"] == "runner_on_ok"
    ]
    assert sorted(h for h, f in facts if f.get("model_download_sha") == repo[1]) == [first, second]
    # This repo's files only: a request an earlier test left open is not this deploy's.
    gets = [r.file for r in fresh_hub.requests("GET") if r.file and f"/{KIMI_REPO}/" in r.path]
    assert len(gets) == len(set(gets)) == sum(1 for p in source(repo).rglob("*") if p.is_file())
    # The host side of the shared storage holds the complete, identical checkpoint.
    (tmp_path / "shared").rmdir()
    (tmp_path / "shared").symlink_to(nodes.storage_dir)
    assert_identical(tmp_path, repo)
