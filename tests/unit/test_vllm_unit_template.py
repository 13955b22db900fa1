"""Render the vllm_service unit and env file as the role does, check them with systemd-analyze."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from ansible.parsing.dataloader import DataLoader
from ansible.plugins.loader import filter_loader, init_plugin_loader
from ansible.template import Templar, trust_as_template

ROOT = Path(__file__).resolve().parents[2]
ROLE = ROOT / "roles/vllm_service"
LAUNCHER = "/usr/local/lib/vllm-fleet/vllm_replica.py"
LAUNCHER_SHA = hashlib.sha256((ROLE / "files/vllm_replica.py").read_bytes()).hexdigest()


def _trust(data: Any) -> Any:
    """Vars files are trusted templates in a play; mark them so here too."""
    if isinstance(data, str):
        return trust_as_template(data)
    if isinstance(data, dict):
        return {key: _trust(value) for key, value in data.items()}
    if isinstance(data, list):
        return [_trust(value) for value in data]
    return data


@pytest.fixture(scope="module")
def loader() -> DataLoader:
    init_plugin_loader()
    filter_loader.add_directory(str(ROLE / "filter_plugins"))
    return DataLoader()


@pytest.fixture
def venv(tmp_path: Path) -> Path:
    """A venv-shaped dir whose bin/python and bin/vllm exist (systemd-analyze checks ExecStart)."""
    (tmp_path / "venv/bin").mkdir(parents=True)
    os.symlink(sys.executable, tmp_path / "venv/bin/python")
    os.symlink(sys.executable, tmp_path / "venv/bin/vllm")
    return tmp_path / "venv"


def render(loader: DataLoader, template: str, **overrides: Any) -> str:
    variables: dict[str, Any] = {}
    for path in (
        ROLE / "defaults/main.yml",
        ROOT / "roles/vllm_fleet/defaults/main.yml",
        ROOT / "roles/vllm_fleet/vars/main.yml",
        ROOT / "playbooks/models/kimi-k2.5-nvfp4.yml",
        ROLE / "vars/main.yml",
    ):
        variables.update(_trust(loader.load_from_file(str(path))))
    variables.update({"inventory_hostname": "node1", "__vllm_service_limit_nofile": 20000})
    # Where a role task looks up files/ (the launcher digest in the unit).
    variables["ansible_search_path"] = [str(ROLE)]
    variables.update(overrides)
    text = (ROLE / "templates" / template).read_text()
    return Templar(loader=loader, variables=variables).template(trust_as_template(text))


def directive(unit: str, key: str) -> list[str]:
    return [line.split("=", 1)[1] for line in unit.splitlines() if line.startswith(f"{key}=")]


def test_kimi_unit_has_plan_args_env_and_restart_policy(loader: DataLoader, venv: Path) -> None:
    plan = {
        "nccl_env": {"NCCL_PROTO": "LL", "NCCL_P2P_LEVEL": "SYS"},
    }
    unit = render(
        loader,
        "vllm.service.j2",
        vllm_fleet_plan=plan,
        vllm_fleet_venv=str(venv),
        vllm_fleet_port=8001,
    )
    (exec_start,) = directive(unit, "ExecStart")
    # vLLM's supported entry point, the model positional (not the deprecated module).
    assert exec_start.startswith(f"{venv}/bin/vllm serve /srv/vllm-fleet/models/tiny-kimi --")
    assert "--model" not in exec_start and "api_server" not in exec_start
    for expected in (
        "--tensor-parallel-size 8",
        "--served-model-name kimi-k2.5",
        "--port 8001",
        "--tool-call-parser kimi_k2",
        "--reasoning-parser kimi_k2",
        "--enable-auto-tool-choice",
        "--trust-remote-code",
    ):
        assert expected in exec_start
    assert "--kv-cache-dtype" not in exec_start
    assert "--disable-custom-all-reduce" not in exec_start
    env = directive(unit, "Environment")
    assert "NCCL_PROTO=LL" in env
    assert "NCCL_P2P_LEVEL=SYS" in env
    assert "VLLM_ENGINE_READY_TIMEOUT_S=2700" in env
    assert "HF_HUB_OFFLINE=1" in env
    assert directive(unit, "Restart") == ["always"]
    assert directive(unit, "TimeoutStartSec") == ["2700"]
    assert directive(unit, "User") == ["vllm"]
    assert directive(unit, "EnvironmentFile") == ["/etc/vllm-fleet/kimi-k2.5.env"]


def test_p2p_disabled_plan_adds_flag_and_env(loader: DataLoader, venv: Path) -> None:
    plan = {
        "nccl_env": {"NCCL_PROTO": "LL", "NCCL_P2P_DISABLE": "1"},
        "disable_custom_all_reduce": True,
    }
    unit = render(loader, "vllm.service.j2", vllm_fleet_plan=plan, vllm_fleet_venv=str(venv))
    (exec_start,) = directive(unit, "ExecStart")
    assert exec_start.count("--disable-custom-all-reduce") == 1
    assert "NCCL_P2P_DISABLE=1" in directive(unit, "Environment")


def test_unit_never_carries_secrets(loader: DataLoader, venv: Path) -> None:
    unit = render(
        loader,
        "vllm.service.j2",
        vllm_fleet_venv=str(venv),
        vllm_fleet_api_key="sk-unit-secret",
        vllm_fleet_hf_token="hf_unit_secret",
    )
    assert "sk-unit-secret" not in unit
    assert "hf_unit_secret" not in unit
    env_file = render(
        loader,
        "vllm.env.j2",
        vllm_fleet_api_key="sk-unit-secret",
        vllm_fleet_hf_token="hf_unit_secret",
    )
    assert 'VLLM_API_KEY="sk-unit-secret"' in env_file
    # The engine runs offline and runs the model's code: no hub token unless it needs the hub.
    assert "hf_unit_secret" not in env_file
    assert "HF_HUB_OFFLINE=1" in directive(unit, "Environment")


def test_the_hub_token_reaches_the_engine_only_when_it_needs_the_hub(
    loader: DataLoader, venv: Path
) -> None:
    hub = {"vllm_fleet_hf_token": "hf_unit_secret", "vllm_fleet_engine_needs_hub": True}
    env_file = render(loader, "vllm.env.j2", **hub)
    assert 'HF_TOKEN="hf_unit_secret"' in env_file
    unit = render(loader, "vllm.service.j2", vllm_fleet_venv=str(venv), **hub)
    assert "HF_HUB_OFFLINE=0" in directive(unit, "Environment")
    assert "hf_unit_secret" not in unit


def test_a_replicas_watch_secret_is_in_the_env_file_only(loader: DataLoader, venv: Path) -> None:
    secret = {"vllm_fleet_replica_secret": "watch-unit-secret"}
    assert "watch-unit-secret" not in render(loader, "vllm.env.j2", **secret)
    plan = {"replica": replica(1)}
    env_file = render(loader, "vllm.env.j2", vllm_fleet_plan=plan, **secret)
    assert 'VLLM_FLEET_REPLICA_KEY="watch-unit-secret"' in env_file
    unit = render(
        loader, "vllm.service.j2", vllm_fleet_plan=plan, vllm_fleet_venv=str(venv), **secret
    )
    assert "watch-unit-secret" not in unit


def test_the_unit_and_the_bench_share_one_sandbox(loader: DataLoader, venv: Path) -> None:
    unit = render(loader, "vllm.service.j2", vllm_fleet_venv=str(venv))
    properties = loader.load_from_file(str(ROLE / "vars/main.yml"))["__vllm_service_sandbox"]
    assert "ProtectSystem=strict" in properties and "SystemCallFilter=~@privileged" in properties
    assert all(f"\n{p}\n" in unit for p in properties), unit
    bench = (ROLE / "tasks/bench.yml").read_text()
    assert "product(__vllm_service_sandbox)" in bench and "'User=' ~ vllm_service_user" in bench


def test_kv_cache_dtype_and_cpu_bind_only_when_set(loader: DataLoader, venv: Path) -> None:
    unit = render(
        loader,
        "vllm.service.j2",
        vllm_fleet_venv=str(venv),
        vllm_service_kv_cache_dtype="fp8",
        vllm_service_cpu_bind="1",
    )
    assert "--kv-cache-dtype fp8" in directive(unit, "ExecStart")[0]
    assert "VLLM_CPU_OMP_THREADS_BIND=1" in directive(unit, "Environment")


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed here"
)
def test_rendered_unit_passes_systemd_analyze_verify(
    loader: DataLoader, venv: Path, tmp_path: Path
) -> None:
    engine_args = {
        "enforce-eager": True,
        "compilation-config": {"level": 0, "note": "a b"},
        "chat-template": 'it\'s "$HOME" 100% \\',
    }
    unit = render(
        loader,
        "vllm.service.j2",
        vllm_fleet_venv=str(venv),
        vllm_fleet_engine_args=engine_args,
        vllm_fleet_engine_env={"SPACED": "a b", "PCT": "5%"},
    )
    path = tmp_path / "vllm-kimi-k2.5.service"
    path.write_text(unit)
    result = subprocess.run(
        ["systemd-analyze", "verify", str(path)], capture_output=True, text=True, check=False
    )
    problems = [line for line in result.stderr.splitlines() if "vllm-kimi-k2.5.service" in line]
    assert result.returncode == 0, result.stderr
    assert not problems, problems


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed here"
)
def test_verify_catches_a_broken_unit(tmp_path: Path) -> None:
    """The check the role's validate: runs does fail on bad quoting (not a no-op)."""
    path = tmp_path / "broken.service"
    path.write_text('[Service]\nExecStart=/bin/true "unbalanced\n')
    result = subprocess.run(
        ["systemd-analyze", "verify", str(path)], capture_output=True, check=False
    )
    assert result.returncode != 0


