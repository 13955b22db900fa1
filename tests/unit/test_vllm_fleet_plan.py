"""library/vllm_fleet_plan.py in-process: the plan and every problem, on real files and sockets."""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible.module_utils import hf_download as hd
from ansible.module_utils.gpu import build_facts

from tests.support.ansible_module import (  # noqa: F401 (patch_ansible_module: autouse fixture)
    fail_module,
    load_module,
    patch_ansible_module,
    run_module,
)
from tests.support.kimi_checkpoint import kimi_config, write_kimi_checkpoint, write_kimi_configs

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "nvidia-smi"
MATRIX = yaml.safe_load((ROOT / "roles/preflight/files/compat_matrix.yml").read_text())
plan_module = load_module("vllm_fleet_plan")
KIMI_BYTES = 540_000_000_000


def gpu(fixture: str) -> dict[str, Any]:
    d = FIXTURES / fixture
    return build_facts(*(d.joinpath(n).read_text() for n in ("query.csv", "topo.txt",
                                                             "nvidia-smi.txt")), [])  # fmt: skip


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def storage(tmp_path: Path) -> Path:
    root = tmp_path / "shared"
    root.mkdir()
    return root


def args(storage: Path, **over: Any) -> dict[str, Any]:
    base = {
        "device": "cuda",
        "gpu": gpu("rtx-pro-6000-x8"),
        "matrix": MATRIX,
        "vllm_version": "0.16.0rc2",
        "tensor_parallel_size": 8,
        "checkpoint_bytes": KIMI_BYTES,
        "model_dir": str(storage / "kimi"),
        "storage_root": str(storage),
        "storage_must_be_mount": False,
        "service_port": free_port(),
        "service_unit": "vllm-kimi.service",
        "host": "node1",
    }
    base.update(over)
    return base


def run(a: dict[str, Any]) -> dict[str, Any]:
    return run_module(plan_module, a)


def fail(a: dict[str, Any]) -> str:
    return fail_module(plan_module, a)


def test_source_deployment_drops_fp8_with_pcie_nccl(storage: Path) -> None:
    write_kimi_checkpoint(storage / "kimi")  # complete on disk: no free-disk demand
    result = run(args(storage))
    plan = result["plan"]
    assert result["problems"] == [] and result["changed"] is False
    assert plan["kv_cache_quant"] == "absent"
    assert plan["checkpoint_kv_cache_quant"] == "fp8" and plan["checkpoint_source"] == "checkpoint"
    assert plan["attention_family"] == "mla"
    assert plan["expected_attention_backend"] == "TRITON_MLA"
    assert plan["nccl_env"] == {"NCCL_P2P_LEVEL": "SYS", "NCCL_PROTO": "LL", "NCCL_IB_DISABLE": "1"}
    assert (plan["tensor_parallel_size"], plan["pipeline_parallel_size"], plan["gpu_count"]) == (
        8, 1, 8)  # fmt: skip
    assert result["checks"]["checkpoint_complete"] is True


def test_h200_keeps_fp8_with_default_nccl(storage: Path) -> None:
    write_kimi_checkpoint(storage / "kimi")
    plan = run(args(storage, gpu=gpu("h200-x8")))["plan"]
    assert (plan["kv_cache_quant"], plan["expected_attention_backend"], plan["nccl_env"]) == (
        "original", "FLASHMLA", {})  # fmt: skip


def test_nvfp4_weights_before_sm100_warn_of_the_weight_only_fallback(storage: Path) -> None:
    write_kimi_checkpoint(storage / "kimi")
    h200 = run(args(storage, gpu=gpu("h200-x8")))
    assert h200["problems"] == []
    (warning,) = [w for w in h200["warnings_list"] if "NVFP4" in w]
    assert warning.startswith("NVFP4 weights on SM9.0: these GPUs have no FP4 tensor cores")
    assert "weight-only FP4 fallback" in warning and "bf16 speed" in warning
    # FP4 tensor cores (SM12.0, SM10.0): nothing to say.
    for native in ("rtx-pro-6000-x8", "b200-x8"):
        assert not [w for w in run(args(storage, gpu=gpu(native)))["warnings_list"] if "NVFP4" in w]


