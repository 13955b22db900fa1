# Copyright: vllm-fleet contributors
# Apache-2.0
"""The compatibility matrix evaluator and the plan's fit checks: decision logic in one place.

The matrix itself is data (roles/preflight/files/compat_matrix.yml), passed in as a dict.
Pure functions, stdlib only (they run on the nodes inside library/vllm_fleet_plan.py);
packaging parses versions where it is installed, a stdlib key with its ordering elsewhere.
"""

from __future__ import annotations

import re
from typing import Any

# The same declaration paths library/hf_quant_config.py patches (one reader, not two).
from ansible.module_utils.hf_quant import (
    CONFIG_FILE,
    HF_QUANT_FILE,
    find_declarations,
    get_path,
    quant_section_paths,
)

try:
    from packaging.version import InvalidVersion as _InvalidVersion
    from packaging.version import Version as _PackagingVersion
except ImportError:  # Debian nodes: python3 without python3-packaging
    _PackagingVersion = None
    _InvalidVersion = ValueError

GIB = 1024**3
MIB = 1024**2

# Architectures using Multi-head Latent Attention even when kv_lora_rank is not visible.
MLA_ARCHITECTURES = frozenset(
    {
        "DeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM",
        "DeepseekV32ForCausalLM",
        "KimiK25ForConditionalGeneration",
        "KimiVLForConditionalGeneration",
        "DeepseekVLV2ForCausalLM",
    }
)
ATTENTION_FAMILIES = ("mla", "mha", "unknown")
KV_QUANTS = ("none", "fp8", "int8", "nvfp4", "unknown")
# A drop row's backend: whatever the row for an undeclared KV cache expects.
AS_UNQUANTIZED = "as-unquantized"


class MatrixError(ValueError):
    """The matrix or an input to it is malformed; the message says where."""


# ---------------------------------------------------------------- versions


def parse_version(text: str) -> Any:
    """A PEP 440 version that compares as pip does: 0.18.0.dev1 < 0.18.0rc1 < 0.18.0 <
    0.18.0+cu130 < 0.18.0.post1. packaging where importable (the controller); else a
    stdlib key with packaging's ordering (Debian nodes ship python3 without it)."""
    text = str(text).strip()
    if _PackagingVersion is not None:
        try:
            return _PackagingVersion(text)
        except _InvalidVersion:
            pass
    else:
        key = pep440_key(text)
        if key is not None:
            return key
    raise MatrixError(f"cannot parse version {text!r} (expected PEP 440, e.g. 0.18.0rc1, 0.18.0)")


# packaging's VERSION_PATTERN (PEP 440 appendix B), for hosts without packaging.
_PEP440 = re.compile(
    r"""^\s*v?(?:(?P<epoch>[0-9]+)!)?(?P<release>[0-9]+(?:\.[0-9]+)*)
    (?P<pre>[-_.]?(?P<pre_l>alpha|a|beta|b|preview|pre|c|rc)[-_.]?(?P<pre_n>[0-9]+)?)?
    (?P<post>(?:-(?P<post_n1>[0-9]+))|(?:[-_.]?(?P<post_l>post|rev|r)[-_.]?(?P<post_n2>[0-9]+)?))?
    (?P<dev>[-_.]?(?P<dev_l>dev)[-_.]?(?P<dev_n>[0-9]+)?)?
    (?:\+(?P<local>[a-z0-9]+(?:[-_.][a-z0-9]+)*))?\s*$""",
    re.VERBOSE | re.IGNORECASE,
)
_PRE_RANK = {"a": 0, "alpha": 0, "b": 1, "beta": 1, "c": 2, "pre": 2, "preview": 2, "rc": 2}
_LOW, _HIGH = (-1,), (1,)


def pep440_key(text: str) -> tuple | None:
    """packaging.version.Version's sort key, stdlib only; None when not PEP 440."""
    m = _PEP440.match(text)
    if not m:
        return None
    release = [int(p) for p in m.group("release").split(".")]
    while len(release) > 1 and release[-1] == 0:
        release.pop()
    pre = (
        (0, _PRE_RANK[m.group("pre_l").lower()], int(m.group("pre_n") or 0))
        if m.group("pre")
        else None
    )
    post_n = m.group("post_n1") or m.group("post_n2")
    post = (0, int(post_n or 0)) if m.group("post") else _LOW
    dev = (0, int(m.group("dev_n") or 0)) if m.group("dev") else _HIGH
    if pre is None:
        pre = _LOW if post == _LOW and dev != _HIGH else _HIGH
    local: tuple = _LOW
    if m.group("local"):
        parts = re.split(r"[-_.]", m.group("local").lower())
        local = (0, *((1, int(p), "") if p.isdigit() else (0, 0, p) for p in parts))
    return (int(m.group("epoch") or 0), tuple(release), pre, post, dev, local)