def test_unit_is_sandboxed_but_keeps_what_gpus_need(loader: DataLoader, venv: Path) -> None:
    unit = render(
        loader,
        "vllm.service.j2",
        vllm_fleet_venv=str(venv),
        vllm_fleet_model_dir="/mnt/models/kimi 100%",
    )
    assert directive(unit, "RequiresMountsFor") == ['"/mnt/models/kimi 100%%"']
    assert directive(unit, "UMask") == ["0077"]
    assert directive(unit, "ProtectSystem") == ["strict"]
    assert directive(unit, "CapabilityBoundingSet") == [""]
    # GPUs: /dev/nvidia* stays reachable and JIT compilers may map W+X memory.
    for absent in ("PrivateDevices", "DevicePolicy", "MemoryDenyWriteExecute", "PrivateUsers"):
        assert directive(unit, absent) == [], absent


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed here"
)
def test_systemd_rates_the_unit_exposure_ok(loader: DataLoader, venv: Path, tmp_path: Path) -> None:
    """The same rating the Molecule scenario asserts on the installed unit."""
    path = tmp_path / "vllm-kimi-k2.5.service"
    path.write_text(render(loader, "vllm.service.j2", vllm_fleet_venv=str(venv)))
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", "--no-pager", str(path)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if "--offline" in result.stderr:
        pytest.skip("this systemd-analyze has no --offline (systemd < 250)")
    score = float(result.stdout.rsplit("exposure level for", 1)[1].split(":")[1].split()[0])
    assert score <= 4.5, result.stdout


