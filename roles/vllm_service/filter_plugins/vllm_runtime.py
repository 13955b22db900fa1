# Copyright: vllm-fleet contributors
# Apache-2.0
"""What vLLM says it runs (attention backend, KV cache dtype), against the plan."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

# vllm/platforms/cuda.py: "Using TRITON_MLA attention backend out of potential backends: [...]"
# or "Using FLASHMLA backend." (a forced backend); vllm/platforms/cpu.py: "Using AMX_MLA
# backend." The vision tower's "Using backend X for vit attention" is not the model's.
# Only these two shapes: other "Using X backend" lines (MoE, sampling) are not attention.
_BACKEND = re.compile(
    r"\bUsing (?:AttentionBackendEnum\.)?([A-Z][A-Z0-9_]+)"
    r" (?:attention backend out of potential backends|backend\.\s*$)"
)
# vllm/config/vllm.py, logged by vllm/v1/engine/core.py at "Initializing a V1 LLM engine".
_KV_CONFIG = re.compile(r"\bkv_cache_dtype=([A-Za-z0-9_]+)")
# vllm/config/cache.py, when the cache dtype is quantized.
_KV_QUANTIZED = re.compile(r"\bUsing ([A-Za-z0-9_]+) data type to store kv cache")
_UNQUANTIZED = ("auto", "bfloat16", "float16", "half", "float32", "float")


def _kv_family(dtype: str) -> str:
    name = dtype.lower()
    if name.startswith("fp8"):
        return "fp8"
    if name.startswith("nvfp4"):
        return "nvfp4"
    if name.startswith("int8"):
        return "int8"
    return "none" if name in _UNQUANTIZED else name


def logged_runtime(lines: Iterable[str], expected_warnings: Iterable[str] = ()) -> dict[str, Any]:
    """Backends, KV cache dtype and the known harmless warnings vLLM logged."""
    lines = [str(line).split("\r")[-1] for line in lines or []]
    harmless = [re.compile(p) for p in expected_warnings or []]
    backends = [m.group(1) for line in lines if (m := _BACKEND.search(line))]
    configured = [m.group(1) for line in lines if (m := _KV_CONFIG.search(line))]
    quantized = [m.group(1) for line in lines if (m := _KV_QUANTIZED.search(line))]
    return {
        "attention_backends": list(dict.fromkeys(backends)),
        # The dtype asked for ("auto" = the checkpoint's), then what it resolved to.
        "kv_cache_dtype": quantized[-1] if quantized else (configured[-1] if configured else None),
        "kv_cache_dtype_requested": configured[-1] if configured else None,
        "expected_warnings": list(
            dict.fromkeys(line for line in lines if any(p.search(line) for p in harmless))
        ),
    }


def vllm_runtime_check(
    lines: Iterable[str],
    expected_backend: str,
    expected_kv_cache_quant: str,
    expected_warnings: Iterable[str] = (),
) -> dict[str, Any]:
    """Compare what vLLM logged with the plan; mismatches name both values.

    *expected_backend*: alternatives joined by '|' ('' or 'unknown' = not checked).
    *expected_kv_cache_quant*: none (an unquantized cache), fp8, ... ('' = not checked).
    A value vLLM did not log (CPU_ATTN logs no line; "auto" is the checkpoint's choice)
    is reported as not logged, not as a mismatch.
    """
    logged = logged_runtime(lines, expected_warnings)
    mismatches: list[str] = []
    notes: list[str] = []
    allowed = [b for b in str(expected_backend or "").split("|") if b and b != "unknown"]
    if allowed:
        if not logged["attention_backends"]:
            notes.append(f"attention backend not logged (plan expects {expected_backend})")
        for backend in logged["attention_backends"]:
            if backend not in allowed:
                mismatches.append(
                    f"attention backend: vLLM logged {backend}, the plan expects {expected_backend}"
                )
    want = str(expected_kv_cache_quant or "")
    dtype = logged["kv_cache_dtype"]
    if want and want != "unknown":
        if dtype is None or dtype == "auto":
            notes.append(f"KV cache dtype {dtype or 'not logged'} (plan expects {want})")
        elif _kv_family(dtype) != want:
            mismatches.append(
                f"KV cache dtype: vLLM logged {dtype}, the plan expects "
                f"{'an unquantized (model dtype) cache' if want == 'none' else want}"
            )
    return {**logged, "mismatches": mismatches, "notes": notes}


def vllm_expected_kv(plan: Mapping[str, Any] | None, forced_dtype: str = "") -> str:
    """The KV cache family the plan expects vLLM to run ('' when nothing is known)."""
    if forced_dtype:
        return _kv_family(forced_dtype)
    if not plan:
        return ""
    if plan.get("kv_cache_quant") == "absent":
        return "none"
    declared = str(plan.get("checkpoint_kv_cache_quant") or "")
    return "" if declared == "unknown" else declared


class FilterModule:
    """vllm_service runtime filters."""

    def filters(self) -> dict[str, Any]:
        return {"vllm_runtime_check": vllm_runtime_check, "vllm_expected_kv": vllm_expected_kv}