def test_profile_hints_before_download(storage: Path) -> None:
    result = run(args(storage, declared_attention="mla", declared_kv_cache_quant="fp8",
                      checkpoint_bytes=1000))  # fmt: skip
    assert result["plan"]["checkpoint_source"] == "profile"
    assert result["plan"]["kv_cache_quant"] == "absent"
    assert result["checks"]["checkpoint_complete"] is False


def test_checkpoint_already_patched_is_original(storage: Path) -> None:
    # A checkpoint whose FP8 declarations were removed declares none: nothing left to drop.
    write_kimi_configs(storage / "kimi", sidecar=False, text_config_overrides={})
    config = storage / "kimi" / "config.json"
    config.write_text(config.read_text().replace('"kv_cache_scheme"', '"kv_cache_scheme_x"'))
    plan = run(args(storage, checkpoint_bytes=1000))["plan"]
    assert plan["checkpoint_kv_cache_quant"] == "none" and plan["kv_cache_quant"] == "original"


def test_plan_reads_pristine_configs_after_our_patch(storage: Path) -> None:
    # Our own patch removed the FP8 declarations: the plan must still see the
    # checkpoint's own FP8 KV (from the pristine copy), or reruns flip-flop.
    write_kimi_checkpoint(storage / "kimi")
    run_module(load_module("hf_quant_config"), {"model_dir": storage / "kimi"})
    assert "kv_cache_scheme" not in (storage / "kimi" / "config.json").read_text()
    plan = run(args(storage))["plan"]
    assert plan["checkpoint_kv_cache_quant"] == "fp8" and plan["kv_cache_quant"] == "absent"
    # A hand edit after our patch is the file's new truth, not ours to override.
    config = storage / "kimi" / "config.json"
    config.write_text(config.read_text().replace("{", "{ ", 1))
    hf_quant = storage / "kimi" / "hf_quant_config.json"
    hf_quant.write_text(hf_quant.read_text().replace("{", "{ ", 1))
    assert run(args(storage))["plan"]["checkpoint_kv_cache_quant"] == "none"


def test_every_problem_at_once(storage: Path) -> None:
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run(args(storage, gpu=gpu("l40s-x4"), checkpoint_bytes=10**18, service_port=port))
    problems = result["problems"]
    assert len(problems) == 4, problems
    assert problems[0].startswith("tensor_parallel_size 8 x pipeline_parallel_size 1 = 8 GPUs")
    assert "exceeds usable GPU memory" in problems[1]
    assert problems[2].startswith(f"free disk at {storage} is ")
    assert f"service port {port} is in use by pid {os.getpid()}" in problems[3]
    assert result["plan"]["kv_cache_quant"] == "original"  # unknown checkpoint: nothing dropped


def test_storage_missing(storage: Path) -> None:
    result = run(args(storage, storage_root=str(storage / "absent"),
                      model_dir=str(storage / "absent" / "kimi")))  # fmt: skip
    assert result["problems"] == [f"shared storage {storage}/absent does not exist (not mounted?)"]


def test_storage_must_be_a_mount(storage: Path) -> None:
    result = run(args(storage, storage_must_be_mount=True, checkpoint_bytes=1))
    mount = result["checks"]["storage_mount_point"]
    is_root = mount == "/"
    assert any("not a mount" in p for p in result["problems"]) is is_root