def replica(rank: int) -> dict[str, Any]:
    """A node's plan.replica as preflight's vllm_fleet_plan returns it."""
    return {
        "name": "r1", "nodes": 2, "rank": rank, "leader": "10.0.0.11",
        "leader_ip": "10.0.0.11", "port": 29501, "watch_port": 29502, "leader_host": "gpu-a",
        "api_port": 8000, "host_ip": f"10.0.0.1{rank + 1}", "ifname": "eth1",
        "env": {"VLLM_HOST_IP": f"10.0.0.1{rank + 1}", "NCCL_SOCKET_IFNAME": "eth1",
                "GLOO_SOCKET_IFNAME": "eth1"},
    }  # fmt: skip


def test_a_replica_leader_serves_and_a_follower_runs_headless(
    loader: DataLoader, venv: Path
) -> None:
    """Issue 19: vLLM's own multi-node launch through the replica launcher."""
    units = {
        rank: render(
            loader,
            "vllm.service.j2",
            vllm_fleet_plan={"replica": replica(rank)},
            vllm_fleet_venv=str(venv),
        )
        for rank in (0, 1)
    }
    launch = "--nnodes 2 --node-rank {} --master-addr 10.0.0.11 --master-port 29501"
    (leader,) = directive(units[0], "ExecStart")
    # After `--`, vllm serve's arguments, the model first (the launcher adds `serve`).
    model = "/srv/vllm-fleet/models/tiny-kimi"
    assert leader.startswith(
        f"{venv}/bin/python {LAUNCHER} leader 10.0.0.11:29502 node1 -- {model} --"
    )
    assert launch.format(0) in leader and "--port 8000" in leader
    (follower,) = directive(units[1], "ExecStart")
    assert follower.startswith(
        f"{venv}/bin/python {LAUNCHER} follower 10.0.0.11:29502 node1 -- {model} --"
    )
    assert "--headless" not in follower  # the launcher adds it to vllm serve
    assert launch.format(1) in follower and "--tensor-parallel-size 8" in follower
    # A follower serves no API.
    assert "--port" not in follower and "--host" not in follower
    for rank, unit in units.items():
        env = directive(unit, "Environment")
        assert f"VLLM_HOST_IP=10.0.0.1{rank + 1}" in env and "NCCL_SOCKET_IFNAME=eth1" in env
        assert "GLOO_SOCKET_IFNAME=eth1" in env
        # The launcher's digest is in the unit: a new launcher restarts the node.
        assert f"{LAUNCHER} sha256 {LAUNCHER_SHA}" in unit
        assert directive(unit, "Restart") == ["always"]
    assert directive(units[1], "Description") == [
        "vLLM follower (rank 1, headless) server for kimi-k2.5"
    ]
    # A node alone: the API server as before, no launcher.
    alone = render(loader, "vllm.service.j2", vllm_fleet_venv=str(venv))
    assert directive(alone, "ExecStart")[0].startswith(f"{venv}/bin/vllm serve {model} --")
    assert "nnodes" not in alone and LAUNCHER not in alone


