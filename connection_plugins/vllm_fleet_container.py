# Copyright: vllm-fleet contributors
# Apache-2.0
"""Connection to the demo and test fleet's nodes: local podman containers, entered with nsenter."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from ansible.errors import AnsibleConnectionFailure, AnsibleError
from ansible.module_utils.common.text.converters import to_bytes, to_text
from ansible.plugins.connection import ConnectionBase
from ansible.utils.display import Display

DOCUMENTATION = r"""
name: vllm_fleet_container
short_description: Run tasks in a local rootful podman container by entering its namespaces
description:
  - The connection of the demo and test fleets (systemd as PID 1 in podman containers on
    this machine). Each command runs in the container's mount, UTS, IPC, network, PID and
    cgroup namespaces through C(nsenter), with the container's own minimal environment;
    files are copied through C(/proc/<pid>/root). Modules are pipelined, one process per
    module run, where C(containers.podman.podman) starts several C(podman) processes
    (no pipelining there) on the CPUs the nodes share.
  - Needs root on the controller (rootful podman). Real fleets use ssh.
  - The container's PID is asked from C(podman inspect) once and cached in the
    controller's temp directory; a cached PID is used only while its process is still
    that container's init (its hostname is the container's name).
options:
  remote_addr:
    description: The container's name.
    default: inventory_hostname
    type: str
    vars:
      - name: inventory_hostname
      - name: ansible_host
  pipelining:
    description: Pipeline modules (stdin of the one nsenter process).
    default: true
    type: boolean
    vars:
      - name: ansible_pipelining
"""

display = Display()

# What `podman exec` gives a process: not the controller's environment.
CONTAINER_ENV = (
    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME=/root",
    "LANG=C.UTF-8",
    "container=podman",
)
NAMESPACES = ("--mount", "--uts", "--ipc", "--net", "--pid", "--cgroup")


def _is_init_of(pid: int, name: str) -> bool:
    try:
        return Path(f"/proc/{pid}/root/etc/hostname").read_text().strip() == name
    except OSError:
        return False


def container_pid(name: str) -> int:
    """The PID (on this machine) of the container's init, cached per container name."""
    cache = Path(tempfile.gettempdir()) / f"vllm-fleet-container-{name}.pid"
    try:
        pid = int(cache.read_text())
        if _is_init_of(pid, name):
            return pid
    except (OSError, ValueError):
        pass
    proc = subprocess.run(
        ["podman", "inspect", "--format", "{{.State.Pid}}", name],
        capture_output=True,
        text=True,
        check=False,
    )
    pid = int(proc.stdout.strip() or 0) if proc.returncode == 0 else 0
    if pid <= 0:
        detail = proc.stderr.strip() or "not running"
        raise AnsibleConnectionFailure(f"container {name} is not running ({detail})")
    cache.write_text(str(pid))
    return pid


class Connection(ConnectionBase):
    """nsenter into a local container; pipelined modules, files through /proc/<pid>/root."""

    transport = "vllm_fleet_container"
    has_pipelining = True

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self._pid = 0

    @property
    def _name(self) -> str:
        return self.get_option("remote_addr")

    def _connect(self) -> Connection:
        if not self._connected:
            if os.geteuid() != 0:
                raise AnsibleConnectionFailure(
                    "vllm_fleet_container needs root (rootful podman, nsenter); "
                    "use ansible_connection=containers.podman.podman otherwise"
                )
            self._pid = container_pid(self._name)
            display.vvv(f"ENTER CONTAINER {self._name} (pid {self._pid})", host=self._name)
            self._connected = True
        return self

    def exec_command(
        self, cmd: str, in_data: bytes | None = None, sudoable: bool = True
    ) -> tuple[int, bytes, bytes]:
        super().exec_command(cmd, in_data=in_data, sudoable=sudoable)
        argv = [
            "nsenter",
            f"--target={self._pid}",
            *NAMESPACES,
            "--",
            "/usr/bin/env",
            "-i",
            *CONTAINER_ENV,
            "/bin/sh",
            "-c",
            to_text(cmd),
        ]
        display.vvv(f"EXEC {to_text(cmd)}", host=self._name)
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd="/",
        )
        stdout, stderr = proc.communicate(in_data)
        return proc.returncode, stdout, stderr

    def _in_container(self, path: str) -> str:
        if not path.startswith("/"):
            raise AnsibleError(f"{self._name}: a relative path cannot be resolved: {path}")
        return f"/proc/{self._pid}/root{path}"

    def put_file(self, in_path: str, out_path: str) -> None:
        super().put_file(in_path, out_path)
        display.vvv(f"PUT {in_path} TO {out_path}", host=self._name)
        try:
            shutil.copyfile(to_bytes(in_path), to_bytes(self._in_container(out_path)))
        except OSError as err:
            raise AnsibleError(f"failed to transfer {in_path} to {out_path}: {err}") from err

    def fetch_file(self, in_path: str, out_path: str) -> None:
        super().fetch_file(in_path, out_path)
        display.vvv(f"FETCH {in_path} TO {out_path}", host=self._name)
        try:
            shutil.copyfile(to_bytes(self._in_container(in_path)), to_bytes(out_path))
        except OSError as err:
            raise AnsibleError(f"failed to fetch {in_path} to {out_path}: {err}") from err

    def close(self) -> None:
        self._connected = False
