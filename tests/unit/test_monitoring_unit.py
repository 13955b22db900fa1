"""roles/monitoring's Prometheus unit, rendered as the role does: its address and its sandbox."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from ansible.parsing.dataloader import DataLoader
from ansible.plugins.loader import init_plugin_loader
from ansible.template import Templar, trust_as_template

ROOT = Path(__file__).resolve().parents[2]
ROLE = ROOT / "roles/monitoring"
UNIT = "vllm-fleet-prometheus.service"


def render(**overrides: Any) -> str:
    init_plugin_loader()
    loader = DataLoader()
    variables: dict[str, Any] = {}
    for path in (
        ROOT / "roles/vllm_fleet/defaults/main.yml",
        ROLE / "defaults/main.yml",
        ROLE / "vars/main.yml",
    ):
        data = loader.load_from_file(str(path))
        variables.update(
            {k: trust_as_template(v) if isinstance(v, str) else v for k, v in data.items()}
        )
    variables.update({"inventory_hostname": "mon-1", "vllm_fleet_served_name": "kimi-k2.5"})
    variables.update(overrides)
    text = (ROLE / "templates" / f"{UNIT}.j2").read_text()
    return Templar(loader=loader, variables=variables).template(trust_as_template(text))


def exec_start(unit: str) -> str:
    (line,) = [line for line in unit.splitlines() if line.startswith("ExecStart=")]
    return line


def test_prometheus_listens_on_the_fleet_address_only() -> None:
    assert "--web.listen-address=10.0.0.10:9090" in exec_start(render(ansible_host="10.0.0.10"))
    assert "--web.listen-address=[fd00::5]:9090" in exec_start(render(ansible_host="fd00::5"))
    # A site may still choose all interfaces.
    unit = render(ansible_host="10.0.0.10", monitoring_listen_address="0.0.0.0")
    assert "--web.listen-address=0.0.0.0:9090" in exec_start(unit)


def test_systemd_rates_the_prometheus_unit_like_the_vllm_unit(tmp_path: Path) -> None:
    path = tmp_path / UNIT
    path.write_text(render(ansible_host="10.0.0.10"))
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", "--no-pager", str(path)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if "--offline" in result.stderr:
        pytest.skip("this systemd-analyze has no --offline (systemd < 250)")
    score = float(result.stdout.rsplit("exposure level for", 1)[1].split(":")[1].split()[0])
    assert score <= 4.5, result.stdout