def sandbox(unit: str) -> list[str]:
    """The unit's [Service] lines but what runs and its environment (the sandbox)."""
    service = unit.split("[Service]", 1)[1].split("[Install]", 1)[0]
    return [
        line
        for line in service.splitlines()
        if line and not line.startswith(("#", "ExecStart=", "Environment="))
    ]


def test_a_ray_replica_runs_head_and_worker_in_the_same_sandboxed_unit(
    loader: DataLoader, venv: Path, tmp_path: Path
) -> None:
    """Issue 19, executor ray: the leader's unit starts the Ray head and the API
    server on it, a follower's unit a Ray worker; the sandbox is the mp unit's."""
    units = {
        (executor, rank): render(
            loader,
            "vllm.service.j2",
            vllm_fleet_plan={
                "replica": {**replica(rank), "executor": executor},
            },
            vllm_fleet_venv=str(venv),
        )
        for executor in ("mp", "ray")
        for rank in (0, 1)
    }
    (head,) = directive(units["ray", 0], "ExecStart")
    assert head.startswith(f"{venv}/bin/python {LAUNCHER} ray-head 10.0.0.11:29502 node1 -- ")
    assert "--distributed-executor-backend ray" in head and "--tensor-parallel-size 8" in head
    assert "--port 8000" in head
    # Ray places the ranks itself: none of vLLM's own launch arguments.
    for launch in ("--nnodes", "--node-rank", "--master-addr", "--master-port", "--headless"):
        assert launch not in head
    (worker,) = directive(units["ray", 1], "ExecStart")
    assert worker == f"{venv}/bin/python {LAUNCHER} ray-worker 10.0.0.11:29502 node1 --"
    for rank in (0, 1):
        env = directive(units["ray", rank], "Environment")
        assert "RAY_ADDRESS=10.0.0.11:29501" in env and "RAY_USAGE_STATS_ENABLED=0" in env
        assert f"VLLM_HOST_IP=10.0.0.1{rank + 1}" in env
        assert not any(e.startswith("RAY_") for e in directive(units["mp", rank], "Environment"))
        # The same hardening, line for line, as the mp unit of the same rank.
        assert sandbox(units["ray", rank]) == sandbox(units["mp", rank])
        assert "ProtectSystem=strict" in sandbox(units["ray", rank])
    assert "--distributed-executor-backend" not in directive(units["mp", 0], "ExecStart")[0]
    # Ray's token: RAY_AUTH_MODE in the unit, the token only in the 0600 file.
    token = "ray-token-" + "5" * 24
    for rank in (0, 1):
        assert "RAY_AUTH_MODE=token" in directive(units["ray", rank], "Environment")
        assert token not in units["ray", rank]
        env_file = render(
            loader,
            "vllm.env.j2",
            vllm_fleet_plan={"replica": {**replica(rank), "executor": "ray"}},
            vllm_fleet_ray_token=token,
        )
        assert f'RAY_AUTH_TOKEN="{token}"' in env_file.splitlines()
        mp_env = render(
            loader,
            "vllm.env.j2",
            vllm_fleet_plan={"replica": replica(rank)},
            vllm_fleet_ray_token=token,
        )
        assert "RAY_AUTH_TOKEN" not in mp_env
    assert directive(units["ray", 1], "Description") == [
        "vLLM follower (rank 1, Ray worker) server for kimi-k2.5"
    ]
    if shutil.which("systemd-analyze"):
        for rank in (0, 1):
            path = tmp_path / f"ray{rank}.service"
            path.write_text(units["ray", rank])
            result = subprocess.run(
                ["systemd-analyze", "verify", str(path)], capture_output=True, text=True,
                check=False,
            )  # fmt: skip
            assert result.returncode == 0, result.stderr