def parse_compute_capability(text: str) -> tuple[int, int]:
    match = re.match(r"^\s*(\d+)\.(\d+)\s*$", str(text))
    if not match:
        raise MatrixError(f"cannot parse compute capability {text!r} (expected e.g. 12.0)")
    return int(match.group(1)), int(match.group(2))


def _in_range(value: Any, spec: dict[str, Any], parse) -> bool:
    if "min" in spec and parse(value) < parse(spec["min"]):
        return False
    return not ("max_exclusive" in spec and parse(value) >= parse(spec["max_exclusive"]))


# ---------------------------------------------------------------- the checkpoint


def kv_quant_name(value: Any) -> str:
    """Normalize a declaration (kv_cache_quant_algo string or kv_cache_scheme dict)."""
    if value in (None, "", {}, []):
        return "none"
    if isinstance(value, dict):
        bits, kind = value.get("num_bits"), str(value.get("type", "")).lower()
        if bits == 8 and kind == "float":
            return "fp8"
        if bits == 8 and kind == "int":
            return "int8"
        if bits == 4 and kind == "float":
            return "nvfp4"
        return "unknown"
    name = str(value).strip().lower()
    if name.startswith("fp8"):
        return "fp8"
    if name in ("int8", "nvfp4"):
        return name
    return "unknown"


def kv_quant_from_docs(config: dict[str, Any] | None, hf_quant: dict[str, Any] | None) -> str:
    """The checkpoint's KV quantization, from the same places hf_quant_config patches."""
    names: set[str] = set()
    for filename, doc in ((CONFIG_FILE, config), (HF_QUANT_FILE, hf_quant)):
        if doc:
            names.update(kv_quant_name(v) for v in find_declarations(filename, doc).values())
    names.discard("none")
    if not names:
        return "none"
    if len(names) == 1:
        return names.pop()
    return "fp8" if "fp8" in names else sorted(names)[0]


def weight_quant_from_docs(config: dict[str, Any] | None, hf_quant: dict[str, Any] | None) -> str:
    """The checkpoint's weight quantization (a ModelOpt quant_algo, lower case: nvfp4, fp8, ...),
    from the same sections hf_quant_config reads; '' when none is declared."""
    for filename, doc in ((HF_QUANT_FILE, hf_quant), (CONFIG_FILE, config)):
        for section in quant_section_paths(filename) if doc else []:
            for path in ((*section, "quantization", "quant_algo"), (*section, "quant_algo")):
                present, value = get_path(doc, path)
                if present and isinstance(value, str) and value:
                    return value.lower()
    return ""


# NVFP4 GEMMs run on FP4 tensor cores from SM100 (vllm nvfp4_utils.py cutlass_fp4_supported);
# below, vLLM falls back to Marlin's weight-only FP4 (marlin_utils_fp4.py: SM75 and up).
FP4_NATIVE_CC = (10, 0)
FP4_MARLIN_CC = (7, 5)


def nvfp4_notes(
    device: str, compute_capability: str | None, weight_quant: str
) -> tuple[list[str], list[str]]:
    """(warnings, problems) for NVFP4 weights on this host's lowest GPU."""
    if device != "cuda" or weight_quant != "nvfp4" or not compute_capability:
        return [], []
    cc = parse_compute_capability(compute_capability)
    if cc >= FP4_NATIVE_CC:
        return [], []
    if cc < FP4_MARLIN_CC:
        return [], [
            f"NVFP4 weights need SM7.5 or later (vLLM's Marlin FP4 fallback, "
            f"marlin_utils_fp4.py); this host's GPUs are SM{compute_capability}"
        ]
    return [
        f"NVFP4 weights on SM{compute_capability}: these GPUs have no FP4 tensor cores (SM10.0 "
        "and later do), so vLLM serves the checkpoint through its weight-only FP4 fallback "
        "(Marlin: the weights stay 4-bit in memory and are expanded to bf16 in every matmul). "
        "The memory saving stays; the FP4 compute does not: prefill and large batches run at "
        "bf16 speed or below (vLLM: 'may degrade performance for compute-heavy workloads'). An "
        "FP8 or bf16 checkpoint of the model may serve faster here if it fits"
    ], []