def test_storage_probe_leaves_nothing(storage: Path) -> None:
    run(args(storage, checkpoint_bytes=1, _ansible_check_mode=True))
    assert list(storage.iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through directory permissions")
def test_storage_not_writable(storage: Path) -> None:
    storage.chmod(0o555)
    try:
        problems = run(args(storage, checkpoint_bytes=1))["problems"]
    finally:
        storage.chmod(0o755)
    assert any("is not writable" in p for p in problems)


def test_partial_download_counts(storage: Path) -> None:
    (storage / "kimi").mkdir()
    (storage / "kimi" / "model-00001-of-00002.safetensors").write_bytes(b"x" * 4096)
    checks = run(args(storage, checkpoint_bytes=10_000))["checks"]
    assert checks["disk_needed_bytes"] == 10_000 - 4096


def test_no_driver(storage: Path) -> None:
    nogpu = {"nvidia_smi_found": True, "driver_loaded": False, "message": "rc 9", "gpus": []}
    problems = run(args(storage, gpu=nogpu, checkpoint_bytes=1))["problems"]
    assert problems == ["NVIDIA driver not loaded: rc 9"]


def test_mig_with_parallel_is_rejected(storage: Path) -> None:
    problems = run(args(storage, gpu=gpu("a100-mig-x2"), tensor_parallel_size=2,
                        checkpoint_bytes=1))["problems"]  # fmt: skip
    assert len(problems) == 1 and "[compat matrix: mig-parallel]" in problems[0]


def test_peer_mismatch(storage: Path) -> None:
    peers = [{"host": "node2", "group": "fleet", "gpu_names": ["NVIDIA H200"],
              "driver_version": "570.133.20"}]  # fmt: skip
    problems = run(args(storage, peers=peers, checkpoint_bytes=1))["problems"]
    assert len(problems) == 2 and all("node2" in p for p in problems)
    other_group = [{**peers[0], "group": "other"}]
    assert run(args(storage, peers=other_group, checkpoint_bytes=1))["problems"] == []


def test_cpu_device_checks_memory_not_gpus(storage: Path) -> None:
    result = run(args(storage, device="cpu", gpu={}, tensor_parallel_size=1,
                      vllm_version="0.32.0", declared_attention="mla",
                      declared_kv_cache_quant="fp8", checkpoint_bytes=10**15))  # fmt: skip
    plan = result["plan"]
    assert (plan["device"], plan["kv_cache_quant"], plan["gpu_count"]) == ("cpu", "absent", 0)
    assert plan["compat_rule"] == "cpu-mla-quantized"
    assert result["problems"][0].startswith("host memory")
    assert not any("GPU" in p or "driver" in p for p in result["problems"])


def test_malformed_config_is_a_problem(storage: Path) -> None:
    (storage / "kimi").mkdir()
    (storage / "kimi" / "config.json").write_text("{not json")
    problems = run(args(storage, checkpoint_bytes=1))["problems"]
    assert any(p.startswith(f"cannot read {storage}/kimi/config.json") for p in problems)


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"vllm_version": "latest"}, "vllm_version: cannot parse version 'latest'"),
        ({"tensor_parallel_size": 0}, "parallel sizes must be >= 1"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be in (0, 1]"),
        ({"matrix": {"kv_cache_rules": []}}, "compat matrix is malformed"),
        ({"declared_kv_cache_quant": "fp16"}, "declared_kv_cache_quant"),
    ],
)
def test_bad_input_fails_clearly(storage: Path, over: dict[str, Any], message: str) -> None:
    assert message in fail(args(storage, **over))


@pytest.mark.parametrize("name", ["vllm_fleet_plan", "gpu_facts"])
def test_module_docs_parse(name: str) -> None:
    module = plan_module if name == "vllm_fleet_plan" else load_module(name)
    doc = yaml.safe_load(module.DOCUMENTATION)
    assert doc["module"] == name
    assert yaml.safe_load(module.RETURN) and yaml.safe_load(module.EXAMPLES)
    source = (ROOT / "library" / f"{name}.py").read_text()
    for option in doc["options"]:
        pattern = rf'"{option}": {{\s*"type"'
        assert re.search(pattern, source), f"{option} documented but not in argument_spec"