def test_the_server_binds_the_fleet_address_and_asks_the_key_everywhere(
    loader: DataLoader, venv: Path
) -> None:
    """vLLM (and its /metrics) on the node's fleet address only, with the key guard."""
    guard = "/usr/local/lib/vllm-fleet/vllm_fleet_auth.py"
    guard_sha = hashlib.sha256((ROLE / "files/vllm_fleet_auth.py").read_bytes()).hexdigest()
    unit = render(loader, "vllm.service.j2", vllm_fleet_venv=str(venv), ansible_host="10.0.0.11")
    (argv,) = directive(unit, "ExecStart")
    assert "--host 10.0.0.11 " in argv and "0.0.0.0" not in unit
    assert "--middleware vllm_fleet_auth.RequireKey" in argv
    assert "PYTHONPATH=/usr/local/lib/vllm-fleet" in directive(unit, "Environment")
    # The guard's digest is in the unit: a new guard restarts the server.
    assert f"{guard} sha256 {guard_sha}" in unit
    named = render(
        loader,
        "vllm.service.j2",
        vllm_fleet_venv=str(venv),
        ansible_host="10.0.0.11",
        vllm_fleet_node_address="192.168.7.11",
    )
    assert "--host 192.168.7.11 " in directive(named, "ExecStart")[0]
    follower = render(
        loader,
        "vllm.service.j2",
        vllm_fleet_plan={"replica": replica(1)},
        vllm_fleet_venv=str(venv),
    )
    assert "--middleware" not in directive(follower, "ExecStart")[0] and guard not in follower


@pytest.mark.parametrize(
    ("version", "drain", "argument", "stop"),
    [
        # vLLM 0.18.0 and later drain on SIGTERM: one number for the drain and the stop.
        ("0.34.0", 120, "--shutdown-timeout 120", "150"),
        ("0.18.0", 45, "--shutdown-timeout 45", "75"),
        # Older ones have no such option (it would fail the start): no argument,
        # no drain to wait for.
        ("0.17.1", 120, None, "30"),
        # 0: a stop aborts the requests, as vLLM's default does.
        ("0.34.0", 0, None, "30"),
    ],
)
def test_a_stop_drains_the_requests_in_flight_where_vllm_can(
    loader: DataLoader, venv: Path, version: str, drain: int, argument: str | None, stop: str
) -> None:
    """Issue 35: --shutdown-timeout is the fleet's vllm_fleet_drain_s, TimeoutStopSec that
    plus the margin, and a stop sends SIGTERM to vLLM's API server alone and waits for it
    (ExecStop) before systemd signals what is left of the unit (KillMode's default).
    Without a drain, systemd's own stop (SIGTERM to all) within the margin."""
    unit = render(
        loader, "vllm.service.j2", vllm_fleet_venv=str(venv),
        vllm_fleet_vllm_version=version, vllm_fleet_drain_s=drain,
    )  # fmt: skip
    (argv,) = directive(unit, "ExecStart")
    assert directive(unit, "TimeoutStopSec") == [stop]
    assert directive(unit, "KillMode") == []
    if not argument:
        assert "--shutdown-timeout" not in argv and directive(unit, "ExecStop") == []
        return
    assert f" {argument}" in argv
    (stop_command,) = directive(unit, "ExecStop")
    assert stop_command.startswith('/bin/sh -c \'kill -TERM "$$MAINPID"')
    assert 'while kill -0 "$$MAINPID"' in stop_command


@pytest.mark.parametrize("rank", [0, 1])
def test_a_replica_node_does_not_drain_on_sigterm(
    loader: DataLoader, venv: Path, rank: int
) -> None:
    """A multi-node engine cannot finish its requests once one of its nodes stops, and a
    node whose peer is gone waited out the whole TimeoutStopSec in its collectives (the
    CI's replica tests: 150 s a stop). The rolling path drains the leader from the
    routers first; the unit stops within the margin."""
    unit = render(
        loader, "vllm.service.j2", vllm_fleet_plan={"replica": replica(rank)},
        vllm_fleet_venv=str(venv), vllm_fleet_vllm_version="0.34.0", vllm_fleet_drain_s=120,
    )  # fmt: skip
    assert "--shutdown-timeout" not in directive(unit, "ExecStart")[0]
    assert directive(unit, "ExecStop") == [] and directive(unit, "TimeoutStopSec") == ["30"]