def attention_from_config(config: dict[str, Any] | None) -> str:
    """mla when the (text) config has kv_lora_rank or an MLA architecture, else mha."""
    if not config:
        return "unknown"
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    for cfg in (config, text):
        if cfg.get("kv_lora_rank"):
            return "mla"
        if MLA_ARCHITECTURES.intersection(cfg.get("architectures") or []):
            return "mla"
    return "mha"


def checkpoint_traits(
    config: dict[str, Any] | None,
    hf_quant: dict[str, Any] | None,
    declared_attention: str = "",
    declared_kv_quant: str = "",
) -> dict[str, Any]:
    """Attention family and KV quant: from the files when on disk, else the profile's hints."""
    warnings: list[str] = []
    if config is not None:
        attention = attention_from_config(config)
        kv = kv_quant_from_docs(config, hf_quant)
        source = "checkpoint"
        if declared_attention and declared_attention != attention:
            warnings.append(
                f"profile declares attention {declared_attention!r} but the checkpoint's "
                f"config.json says {attention!r}; using the checkpoint"
            )
        if declared_kv_quant and declared_kv_quant != kv:
            warnings.append(
                f"profile declares KV cache quant {declared_kv_quant!r} but the checkpoint "
                f"declares {kv!r}; using the checkpoint"
            )
    elif declared_attention or declared_kv_quant:
        attention = declared_attention or "unknown"
        kv = declared_kv_quant or "unknown"
        source = "profile"
    else:
        attention, kv, source = "unknown", "unknown", "none"
    return {
        "attention_family": attention,
        "kv_cache_quant": kv,
        "source": source,
        "warnings": warnings,
    }


# ---------------------------------------------------------------- the matrix


_MATCH_KEYS = {
    "device",
    "compute_capability",
    "vllm_version",
    "attention",
    "kv_cache_quant",
    "interconnect",
    "widest_pcie_path",
    "infiniband",
    "mig",
    "world_size",
}


def _check_range(where: str, spec: Any, parse, errors: list[str]) -> None:
    if not isinstance(spec, dict) or not set(spec) <= {"min", "max_exclusive"} or not spec:
        errors.append(f"{where}: expected a mapping with min and/or max_exclusive")
        return
    for key, value in spec.items():
        try:
            parse(value)
        except MatrixError as exc:
            errors.append(f"{where}.{key}: {exc}")


def _check_match(where: str, match: Any, errors: list[str]) -> None:
    if not isinstance(match, dict):
        errors.append(f"{where}.match: expected a mapping")
        return
    for key in set(match) - _MATCH_KEYS:
        errors.append(
            f"{where}.match: unknown key {key!r} (known: {', '.join(sorted(_MATCH_KEYS))})"
        )
    if "compute_capability" in match:
        _check_range(
            f"{where}.match.compute_capability",
            match["compute_capability"],
            parse_compute_capability,
            errors,
        )
    if "vllm_version" in match:
        _check_range(f"{where}.match.vllm_version", match["vllm_version"], parse_version, errors)
    if "world_size" in match:
        _check_range(f"{where}.match.world_size", match["world_size"], int, errors)


