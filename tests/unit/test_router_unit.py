"""roles/vllm_router's unit and membership, rendered as the role does.

The worker URLs reach the unit's argv as quoted words (no environment
variable split by systemd), only the inventory's nodes are members (a URL
added behind the toolkit's back is not), a URL that is not http(s)://host:port
is caught, and the sandbox rates like the vLLM unit's.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
from ansible.parsing.dataloader import DataLoader
from ansible.plugins.loader import init_plugin_loader
from ansible.template import Templar, trust_as_template

ROOT = Path(__file__).resolve().parents[2]
ROLE = ROOT / "roles/vllm_router"
UNIT = "vllm-router.service"
GOOD = ["http://10.0.0.11:8000", "http://gpu-b:8100", "http://[fd00::12]:8000"]


def trusted(value: Any) -> Any:
    """A loaded value with every string in it a template, as a role's vars are."""
    if isinstance(value, str):
        return trust_as_template(value)
    if isinstance(value, dict):
        return {k: trusted(v) for k, v in value.items()}
    if isinstance(value, list):
        return [trusted(v) for v in value]
    return value


def templar(**overrides: Any) -> Templar:
    init_plugin_loader()
    loader = DataLoader()
    variables: dict[str, Any] = {}
    for path in (
        ROOT / "roles/vllm_fleet/defaults/main.yml",
        ROLE / "defaults/main.yml",
        ROLE / "vars/main.yml",
    ):
        data = loader.load_from_file(str(path))
        variables.update(trusted(data))
    variables.update(
        {
            "inventory_hostname": "router-1",
            "ansible_host": "10.0.0.10",
            "vllm_fleet_served_name": "kimi-k2.5",
            "groups": {"gpu-nodes": []},
            "hostvars": {},
        }
    )
    variables.update(overrides)
    return Templar(loader=loader, variables=variables)


def render(workers: list[str], **overrides: Any) -> str:
    text = (ROLE / "templates" / f"{UNIT}.j2").read_text()
    return templar(__vllm_router_unit_workers=workers, **overrides).template(
        trust_as_template(text)
    )


def argv(unit: str) -> list[str]:
    (line,) = [line for line in unit.splitlines() if line.startswith("ExecStart=")]
    # systemd's quoting of these words (no escapes, no specifiers) is the shell's.
    return shlex.split(line.removeprefix("ExecStart="))


def test_the_workers_are_quoted_arguments_not_an_environment_variable() -> None:
    unit = render(GOOD)
    assert "EnvironmentFile" not in unit and "$" not in unit
    words = argv(unit)
    assert words[words.index("--worker-urls") + 1 :] == GOOD
    assert words[words.index("--prometheus-host") + 1] == "10.0.0.10"


def members(nodes: dict[str, dict[str, Any]], live: list[str]) -> list[str]:
    hostvars = {name: {"inventory_hostname": name, **v} for name, v in nodes.items()}
    variables = {
        "groups": {"gpu-nodes": list(nodes)},
        "hostvars": hostvars,
        "__vllm_router_live": {"json": {"urls": live}},
    }
    t = templar(**variables)
    return list(t.template(trust_as_template("{{ __vllm_router_members }}")))


def test_the_members_are_the_inventorys_nodes_only() -> None:
    nodes = {
        # In this run, healthy at the routers' URL.
        "gpu-a": {"vllm_router_probe": {"status": 200, "url": "http://10.0.0.11:8000/health"}},
        # In this run, failed its rollout: stays out.
        "gpu-b": {"vllm_router_probe": {"status": 200, "url": "http://10.0.0.12:8000/health"},
                  "vllm_router_keep_out": "http://10.0.0.12:8000"},
        # Outside this run (-l): keeps its place if the router has it.
        "gpu-c": {"ansible_host": "10.0.0.13", "vllm_service_port": 8100},
        "gpu-d": {"ansible_host": "10.0.0.14"},
        # A replica's follower serves no API.
        "gpu-e": {"ansible_host": "10.0.0.15", "vllm_fleet_replica_rank": 1},
    }  # fmt: skip
    live = [
        "http://10.0.0.12:8000",
        "http://10.0.0.13:8100",
        "http://10.0.0.15:8000",
        # Added behind the toolkit's back.
        "http://10.6.6.6:8000",
    ]
    assert members(nodes, live) == ["http://10.0.0.11:8000", "http://10.0.0.13:8100"]


@pytest.mark.parametrize(
    "url",
    [
        "http://10.0.0.11:8000\nVLLM_ROUTER_EVIL=1",
        "http://10.0.0.11:8000 --policy random",
        'http://10.0.0.11:8000"',
        "http://10.0.0.11:8000/v1",
        "ftp://10.0.0.11:8000",
        "http://10.0.0.11",
        "http://$HOST:8000",
        "http://10.0.0.11:80%n",
    ],
)
def test_a_url_that_is_not_scheme_host_port_is_caught(url: str) -> None:
    pattern = templar().template(trust_as_template("{{ __vllm_router_url_re }}"))
    assert not re.match(pattern, url)
    assert all(re.match(pattern, good) for good in GOOD)


def score(path: Path) -> float:
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", "--no-pager", str(path)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if "--offline" in result.stderr:
        pytest.skip("this systemd-analyze has no --offline (systemd < 250)")
    return float(result.stdout.rsplit("exposure level for", 1)[1].split(":")[1].split()[0])


def test_systemd_rates_the_router_unit_like_the_vllm_unit(tmp_path: Path) -> None:
    path = tmp_path / UNIT
    path.write_text(render(GOOD))
    assert score(path) <= 4.5
