"""roles/vllm_router's unit and membership, rendered as the role does.

The worker URLs reach the unit's argv as quoted words (no environment
variable split by systemd), only the inventory's nodes are members (a URL
added behind the toolkit's back is not), a URL that is not http(s)://host:port
is caught, and the sandbox rates like the vLLM unit's.
"""

from __future__ import annotations

import datetime as dt
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
from ansible.parsing.dataloader import DataLoader
from ansible.plugins.loader import init_plugin_loader
from ansible.template import Templar, trust_as_template

from tests.support.ansible_module import load_module
from tests.support.tls import site_tls

ROOT = Path(__file__).resolve().parents[2]
ROLE = ROOT / "roles/vllm_router"
UNIT = "vllm-router.service"
vllm_tls_problems = load_module("vllm_fleet_tls", "filter_plugins").vllm_tls_problems
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
        ROOT / "roles/vllm_fleet/vars/main.yml",
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
        "gpu-c": {"ansible_host": "10.0.0.13", "vllm_fleet_port": 8100},
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
    pattern = templar().template(trust_as_template("{{ vllm_fleet_worker_url_re }}"))
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


def render_role_template(name: str, **overrides: Any) -> str:
    text = (ROLE / "templates" / name).read_text()
    return templar(**overrides).template(trust_as_template(text))


def test_the_router_listens_on_loopback_behind_the_endpoint() -> None:
    words = argv(render(GOOD))
    assert words[words.index("--host") + 1] == "127.0.0.1"
    assert words[words.index("--port") + 1] == "30001"
    config = render_role_template("vllm-fleet-endpoint.cfg.j2")
    assert "bind 0.0.0.0:30000\n" in config and " ssl " not in config
    assert "server router 127.0.0.1:30001" in config
    assert "http-request deny deny_status 403 unless inference || health" in config


def test_the_endpoint_terminates_tls_with_the_sites_certificate() -> None:
    tls = site_tls()
    config = render_role_template(
        "vllm-fleet-endpoint.cfg.j2",
        vllm_fleet_router_tls={"cert": tls.cert, "key": tls.key},
        vllm_router_host="10.0.0.10",
        vllm_fleet_router_port=443,
    )
    assert "bind 10.0.0.10:443 ssl crt /etc/vllm-fleet/tls/vllm-fleet-endpoint.pem" in config
    assert "ssl-min-ver TLSv1.2" in config
    # The key goes to its own 0640 file, never into the config.
    assert tls.key.splitlines()[1] not in config


@pytest.mark.parametrize(
    ("path", "passes"),
    [
        ("/v1/completions", True),
        ("/v1/chat/completions", True),
        ("/v1/models", True),
        ("/v1/responses/resp_1.a-b", True),
        ("/add_worker", False),
        ("/list_workers", False),
        ("/workers", False),
        ("/v1/../list_workers", False),
        ("/v1/%2e%2e/list_workers", False),
        ("/v1//x", False),
        ("/v1/./models", False),
        ("/v1", False),
        ("/metrics", False),
    ],
)
def test_clients_reach_the_inference_api_by_plain_paths_only(path: str, passes: bool) -> None:
    pattern = templar().template(trust_as_template("{{ __vllm_router_client_path_re }}"))
    assert bool(re.match(pattern, path)) is passes


def test_a_key_pair_is_checked_before_anything_is_written() -> None:
    tls = site_tls()
    assert vllm_tls_problems({}) == []
    assert vllm_tls_problems({"cert": tls.cert, "key": tls.key}) == []
    wrong = vllm_tls_problems({"cert": tls.cert, "key": tls.other_key})
    assert len(wrong) == 1 and "the key does not match the certificate" in wrong[0]
    later = dt.datetime.now(dt.UTC) + dt.timedelta(days=60)
    expired = vllm_tls_problems({"cert": tls.cert, "key": tls.key}, now=later)
    assert len(expired) == 1 and expired[0].startswith("the certificate expired on")
    assert "not a PEM certificate" in vllm_tls_problems({"cert": "x", "key": tls.key})[0]
    garbled = vllm_tls_problems({"cert": tls.cert, "key": "-----BEGIN PRIVATE KEY-----\nxx"})
    assert "not an unencrypted PEM private key" in garbled[0]
    assert "set both cert and key" in vllm_tls_problems({"cert": tls.cert})[0]
    # A misspelt name is named, and the value under it (a key) is not shown.
    typo = vllm_tls_problems({"cert": tls.cert, "kye": tls.key})
    assert typo == ["unknown entries kye: only cert and key are read"], typo
    for problems in (wrong, garbled):
        assert all(tls.other_key.splitlines()[1] not in p for p in problems)


def test_systemd_rates_the_endpoint_unit_like_the_router_unit(tmp_path: Path) -> None:
    path = tmp_path / "vllm-fleet-endpoint.service"
    path.write_text(render_role_template("vllm-fleet-endpoint.service.j2"))
    assert score(path) <= 4.5