def validate_matrix(matrix: Any) -> list[str]:
    """Every structural problem of the matrix, so a bad edit fails with all its reasons."""
    errors: list[str] = []
    if not isinstance(matrix, dict):
        return ["compat matrix: expected a mapping with kv_cache_rules, nccl_profiles, rejections"]
    spec = {
        "kv_cache_rules": ("kv_cache", "attention_backend", "reason"),
        "nccl_profiles": ("env", "reason"),
        "rejections": ("reason",),
    }
    for section, required in spec.items():
        rows = matrix.get(section)
        if not isinstance(rows, list) or not rows:
            errors.append(f"compat matrix: {section} must be a non-empty list")
            continue
        for i, row in enumerate(rows):
            where = f"{section}[{i}]"
            if not isinstance(row, dict) or "id" not in row:
                errors.append(f"{where}: expected a mapping with an id")
                continue
            where = f"{section}[{row['id']}]"
            _check_match(where, row.get("match", {}), errors)
            decision = row if section == "rejections" else row.get("decision")
            if not isinstance(decision, dict):
                errors.append(f"{where}: missing decision mapping")
                continue
            errors.extend(f"{where}: decision lacks {k}" for k in required if k not in decision)
            kv = decision.get("kv_cache")
            if section == "kv_cache_rules" and kv not in (None, "keep", "drop"):
                errors.append(f"{where}: kv_cache must be keep or drop, not {kv!r}")
            env = decision.get("env")
            if section == "nccl_profiles" and not isinstance(env, dict):
                errors.append(f"{where}: env must be a mapping")
    return errors


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def matches(match: dict[str, Any], ctx: dict[str, Any]) -> bool:
    """Whether a row's match block holds for this context (absent keys match anything)."""
    for key, want in match.items():
        have = ctx.get(key)
        if key in ("compute_capability", "vllm_version", "world_size"):
            if have is None:
                return False
            parse = {
                "compute_capability": parse_compute_capability,
                "vllm_version": parse_version,
                "world_size": int,
            }[key]
            if not _in_range(have, want, parse):
                return False
        elif have not in _as_list(want):
            return False
    return True


def first_match(rows: list[dict[str, Any]], ctx: dict[str, Any]) -> dict[str, Any] | None:
    return next((row for row in rows if matches(row.get("match", {}), ctx)), None)


def kv_cache_decision(matrix: dict[str, Any], ctx: dict[str, Any]) -> dict[str, Any]:
    """keep/drop the checkpoint's KV quantization and the attention backend to expect."""
    row = first_match(matrix["kv_cache_rules"], ctx)
    if row is None:
        return {
            "rule": None,
            "kv_cache": "keep",
            "attention_backend": "unknown",
            "reason": "no compat matrix row matched; the checkpoint is left as it is",
        }
    decision = row["decision"]
    backend = decision["attention_backend"]
    if backend == AS_UNQUANTIZED and ctx.get("kv_cache_quant") != "none":
        backend = kv_cache_decision(matrix, {**ctx, "kv_cache_quant": "none"})["attention_backend"]
    if isinstance(backend, dict):
        backend = backend.get(ctx.get("attention"), backend.get("default", "unknown"))
    return {
        "rule": row["id"],
        "kv_cache": decision["kv_cache"],
        "attention_backend": backend,
        "reason": decision["reason"].strip(),
    }


# nvidia-smi topo -m path -> NCCL_P2P_LEVEL (NCCL has no NODE level: PHB covers it).
P2P_LEVEL = {"PIX": "PIX", "PXB": "PXB", "PHB": "PHB", "NODE": "PHB", "SYS": "SYS"}
FROM_TOPOLOGY = "from-topology"


def nccl_decision(
    matrix: dict[str, Any],
    ctx: dict[str, Any],
    p2p_disable: bool | None = None,
    disable_custom_all_reduce: bool | None = None,
) -> dict[str, Any]:
    """NCCL environment and the custom all-reduce switch; a switch given wins the row's default."""
    row = first_match(matrix["nccl_profiles"], ctx)
    decision = row["decision"] if row else {"env": {}}
    env = {str(k): str(v) for k, v in decision["env"].items()}
    if env.get("NCCL_P2P_LEVEL") == FROM_TOPOLOGY:
        env["NCCL_P2P_LEVEL"] = P2P_LEVEL.get(str(ctx.get("widest_pcie_path")), "SYS")
    disable = decision.get("p2p_disable", False) if p2p_disable is None else p2p_disable
    if disable:
        # P2P off: a P2P level would be meaningless; vLLM's custom all-reduce needs P2P.
        env.pop("NCCL_P2P_LEVEL", None)
        env["NCCL_P2P_DISABLE"] = "1"
    no_car = bool(decision.get("disable_custom_all_reduce", False) or disable)
    if disable_custom_all_reduce is not None:
        no_car = disable_custom_all_reduce
    return {
        "profile": row["id"] if row else None,
        "env": env,
        "disable_custom_all_reduce": no_car,
        "reason": decision["reason"].strip() if row else "no NCCL profile matched: NCCL defaults",
    }


