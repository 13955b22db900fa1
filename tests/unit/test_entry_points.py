"""Every role another role or play calls into is called at a declared entry point."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CALLS = ("ansible.builtin.include_role", "ansible.builtin.import_role")


def calls(node: Any) -> Iterator[dict[str, Any]]:
    """Each include_role/import_role of a play list or task list, however nested."""
    if isinstance(node, list):
        for item in node:
            yield from calls(item)
    elif isinstance(node, dict):
        for key, value in node.items():
            if key in CALLS and isinstance(value, dict):
                yield value
            else:
                yield from calls(value)


def entry_points(role: str) -> set[str]:
    spec = ROOT / "roles" / role / "meta/argument_specs.yml"
    return set(yaml.safe_load(spec.read_text())["argument_specs"]) if spec.exists() else set()


def test_every_tasks_from_names_an_entry_point_of_its_role() -> None:
    files = [*ROOT.glob("playbooks/*.yml"), *ROOT.glob("roles/*/tasks/*.yml")]
    called = {
        (str(path.relative_to(ROOT)), call["name"], call["tasks_from"])
        for path in files
        for call in calls(yaml.safe_load(path.read_text()))
        if "tasks_from" in call
    }
    assert len(called) >= 10  # the rolling path, rollback, validation and status call in
    undeclared = [
        (where, role, tasks_from)
        for where, role, tasks_from in sorted(called)
        if Path(tasks_from).stem not in entry_points(role)
    ]
    assert undeclared == []