# ---- KV memory before the load (Kimi-K2.5's real text_config: 61 layers, MLA 512 + 64)

KIMI_LAYOUT = yaml.safe_load((ROOT / "playbooks/models/kimi-k2.5-nvfp4.yml").read_text())[
    "vllm_fleet_model_kv_layout"
]
H100_80GB_MIB = 81559  # nvidia-smi memory.total of an H100 80GB HBM3


def kimi_on_disk(storage: Path) -> None:
    """The Kimi-shaped checkpoint with the real shard index total (540 GB)."""
    write_kimi_checkpoint(storage / "kimi")
    index_path = storage / "kimi" / "model.safetensors.index.json"
    index = yaml.safe_load(index_path.read_text())
    index["metadata"]["total_size"] = KIMI_BYTES
    index_path.write_text(json.dumps(index))


def gpus_80gb(fixture: str, cc: str | None = None) -> dict[str, Any]:
    facts = gpu(fixture)
    for g in facts["gpus"]:
        g["memory_mib"] = H100_80GB_MIB
        g["compute_capability"] = cc or g["compute_capability"]
    return facts


def test_kimi_config_matches_the_profile_layout() -> None:
    text = kimi_config()["text_config"]
    assert {k: text[k] for k in KIMI_LAYOUT} == KIMI_LAYOUT


def test_kimi_full_context_fits_8x_96gb_with_bf16_kv(storage: Path) -> None:
    kimi_on_disk(storage)
    result = run(args(storage, vllm_version="0.16.0"))
    kv = result["checks"]["kv_memory"]
    assert result["problems"] == []
    assert result["plan"]["kv_cache_quant"] == "absent"  # FP8 dropped: bf16, 2 bytes
    # (512 + 64) x 61 x 2 B; the whole 262,144-token context = 17.2 GiB per GPU.
    assert kv["kv_bytes_per_token"] == 70272
    assert (kv["max_model_len"], kv["fits"]) == (262144, True)
    assert kv["weights_per_gpu_bytes"] == KIMI_BYTES // 8
    # 97887 MiB x 0.9 - 67.5 GB weights - 4 GiB overhead = 19.17 GiB -> 292,901 tokens.
    assert kv["largest_fitting_len"] == 292901


def test_kimi_full_context_refused_on_8x_80gb_with_bf16_kv(storage: Path) -> None:
    kimi_on_disk(storage)
    result = run(args(storage, vllm_version="0.16.0", gpu=gpus_80gb("a100-mig-x2")
                      | {"gpu_count": 8}, tensor_parallel_size=8))  # fmt: skip
    (problem,) = [p for p in result["problems"] if "max-model-len" in p]
    assert "max-model-len 262144 needs 17.2 GiB of KV cache per GPU" in problem
    assert "MLA (512 + 64) x 61 layers x 2 B = 70272 B/token" in problem
    assert "only 4.8 GiB is left" in problem
    assert "the largest context that fits is 73624 tokens" in problem


def test_fp8_kv_kept_halves_the_need_but_80gb_still_refuses(storage: Path) -> None:
    kimi_on_disk(storage)
    facts = gpus_80gb("h200-x8")  # SM90 keeps the checkpoint's FP8 KV: 1 byte
    result = run(args(storage, vllm_version="0.16.0", gpu=facts))
    assert result["plan"]["kv_cache_quant"] == "original"
    kv = result["checks"]["kv_memory"]
    assert (kv["kv_bytes_per_token"], kv["largest_fitting_len"]) == (35136, 147249)
    assert any("largest context that fits is 147249 tokens" in p for p in result["problems"])


