"""The compat matrix against vLLM's own code, read from the released wheels.

For every GPU of the nvidia-smi fixtures (and a bare SM11.0), every vLLM
version at a CUDA MLA row's boundary (and the release before it, and the
default pin), and a modelopt checkpoint declaring no KV quantization or FP8:
what the wheel's attention selection accepts (tools/vllm_source.py: cuda.py's
priority order, each backend's KV dtypes and capability predicate, whether the
declaration is read at all) must be what the matrix decides: keep where a
backend serves the declared KV cache, drop where none does or where vLLM does
not read it, and the backend vLLM picks first among the ones the row names.
The wheels' members are cached by version under $VLLM_FLEET_CACHE/vllm-src.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from ansible.module_utils.gpu import build_facts
from ansible.module_utils.vllm_fleet_compat import kv_cache_decision, plan_context

from tools import vllm_source as vs

ROOT = Path(__file__).resolve().parents[2]
MATRIX = yaml.safe_load((ROOT / "roles/preflight/files/compat_matrix.yml").read_text())
FIXTURES = ROOT / "tests/fixtures/nvidia-smi"
DEFAULT_PIN = str(
    yaml.safe_load((ROOT / "roles/vllm_fleet/defaults/main.yml").read_text())[
        "vllm_fleet_vllm_version"
    ]
)
# Each boundary of a CUDA MLA row with the release before it; 0.15.0 (SM10.x
# order changes), 0.21.0 (TOKENSPEED_MLA), the old default 0.16.0, the newest.
PREDECESSOR = {"0.14.0": "0.13.0", "0.18.0": "0.17.1"}
VERSIONS = (
    "0.12.0",
    "0.13.0",
    "0.14.0",
    "0.15.0",
    "0.16.0",
    "0.17.1",
    "0.18.0",
    "0.21.0",
    "0.34.0",
)
# Rows stricter than the backends' declarations, with the code they rest on instead.
STRICTER = {
    "below-sm89-fp8": "Triton has no fp8e4nv lowering below SM89 (vLLM PRs #43914, #47060)",
}


def capabilities() -> list[str]:
    found = {"11.0"}
    for d in FIXTURES.iterdir():
        if (d / "query.csv").is_file():
            facts = build_facts((d / "query.csv").read_text(), "", "", [])
            found.update(g["compute_capability"] for g in facts.get("gpus", []))
    return sorted(found, key=lambda c: tuple(int(p) for p in c.split(".")))


def disagreements(src: vs.Source, cc_text: str, kv: str) -> list[str]:
    """What the matrix decides for (GPU, version, KV) that the version's code contradicts."""
    major, minor = (int(p) for p in cc_text.split("."))
    cc = vs.DeviceCapability(major, minor)
    bf16 = vs.select(src, cc, "none")
    declared = vs.select(src, cc, kv)
    gpu = {"gpus": [{"compute_capability": cc_text}], "summary": {}}
    decision = kv_cache_decision(MATRIX, plan_context("cuda", gpu, src.version, "mla", kv, 8))
    where = f"SM{cc_text} vLLM {src.version} KV {kv} [row {decision['rule']}]"
    problems = []
    if kv == "none" or declared["kv_cache_dtype"] == "auto" or not declared["accepted"]:
        # Nothing to keep: no declaration, one vLLM never reads, or one no backend serves.
        runs = bf16["accepted"]
        if kv != "none" and decision["kv_cache"] != "drop":
            why = "does not read it" if declared["kv_cache_dtype"] == "auto" else "has no backend"
            problems.append(f"{where}: the matrix keeps the KV declaration, vLLM {why}")
    elif decision["rule"] in STRICTER:
        runs = bf16["accepted"]
    else:
        runs = declared["accepted"]
        if decision["kv_cache"] != "keep":
            problems.append(f"{where}: the matrix drops a KV cache {runs} serve")
    named = decision["attention_backend"].split("|")
    if not runs:
        problems.append(f"{where}: no MLA backend at all ({bf16['rejected']})")
    elif runs[0] not in named:
        problems.append(f"{where}: vLLM picks {runs[0]} first, the matrix expects {named}")
    stray = [n for n in named if n not in runs]
    if runs and stray:
        problems.append(f"{where}: the matrix names {stray}, which vLLM rejects here")
    return problems


@pytest.fixture(scope="module")
def sources() -> dict[str, vs.Source]:
    return {v: vs.load(v) for v in VERSIONS}


def test_the_versions_cover_every_boundary_and_the_default_pin() -> None:
    bounds = {
        str(row["match"]["vllm_version"][key])
        for row in MATRIX["kv_cache_rules"]
        if row.get("match", {}).get("device") == "cuda" and "vllm_version" in row["match"]
        for key in ("min", "max_exclusive")
        if key in row["match"]["vllm_version"]
    }
    assert bounds <= set(PREDECESSOR), bounds
    assert set(PREDECESSOR.items()) and all({b, p} <= set(VERSIONS) for b, p in PREDECESSOR.items())
    assert VERSIONS[-1] == DEFAULT_PIN, "the default pin is the newest release verified here"


@pytest.mark.parametrize("kv", ["none", "fp8"])
@pytest.mark.parametrize("version", VERSIONS)
def test_every_cuda_mla_row_agrees_with_the_wheel(
    sources: dict[str, vs.Source], version: str, kv: str
) -> None:
    problems = [p for cc in capabilities() for p in disagreements(sources[version], cc, kv)]
    assert problems == []


def test_every_cuda_mla_row_cites_its_source() -> None:
    rows = [
        r
        for r in MATRIX["kv_cache_rules"]
        if r.get("match", {}).get("device") == "cuda" and r["match"].get("attention") != "mha"
    ]
    assert rows and [r["id"] for r in rows if not str(r.get("source", "")).strip()] == []


def test_the_sm90_row_follows_vllm_order(sources: dict[str, vs.Source]) -> None:
    # The row the matrix had wrong: FLASH_ATTN_MLA is first on SM90 with a bf16 KV cache.
    got = vs.select(sources["0.34.0"], vs.DeviceCapability(9, 0), "none")
    assert got["accepted"][0] == "FLASH_ATTN_MLA"
    assert (
        vs.select(sources["0.34.0"], vs.DeviceCapability(9, 0), "fp8")["accepted"][0] == "FLASHMLA"
    )


def test_a_row_the_code_contradicts_is_reported(
    sources: dict[str, vs.Source], tmp_path: Path
) -> None:
    """0.16.0 with a triton_mla.py that lists fp8: the SM12 drop row is then wrong."""
    real = sources["0.16.0"]
    doctored = tmp_path / "0.16.0"
    shutil.copytree(real.root, doctored)
    triton = doctored / "vllm/v1/attention/backends/mla/triton_mla.py"
    text = triton.read_text()
    assert '"bfloat16",\n    ]' in text
    triton.write_text(
        text.replace('"bfloat16",\n    ]', '"bfloat16",\n        "fp8_e4m3",\n    ]', 1)
    )
    problems = disagreements(vs.Source("0.16.0", doctored), "12.0", "fp8")
    assert problems and "the matrix drops a KV cache ['TRITON_MLA'] serve" in problems[0], problems
    assert disagreements(real, "12.0", "fp8") == []


def test_the_reader_fails_loudly_on_code_it_cannot_read(tmp_path: Path) -> None:
    with pytest.raises(LookupError, match=r"none of vllm/platforms/cuda\.py"):
        vs.priorities(vs.Source("9.9.9", tmp_path), vs.DeviceCapability(9, 0), "auto")
