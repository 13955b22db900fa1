"""The after-start check: attention backend and KV cache dtype vLLM logged vs the plan.

Journal lines are shaped like vLLM's own (the format strings of vllm/platforms/cuda.py,
vllm/platforms/cpu.py, vllm/config/cache.py, vllm/v1/engine/core.py, and the k/v scale
warnings of vllm/model_executor); the patterns are the role's defaults.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
_SPEC = importlib.util.spec_from_file_location(
    "vllm_runtime", ROOT / "roles/vllm_service/filter_plugins/vllm_runtime.py"
)
runtime = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(runtime)
DEFAULTS = yaml.safe_load((ROOT / "roles/vllm_service/defaults/main.yml").read_text())
HARMLESS = DEFAULTS["vllm_service_expected_warnings"]
DIAGNOSES = yaml.safe_load((ROOT / "roles/vllm_service/vars/main.yml").read_text())[
    "__vllm_service_diagnoses"
]


def engine_line(kv: str, version: str = "0.16.0") -> str:
    return (
        f"(EngineCore_DP0 pid=4121) INFO 12-01 07:51:02 [core.py:93] Initializing a V1 LLM engine"
        f" (v{version}) with config: model='/shared/models/kimi-k2.5-nvfp4', dtype=torch.bfloat16,"
        " max_seq_len=262144, tensor_parallel_size=8, quantization=modelopt_fp4,"
        " quantization_config={'quant_algo': 'NVFP4', 'kv_cache_quant_algo': 'FP8'},"
        " enforce_eager=False,"
        f" kv_cache_dtype={kv}, device_config=cuda, seed=0"
    )


SM120_DROPPED = [
    engine_line("auto"),
    "(Worker_TP0 pid=4188) INFO 12-01 07:51:40 [cuda.py:367] Using TRITON_MLA attention backend"
    " out of potential backends: ['TRITON_MLA'].",
    "(Worker_TP3 pid=4191) INFO 12-01 07:51:40 [cuda.py:367] Using TRITON_MLA attention backend"
    " out of potential backends: ['TRITON_MLA'].",
    "(Worker_TP0 pid=4188) INFO 12-01 07:51:41 [cuda.py:395] Using backend"
    " AttentionBackendEnum.FLASH_ATTN for vit attention",
    "(Worker_TP0 pid=4188) INFO 12-01 07:52:10 [nvfp4.py:240] Using FLASHINFER_CUTLASS backend"
    " for NvFp4 MoE",
    "(Worker_TP0 pid=4188) WARNING 12-01 07:58:12 [weight_utils.py:1634] Found kv_scale in the"
    " checkpoint (e.g. language_model.model.layers.0.self_attn.k_scale), but not found the"
    " expected name in the model (e.g. language_model.model.layers.0.self_attn.mla_attn.k_scale)."
    " k_scale is not loaded.",
    "(APIServer pid=4050) INFO 12-01 08:06:55 [api_server.py:1352] Starting vLLM API server 0 on"
    " http://0.0.0.0:8000",
]
CPU_AMX = [
    engine_line("auto", "0.32.0").replace("device_config=cuda", "device_config=cpu"),
    "(EngineCore_DP0 pid=311) INFO 12-01 07:40:02 [cpu.py:163] Using AMX_MLA backend.",
]
SM90_FP8 = [
    engine_line("auto"),
    "(EngineCore_DP0 pid=88) INFO 12-01 07:51:02 [cache.py:361] Using fp8 data type to store kv"
    " cache. It reduces the GPU memory footprint and boosts the performance. Meanwhile, it may"
    " cause accuracy drop without a proper scaling factor",
    "(Worker_TP0 pid=90) INFO 12-01 07:51:40 [cuda.py:367] Using FLASHMLA attention backend out"
    " of potential backends: ['FLASHMLA', 'FLASHINFER_MLA', 'TRITON_MLA'].",
    "(Worker_TP0 pid=90) WARNING 12-01 07:58:12 [kv_cache.py:147] Checkpoint does not provide a"
    " q scaling factor. Setting it to k_scale. This only matters for FP8 Attention backends"
    " (flash-attn or flashinfer).",
]


def check(lines: list[str], backend: str, kv: str) -> dict:
    return runtime.vllm_runtime_check(lines, backend, kv, HARMLESS)


def test_source_deployment_as_planned() -> None:
    result = check(SM120_DROPPED, "TRITON_MLA", "none")
    assert result["mismatches"] == []
    assert result["attention_backends"] == ["TRITON_MLA"]  # the vit line is not the model's
    assert result["kv_cache_dtype"] == "auto"
    (warning,) = result["expected_warnings"]
    assert "k_scale is not loaded" in warning


def test_forced_backend_line_is_read() -> None:
    lines = ["INFO 12-01 07:51:40 [cuda.py:331] Using AttentionBackendEnum.CUTLASS_MLA backend."]
    result = check(lines, "CUTLASS_MLA|FLASHINFER_MLA|FLASHMLA", "")
    assert (result["attention_backends"], result["mismatches"]) == (["CUTLASS_MLA"], [])


def test_backend_mismatch_names_both_values() -> None:
    result = check(SM90_FP8, "TRITON_MLA", "fp8")
    assert result["mismatches"] == [
        "attention backend: vLLM logged FLASHMLA, the plan expects TRITON_MLA"
    ]


def test_fp8_kv_running_where_the_plan_dropped_it() -> None:
    result = check(SM90_FP8, "FLASHMLA", "none")
    assert result["mismatches"] == [
        "KV cache dtype: vLLM logged fp8, the plan expects an unquantized (model dtype) cache"
    ]


def test_explicit_bf16_where_the_plan_keeps_fp8() -> None:
    lines = [engine_line("bfloat16"), *SM90_FP8[2:3]]
    assert check(lines, "FLASHMLA", "fp8")["mismatches"] == [
        "KV cache dtype: vLLM logged bfloat16, the plan expects fp8"
    ]


@pytest.mark.parametrize("backend", ["AMX_MLA", "CPU_MLA"])
def test_cpu_demo_accepts_either_mla_backend(backend: str) -> None:
    lines = [CPU_AMX[0], CPU_AMX[1].replace("AMX_MLA", backend)]
    result = check(lines, "CPU_MLA|AMX_MLA", "none")
    assert (result["mismatches"], result["attention_backends"]) == ([], [backend])


def test_unlogged_values_are_notes_not_mismatches() -> None:
    # CPU_ATTN logs no "Using" line; "auto" leaves the dtype to the checkpoint.
    result = check([engine_line("auto")], "CPU_ATTN", "fp8")
    assert result["mismatches"] == []
    assert result["notes"] == [
        "attention backend not logged (plan expects CPU_ATTN)",
        "KV cache dtype auto (plan expects fp8)",
    ]
    assert check([], "unknown", "")["notes"] == []


@pytest.mark.parametrize(
    ("plan", "forced", "want"),
    [
        ({"kv_cache_quant": "absent", "checkpoint_kv_cache_quant": "fp8"}, "", "none"),
        ({"kv_cache_quant": "original", "checkpoint_kv_cache_quant": "fp8"}, "", "fp8"),
        ({"kv_cache_quant": "original", "checkpoint_kv_cache_quant": "none"}, "", "none"),
        ({"kv_cache_quant": "original", "checkpoint_kv_cache_quant": "unknown"}, "", ""),
        ({"kv_cache_quant": "absent", "checkpoint_kv_cache_quant": "fp8"}, "fp8_e4m3", "fp8"),
        ({}, "", ""),
    ],
)
def test_expected_kv_from_plan(plan: dict, forced: str, want: str) -> None:
    assert runtime.vllm_expected_kv(plan, forced) == want


def test_harmless_warnings_are_not_a_diagnosis() -> None:
    """The default patterns cover the scale warnings and none of the known failures."""
    pattern = re.compile("|".join(HARMLESS))
    harmless = [line for line in SM120_DROPPED + SM90_FP8 if pattern.search(line)]
    assert len(harmless) == 2
    failures = [
        "NotImplementedError: TritonMLA V1 with FP8 KV cache not yet supported",
        "RuntimeError: AMXMLAImpl only supports an unquantized (bf16) KV cache; fp8 KV cache"
        " for CPU MLA is not yet implemented",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
    ]
    assert not any(pattern.search(line) for line in failures)
    for diagnosis in DIAGNOSES:
        for line in harmless:
            assert not any(re.search(p, line) for p in diagnosis["patterns"]), diagnosis["name"]
