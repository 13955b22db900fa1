"""The patch play (playbooks/patch_config.yml) through ansible-runner on this machine.

Runs against inventory/local (localhost as the one-node gpu-nodes group) on a
generated Kimi-K2.5-NVFP4-shaped checkpoint, and asserts on runner events and
on the files.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import ansible_runner
import pytest

from tests.support.kimi_checkpoint import write_kimi_checkpoint

ROOT = Path(__file__).resolve().parents[2]
PLAYBOOK = ROOT / "playbooks" / "patch_config.yml"
PATCH_TASK = "Ensure the checkpoint's KV-cache quantization is"
HANDLER = "Restart vLLM on the nodes serving the patched checkpoint"
FILES = ("config.json", "hf_quant_config.json")


def hashes(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


class Run:
    """One ansible-runner run of the patch play, with what the tests ask of it."""

    def __init__(self, runner: Any) -> None:
        self.status = runner.status
        self.rc = runner.rc
        self.stats = runner.stats or {}
        self.events = list(runner.events)

    def changed(self) -> int:
        return int(self.stats.get("changed", {}).get("localhost", 0))

    def task_results(self, prefix: str) -> list[dict[str, Any]]:
        return [
            e["event_data"]
            for e in self.events
            if e["event"] in ("runner_on_ok", "runner_on_failed")
            and e["event_data"].get("task", "").startswith(prefix)
        ]

    def handlers_notified(self) -> list[str]:
        return [
            e["event_data"]["handler"] for e in self.events if e["event"] == "playbook_on_notify"
        ]


@pytest.fixture
def storage(tmp_path: Path) -> Path:
    """Shared storage root holding the demo profile's checkpoint."""
    root = tmp_path / "models"
    write_kimi_checkpoint(root / "tiny-kimi")
    return root


def run_play(tmp_path: Path, storage: Path, *, check: bool = False, **extravars: Any) -> Run:
    private = tmp_path / f"runner-{len(list(tmp_path.glob('runner-*')))}"
    private.mkdir()
    bindir = str(Path(sys.executable).parent)
    runner = ansible_runner.run(
        private_data_dir=str(private),
        project_dir=str(ROOT),
        playbook=str(PLAYBOOK),
        inventory=str(ROOT / "inventory" / "local" / "hosts.yml"),
        extravars={
            "vllm_fleet_storage_root": str(storage),
            "vllm_fleet_served_name": "tiny-kimi",
            **extravars,
        },
        envvars={
            "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
            "PATH": bindir + os.pathsep + os.environ.get("PATH", ""),
        },
        cmdline="--diff --check" if check else "--diff",
        quiet=True,
    )
    result = Run(runner)
    assert result.status == "successful", [
        e["event_data"].get("res") for e in result.events if e["event"] == "runner_on_failed"
    ]
    return result


def test_patch_play_twice_second_run_changes_nothing(tmp_path: Path, storage: Path) -> None:
    model_dir = storage / "tiny-kimi"
    originals = {n: json.loads((model_dir / n).read_text()) for n in FILES}

    first = run_play(tmp_path, storage)

    (patch,) = first.task_results(PATCH_TASK)
    assert patch["res"]["changed"] is True
    assert patch["res"]["removed"] == {
        "config.json": ["/quantization_config/kv_cache_scheme"],
        "hf_quant_config.json": ["/quantization/kv_cache_quant_algo"],
    }
    assert HANDLER in first.handlers_notified()
    after = {n: json.loads((model_dir / n).read_text()) for n in FILES}
    del originals["config.json"]["quantization_config"]["kv_cache_scheme"]
    del originals["hf_quant_config.json"]["quantization"]["kv_cache_quant_algo"]
    assert after == originals
    patched = hashes(storage)

    second = run_play(tmp_path, storage)

    assert second.changed() == 0
    assert second.handlers_notified() == []
    assert hashes(storage) == patched


def test_check_mode_reports_and_changes_nothing(tmp_path: Path, storage: Path) -> None:
    before = hashes(storage)

    result = run_play(tmp_path, storage, check=True)

    (patch,) = result.task_results(PATCH_TASK)
    assert patch["res"]["changed"] is True
    assert {d["before_header"] for d in patch["res"]["diff"]} == {
        str(storage / "tiny-kimi" / n) for n in FILES
    }
    assert hashes(storage) == before


def test_plan_original_restores_the_files_byte_for_byte(tmp_path: Path, storage: Path) -> None:
    model_dir = storage / "tiny-kimi"
    pristine = {n: (model_dir / n).read_bytes() for n in FILES}
    run_play(tmp_path, storage)
    plan = {"vllm_fleet_plan": {"kv_cache_quant": "original"}}

    restore = run_play(tmp_path, storage, **plan)

    (task,) = restore.task_results(PATCH_TASK)
    assert task["res"]["restored"] == list(FILES)
    assert HANDLER in restore.handlers_notified()
    assert {n: (model_dir / n).read_bytes() for n in FILES} == pristine
    again = run_play(tmp_path, storage, **plan)
    assert again.changed() == 0
