#!/usr/bin/python
# Copyright: vllm-fleet contributors
# Apache-2.0
from __future__ import annotations

DOCUMENTATION = r"""
---
module: gpu_facts
short_description: Report NVIDIA GPUs, driver, CUDA version and GPU-to-GPU interconnect
description:
  - Runs C(nvidia-smi --query-gpu=index,name,uuid,memory.total,compute_cap,driver_version,
    mig.mode.current,pci.bus_id --format=csv,noheader,nounits), plain C(nvidia-smi) (for the
    CUDA version in its banner) and C(nvidia-smi topo -m) (for NVLink vs PCIe paths).
  - Read-only; the same in check mode. Sets the fact C(vllm_fleet_gpu) (under C(ansible_facts))
    and returns the same keys at the top level for C(register).
  - A host without the binary answers C(nvidia_smi_found=false); a host whose binary cannot talk
    to the kernel driver answers C(driver_loaded=false). Neither is a failure.
version_added: "0.1.0"
options:
  nvidia_smi:
    description:
      - Name or path of nvidia-smi. A bare name is looked up in C(PATH) and the usual sbin dirs.
      - Tests point this at C(tests/support/fake_nvidia_smi.py), a named fake replaying fixtures.
    type: str
    default: nvidia-smi
  infiniband_sysfs:
    description:
      - Directory whose entries are the host's InfiniBand devices. Present and non-empty means
        InfiniBand is available (NCCL may use it); absent or empty means it is not.
    type: path
    default: /sys/class/infiniband
  timeout:
    description: Seconds each nvidia-smi call may take (a hung driver must not hang the play).
    type: int
    default: 60
attributes:
  check_mode:
    description: Runs in check mode; it reports no change in any mode.
    support: full
  diff_mode:
    description: Returns no diff.
    support: none
author:
  - vllm-fleet
"""

EXAMPLES = r"""
- name: Gather GPU facts
  gpu_facts:

- name: Gather GPU facts from a fake replaying a fixture (tests)
  gpu_facts:
    nvidia_smi: "{{ playbook_dir }}/../tests/support/fake_nvidia_smi.py"
  register: gpu

- name: Show the interconnect
  ansible.builtin.debug:
    msg: "{{ ansible_facts['vllm_fleet_gpu']['summary']['interconnect'] }}"
"""

RETURN = r"""
nvidia_smi_found:
  description: Whether the nvidia-smi binary exists.
  returned: always
  type: bool
driver_loaded:
  description: Whether nvidia-smi could talk to the NVIDIA kernel driver.
  returned: always
  type: bool
gpu_count:
  description: Number of GPUs.
  returned: always
  type: int
  sample: 8
gpus:
  description: One entry per GPU, ordered by index.
  returned: always
  type: list
  elements: dict
  contains:
    index: {description: nvidia-smi index, type: int}
    name: {description: Product name, type: str, sample: NVIDIA H200}
    uuid: {description: GPU UUID, type: str}
    memory_mib: {description: Total memory in MiB, type: int, sample: 143771}
    compute_capability: {description: Compute capability, type: str, sample: "9.0"}
    driver_version: {description: Driver version, type: str}
    mig_mode: {description: 'enabled, disabled or unsupported', type: str}
    pci_bus_id: {description: PCI bus id, type: str}
driver_version:
  description: Driver version (from the banner, else the query).
  returned: always
  type: str
  sample: "570.133.20"
cuda_version:
  description: Highest CUDA version the driver supports (banner of plain nvidia-smi).
  returned: always
  type: str
  sample: "12.8"
interconnect:
  description: One entry per GPU pair (a < b) from C(nvidia-smi topo -m).
  returned: always
  type: list
  elements: dict
  contains:
    a: {description: First GPU index, type: int}
    b: {description: Second GPU index, type: int}
    type: {description: nvlink or pcie, type: str}
    path: {description: "Raw path: NV18, PIX, PXB, PHB, NODE or SYS", type: str}
    nvlinks: {description: Bonded NVLinks (0 for PCIe), type: int}
nics:
  description: The NIC legend of C(topo -m) (NIC0 -> mlx5_0).
  returned: always
  type: dict
infiniband:
  description: Whether InfiniBand devices exist (see I(infiniband_sysfs)).
  returned: always
  type: bool
infiniband_devices:
  description: Names of the InfiniBand devices.
  returned: always
  type: list
  elements: str
mig_enabled:
  description: Whether any GPU has MIG mode enabled.
  returned: always
  type: bool
summary:
  description: all_nvlink, pcie_only, interconnect (nvlink, pcie, mixed or none), widest_pcie_path.
  returned: always
  type: dict
message:
  description: Why no GPU was found.
  returned: when driver_loaded is false
  type: str
ansible_facts:
  description: The keys above under C(vllm_fleet_gpu).
  returned: always
  type: dict
"""

import os
import shutil

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.gpu import (
    QUERY_ARGS,
    GpuParseError,
    build_facts,
    empty_facts,
    no_driver_output,
)


def _find_binary(module: AnsibleModule, name: str) -> str | None:
    if os.sep in name:
        return name if os.path.isfile(name) and os.access(name, os.X_OK) else None
    found = shutil.which(name)
    if found:
        return found
    return module.get_bin_path(name, opt_dirs=["/usr/bin", "/usr/sbin", "/usr/local/bin"])


def _infiniband_devices(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _run(module: AnsibleModule, argv: list[str]) -> tuple[int, str, str]:
    timeout = module.params["timeout"]
    return module.run_command(["timeout", str(timeout), *argv], environ_update={"LC_ALL": "C"})


def gather(module: AnsibleModule) -> dict:
    binary = _find_binary(module, module.params["nvidia_smi"])
    if binary is None:
        return empty_facts(False, f"{module.params['nvidia_smi']} not found: no NVIDIA driver")
    rc, out, err = _run(module, [binary, *QUERY_ARGS])
    if rc != 0:
        text = (out + err).strip()
        if no_driver_output(text) or rc == 9:
            return empty_facts(
                True, f"nvidia-smi found but the NVIDIA driver is not loaded: {text}"
            )
        module.fail_json(msg=f"{binary} {' '.join(QUERY_ARGS)} failed (rc={rc}): {text}")
    _, banner, _ = _run(module, [binary])
    topo_rc, topo, topo_err = _run(module, [binary, "topo", "-m"])
    if topo_rc != 0:
        module.warn(f"nvidia-smi topo -m failed (rc={topo_rc}): {topo_err.strip()}")
        topo = ""
    try:
        return build_facts(
            out, topo, banner, _infiniband_devices(module.params["infiniband_sysfs"])
        )
    except GpuParseError as exc:
        module.fail_json(msg=f"cannot parse nvidia-smi output from {binary}: {exc}")
    return {}  # unreachable: fail_json exits


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "nvidia_smi": {"type": "str", "default": "nvidia-smi"},
            "infiniband_sysfs": {"type": "path", "default": "/sys/class/infiniband"},
            "timeout": {"type": "int", "default": 60},
        },
        supports_check_mode=True,
    )
    facts = gather(module)
    module.exit_json(changed=False, ansible_facts={"vllm_fleet_gpu": facts}, **facts)


if __name__ == "__main__":
    main()
