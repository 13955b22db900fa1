"""Role vllm_fleet's validation checks the variables against the union of every role's spec."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def validated_roles() -> list[str]:
    # Role vllm_fleet's validation (entry point validate, playbooks/validate.yml).
    return yaml.safe_load((ROOT / "roles/vllm_fleet/vars/main.yml").read_text())[
        "__vllm_fleet_validate_roles"
    ]


def test_the_union_covers_every_role_with_a_spec_and_no_name_is_shared() -> None:
    with_spec = {
        path.parents[1].name
        for path in ROOT.glob("roles/*/meta/argument_specs.yml")
        if "main" in yaml.safe_load(path.read_text())["argument_specs"]
    }
    assert set(validated_roles()) == with_spec
    names = Counter(
        name
        for role in validated_roles()
        for name in yaml.safe_load((ROOT / f"roles/{role}/meta/argument_specs.yml").read_text())[
            "argument_specs"
        ]["main"]["options"]
    )
    # A name in two specs would keep only the last role's type in the union.
    assert [name for name, count in names.items() if count > 1] == []
