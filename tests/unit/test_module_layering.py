"""The modules' dependencies run one way: the local proof of a download never needs the hub."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def imported(path: Path) -> set[str]:
    """Every module a file imports (absolute names)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_the_manifest_proof_imports_no_transport() -> None:
    assert not {
        name for name in imported(ROOT / "module_utils/hf_manifest.py")
        if "hf_download" in name or "huggingface_hub" in name
    }  # fmt: skip


def test_the_transport_builds_on_the_proof_and_the_plan_reads_only_the_proof() -> None:
    assert "ansible.module_utils.hf_manifest" in imported(ROOT / "module_utils/hf_download.py")
    plan = imported(ROOT / "library/vllm_fleet_plan.py")
    assert "ansible.module_utils.hf_manifest" in plan
    assert "ansible.module_utils.hf_download" not in plan
