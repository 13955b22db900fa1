"""The container fleet itself: systemd nodes, shared storage, Ansible reach, faults.

Runs on real podman containers of the node image (`make hosts`) under its
own name prefix, so a demo fleet that is up is left alone.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support import fleet

pytestmark = pytest.mark.hosts

PREFIX = "vf-ftest"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    storage = tmp_path_factory.mktemp("fleet") / "storage"
    up = fleet.up(2, prefix=PREFIX, storage_dir=storage, fresh=True, wipe_storage=True)
    yield up
    removed = fleet.down(PREFIX)
    assert sorted(removed) == sorted(up.nodes)
    assert fleet.existing_nodes(PREFIX) == []


def test_every_node_runs_systemd_as_pid1(two_nodes):
    for node in two_nodes.nodes:
        comm = fleet.exec_in(node, ["cat", "/proc/1/comm"]).stdout.strip()
        assert comm == "systemd", f"{node}: PID 1 is {comm}"
        state = fleet.exec_in(node, ["systemctl", "is-system-running"], check=False)
        assert state.stdout.strip() in ("running", "degraded")


def test_nodes_share_the_storage_at_the_same_path(two_nodes):
    first, second = two_nodes.nodes
    target = f"{two_nodes.storage_path}/written-by-{first}"
    fleet.exec_in(first, ["sh", "-c", f"hostname > {target}"])
    assert fleet.exec_in(second, ["cat", target]).stdout.strip() == first
    assert (two_nodes.storage_dir / f"written-by-{first}").read_text().strip() == first


def test_ansible_pings_every_node(two_nodes, tmp_path):
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(fleet.inventory_yaml(len(two_nodes.nodes), PREFIX))
    proc = subprocess.run(
        ["ansible", "-i", str(inventory), "gpu-nodes", "-m", "ansible.builtin.ping"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for node in two_nodes.nodes:
        assert f"{node} | SUCCESS" in proc.stdout


def test_ansible_reaches_nodes_over_real_ssh(two_nodes, tmp_path):
    key = fleet.ensure_key_pair(tmp_path / "id_ed25519")
    public = key.with_name("id_ed25519.pub").read_text()
    inv = fleet.ssh_inventory(len(two_nodes.nodes), PREFIX, key=key)
    for node, host in inv["gpu-nodes"]["hosts"].items():
        fleet.enable_ssh(node, host["ansible_port"], public)
    inventory = tmp_path / "ssh.yml"
    inventory.write_text(yaml.safe_dump(inv))
    proc = subprocess.run(
        ["ansible", "-i", str(inventory), "gpu-nodes", "-m", "ansible.builtin.command",
         "-a", "printenv SSH_CONNECTION"],
        cwd=ROOT, capture_output=True, text=True, check=False,
        # Host keys are new on every run: keep them out of ~/.ssh/known_hosts.
        env=dict(os.environ, ANSIBLE_PARAMIKO_RECORD_HOST_KEYS="False"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for node, host in inv["gpu-nodes"]["hosts"].items():
        # SSH_CONNECTION: client ip, client port, server ip, server port.
        assert f"{node} | CHANGED" in proc.stdout
        assert f"127.0.0.1 {host['ansible_port']}" in proc.stdout


def test_limit_disk_fills_one_node_only(two_nodes):
    first, second = two_nodes.nodes
    path = "/var/lib/vllm-fleet-probe"
    write = ["dd", "if=/dev/zero", f"of={path}/blob", "bs=1M", "count=4"]
    with fleet.disk_limited(first, path, "1m"):
        full = fleet.exec_in(first, write, check=False)
        assert full.returncode != 0 and "No space left" in full.stderr
        fleet.exec_in(second, ["mkdir", "-p", path])
        assert fleet.exec_in(second, write, check=False).returncode == 0
    assert fleet.exec_in(first, write, check=False).returncode == 0


def test_killed_node_boots_again(two_nodes):
    node = two_nodes.nodes[-1]
    fleet.kill_node(node)
    status = fleet.podman("inspect", "--format", "{{.State.Running}}", node).stdout.strip()
    assert status == "false"
    assert fleet.start_node(node) in ("running", "degraded")


def test_small_shared_storage_fills_up(tmp_path):
    storage = tmp_path / "storage"
    small = fleet.up(
        1, prefix=f"{PREFIX}-small", storage_dir=storage, storage_size="2m", fresh=True
    )
    try:
        node = small.nodes[0]
        write = ["dd", "if=/dev/zero", f"of={small.storage_path}/blob", "bs=1M", "count=4"]
        full = fleet.exec_in(node, write, check=False)
        assert full.returncode != 0 and "No space left" in full.stderr
    finally:
        fleet.down(small.prefix)
    assert subprocess.run(["mountpoint", "-q", str(storage)], check=False).returncode != 0
