"""Variable layering: profile < inventory group_vars < host_vars, without -e.

A real ansible-playbook run (validate.yml, then the vllm_service role's unit
step in check and diff mode on the controller): each node's rendered unit
comes back in the diff, nothing is written.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import sys
from pathlib import Path
from typing import Any

import ansible_runner
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PLAYBOOK = ROOT / "tests/integration/playbooks/render_unit.yml"
PLAN_PLAYBOOK = ROOT / "tests/integration/playbooks/plan.yml"
PROFILE = yaml.safe_load((ROOT / "playbooks/models/tiny-kimi.yml").read_text())
DEFAULT_PIN = yaml.safe_load((ROOT / "roles/vllm_fleet/defaults/main.yml").read_text())[
    "vllm_fleet_vllm_version"
]
UNIT_TASK = "Install the systemd unit (verified with systemd-analyze first)"


# A replica's watch secret (validation refuses a replica of several nodes without it).
WATCH_SECRET = "watch-" + secrets.token_hex(8)


def write_inventory(root: Path, group_vars: dict[str, Any], host_vars: dict[str, Any]) -> Path:
    hosts = {"gpu-nodes": {"hosts": {"node-a": {}, "node-b": {}}}}
    common = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    (root / "group_vars").mkdir(parents=True)
    (root / "host_vars").mkdir()
    (root / "hosts.yml").write_text(yaml.safe_dump(hosts))
    (root / "group_vars/all.yml").write_text(yaml.safe_dump(common))
    (root / "group_vars/gpu-nodes.yml").write_text(yaml.safe_dump(group_vars))
    (root / "host_vars/node-b.yml").write_text(yaml.safe_dump(host_vars))
    return root


def run(
    tmp_path: Path, inventory: Path, playbook: Path = PLAYBOOK, **extravars: Any
) -> ansible_runner.Runner:
    (tmp_path / "runner").mkdir()
    return ansible_runner.run(
        private_data_dir=str(tmp_path / "runner"),
        project_dir=str(ROOT),
        playbook=str(playbook),
        inventory=str(inventory),
        extravars=extravars,
        cmdline="--check --diff",
        quiet=True,
        envvars={
            "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        },
    )


def render(tmp_path: Path, inventory: Path, **extravars: Any) -> tuple[dict[str, str], int]:
    """Each node's rendered unit, and how many batches (play starts) the render play ran in."""
    runner = run(tmp_path, inventory, **extravars)
    events = list(runner.events)
    assert runner.rc == 0, runner.stdout.read()[-3000:]
    # Role vllm_fleet's spec is checked once, by the validation play, not again by
    # each play that lists the role for its defaults.
    checks = [
        e["event_data"]["play"] for e in events
        if e["event"] == "playbook_on_task_start"
        and "vllm_fleet" in e["event_data"].get("task", "")
        and e["event_data"].get("task_action", "").endswith("validate_argument_spec")
    ]  # fmt: skip
    assert checks == ["Validate the deployment variables"], checks
    units = {}
    for event in events:
        data = event.get("event_data", {})
        if event["event"] == "runner_on_ok" and data.get("task") == UNIT_TASK:
            diff = data["res"]["diff"]
            units[data["host"]] = (diff[0] if isinstance(diff, list) else diff)["after"]
    batches = sum(
        1
        for e in events
        if e["event"] == "playbook_on_play_start"
        and e["event_data"].get("name") == "Render each node's unit"
    )
    return units, batches


def argv(unit: str) -> list[str]:
    (line,) = [line for line in unit.splitlines() if line.startswith("ExecStart=")]
    return line.split()


def arg(unit: str, flag: str) -> str:
    words = argv(unit)
    return words[words.index(flag) + 1]


@pytest.fixture
def layered(tmp_path: Path) -> Path:
    group = {
        # A site's engine arguments (the whole mapping replaces the profile's).
        "vllm_fleet_engine_args": {**PROFILE["vllm_fleet_engine_args"], "max-model-len": 256},
        "vllm_fleet_health_timeout_s": 900,
        # Ignored by the serial keyword (play keywords do not see the inventory).
        "vllm_fleet_serial": 2,
    }
    host = {"vllm_fleet_engine_args": {**PROFILE["vllm_fleet_engine_args"], "max-model-len": 128}}
    return write_inventory(tmp_path / "inventory", group, host)


