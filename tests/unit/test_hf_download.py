"""Unit tests of module_utils/hf_download.py: the parts that need no hub."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "module_utils"))

import hf_download as hd


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


def record(o: hd.Options, entries: list[hd.Entry]) -> None:
    plan = hd.Plan("a" * 40, entries, dict.fromkeys((e.path for e in entries), "ok"), {}, 0, 0)
    hd.write_manifest(o, plan, {})


def test_unrecorded_present_files_are_trusted_by_size_and_missing_ones_found(checkpoint) -> None:
    o, entries = checkpoint
    os.unlink(Path(o.local_dir) / entries[1].path)
    status, _ = hd.assess(o, entries, {})
    assert status == {entries[0].path: "ok", entries[1].path: "missing", entries[2].path: "ok"}


def test_rewrite_with_restored_mtime_is_seen_through_ctime(checkpoint) -> None:
    o, entries = checkpoint
    record(o, entries)
    shard = Path(o.local_dir) / entries[0].path
    st = shard.stat()
    shard.write_bytes(b"A" + b"a" * 4095)  # same size
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    status, hashes = hd.assess(o, entries, hd.load_manifest(o))
    assert status[entries[0].path] == "corrupt"
    assert status[entries[1].path] == "ok" and status[entries[2].path] == "ok"
    assert entries[0].path not in hashes


def test_touched_but_intact_file_is_rehashed_and_kept(checkpoint) -> None:
    o, entries = checkpoint
    record(o, entries)
    os.utime(Path(o.local_dir) / entries[2].path, ns=(1, 1))
    status, hashes = hd.assess(o, entries, hd.load_manifest(o))
    assert set(status.values()) == {"ok"}
    assert hashes == {entries[2].path: entries[2].oid}  # git blob sha1 for non-LFS files


def test_full_verification_hashes_everything_once(checkpoint) -> None:
    o, entries = checkpoint
    o.verify = "full"
    status, hashes = hd.assess(o, entries, {})
    assert set(status.values()) == {"ok"}
    assert hashes == {e.path: e.reference()[1] for e in entries}


def test_patched_config_is_not_refetched_once_recorded(checkpoint) -> None:
    o, entries = checkpoint
    o.patched_files = ["config.json"]
    record(o, entries)
    (Path(o.local_dir) / "config.json").write_text('{"x": 1, "patched": true}\n')
    status, _ = hd.assess(o, entries, hd.load_manifest(o))
    assert status["config.json"] == "ok"


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


def test_second_lock_holder_waits_then_fails_naming_the_holder(checkpoint) -> None:
    o, _ = checkpoint
    o.lock_timeout = 1
    # flock locks belong to the open file description: a second open conflicts.
    with hd.DirLock(o), pytest.raises(hd.DownloadError, match=f"pid={os.getpid()}"), hd.DirLock(o):
        pass
    with hd.DirLock(o):  # released on exit
        pass


def test_index_naming_a_missing_shard_is_incomplete(checkpoint) -> None:
    o, entries = checkpoint
    index = {"weight_map": {"w1": entries[0].path, "w2": "model-00003-of-00003.safetensors"}}
    entries.append(entry_for(Path(o.local_dir), hd.INDEX_FILE, json.dumps(index).encode(), False))
    with pytest.raises(hd.DownloadError, match=r"model-00003-of-00003\.safetensors"):
        hd.prove_complete(o, entries)
