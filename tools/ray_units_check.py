#!/usr/bin/env python3
"""A real check of the Ray executor's units on two container nodes (issue 19).

vLLM's CPU platform runs no Ray executor (``current platform cpu does not
support ray``), so no test fleet here can serve a model over Ray. What can run
here runs for real: two systemd container nodes (the e2e node image), Ray
from PyPI wheels in a venv on each, the replica launcher and the units that
role vllm_service renders for ``executor: ray`` (leader rank 0, follower rank
1), with their whole sandbox. The vLLM API server is the one part that is not
real: a module named ``vllm.entrypoints.cli.main`` (what ``vllm serve``
runs) in that venv STANDS IN for it (it joins the Ray cluster at RAY_ADDRESS as vLLM's Ray
executor does, logs the cluster's alive nodes, then sleeps).

It shows: the follower's Ray worker joins the leader's Ray head (two alive
nodes, ``ray status`` with the cluster token from the 0600 environment file
the role renders), a client with a wrong token is refused, and a killed worker takes
the leader down with the follower named in its journal, after which systemd
brings both back and the cluster has two nodes again.

    python3 tools/ray_units_check.py --wheels DIR [--keep]

DIR holds ray and its dependencies as wheels (``pip download ray==2.60.0``).
Not part of CI (minutes, and about 90 MB of wheels); its output is evidence
for the issue's note.
"""

from __future__ import annotations

import argparse
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ansible.parsing.dataloader import DataLoader  # noqa: E402
from ansible.plugins.loader import filter_loader, init_plugin_loader  # noqa: E402

from tests.support import fleet as fleet_mod  # noqa: E402
from tests.unit import test_vllm_unit_template as unit_test  # noqa: E402

PREFIX = "vf-ray"
VENV = "/opt/ray-venv"
PORT = 6399  # the rendezvous port: the Ray head's; the watch port is the next one
UNIT = "vllm-kimi-k2.5"
LAUNCHER = "/usr/local/lib/vllm-fleet/vllm_replica.py"
ENV_FILE = "/etc/vllm-fleet/kimi-k2.5.env"
TOKEN = "ray-" + secrets.token_hex(16)
STAND_IN = '''"""STAND-IN for vLLM's CLI (`vllm serve`; no vLLM here): tools/ray_units_check.py."""
import os, sys, time
import ray
print("stand-in api_server: argv", sys.argv[1:], flush=True)
ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
while True:
    alive = [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]]
    print(f"stand-in api_server: Ray cluster has {len(alive)} alive node(s)", flush=True)
    time.sleep(5)
'''


def sh(node: str, *argv: str, check: bool = True) -> str:
    return fleet_mod.podman("exec", node, *argv, check=check).stdout


def write(node: str, path: str, text: str) -> None:
    subprocess.run(
        ["podman", "exec", "-i", node, "sh", "-c", f"cat > '{path}'"],
        input=text, text=True, check=True, env=fleet_mod.podman_env(),
    )  # fmt: skip


def install_ray(node: str, wheels: Path) -> None:
    fleet_mod.podman("cp", str(wheels), f"{node}:/tmp/raywheels")
    # As role vllm_install does: Debian's python3 needs python3-venv for ensurepip.
    sh(node, "sh", "-c", "apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null")
    sh(node, "python3", "-m", "venv", VENV)
    sh(node, f"{VENV}/bin/pip", "install", "--quiet", "--no-index", "--find-links",
       "/tmp/raywheels", "ray==2.60.0")  # fmt: skip
    site = sh(node, f"{VENV}/bin/python", "-c", "import site; print(site.getsitepackages()[0])")
    module = Path(site.strip()) / "vllm/entrypoints/cli"
    sh(node, "mkdir", "-p", str(module))
    for package in ("vllm", "vllm/entrypoints", "vllm/entrypoints/cli"):
        sh(node, "touch", str(Path(site.strip()) / package / "__init__.py"))
    write(node, f"{module}/main.py", STAND_IN)


def replica(rank: int) -> dict[str, Any]:
    return {
        "name": "r1", "nodes": 2, "rank": rank, "leader": "127.0.0.1", "leader_ip": "127.0.0.1",
        "port": PORT, "watch_port": PORT + 1, "leader_host": f"{PREFIX}1", "api_port": 8399,
        "host_ip": "127.0.0.1", "ifname": "lo", "executor": "ray",
        "env": {"VLLM_HOST_IP": "127.0.0.1", "NCCL_SOCKET_IFNAME": "lo",
                "GLOO_SOCKET_IFNAME": "lo"},
    }  # fmt: skip


