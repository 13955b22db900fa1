"""The local fleet: podman containers with systemd as PID 1, standing in for GPU nodes.

Each node is a container of the node image (``make hosts``) named
``<prefix><i>`` (``vf-node1`` .. ``vf-nodeN`` by default) with:

- systemd as PID 1 (``--systemd=always``, /sbin/init), booted until
  ``systemctl is-system-running --wait`` says running or degraded;
- the host's network (``--network host``): the hub on 127.0.0.1 and each
  node's ports are reachable from the host, so ports differ per node
  (see :func:`inventory`);
- one shared storage directory of the host bind-mounted at the same path in
  every node (:data:`STORAGE_PATH`, the demo's ``vllm_fleet_storage_root``);
- CAP_SYS_ADMIN, so that systemd applies each unit's sandbox as on a real
  node (the e2e and demo runs serve sandboxed);
- a 1 GiB /dev/shm (vLLM's shared memory), the host's unified cgroup
  hierarchy and host-fitted ulimits (both from ``CONTAINERS_CONF``, written
  by ``tools/hosts/containers-conf.sh``).

Command line (from the repository root)::

    python -m tests.support.fleet up [--nodes N] [--fresh] [--wipe-storage]
    python -m tests.support.fleet down [--wipe-storage]
    python -m tests.support.fleet status
    python -m tests.support.fleet inventory [--nodes N]   # inventory YAML on stdout

From pytest: the session fixture :func:`demo_fleet` brings up a fresh
2-node fleet with empty storage matching ``inventory/demo`` and removes it at
the end; import it into a conftest (``from tests.support.fleet import
demo_fleet``). For other shapes, call :func:`up` / :func:`down` from your own
fixture.

Function API:

- :func:`up` (nodes, prefix, storage_dir, storage_size, fresh, wipe_storage,
  extra_volumes) -> :class:`Fleet`; :func:`down` (prefix) -> removed names.
- :func:`exec_in` (node, argv) runs a command in a node.
- :func:`enable_ssh` (node, port, public_key) starts sshd on the node's own
  port (``vllm_fleet_node_ssh_port`` in the inventory) with root login by that
  key only; ``up(ssh_key=path)`` does it on every node, generating the key
  pair at ``path`` if missing (``--ssh`` on the command line). Then
  ``ssh_inventory`` reaches the nodes with ``ansible_connection: paramiko``.
- Fault injection, for the tests that need a broken fleet:

  - :func:`limit_disk` (node, path, size) mounts a tmpfs of ``size`` over
    ``path`` inside one node, so writes there fail with ENOSPC ("disk full")
    once ``size`` is used; :func:`unlimit_disk` removes it (what was written
    there is gone, what was under it comes back). :func:`disk_limited` is the
    context manager.
  - ``up(storage_size="64m")`` makes the *shared* storage a tmpfs of that size
    on the host, so every node sees the same full disk.
  - :func:`kill_node` (signal, default SIGKILL to the container: the node
    loses power), :func:`stop_node` (clean shutdown), :func:`start_node`
    (boot again, waits for systemd), :func:`pause_node` /
    :func:`resume_node` (the node hangs: alive but unresponsive).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PREFIX = "vf-node"
DEFAULT_NODES = 2
# Where the shared model storage appears in every node (vllm_fleet_storage_root).
STORAGE_PATH = "/srv/vllm-fleet/models"
LABEL = "vllm-fleet.fleet"
# Each node records the host side of its shared storage, for `down`.
STORAGE_LABEL = "vllm-fleet.storage"
BOOT_TIMEOUT_S = 90.0
# The node image's interpreter (Debian bookworm's python3).
NODE_PYTHON = "/usr/bin/python3"
# Per-node ports: nodes share the host network.
BASE_SERVICE_PORT = 8000
BASE_SSH_PORT = 2200
# The demo's fleet endpoint (vllm-router) and its Prometheus exporter.
ROUTER_PORT = 8000
ROUTER_METRICS_PORT = 29000
# vllm-router itself behind the endpoint's proxy, on loopback (its worker API).
ROUTER_ADMIN_PORT = 29001
# The demo's Prometheus (group monitoring), beside the router.
MONITORING_PORT = 29090


class FleetError(RuntimeError):
    """A fleet operation failed; the message says what to do."""


@dataclass(frozen=True)
class Fleet:
    """A running fleet: node names (in order) and its shared storage."""

    prefix: str
    nodes: tuple[str, ...]
    storage_dir: Path
    storage_path: str = STORAGE_PATH
    image: str = ""

    def inventory(self) -> dict:
        """This fleet as an Ansible inventory (see :func:`inventory`)."""
        return inventory(len(self.nodes), self.prefix)


def cache_dir() -> Path:
    """The heavy-artifact cache shared with make (VLLM_FLEET_CACHE)."""
    return Path(os.environ.get("VLLM_FLEET_CACHE") or Path.home() / ".cache" / "vllm-fleet")


def podman_env() -> dict[str, str]:
    """Environment for podman: the host-fitted containers.conf from `make hosts`."""
    env = dict(os.environ)
    if not env.get("CONTAINERS_CONF"):
        conf = cache_dir() / "containers.conf"
        if not conf.is_file():
            raise FleetError(f"{conf} is missing: run `make hosts` first")
        env["CONTAINERS_CONF"] = str(conf)
    return env


def podman(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run podman; on failure raise FleetError with its stderr."""
    proc = subprocess.run(
        ["podman", *args], capture_output=True, text=True, env=podman_env(), check=False
    )
    if check and proc.returncode != 0:
        raise FleetError(f"podman {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc


def node_image() -> str:
    """The node image for the current recipe; it must have been built."""
    image = os.environ.get("VLLM_FLEET_NODE_IMAGE")
    if not image:
        image = subprocess.run(
            [str(ROOT / "tools/hosts/node-image.sh"), "tag"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    if podman("image", "exists", image, check=False).returncode != 0:
        raise FleetError(f"node image {image} is missing: run `make hosts` first")
    return image


def node_names(nodes: int, prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Names of an N-node fleet: vf-node1 .. vf-nodeN."""
    if nodes < 1:
        raise FleetError(f"a fleet needs at least one node, not {nodes}")
    return [f"{prefix}{i}" for i in range(1, nodes + 1)]


def inventory(
    nodes: int = DEFAULT_NODES,
    prefix: str = DEFAULT_PREFIX,
    cpus: int | None = None,
    *,
    router: bool = False,
    monitoring: bool = False,
) -> dict:
    """The fleet as an Ansible YAML inventory (group gpu-nodes).

    Per node: vLLM port 8001.., sshd port 2201.. and its own OpenMP core
    (round robin over `cpus`, default this machine's), since nodes share the
    host's network and CPUs. With ``router``: group routers, vllm-router
    beside the first node on port 8000 (:data:`ROUTER_PORT`): no extra
    container to boot on a machine whose CPUs the nodes already share.
    With ``monitoring``: group monitoring, Prometheus beside it on port
    29090 (:data:`MONITORING_PORT`).
    """
    cpus = cpus or os.cpu_count() or 1
    hosts = {
        name: {
            "vllm_fleet_port": BASE_SERVICE_PORT + i,
            "vllm_service_cpu_bind": str((i - 1) % cpus),
            "vllm_fleet_node_ssh_port": BASE_SSH_PORT + i,
        }
        for i, name in enumerate(node_names(nodes, prefix), start=1)
    }
    groups: dict = {
        "gpu-nodes": {
            "hosts": hosts,
            # Throwaway local containers: no SSH host key to verify.
            "vars": {
                # Pipelined nsenter (connection_plugins/): one process per module run,
                # not several podman ones on the CPUs the nodes share.
                "ansible_connection": "vllm_fleet_container",
                "ansible_host_key_checking": False,
                # The node image's Python: no interpreter discovery, which costs
                # each node two more round trips on every run.
                "ansible_python_interpreter": NODE_PYTHON,
            },
        }
    }
    if router:
        groups["routers"] = {
            "hosts": {
                next(iter(hosts)): {
                    "vllm_fleet_router_port": ROUTER_PORT,
                    "vllm_fleet_router_admin_port": ROUTER_ADMIN_PORT,
                    "vllm_router_prometheus_port": ROUTER_METRICS_PORT,
                }
            }
        }
    if monitoring:
        first = next(iter(hosts))
        groups["monitoring"] = {"hosts": {first: {"vllm_fleet_monitoring_port": MONITORING_PORT}}}
    return groups


def ssh_inventory(nodes: int = DEFAULT_NODES, prefix: str = DEFAULT_PREFIX, *, key: Path) -> dict:
    """:func:`inventory`, but over real SSH (paramiko) to each node's sshd port."""
    inv = inventory(nodes, prefix)
    group = inv["gpu-nodes"]
    for host in group["hosts"].values():
        host["ansible_port"] = host["vllm_fleet_node_ssh_port"]
    group["vars"] = {
        "ansible_connection": "paramiko",
        "ansible_host": "127.0.0.1",
        "ansible_user": "root",
        "ansible_ssh_private_key_file": str(key),
        # Fresh host keys on every test run: nothing to verify them against.
        "ansible_host_key_checking": False,
        "ansible_python_interpreter": NODE_PYTHON,
    }
    return inv


def inventory_yaml(
    nodes: int = DEFAULT_NODES, prefix: str = DEFAULT_PREFIX, cpus: int | None = None
) -> str:
    """:func:`inventory` as the text of inventory/demo/hosts.yml."""
    header = (
        "---\n"
        "# The embedded default fleet: local podman containers with systemd as\n"
        "# PID 1 (make fleet-up / fleet-down). Generated by\n"
        "# `python -m tests.support.fleet inventory`; edit tests/support/fleet.py.\n"
        "# Nodes share the host's network and CPUs, hence per-node ports and cores;\n"
        "# the fleet endpoint (vllm-router, group routers) and Prometheus (group\n"
        "# monitoring) run beside the first node.\n"
    )
    groups = inventory(nodes, prefix, cpus, router=True, monitoring=True)
    return header + yaml.safe_dump(groups, sort_keys=False)


def exec_in(
    node: str, argv: Sequence[str], *, check: bool = True, user: str = "root"
) -> subprocess.CompletedProcess[str]:
    """Run argv inside a node (as root unless told) and return the finished process."""
    return podman("exec", "--user", user, node, *argv, check=check)


def wait_booted(node: str, timeout: float = BOOT_TIMEOUT_S) -> str:
    """Wait until systemd in the node is up; return its state (running/degraded)."""
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        # The bus may not exist for the first instant after start.
        proc = exec_in(node, ["systemctl", "is-system-running", "--wait"], check=False)
        state = proc.stdout.strip()
        if state in ("running", "degraded"):
            return state
        time.sleep(0.5)
    failed = exec_in(node, ["systemctl", "--failed", "--no-legend"], check=False).stdout
    raise FleetError(f"{node}: systemd did not boot in {timeout:.0f}s (state {state!r}); {failed}")


def _inspect(name: str) -> dict | None:
    """Inspect data of an existing container, or None."""
    proc = podman("container", "inspect", name, check=False)
    if proc.returncode != 0:
        return None
    return json.loads(proc.stdout)[0]


def _storage_mounted(storage_dir: Path) -> bool:
    return subprocess.run(["mountpoint", "-q", str(storage_dir)], check=False).returncode == 0


def _prepare_storage(storage_dir: Path, size: str | None, wipe: bool) -> None:
    """Create (or limit, or empty) the host side of the shared storage."""
    storage_dir.mkdir(parents=True, exist_ok=True)
    if _storage_mounted(storage_dir):
        subprocess.run(["umount", str(storage_dir)], check=True)
    if wipe:
        shutil.rmtree(storage_dir)
        storage_dir.mkdir(parents=True)
    if size:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(storage_dir)],
            check=True,
        )


def _start(name: str, image: str, prefix: str, storage_dir: Path, volumes: Sequence[str]) -> None:
    args = [
        "run", "-d", "--name", name, "--hostname", name,
        "--label", f"{LABEL}={prefix}", "--label", f"{STORAGE_LABEL}={storage_dir}",
        "--systemd=always", "--network", "host", "--shm-size=1g",
        # systemd in the node needs it to apply a unit's sandbox (mount
        # namespaces for ProtectSystem, PrivateTmp, PrivateDevices ...);
        # without it systemd skips them and the units run unsandboxed.
        "--cap-add", "SYS_ADMIN",
    ]  # fmt: skip
    for volume in volumes:
        args += ["--volume", volume]
    podman(*args, image, "/sbin/init")


def up(
    nodes: int = DEFAULT_NODES,
    *,
    prefix: str = DEFAULT_PREFIX,
    storage_dir: Path | None = None,
    storage_size: str | None = None,
    fresh: bool = False,
    wipe_storage: bool = False,
    extra_volumes: Sequence[str] = (),
    ssh_key: Path | None = None,
) -> Fleet:
    """Bring up an N-node fleet and wait until every node has booted.

    Nodes already running from the same image are kept unless ``fresh``;
    nodes beyond N with the same prefix are removed. ``storage_dir`` (host
    side of the shared storage) defaults to $VLLM_FLEET_CACHE/fleet/<prefix>/
    storage; ``wipe_storage`` empties it, ``storage_size`` makes it a tmpfs of
    that size (a small disk). ``extra_volumes`` are more podman ``--volume``
    specs for every node (e.g. a read-only wheelhouse). ``ssh_key`` (private
    key path, generated if missing) enables sshd on each node's own port.
    """
    image = node_image()
    names = node_names(nodes, prefix)
    storage_dir = storage_dir or cache_dir() / "fleet" / prefix / "storage"
    existing = existing_nodes(prefix)
    stale = [n for n in existing if fresh or n not in names or _needs_restart(n, image)]
    if stale:
        podman("rm", "--force", "--time", "0", *stale)
    if storage_size or wipe_storage or fresh or not storage_dir.exists():
        if len(stale) < len(existing):
            raise FleetError("cannot change the shared storage under running nodes: use fresh")
        _prepare_storage(storage_dir, storage_size, wipe_storage)
    volumes = [f"{storage_dir}:{STORAGE_PATH}", *extra_volumes]
    for name in names:
        if name in stale or name not in existing:
            _start(name, image, prefix, storage_dir, volumes)
    for name in names:
        wait_booted(name)
    if ssh_key:
        public = ensure_key_pair(ssh_key).with_name(ssh_key.name + ".pub").read_text()
        for i, name in enumerate(names, start=1):
            enable_ssh(name, BASE_SSH_PORT + i, public)
    return Fleet(prefix, tuple(names), storage_dir, STORAGE_PATH, image)


def _needs_restart(name: str, image: str) -> bool:
    info = _inspect(name)
    return not info or not info["State"]["Running"] or info["ImageName"] != image


def existing_nodes(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Containers of the fleet with this prefix, running or not."""
    out = podman("ps", "-a", "--filter", f"label={LABEL}={prefix}", "--format", "{{.Names}}").stdout
    return sorted(out.split())


def down(prefix: str = DEFAULT_PREFIX, *, wipe_storage: bool = False) -> list[str]:
    """Remove every node of the fleet at once (no stop timeout); return their names.

    The shared storage stays (a later ``up`` reuses the downloaded model)
    unless ``wipe_storage``; a tmpfs from ``storage_size`` is unmounted.
    """
    names = existing_nodes(prefix)
    storage_dirs = {cache_dir() / "fleet" / prefix / "storage"}
    for name in names:
        labels = (_inspect(name) or {}).get("Config", {}).get("Labels") or {}
        if labels.get(STORAGE_LABEL):
            storage_dirs.add(Path(labels[STORAGE_LABEL]))
    if names:
        podman("rm", "--force", "--time", "0", *names)
    for storage_dir in storage_dirs:
        if storage_dir.exists() and _storage_mounted(storage_dir):
            subprocess.run(["umount", str(storage_dir)], check=True)
        if wipe_storage:
            shutil.rmtree(storage_dir, ignore_errors=True)
    return names


def ensure_key_pair(path: Path) -> Path:
    """An ed25519 key pair at path (private) and path.pub; generated if missing."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "vllm-fleet", "-f", str(path)],
            check=True,
        )
    return path


def enable_ssh(node: str, port: int, public_key: str) -> None:
    """Run sshd on `port` in the node (the host network is shared), root by key only."""
    config = f"Port {port}\nPermitRootLogin prohibit-password\nPasswordAuthentication no\n"
    script = (
        "install -d -m 0700 /root/.ssh && "
        'printf "%s\\n" "$1" > /root/.ssh/authorized_keys && '
        "chmod 0600 /root/.ssh/authorized_keys && "
        'printf "%s" "$2" > /etc/ssh/sshd_config.d/00-vllm-fleet.conf && '
        "systemctl enable --quiet ssh.service && systemctl restart ssh.service"
    )
    exec_in(node, ["sh", "-c", script, "enable-ssh", public_key.strip(), config])


def _pid(node: str) -> int:
    info = _inspect(node)
    if not info or not info["State"]["Running"]:
        raise FleetError(f"{node} is not running")
    return int(info["State"]["Pid"])


def limit_disk(node: str, path: str, size: str) -> None:
    """Mount a tmpfs of `size` (e.g. "1m") over `path` inside one node only.

    Entered from the host (nsenter into the node's mount namespace), so the
    node needs no extra capabilities; other nodes keep seeing the real path.
    """
    mnt = ["nsenter", "--target", str(_pid(node)), "--mount", "--"]
    subprocess.run([*mnt, "mkdir", "-p", path], check=True)
    subprocess.run(
        [*mnt, "mount", "-t", "tmpfs", "-o", f"size={size},mode=0777", "vf-disk-full", path],
        check=True,
    )


def unlimit_disk(node: str, path: str) -> None:
    """Undo :func:`limit_disk`: unmount the small tmpfs from `path`."""
    subprocess.run(
        ["nsenter", "--target", str(_pid(node)), "--mount", "--", "umount", path], check=True
    )


@contextmanager
def disk_limited(node: str, path: str, size: str) -> Iterator[None]:
    """`path` in `node` holds only `size` bytes for the duration of the block."""
    limit_disk(node, path, size)
    try:
        yield
    finally:
        unlimit_disk(node, path)


def kill_node(node: str, signal: str = "KILL") -> None:
    """Send a signal to the node's PID 1 (SIGKILL: the node loses power)."""
    podman("kill", "--signal", signal, node)


def stop_node(node: str, timeout_s: int = 10) -> None:
    """Shut the node down cleanly (systemd stops its units)."""
    podman("stop", "--time", str(timeout_s), node)


def start_node(node: str) -> str:
    """Boot a stopped or killed node again; return systemd's state once up."""
    podman("start", node)
    return wait_booted(node)


def pause_node(node: str) -> None:
    """Freeze every process of the node: it hangs, connections time out."""
    podman("pause", node)


def resume_node(node: str) -> None:
    """Thaw a paused node."""
    podman("unpause", node)


try:  # pytest is a dev dependency; the CLI works without it.
    import pytest
except ImportError:  # pragma: no cover
    pytest = None  # type: ignore[assignment]

if pytest is not None:

    @pytest.fixture(scope="session")
    def demo_fleet() -> Iterator[Fleet]:
        """The demo fleet (inventory/demo), fresh with empty storage; removed after."""
        fleet = up(DEFAULT_NODES, fresh=True, wipe_storage=True)
        try:
            yield fleet
        finally:
            down(fleet.prefix)


def _cli(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.fleet", description=__doc__)
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="node name prefix")
    sub = parser.add_subparsers(dest="command", required=True)
    p_up = sub.add_parser("up", help="bring the fleet up (idempotent)")
    p_up.add_argument("--nodes", type=int, default=DEFAULT_NODES)
    p_up.add_argument("--fresh", action="store_true", help="recreate running nodes")
    p_up.add_argument("--wipe-storage", action="store_true", help="empty the shared storage")
    p_up.add_argument("--storage-size", help="make the shared storage a tmpfs of this size")
    p_up.add_argument(
        "--ssh", action="store_true", help="run sshd on each node's port (key in the cache)"
    )
    p_down = sub.add_parser("down", help="remove every node")
    p_down.add_argument("--wipe-storage", action="store_true")
    sub.add_parser("status", help="list the nodes")
    p_inv = sub.add_parser("inventory", help="print the inventory YAML")
    p_inv.add_argument("--nodes", type=int, default=DEFAULT_NODES)
    p_inv.add_argument(
        "--cpus", type=int, help="cores to spread OpenMP over (default: this host's)"
    )
    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            start = time.monotonic()
            fleet = up(
                args.nodes,
                prefix=args.prefix,
                fresh=args.fresh,
                wipe_storage=args.wipe_storage,
                storage_size=args.storage_size,
                ssh_key=cache_dir() / "fleet" / args.prefix / "id_ed25519" if args.ssh else None,
            )
            print(
                f"fleet up in {time.monotonic() - start:.1f}s: {', '.join(fleet.nodes)} "
                f"(storage {fleet.storage_dir} -> {fleet.storage_path})"
            )
        elif args.command == "down":
            removed = down(args.prefix, wipe_storage=args.wipe_storage)
            print(f"fleet down: removed {', '.join(removed) or 'nothing'}")
        elif args.command == "status":
            for name in existing_nodes(args.prefix):
                info = _inspect(name) or {}
                print(f"{name} {info.get('State', {}).get('Status', '?')}")
        else:
            sys.stdout.write(inventory_yaml(args.nodes, args.prefix, args.cpus))
    except FleetError as err:
        print(f"fleet: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_cli())
