"""The view play (playbooks/patch_config.yml) through ansible-runner on this machine.

Runs against inventory/local (localhost as the one-node gpu-nodes group) on a
generated Kimi-K2.5-NVFP4-shaped checkpoint with a download manifest of the
hub's digests, and asserts on runner events and on the files.
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

from tests.support.ansible_module import (  # noqa: F401 (patch_ansible_module: autouse fixture)
    load_module,
    patch_ansible_module,
    run_module,
)
from tests.support.kimi_checkpoint import write_kimi_checkpoint

ROOT = Path(__file__).resolve().parents[2]
PLAYBOOK = ROOT / "playbooks" / "patch_config.yml"
VIEW_TASK = "Build the view of the checkpoint"
PATCH_TASK = "Remove the KV-cache quantization declarations from the view's configs"
FACT_TASK = "Set the view this node serves"
FILES = ("config.json", "hf_quant_config.json")
SHA = "89abcdef" * 5


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

    def view(self) -> dict[str, Any]:
        (fact,) = self.task_results(FACT_TASK)
        return fact["res"]["ansible_facts"]["vllm_fleet_view"]


@pytest.fixture
def storage(tmp_path: Path) -> Path:
    """Shared storage root holding the demo profile's checkpoint."""
    root = tmp_path / "models"
    checkpoint = root / "tiny-kimi"
    write_kimi_checkpoint(checkpoint)
    files = {}
    for path in checkpoint.rglob("*"):
        data = path.read_bytes() if path.is_file() else None
        if data is not None:
            oid = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
            files[str(path.relative_to(checkpoint))] = {"size": len(data), "oid": oid}
    state = root / ".vllm-fleet" / "tiny-kimi"
    state.mkdir(parents=True)
    (state / "manifest.json").write_text(json.dumps({"sha": SHA, "files": files}))
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


def test_view_play_builds_a_view_and_never_touches_the_checkpoint(
    tmp_path: Path, storage: Path
) -> None:
    model_dir = storage / "tiny-kimi"
    checkpoint = hashes(model_dir)
    originals = {n: json.loads((model_dir / n).read_text()) for n in FILES}

    first = run_play(tmp_path, storage)

    view = storage / ".vllm-fleet" / "tiny-kimi" / "views" / SHA / "absent"
    (built,) = first.task_results(VIEW_TASK)
    assert built["res"]["changed"] and built["res"]["path"] == str(view)
    (patch,) = first.task_results(PATCH_TASK)
    assert patch["res"]["removed"] == {
        "config.json": ["/quantization_config/kv_cache_scheme"],
        "hf_quant_config.json": ["/quantization/kv_cache_quant_algo"],
    }
    fact = first.view()
    assert fact["path"] == str(view) and fact["variant"] == "absent"
    assert fact["files"] == {n: hashlib.sha256((view / n).read_bytes()).hexdigest() for n in FILES}
    after = {n: json.loads((view / n).read_text()) for n in FILES}
    del originals["config.json"]["quantization_config"]["kv_cache_scheme"]
    del originals["hf_quant_config.json"]["quantization"]["kv_cache_quant_algo"]
    assert after == originals
    assert hashes(model_dir) == checkpoint
    assert (view / "model.safetensors.index.json").is_symlink()
    everything = hashes(storage)

    second = run_play(tmp_path, storage)

    assert second.changed() == 0
    assert hashes(storage) == everything


def test_check_mode_reports_and_builds_nothing(tmp_path: Path, storage: Path) -> None:
    before = hashes(storage)

    result = run_play(tmp_path, storage, check=True)

    (built,) = result.task_results(VIEW_TASK)
    assert built["res"]["changed"] is True and built["res"]["created"] is True
    assert hashes(storage) == before
    assert not (storage / ".vllm-fleet" / "tiny-kimi" / "views" / SHA).exists()


def test_original_decision_serves_the_checkpoint_itself(tmp_path: Path, storage: Path) -> None:
    before = hashes(storage)

    result = run_play(tmp_path, storage, quant_config_kv_cache_quant="original")

    assert result.view()["path"] == str(storage / "tiny-kimi")
    assert result.changed() == 0
    assert hashes(storage) == before


def test_a_checkpoint_patched_in_place_is_restored_to_the_hubs_bytes(
    tmp_path: Path, storage: Path
) -> None:
    model_dir = storage / "tiny-kimi"
    hub = {n: (model_dir / n).read_bytes() for n in FILES}
    # What earlier versions did: patch the shared checkpoint, pristine copies beside it.
    legacy = run_module(load_module("hf_quant_config"), {"model_dir": model_dir})
    assert legacy["changed"] and legacy["backup_files_created"]
    assert (model_dir / "config.json").read_bytes() != hub["config.json"]

    upgrade = run_play(tmp_path, storage)

    assert {n: (model_dir / n).read_bytes() for n in FILES} == hub
    (restored,) = upgrade.task_results("Restore the checkpoint's configs patched in place")
    assert restored["res"]["restored"] == list(FILES)
    assert upgrade.view()["variant"] == "absent"
    assert run_play(tmp_path, storage).changed() == 0