def install_unit(node: str, rank: int) -> str:
    init_plugin_loader()
    filter_loader.add_directory(str(ROOT / "roles/vllm_service/filter_plugins"))
    text = unit_test.render(
        DataLoader(),
        "vllm.service.j2",
        inventory_hostname=node,
        vllm_fleet_plan={"replica": replica(rank)},
        vllm_fleet_tensor_parallel_size=2,
        vllm_fleet_venv=VENV,
        vllm_fleet_port=8399,
        vllm_fleet_model_dir="/srv/models/kimi",
    )
    write(node, f"/etc/systemd/system/{UNIT}.service", text)
    sh(node, "mkdir", "-p", "/etc/vllm-fleet", "/srv/models/kimi", str(Path(LAUNCHER).parent))
    secrets_file = unit_test.render(
        DataLoader(),
        "vllm.env.j2",
        vllm_fleet_plan={"replica": replica(rank)},
        vllm_fleet_ray_token=TOKEN,
    )
    sh(node, "sh", "-c", f"install -m 0600 /dev/null {ENV_FILE}")
    write(node, ENV_FILE, secrets_file)
    sh(node, "sh", "-c", "id vllm || useradd --system --user-group --no-create-home vllm")
    fleet_mod.podman("cp", str(ROOT / "roles/vllm_service/files/vllm_replica.py"),
                     f"{node}:{LAUNCHER}")  # fmt: skip
    sh(node, "systemctl", "daemon-reload")
    return text


def journal(node: str, since: str = "") -> str:
    argv = ["journalctl", "--no-pager", "-o", "short-iso", "-u", f"{UNIT}.service"]
    return sh(node, *argv, *([f"--since={since}"] if since else []), check=False)


def wait_for(node: str, text: str, timeout: float = 180, since: str = "") -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = journal(node, since)
        if text in found:
            return found
        time.sleep(3)
    raise SystemExit(f"{node}: no {text!r} in its journal within {timeout:.0f} s:\n"
                     f"{journal(node, since)[-4000:]}")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheels", type=Path, required=True)
    parser.add_argument("--keep", action="store_true", help="leave the nodes running")
    opts = parser.parse_args()
    fleet = fleet_mod.up(2, prefix=PREFIX, fresh=True)
    leader, follower = fleet.nodes
    try:
        for rank, node in enumerate((leader, follower)):
            install_ray(node, opts.wheels)
            unit = install_unit(node, rank)
            print(
                f"== {node}: ExecStart",
                [ln for ln in unit.splitlines() if ln.startswith("ExecStart")],
            )
        # The follower first: its worker waits for the leader's watch port.
        sh(follower, "systemctl", "start", UNIT)
        time.sleep(3)
        sh(leader, "systemctl", "start", UNIT)
        wait_for(leader, "Ray cluster has 2 alive node(s)")
        status = [f"{VENV}/bin/ray", "status", "--address", f"127.0.0.1:{PORT}"]
        print(f"== ray status on {leader} (RAY_AUTH_MODE=token, the token from {ENV_FILE})")
        print(sh(leader, "env", "RAY_AUTH_MODE=token", f"RAY_AUTH_TOKEN={TOKEN}", *status))
        wrong = fleet_mod.podman(
            "exec", follower, "env", "RAY_AUTH_MODE=token", "RAY_AUTH_TOKEN=wrong", *status,
            check=False,
        )  # fmt: skip
        print(f"== ray status on {follower} with a wrong token: rc {wrong.returncode}")
        print("\n".join((wrong.stdout + wrong.stderr).strip().splitlines()[-4:]))
        if wrong.returncode == 0:
            raise SystemExit("a client with a wrong token reached the Ray cluster")
        for node in (leader, follower):
            print(f"== journal of {node}\n{journal(node)}")
            if TOKEN in journal(node) + sh(node, "cat", f"/etc/systemd/system/{UNIT}.service"):
                raise SystemExit(f"{node}: the Ray token is in the journal or the unit")
        since = sh(leader, "date", "+%Y-%m-%d %H:%M:%S").strip()
        sh(follower, "systemctl", "kill", "--signal=KILL", "--kill-whom=main", UNIT)
        wait_for(leader, "is gone", since=since, timeout=120)
        wait_for(leader, "Ray cluster has 2 alive node(s)", since=since, timeout=300)
        for node in (leader, follower):
            state = sh(node, "systemctl", "show", "-p", "NRestarts,ActiveState", UNIT)
            print(
                f"== {node} after the follower was killed: {state.split()}\n{journal(node, since)}"
            )
        return 0
    finally:
        if not opts.keep:
            fleet_mod.down(PREFIX)


if __name__ == "__main__":
    sys.exit(main())
