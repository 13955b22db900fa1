"""validate.yml refuses a worker URL the routers would write into their unit.

A real ansible-playbook run of the validate play on the controller (no
containers, no vLLM): a node address with a newline or spaces is refused by
node, before any play changes anything.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def validate(tmp_path: Path, address: str) -> subprocess.CompletedProcess[str]:
    local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    inventory = {
        "gpu-nodes": {
            "hosts": {"node-a": {"vllm_fleet_node_address": address}, "node-b": {}},
            "vars": local,
        },
        "routers": {"hosts": {"node-b": {}}},
    }
    (tmp_path / "hosts.yml").write_text(yaml.safe_dump(inventory))
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg")}
    return subprocess.run(
        [str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(tmp_path / "hosts.yml"),
         str(ROOT / "playbooks/validate.yml")],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300, check=False,
    )  # fmt: skip


@pytest.mark.parametrize("address", ["10.0.0.11\nVLLM_ROUTER_EVIL=1", "10.0.0.11 --policy random"])
def test_a_worker_url_with_a_newline_or_spaces_is_refused(tmp_path: Path, address: str) -> None:
    done = validate(tmp_path, address)
    assert done.returncode != 0
    assert "vllm_fleet_worker_url of node-a is" in done.stdout + done.stderr
    assert "not http(s)://host:port" in done.stdout + done.stderr


def test_a_plain_address_passes(tmp_path: Path) -> None:
    done = validate(tmp_path, "10.0.0.11")
    assert done.returncode == 0, done.stdout[-3000:]