def rejections(matrix: dict[str, Any], ctx: dict[str, Any]) -> list[str]:
    return [
        f"{row['reason'].strip()} [compat matrix: {row['id']}]"
        for row in matrix["rejections"]
        if matches(row.get("match", {}), ctx)
    ]


# ---------------------------------------------------------------- fit checks


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def gpu_fit_problems(
    gpu: dict[str, Any],
    tensor_parallel: int,
    pipeline_parallel: int,
    checkpoint_bytes: int,
    memory_utilization: float,
    min_kv_cache_bytes: int,
    nodes: int = 1,
) -> list[str]:
    """Parallel size vs GPUs (each of a replica's nodes holds its share), and weights per
    GPU + a minimum KV budget vs GPU memory."""
    problems: list[str] = []
    world = tensor_parallel * pipeline_parallel
    share = -(-world // max(nodes, 1))
    if not gpu.get("nvidia_smi_found"):
        return [
            "no NVIDIA driver: nvidia-smi not found (device is cuda; install the driver or "
            "set vllm_fleet_device: cpu)"
        ]
    if not gpu.get("driver_loaded"):
        return [f"NVIDIA driver not loaded: {gpu.get('message', 'nvidia-smi failed')}"]
    count = int(gpu.get("gpu_count", 0))
    if count == 0:
        return ["nvidia-smi reports no GPUs"]
    if share > count:
        over = f" over {nodes} nodes, {share} on each" if nodes > 1 else ""
        problems.append(
            f"tensor_parallel_size {tensor_parallel} x pipeline_parallel_size {pipeline_parallel}"
            f" = {world} GPUs needed{over}, this host has {count}"
        )
    memories = [g["memory_mib"] for g in gpu.get("gpus", []) if g.get("memory_mib")]
    if memories and world > 0:
        usable = min(memories) * MIB * memory_utilization
        weights = checkpoint_bytes / world
        need = weights + min_kv_cache_bytes
        if need > usable:
            problems.append(
                f"weights per GPU {_gib(weights)} (checkpoint {_gib(checkpoint_bytes)} / {world})"
                f" + minimum KV cache {_gib(min_kv_cache_bytes)} = {_gib(need)} exceeds usable GPU"
                f" memory {_gib(usable)} ({min(memories)} MiB x {memory_utilization})"
            )
    return problems


def cpu_fit_problems(
    mem_total_bytes: int, checkpoint_bytes: int, kv_cache_bytes: int, overhead_bytes: int
) -> list[str]:
    need = checkpoint_bytes + kv_cache_bytes + overhead_bytes
    if need > mem_total_bytes:
        return [
            f"host memory {_gib(mem_total_bytes)} is less than checkpoint {_gib(checkpoint_bytes)}"
            f" + KV cache {_gib(kv_cache_bytes)} + server overhead {_gib(overhead_bytes)}"
            f" = {_gib(need)}"
        ]
    return []


def peer_problems(me: dict[str, Any], peers: list[dict[str, Any]]) -> list[str]:
    """Hosts of one multi-GPU group must agree on GPU model and driver."""
    problems: list[str] = []
    for peer in peers:
        if peer.get("host") == me.get("host"):
            continue
        for key, label in (("gpu_names", "GPU model"), ("driver_version", "driver version")):
            if peer.get(key) != me.get(key):
                problems.append(
                    f"{label} differs from {peer.get('host')} in group {me.get('group')}: "
                    f"{me.get(key)} here, {peer.get(key)} there"
                )
    return problems


def plan_context(
    device: str,
    gpu: dict[str, Any],
    vllm_version: str,
    attention: str,
    kv_quant: str,
    world_size: int,
) -> dict[str, Any]:
    """The keys matrix rows match on, for one host."""
    ccs = sorted(
        {g["compute_capability"] for g in gpu.get("gpus", []) if g.get("compute_capability")},
        key=parse_compute_capability,
    )
    summary = gpu.get("summary", {})
    return {
        "device": device,
        # The lowest capability decides: every GPU of the world must run the backend.
        "compute_capability": ccs[0] if device == "cuda" and ccs else None,
        "vllm_version": vllm_version,
        "attention": attention,
        "kv_cache_quant": kv_quant,
        "interconnect": summary.get("interconnect", "none"),
        "widest_pcie_path": summary.get("widest_pcie_path"),
        "infiniband": bool(gpu.get("infiniband")),
        "mig": bool(gpu.get("mig_enabled")),
        "world_size": world_size,
    }


# ---------------------------------------------------------------- KV cache memory

_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: nested text_config (Kimi-K2.5, VL wrappers) or the top."""
    nested = config.get("text_config")
    return {**config, **nested} if isinstance(nested, dict) else config


def kv_dtype_bytes(kv_cache_dtype: str, kv_kept: str, config: dict[str, Any]) -> int:
    """Bytes per KV element: the explicit --kv-cache-dtype, else the checkpoint's KV
    quantization when the plan keeps it (fp8: 1), else the model dtype (auto)."""
    name = (kv_cache_dtype or "auto").lower()
    if name.startswith("fp8"):
        return 1
    if name != "auto":
        return _DTYPE_BYTES.get(name, 2)
    if kv_kept == "fp8":
        return 1
    text = text_config(config)
    dtype = str(text.get("torch_dtype") or text.get("dtype") or "bfloat16").lower()
    return _DTYPE_BYTES.get(dtype.removeprefix("torch."), 2)


def kv_bytes_per_token(
    config: dict[str, Any], dtype_bytes: int, tensor_parallel: int, pipeline_parallel: int
) -> tuple[int, str]:
    """KV bytes one token takes on one GPU, and the formula with its numbers.

    MLA caches one latent (kv_lora_rank + qk_rope_head_dim) per layer, the same on
    every TP rank (vLLM replicates it); GQA/MHA caches K and V for the rank's share of
    the KV heads (at least one). Pipeline stages split the layers.
    """
    text = text_config(config)
    layers = -(-int(text["num_hidden_layers"]) // max(1, pipeline_parallel))
    if text.get("kv_lora_rank"):
        latent = int(text["kv_lora_rank"]) + int(text.get("qk_rope_head_dim") or 0)
        total = latent * layers * dtype_bytes
        return total, (
            f"MLA ({text['kv_lora_rank']} + {text.get('qk_rope_head_dim') or 0}) x {layers} layers"
            f" x {dtype_bytes} B = {total} B/token"
        )
    heads = int(text.get("num_key_value_heads") or text["num_attention_heads"])
    head_dim = int(
        text.get("head_dim") or int(text["hidden_size"]) // int(text["num_attention_heads"])
    )
    per_rank = max(1, heads // max(1, tensor_parallel))
    total = 2 * per_rank * head_dim * layers * dtype_bytes
    return total, (
        f"2 x {per_rank} KV heads x {head_dim} x {layers} layers x {dtype_bytes} B"
        f" = {total} B/token"
    )


def default_max_model_len(config: dict[str, Any]) -> int:
    return int(text_config(config).get("max_position_embeddings") or 0)


def context_fit(
    gpu_memory_bytes: int,
    memory_utilization: float,
    weights_per_gpu: float,
    overhead_bytes: int,
    kv_per_token: int,
    max_model_len: int,
) -> dict[str, Any]:
    """Whether one full max_model_len sequence's KV fits beside the weights on one GPU."""
    budget = gpu_memory_bytes * memory_utilization - weights_per_gpu - overhead_bytes
    fits_tokens = int(max(0, budget) // kv_per_token) if kv_per_token else 0
    return {
        "kv_budget_bytes": int(budget),
        "kv_bytes_per_token": kv_per_token,
        "kv_bytes_max_model_len": kv_per_token * max_model_len,
        "max_model_len": max_model_len,
        "largest_fitting_len": fits_tokens,
        "fits": kv_per_token * max_model_len <= budget,
    }


def context_fit_problem(fit: dict[str, Any], formula: str, memory_utilization: float) -> list[str]:
    if fit["fits"]:
        return []
    need = fit["kv_bytes_max_model_len"]
    return [
        f"max-model-len {fit['max_model_len']} needs {_gib(need)} of KV cache per GPU for one"
        f" full sequence ({formula}), but only {_gib(max(0, fit['kv_budget_bytes']))} is left"
        f" after the weights and the overhead at gpu-memory-utilization {memory_utilization};"
        f" the largest context that fits is {fit['largest_fitting_len']} tokens: set"
        f" vllm_fleet_engine_args['max-model-len'] to at most that, raise"
        f" gpu-memory-utilization, or use more GPUs"
    ]