def test_smaller_max_model_len_fits_on_80gb(storage: Path) -> None:
    kimi_on_disk(storage)
    result = run(args(storage, vllm_version="0.16.0", gpu=gpus_80gb("h200-x8"),
                      max_model_len=131072))  # fmt: skip
    assert result["problems"] == [] and result["checks"]["kv_memory"]["fits"] is True


def test_explicit_kv_cache_dtype_wins(storage: Path) -> None:
    kimi_on_disk(storage)
    kv = run(args(storage, vllm_version="0.16.0", kv_cache_dtype="fp8_e4m3"))["checks"]["kv_memory"]
    assert kv["kv_bytes_per_token"] == 35136


def test_profile_layout_sizes_kv_before_download(storage: Path) -> None:
    result = run(args(storage, vllm_version="0.16.0", gpu=gpus_80gb("h200-x8", cc="12.0"),
                      declared_attention="mla", declared_kv_cache_quant="fp8",
                      declared_kv_layout=KIMI_LAYOUT, checkpoint_bytes=1000))  # fmt: skip
    # 1000 bytes of weights: the 262,144-token context in bf16 (17.2 GiB) fits 80 GB.
    assert result["checks"]["kv_memory"]["kv_bytes_per_token"] == 70272
    assert result["problems"] == []
    unsized = run(args(storage, declared_attention="mla", checkpoint_bytes=1000))
    assert unsized["checks"]["kv_memory"].startswith("skipped")


def test_cpu_device_is_not_sized_by_gpu_memory(storage: Path) -> None:
    kimi_on_disk(storage)
    result = run(args(storage, device="cpu", gpu={}, checkpoint_bytes=1000,
                      min_kv_cache_bytes=0, cpu_overhead_bytes=0))  # fmt: skip
    assert "kv_memory" not in result["checks"]
    assert not any("max-model-len" in p for p in result["problems"])


def test_bad_config_for_kv_sizing_is_a_clear_problem(storage: Path) -> None:
    result = run(args(storage, declared_attention="mla", checkpoint_bytes=1000,
                      declared_kv_layout={"kv_lora_rank": 512}))  # fmt: skip
    assert any(
        "cannot size the KV cache from the checkpoint config" in p and "num_hidden_layers" in p
        for p in result["problems"]
    )


@pytest.mark.parametrize(
    ("p2p", "car", "want_env_key", "want_car"),
    [("", "", "NCCL_P2P_LEVEL", False), ("true", "", "NCCL_P2P_DISABLE", True),
     (True, False, "NCCL_P2P_DISABLE", False), ("", "yes", "NCCL_P2P_LEVEL", True)],
)  # fmt: skip
def test_nccl_profile_switches(
    storage: Path, p2p: object, car: object, want_env_key: str, want_car: bool
) -> None:
    write_kimi_checkpoint(storage / "kimi")
    plan = run(args(storage, nccl_p2p_disable=p2p, disable_custom_all_reduce=car))["plan"]
    assert want_env_key in plan["nccl_env"]
    assert plan["disable_custom_all_reduce"] is want_car


def test_nccl_switch_garbage_is_refused(storage: Path) -> None:
    assert "maybe" in fail(args(storage, nccl_p2p_disable="maybe"))


