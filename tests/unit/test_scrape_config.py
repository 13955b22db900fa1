"""roles/monitoring's scrape configuration, rendered by ansible-playbook from a
multi-group inventory (real hostvars), then checked by promtool."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
ROLE = ROOT / "roles/monitoring"
# Nodes reached by name, by ansible_host and by vllm_fleet_node_address (with
# its own port); a router with its own exporter port; a group nobody scrapes.
INVENTORY = {
    "gpu-nodes": {
        "hosts": {
            "gpu-a": {"ansible_host": "10.0.0.11"},
            "gpu-b": {
                "ansible_host": "10.0.0.12",
                "vllm_fleet_node_address": "192.168.1.12",
                "vllm_fleet_port": 8100,
            },
            "gpu-c": {},
        }
    },
    "routers": {"hosts": {"router-1": {"ansible_host": "10.0.0.10",
                                       "vllm_router_prometheus_port": 29100}}},
    "monitoring": {"hosts": {"router-1": {}}},
    "storage": {"hosts": {"nfs-1": {"ansible_host": "10.0.0.5"}}},
}  # fmt: skip


def render(tmp_path: Path, inventory: dict, limit: str = "all", **extra: Any) -> dict:
    """The role's two templates, as its tasks render them, on the monitoring host."""
    out = tmp_path / f"out-{len(list(tmp_path.glob('out-*')))}"
    out.mkdir()
    rules = out / "vllm-fleet.rules.yml"
    play = [{
        "hosts": "monitoring", "gather_facts": False, "connection": "local",
        "vars_files": [str(ROLE / "defaults/main.yml"), str(ROLE / "vars/main.yml"),
                       # Role vllm_fleet's contract (the API port's default).
                       str(ROOT / "roles/vllm_fleet/vars/main.yml")],
        "vars": {"vllm_fleet_monitoring_port": 9090,
                 # Role vllm_fleet's default: the host's fleet address.
                 "vllm_fleet_node_address": "{{ ansible_host | default(inventory_hostname) }}"},
        "tasks": [
            {"ansible.builtin.template": {
                "src": str(ROLE / "templates/vllm-fleet.rules.yml.j2"), "dest": str(rules),
                "mode": "0644", "variable_start_string": "[[", "variable_end_string": "]]"}},
            {"ansible.builtin.template": {
                "src": str(ROLE / "templates/prometheus.yml.j2"),
                "dest": str(out / "prometheus.yml"), "mode": "0644"}},
        ],
    }]  # fmt: skip
    (tmp_path / "play.yml").write_text(json.dumps(play))
    (tmp_path / "hosts.yml").write_text(yaml.safe_dump(inventory))
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg")}
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(tmp_path / "hosts.yml"),
         "-l", limit, "-e", f"ansible_python_interpreter={sys.executable}",
         # Above the role defaults (vars_files), as the inventory is above a role's defaults.
         "-e", json.dumps(extra),
         # Above the role's vars (vars_files) too: the rules file is this test's.
         "-e", json.dumps({"__monitoring_rules": str(rules)}),
         str(tmp_path / "play.yml")],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:]
    return {"dir": out, "config": yaml.safe_load((out / "prometheus.yml").read_text())}


def targets(config: dict) -> dict[str, dict[str, str]]:
    """Per job: target -> its node label."""
    return {
        job["job_name"]: {
            target: group.get("labels", {}).get("node", "")
            for group in job["static_configs"]
            for target in group["targets"]
        }
        for job in config["scrape_configs"]
    }


def test_targets_come_from_the_inventory_groups(tmp_path: Path, promtool: str) -> None:
    rendered = render(tmp_path, INVENTORY)
    assert targets(rendered["config"]) == {
        "vllm": {"10.0.0.11:8000": "gpu-a", "192.168.1.12:8100": "gpu-b", "gpu-c:8000": "gpu-c"},
        "vllm-router": {"10.0.0.10:29100": "router-1"},
        # Prometheus listens on its host's fleet address only, and scrapes itself there.
        "prometheus": {"10.0.0.10:9090": ""},
    }
    assert rendered["config"]["global"]["scrape_interval"] == "15s"
    checked = subprocess.run(
        [promtool, "check", "config", str(rendered["dir"] / "prometheus.yml")],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 8 rules found" in checked.stdout


def test_a_limited_run_renders_the_same_file(tmp_path: Path) -> None:
    whole = render(tmp_path, INVENTORY)["config"]
    limited = render(tmp_path, INVENTORY, limit="router-1")["config"]
    assert {**limited, "rule_files": []} == {**whole, "rule_files": []}


def test_no_router_group_extra_scrape_configs_and_intervals(tmp_path: Path) -> None:
    inventory = {k: v for k, v in INVENTORY.items() if k != "routers"}
    extra = [{"job_name": "node", "static_configs": [{"targets": ["10.0.0.11:9100"]}]}]
    config = render(
        tmp_path, inventory, monitoring_extra_scrape_configs=extra, monitoring_scrape_interval="5s"
    )["config"]
    assert set(targets(config)) == {"vllm", "prometheus", "node"}
    assert config["scrape_configs"][-1] == extra[0]
    assert config["global"]["scrape_interval"] == "5s"


def test_an_empty_node_group_still_renders_valid_yaml(tmp_path: Path) -> None:
    inventory = {"monitoring": {"hosts": {"mon-1": {}}}}
    config = render(tmp_path, inventory)["config"]
    assert targets(config) == {"vllm": {}, "prometheus": {"mon-1:9090": ""}}


def test_ipv6_addresses_are_bracketed(tmp_path: Path) -> None:
    inventory = {
        "gpu-nodes": {"hosts": {"gpu-a": {"vllm_fleet_node_address": "fd00::11"}}},
        "monitoring": {"hosts": {"mon-1": {"ansible_host": "fd00::5"}}},
    }
    config = render(tmp_path, inventory)["config"]
    assert targets(config) == {
        "vllm": {"[fd00::11]:8000": "gpu-a"},
        "prometheus": {"[fd00::5]:9090": ""},
    }


def test_a_replica_is_scraped_at_its_leader_only(tmp_path: Path) -> None:
    """Issue 19: a follower serves no API (no /metrics); the leader's target names its replica."""
    inventory = json.loads(json.dumps(INVENTORY))
    nodes = inventory["gpu-nodes"]["hosts"]
    nodes["gpu-a"].update(vllm_fleet_replica="r1", vllm_fleet_replica_rank=0)
    nodes["gpu-b"].update(vllm_fleet_replica="r1", vllm_fleet_replica_rank="1")
    config = render(tmp_path, inventory)["config"]
    assert targets(config)["vllm"] == {"10.0.0.11:8000": "gpu-a", "gpu-c:8000": "gpu-c"}
    (leader,) = [
        g for g in config["scrape_configs"][0]["static_configs"] if "10.0.0.11:8000" in g["targets"]
    ]
    assert leader["labels"] == {"node": "gpu-a", "replica": "r1"}
