"""The test-host tooling: demo inventory, containers.conf, image tag, Molecule runner."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support import fleet

ROOT = Path(__file__).resolve().parents[2]
HOSTS = ROOT / "tools" / "hosts"


def load_runner():
    spec = importlib.util.spec_from_file_location("molecule_all", HOSTS / "molecule_all.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["molecule_all"] = module
    spec.loader.exec_module(module)
    return module


def test_demo_inventory_is_the_generated_one():
    committed = (ROOT / "inventory/demo/hosts.yml").read_text()
    assert committed == fleet.inventory_yaml(2, cpus=2), (
        "regenerate: python -m tests.support.fleet inventory --cpus 2 > inventory/demo/hosts.yml"
    )


def test_inventory_gives_each_node_its_own_ports_and_core():
    hosts = fleet.inventory(3, cpus=2)["gpu-nodes"]["hosts"]
    assert list(hosts) == ["vf-node1", "vf-node2", "vf-node3"]
    ports = [h["vllm_fleet_port"] for h in hosts.values()]
    ssh_ports = [h["vllm_fleet_node_ssh_port"] for h in hosts.values()]
    assert len(set(ports)) == 3 and len(set(ssh_ports)) == 3
    assert [h["vllm_service_cpu_bind"] for h in hosts.values()] == ["0", "1", "0"]


def test_inventory_reaches_nodes_through_podman():
    inv = yaml.safe_load(fleet.inventory_yaml(2, cpus=2))
    assert inv["gpu-nodes"]["vars"]["ansible_connection"] == "vllm_fleet_container"


@pytest.mark.parametrize("nodes", [0, -1])
def test_fleet_of_no_nodes_is_refused(nodes):
    with pytest.raises(fleet.FleetError, match="at least one node"):
        fleet.node_names(nodes)


def test_missing_containers_conf_says_run_make_hosts(tmp_path, monkeypatch):
    monkeypatch.delenv("CONTAINERS_CONF", raising=False)
    monkeypatch.setenv("VLLM_FLEET_CACHE", str(tmp_path))
    with pytest.raises(fleet.FleetError, match="make hosts"):
        fleet.podman_env()


def test_containers_conf_fits_host_limits(tmp_path):
    out = tmp_path / "containers.conf"
    subprocess.run([HOSTS / "containers-conf.sh", out], check=True, capture_output=True)
    text = out.read_text()
    nofile = subprocess.run(
        ["bash", "-c", "ulimit -Hn"], capture_output=True, text=True, check=True
    ).stdout.strip()
    pid_max = Path("/proc/sys/kernel/pid_max").read_text().strip()
    assert f'"nofile={nofile}:{nofile}"' in text
    assert f'"nproc={pid_max}:{pid_max}"' in text
    assert 'runtime = "runc"' in text
    assert ("/sys/fs/cgroup/unified:/sys/fs/cgroup/unified:rw" in text) == Path(
        "/sys/fs/cgroup/unified"
    ).is_dir()
    before = out.stat().st_mtime_ns
    again = subprocess.run(
        [HOSTS / "containers-conf.sh", out], check=True, capture_output=True, text=True
    )
    assert "up to date" in again.stdout and out.stat().st_mtime_ns == before


def test_image_tag_follows_the_recipe(tmp_path):
    copy = tmp_path / "hosts"
    shutil.copytree(HOSTS, copy)
    script = copy / "node-image.sh"

    def tag() -> str:
        return subprocess.run(
            [script, "tag"], capture_output=True, text=True, check=True
        ).stdout.strip()

    original = tag()
    assert original.startswith("localhost/vllm-fleet-node:")
    assert tag() == original
    # The script's own text is not part of the recipe: no rebuild for a comment.
    script.write_text(script.read_text() + "\n# comment\n")
    assert tag() == original
    recipe = copy / "node-image" / "recipe.sh"
    recipe.write_text(recipe.read_text().replace("sudo,", "sudo,less,"))
    assert tag() != original


def test_molecule_runner_finds_role_and_project_scenarios():
    runner = load_runner()
    scenarios = {str(s.path): s for s in runner.discover(ROOT)}
    assert "molecule/multinode" in scenarios and "molecule/ssh" in scenarios
    assert scenarios["molecule/ssh"].project == ROOT
    for path, scenario in scenarios.items():
        if path.startswith("roles/"):
            assert scenario.project == ROOT / "roles" / path.split("/")[1]
            assert scenario.host.startswith("vf-mol-")


def test_molecule_runner_rejects_unknown_scenario():
    runner = load_runner()
    with pytest.raises(SystemExit, match="no such scenario: roles/nope/molecule/default"):
        runner.select(runner.discover(ROOT), ["roles/nope/molecule/default"])