def test_checkpoint_proof_names_the_commit_this_node_sees_or_why_not(storage: Path) -> None:
    """The plan proves this node's view of a completed download (model_download then
    skips its own check of the node), and says why when it cannot."""
    model = storage / "kimi"
    state = storage / ".state"
    model.mkdir()
    state.mkdir()
    opts = hd.Options("org/kimi", "main", str(model), str(state))
    entries = []
    for name, data in (("config.json", b"{}\n"), ("model.safetensors", b"w" * 512)):
        (model / name).write_bytes(data)
        entries.append(hd.Entry(name, len(data), "0" * 40, hashlib.sha256(data).hexdigest()))
    given = {"checkpoint_repo": "org/kimi", "checkpoint_state_dir": str(state)}

    assert run(args(storage, **given))["plan"]["checkpoint_proof"]["reason"].startswith(
        "No complete download recorded"
    )
    plan = hd.Plan("c" * 40, entries, dict.fromkeys((e.path for e in entries), "ok"), {}, 0, 0)
    hd.write_manifest(opts, plan, {e.path: e.reference()[1] for e in entries})
    assert run(args(storage, **given))["plan"]["checkpoint_proof"] == {
        "sha": "c" * 40,
        "files": 2,
        "reason": "",
    }
    # Without the manifest's location: not proved here (model_download checks the node).
    assert run(args(storage))["plan"]["checkpoint_proof"]["sha"] == ""
    # Another repo's manifest proves nothing.
    other = run(args(storage, checkpoint_repo="org/other", checkpoint_state_dir=str(state)))
    assert other["plan"]["checkpoint_proof"]["sha"] == ""
    # A file this node sees changed: not proved, the file named.
    os.utime(model / "config.json", ns=(1, 1))
    proof = run(args(storage, **given))["plan"]["checkpoint_proof"]
    assert proof["sha"] == ""
    assert "config.json (changed since the download proved it)" in proof["reason"]


def test_a_replica_of_one_node_plans_no_network(storage: Path) -> None:
    assert run(args(storage, checkpoint_bytes=1))["plan"]["replica"] == {}


def test_a_replica_node_plans_the_route_to_its_leader(storage: Path) -> None:
    """Each node of a multi-node replica: the address and interface it reaches the
    leader from become VLLM_HOST_IP and the NCCL/Gloo socket interfaces."""
    port = free_port()
    replica = {"replica_name": "r1", "replica_nodes": 2, "replica_leader": "127.0.0.1",
               "replica_port": port, "replica_leader_host": "node-a",
               "replica_api_port": 8801}  # fmt: skip
    leader = run(args(storage, checkpoint_bytes=1, replica_rank=0, **replica))
    assert leader["problems"] == []
    assert leader["plan"]["replica"] == {
        "name": "r1", "nodes": 2, "rank": 0, "leader": "127.0.0.1", "leader_ip": "127.0.0.1",
        "port": port, "watch_port": port + 1, "leader_host": "node-a", "api_port": 8801,
        "executor": "mp", "host_ip": "127.0.0.1", "ifname": "lo",
        "env": {"VLLM_HOST_IP": "127.0.0.1", "NCCL_SOCKET_IFNAME": "lo",
                "GLOO_SOCKET_IFNAME": "lo"},
    }  # fmt: skip
    # Each port under its own key: the service port's stays "port" (Molecule reads it).
    checks = leader["checks"]
    assert (checks["port"], checks["rendezvous_port"], checks["watch_port"]) == ("free",) * 3
    follower = run(args(storage, checkpoint_bytes=1, replica_rank=1, **replica))
    assert follower["problems"] == [] and follower["plan"]["replica"]["rank"] == 1
    # The rendezvous port is checked on the leader only: taken, the leader says by whom.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        problems = run(args(storage, checkpoint_bytes=1, replica_rank=0, **replica))["problems"]
        assert len(problems) == 1 and problems[0].startswith(f"rendezvous port {port} is in use")
        assert run(args(storage, checkpoint_bytes=1, replica_rank=1, **replica))["problems"] == []
    # So is the watch port, the next one (followers hold a connection to it).
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port + 1))
        taken.listen()
        problems = run(args(storage, checkpoint_bytes=1, replica_rank=0, **replica))["problems"]
        assert len(problems) == 1 and problems[0].startswith(f"watch port {port + 1} is in use")