def test_group_vars_override_the_profile_and_host_vars_override_both(
    tmp_path: Path, layered: Path
) -> None:
    units, batches = render(tmp_path, layered)
    assert set(units) == {"node-a", "node-b"}
    assert PROFILE["vllm_fleet_engine_args"]["max-model-len"] == 512
    assert arg(units["node-a"], "--max-model-len") == "256"
    assert arg(units["node-b"], "--max-model-len") == "128"
    # Scalars too: the group's timeout outranks the profile's 600 s, on both nodes.
    for unit in units.values():
        assert "TimeoutStartSec=900" in unit.splitlines()
        # The profile's other values still arrive (served name, model path).
        assert arg(unit, "--served-model-name") == PROFILE["vllm_fleet_served_name"]
    # serial: role vllm_fleet's default (1), not the inventory's 2.
    assert batches == 2


def test_profile_values_arrive_without_inventory_and_serial_follows_extra_vars(
    tmp_path: Path,
) -> None:
    inventory = write_inventory(tmp_path / "inventory", {}, {})
    units, batches = render(tmp_path, inventory, vllm_fleet_serial=2)
    for unit in units.values():
        assert arg(unit, "--max-model-len") == "512"
        assert "--enforce-eager" in argv(unit)
        assert "TimeoutStartSec=600" in unit.splitlines()
    assert batches == 1


def test_a_mistyped_fleet_value_stops_the_validation_play_naming_it(tmp_path: Path) -> None:
    inventory = write_inventory(
        tmp_path / "inventory", {"vllm_fleet_tensor_parallel_size": "eight"}, {}
    )
    runner = run(tmp_path, inventory)
    assert runner.rc != 0
    failed = [e["event_data"] for e in runner.events if e["event"] == "runner_on_failed"]
    assert {f["play"] for f in failed} == {"Validate the deployment variables"}
    assert {f["host"] for f in failed} == {"node-a", "node-b"}
    msg = failed[0]["res"]["msg"]
    assert "vllm_fleet_tensor_parallel_size" in msg and "int" in msg, msg


def failed_validation(runner: ansible_runner.Runner) -> dict[str, Any]:
    """The one failed task of a run that the validation play stopped, before any unit."""
    assert runner.rc != 0
    events = list(runner.events)
    (failed,) = [e["event_data"] for e in events if e["event"] == "runner_on_failed"]
    assert failed["play"] == "Validate the deployment variables"
    # Runner's verbose and warning events carry no event_data.
    assert not [e for e in events if e.get("event_data", {}).get("task") == UNIT_TASK]
    return failed


def test_a_pin_below_the_profiles_minimum_is_refused_naming_both(tmp_path: Path) -> None:
    # The Kimi-K2.5 profile (vLLM 0.15.0 or later) on an older pin; node-b pins one that loads it.
    kimi = {"vllm_fleet_model": "kimi-k2.5-nvfp4", "vllm_fleet_vllm_version": "0.15.0rc1"}
    inventory = write_inventory(tmp_path / "inventory", kimi, {"vllm_fleet_vllm_version": "0.15.0"})
    runner = run(tmp_path, inventory)
    assert runner.rc != 0
    failed = [e["event_data"] for e in runner.events if e["event"] == "runner_on_failed"]
    assert [(f["host"], f["task"]) for f in failed] == [
        ("node-a", "Check the pinned vLLM against the model's minimum")
    ]
    msg = failed[0]["res"]["msg"]
    assert "vLLM 0.15.0rc1 (vllm_fleet_vllm_version) cannot load nvidia/Kimi-K2.5-NVFP4" in msg
    assert "needs vLLM 0.15.0 or later (vllm_fleet_vllm_min_version)" in msg, msg


def test_a_broken_replica_topology_is_refused_with_every_problem(tmp_path: Path) -> None:
    replica = {
        "vllm_fleet_replica": "r1",
        "vllm_fleet_replica_rank": 0,
        "vllm_fleet_replica_secret": WATCH_SECRET,
    }
    inventory = write_inventory(
        tmp_path / "inventory", {}, {**replica, "vllm_fleet_vllm_version": "0.17.0"}
    )
    (inventory / "host_vars/node-a.yml").write_text(yaml.safe_dump(replica))
    failed = failed_validation(run(tmp_path, inventory))
    assert failed["task"] == "Check the replica topology"
    assert failed["res"]["msg"] == (
        "Inconsistent replica topology (vllm_fleet_replica, vllm_fleet_replica_rank), nothing "
        "was changed: (1) replica r1: rank 0 is set on node-a, node-b (one node per rank); "
        "(2) replica r1: its 2 nodes need ranks 0..1, one each (missing 1); (3) replica r1: its "
        f"nodes differ in vllm_fleet_vllm_version (node-a: {DEFAULT_PIN}, node-b: 0.17.0)."
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def plan_replica(
    tmp_path: Path, leader: dict[str, Any], follower: dict[str, Any], *, fails: bool = True
) -> Any:
    """validate.yml + preflight.yml on node-a and node-b (this machine, device cpu) as
    one tensor parallel 2 replica: node-a leads (``port``: the group's rendezvous
    port); the events of the run."""
    storage = tmp_path / "storage"
    storage.mkdir()
    group = {
        "vllm_fleet_device": "cpu",
        "vllm_fleet_tensor_parallel_size": 2,
        "vllm_fleet_storage_root": str(storage),
        "preflight_storage_must_be_mount": False,
        "vllm_fleet_port": free_port(),
        "vllm_fleet_replica": "r1",
        "vllm_fleet_replica_secret": WATCH_SECRET,
    }
    if "port" in leader:
        group["vllm_fleet_replica_port"] = leader.pop("port")
    inventory = write_inventory(
        tmp_path / "inventory", group, {"vllm_fleet_replica_rank": 1, **follower}
    )
    (inventory / "host_vars/node-a.yml").write_text(
        yaml.safe_dump({"vllm_fleet_replica_rank": 0, **leader})
    )
    runner = run(tmp_path, inventory, PLAN_PLAYBOOK)
    assert (runner.rc != 0) is fails, runner.stdout.read()[-3000:]
    return list(runner.events)


def failures(events: list[dict[str, Any]]) -> dict[str, list[tuple[str, str]]]:
    """Failed task -> [(host, message)], after validation passed."""
    found: dict[str, list[tuple[str, str]]] = {}
    for event in events:
        data = event.get("event_data", {})
        if event["event"] == "runner_on_failed":
            assert data["play"] == "Preflight", data
            found.setdefault(data["task"], []).append((data["host"], data["res"]["msg"]))
    return found


def test_a_replica_across_nodes_is_planned_for_each_node(tmp_path: Path) -> None:
    # Tensor parallel 2 over 2 nodes: a topology that fits, and a network that works.
    port = free_port()
    events = plan_replica(
        tmp_path, {"vllm_fleet_replica_address": "127.0.0.1", "port": port}, {}, fails=False
    )
    plans = {
        e["event_data"]["host"]: e["event_data"]["res"]["ansible_facts"]["vllm_fleet_plan"]
        for e in events
        if e["event"] == "runner_on_ok"
        and "vllm_fleet_plan" in e["event_data"]["res"].get("ansible_facts", {})
    }
    assert sorted(plans) == ["node-a", "node-b"]
    for rank, host in enumerate(("node-a", "node-b")):
        replica = plans[host]["replica"]
        assert {k: v for k, v in replica.items() if k not in ("env", "api_port")} == {
            "name": "r1", "nodes": 2, "rank": rank, "leader": "127.0.0.1",
            "leader_ip": "127.0.0.1", "port": port, "watch_port": port + 1,
            "leader_host": "node-a", "host_ip": "127.0.0.1", "ifname": "lo", "executor": "mp",
        }  # fmt: skip
        assert replica["env"] == {
            "VLLM_HOST_IP": "127.0.0.1", "NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo"
        }  # fmt: skip
    # Followers wait on the leader's API port.
    assert plans["node-a"]["replica"]["api_port"] == plans["node-b"]["replica"]["api_port"] > 0


def test_a_replica_whose_nodes_plan_differently_is_refused_naming_each(tmp_path: Path) -> None:
    # No port on the leader (nor for the group): each node takes its own, and
    # node-b's is another.
    port = free_port()
    events = plan_replica(
        tmp_path, {"vllm_fleet_replica_address": "127.0.0.1"}, {"vllm_fleet_replica_port": port}
    )
    assert failures(events) == {
        "Check that the nodes of each replica plan alike": [(
            "node-a",
            "Preflight found 1 difference(s) within replicas, nothing was changed: (1) replica "
            f"r1: its nodes plan different leader port (node-a: 29501, node-b: {port}).",
        )]
    }  # fmt: skip


def test_a_leader_address_the_nodes_cannot_resolve_stops_every_node(tmp_path: Path) -> None:
    events = plan_replica(
        tmp_path, {"vllm_fleet_replica_address": "leader.invalid", "port": free_port()}, {}
    )
    failed = failures(events)
    assert list(failed) == ["Fail with every problem found"]
    assert sorted(host for host, _ in failed["Fail with every problem found"]) == [
        "node-a",
        "node-b",
    ]
    for host, msg in failed["Fail with every problem found"]:
        rank = 0 if host == "node-a" else 1
        assert msg.startswith(f"Preflight found 1 problem(s) on {host}, nothing was changed: (1) "
                              f"replica r1 (rank {rank} of 2): cannot resolve the leader's "
                              "address 'leader.invalid'"), msg  # fmt: skip


def test_the_ray_executor_on_cpu_nodes_is_refused_before_any_change(tmp_path: Path) -> None:
    """vllm_fleet_executor: ray from the inventory: validation stops a replica
    whose node has no Ray token (naming the node, never the token); with the
    token on both, preflight stops each node with vLLM's own reason and the way out."""
    token = "ray-" + secrets.token_hex(12)
    ray = {"vllm_fleet_executor": "ray"}
    leader = {"vllm_fleet_replica_address": "127.0.0.1", "vllm_fleet_ray_token": token, **ray}
    (tmp_path / "untokened").mkdir()
    events = plan_replica(tmp_path / "untokened", {**leader, "port": free_port()}, ray)
    refused = [
        (e["event_data"]["task"], e["event_data"]["res"]["msg"])
        for e in events
        if e["event"] == "runner_on_failed"
    ]
    assert refused == [
        (
            "Check the replica topology",
            "Inconsistent replica topology (vllm_fleet_replica, vllm_fleet_replica_rank), "
            "nothing was changed: (1) replica r1: the ray executor needs vllm_fleet_ray_token "
            "on node-b (in vault, the same on every node of the replica): a Ray port without "
            "a token runs any code sent to it.",
        )
    ], refused
    assert not any(token in json.dumps(e) for e in events)

    (tmp_path / "tokened").mkdir()
    events = plan_replica(
        tmp_path / "tokened",
        {**leader, "port": free_port()},
        {"vllm_fleet_ray_token": token, **ray},
    )
    assert not any(token in json.dumps(e) for e in events)
    failed = failures(events)
    assert list(failed) == ["Fail with every problem found"]
    for host, msg in failed["Fail with every problem found"]:
        rank = 0 if host == "node-a" else 1
        assert msg == (
            f"Preflight found 1 problem(s) on {host}, nothing was changed: (1) replica r1 "
            f"(rank {rank} of 2): the ray executor does not run on the cpu device (vLLM: "
            "'current platform cpu does not support ray'); set vllm_fleet_executor: mp, vLLM's "
            "own multi-node launch."
        ), msg
    assert sorted(host for host, _ in failed["Fail with every problem found"]) == [
        "node-a",
        "node-b",
    ]


def refused_replica(tmp_path: Path, playbook: Path) -> list[dict[str, Any]]:
    """``playbook`` on node-a and node-b as replica r1 (tensor parallel 2, node-a leads),
    which must fail; its failed results."""
    inventory = write_inventory(
        tmp_path / "inventory",
        {
            "vllm_fleet_tensor_parallel_size": 2,
            "vllm_fleet_replica": "r1",
            "vllm_fleet_replica_secret": WATCH_SECRET,
        },
        {"vllm_fleet_replica_rank": 1},
    )
    (inventory / "host_vars/node-a.yml").write_text(yaml.safe_dump({"vllm_fleet_replica_rank": 0}))
    runner = run(tmp_path, inventory, playbook)
    assert runner.rc != 0
    return [e["event_data"] for e in runner.events if e["event"] == "runner_on_failed"]


def test_serve_alone_refuses_a_replica_node_without_its_plan(tmp_path: Path) -> None:
    """playbooks/serve.yml run without preflight (serve_alone.yml and deploy.yml plan first):
    a replica's node would start a server of its own; each node is refused by name."""
    failed = refused_replica(tmp_path, ROOT / "playbooks/serve.yml")
    assert sorted((f["host"], f["task"]) for f in failed) == [
        ("node-a", "Check that a replica's node has its plan"),
        ("node-b", "Check that a replica's node has its plan"),
    ]
    assert failed[0]["res"]["msg"] == (
        f"{failed[0]['host']} is in replica r1 but has no plan (vllm_fleet_plan): serve it "
        "through deploy.yml or playbooks/serve_alone.yml, whose preflight plans each replica. "
        "Nothing was changed."
    )


def test_an_old_variable_name_is_refused_with_its_new_name(tmp_path: Path) -> None:
    # The API port is a fleet fact now (vllm_fleet_port): the old name would be ignored.
    old = {"vllm_service_port": 8123, "preflight_gpu_memory_utilization": 0.8}
    inventory = write_inventory(tmp_path / "inventory", {}, old)
    runner = run(tmp_path, inventory)
    assert runner.rc != 0
    failed = [e["event_data"] for e in runner.events if e["event"] == "runner_on_failed"]
    assert [(f["play"], f["host"], f["task"]) for f in failed] == [
        ("Validate the deployment variables", "node-b", "Refuse the variables that have a new name")
    ]
    msg = failed[0]["res"]["msg"]
    assert "vllm_service_port is now vllm_fleet_port" in msg, msg
    # Preflight reads the fleet's names: its own aliases of an earlier release are refused too.
    assert "preflight_gpu_memory_utilization is now vllm_fleet_engine_args" in msg, msg


def test_a_device_outside_the_fleets_choices_is_refused_by_the_fleets_spec(tmp_path: Path) -> None:
    inventory = write_inventory(tmp_path / "inventory", {"vllm_fleet_device": "gpu"}, {})
    runner = run(tmp_path, inventory)
    assert runner.rc != 0
    failed = [e["event_data"] for e in runner.events if e["event"] == "runner_on_failed"]
    assert {f["play"] for f in failed} == {"Validate the deployment variables"}
    assert {f["task"] for f in failed} == {
        "Check the fleet defaults and the profile's values against role vllm_fleet's spec"
    }
    msg = failed[0]["res"]["msg"]
    assert "vllm_fleet_device" in msg and "cuda, cpu" in msg, msg


def test_a_profile_may_set_the_nccl_switches_and_the_plan_follows(tmp_path: Path) -> None:
    # A site's profile for a PCIe box whose P2P hangs: the switch is a profile value.
    profiles = tmp_path / "models"
    profiles.mkdir()
    (profiles / "tiny-kimi.yml").write_text(
        yaml.safe_dump({**PROFILE, "vllm_fleet_nccl_p2p_disable": True})
    )
    storage = tmp_path / "storage"
    storage.mkdir()
    group = {
        "vllm_fleet_profiles_dir": str(profiles),
        "vllm_fleet_device": "cpu",
        "vllm_fleet_storage_root": str(storage),
        "preflight_storage_must_be_mount": False,
        "vllm_fleet_port": free_port(),
    }
    runner = run(tmp_path, write_inventory(tmp_path / "inventory", group, {}), PLAN_PLAYBOOK)
    assert runner.rc == 0, runner.stdout.read()[-3000:]
    plans = [
        e["event_data"]["res"]["ansible_facts"]["vllm_fleet_plan"]
        for e in runner.events
        if e["event"] == "runner_on_ok"
        and "vllm_fleet_plan" in e["event_data"]["res"].get("ansible_facts", {})
    ]
    assert len(plans) == 2
    assert all(plan["disable_custom_all_reduce"] is True for plan in plans), plans