def test_replica_network_problems_are_listed_with_the_rest(storage: Path) -> None:
    replica = {"replica_name": "r1", "replica_nodes": 2, "replica_port": free_port()}
    unknown = run(args(storage, checkpoint_bytes=1, replica_rank=1,
                       replica_leader="leader.invalid", **replica))  # fmt: skip
    (problem,) = unknown["problems"]
    assert problem.startswith(
        "replica r1 (rank 1 of 2): cannot resolve the leader's address 'leader.invalid'"
    )
    # Rank 0 whose declared leader address is not the one it reaches it from
    # (127.0.0.2 is reached from 127.0.0.1 on every Linux host).
    elsewhere = run(args(storage, checkpoint_bytes=1, replica_rank=0,
                         replica_leader="127.0.0.2", **replica))["problems"]  # fmt: skip
    assert elsewhere == [
        "replica r1 (rank 0 of 2): this node leads, but the leader address 127.0.0.2 "
        "(127.0.0.2) is not one of its own (it reaches 127.0.0.2 from 127.0.0.1)"
    ]
    missing = run(args(storage, checkpoint_bytes=1, replica_rank=1, **replica))["problems"]
    assert missing == [
        "replica r1 (rank 1 of 2): no leader address "
        "(vllm_fleet_replica_address on its rank 0 node)"
    ]
    assert "replica rank 2 must be in 0..1" in fail(
        args(storage, checkpoint_bytes=1, replica_rank=2, replica_leader="127.0.0.1", **replica)
    )


def test_the_ray_executor_is_planned_on_gpus_and_refused_on_the_cpu(storage: Path) -> None:
    port = free_port()
    replica = {"replica_name": "r1", "replica_nodes": 2, "replica_leader": "127.0.0.1",
               "replica_port": port, "replica_executor": "ray"}  # fmt: skip
    gpus = run(args(storage, checkpoint_bytes=1, **replica))
    assert gpus["problems"] == [] and gpus["plan"]["replica"]["executor"] == "ray"
    # The head's port is the rendezvous port, checked on the leader under its Ray name.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        (problem,) = run(args(storage, checkpoint_bytes=1, **replica))["problems"]
        assert problem.startswith(f"Ray port {port} is in use")
    cpu = run(args(storage, device="cpu", gpu={}, tensor_parallel_size=1,
                   pipeline_parallel_size=2, checkpoint_bytes=1, **replica))  # fmt: skip
    assert cpu["problems"] == [
        "replica r1 (rank 0 of 2): the ray executor does not run on the cpu device (vLLM: "
        "'current platform cpu does not support ray'); set vllm_fleet_executor: mp, vLLM's own "
        "multi-node launch"
    ]
    replica["replica_executor"] = "mp"
    mp = run(args(storage, device="cpu", gpu={}, tensor_parallel_size=1,
                  pipeline_parallel_size=2, checkpoint_bytes=1, **replica))  # fmt: skip
    assert mp["problems"] == []


def test_each_replica_node_needs_only_its_share_of_the_gpus(storage: Path) -> None:
    # Tensor parallel 8 on 4-GPU nodes: refused on one node, fits over two.
    four = {**gpu("rtx-pro-6000-x8"), "gpu_count": 4}
    four["gpus"] = four["gpus"][:4]
    alone = run(args(storage, gpu=four, checkpoint_bytes=1))["problems"]
    assert alone == [
        "tensor_parallel_size 8 x pipeline_parallel_size 1 = 8 GPUs needed, this host has 4"
    ]
    over_two = run(args(storage, gpu=four, checkpoint_bytes=1, replica_nodes=2,
                        replica_leader="127.0.0.1", replica_port=free_port()))  # fmt: skip
    assert over_two["problems"] == []
    over_four = run(args(storage, gpu={**four, "gpu_count": 1, "gpus": four["gpus"][:1]},
                         checkpoint_bytes=1, replica_nodes=2, replica_leader="127.0.0.1",
                         replica_port=free_port()))["problems"]  # fmt: skip
    assert over_four == [
        "tensor_parallel_size 8 x pipeline_parallel_size 1 = 8 GPUs needed over 2 nodes, "
        "4 on each, this host has 1"
    ]
