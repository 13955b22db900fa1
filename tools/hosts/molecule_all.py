#!/usr/bin/env python3
"""Run every Molecule scenario of the project, one after another.

Scenarios: roles/<role>/molecule/<name>/ (run from roles/<role>, so Molecule
sees the role as its project) and molecule/<name>/ (run from the repository
root). Each runs the full `molecule test` sequence of the shared base config
(.config/molecule/config.yml). All run even when one fails; the exit status
is non-zero if any failed or left a container behind.

    molecule_all.py                              # every scenario
    molecule_all.py roles/vllm_service/molecule/default molecule/ssh
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Scenario:
    """One Molecule scenario and where to run it from."""

    path: Path  # the scenario directory, relative to ROOT
    project: Path  # the directory Molecule runs in

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def host(self) -> str:
        """Container name for scenarios that use the base config's platform."""
        owner = self.project.name if self.project != ROOT else "project"
        return f"vf-mol-{owner}-{self.name}".replace("_", "-")


def discover(root: Path) -> list[Scenario]:
    """Return all scenarios: roles' first, then project-level ones."""
    found = [
        Scenario(p.parent.relative_to(root), p.parents[2])
        for p in sorted(root.glob("roles/*/molecule/*/molecule.yml"))
    ]
    found += [
        Scenario(p.parent.relative_to(root), root)
        for p in sorted(root.glob("molecule/*/molecule.yml"))
    ]
    return found


def select(scenarios: list[Scenario], wanted: list[str]) -> list[Scenario]:
    """Keep the scenarios named by path; fail clearly on an unknown one."""
    if not wanted:
        return scenarios
    by_path = {str(s.path): s for s in scenarios}
    unknown = [w for w in wanted if w.rstrip("/") not in by_path]
    if unknown:
        known = "\n  ".join(by_path)
        raise SystemExit(f"no such scenario: {', '.join(unknown)}; known:\n  {known}")
    return [by_path[w.rstrip("/")] for w in wanted]


RUN_LABEL = "vllm-fleet.molecule-run"


def left_behind(run_id: str) -> list[str]:
    """Containers this run created and did not remove (the shared create labels them).

    Only this run's: other sessions may run Molecule on the same host at once.
    """
    out = subprocess.run(
        ["podman", "ps", "-a", "--filter", f"label={RUN_LABEL}={run_id}", "--format", "{{.Names}}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return sorted(out.split())


def run(scenario: Scenario, run_id: str) -> tuple[bool, float]:
    """Run `molecule test` for one scenario; return (passed, seconds)."""
    env = dict(os.environ, VLLM_FLEET_MOLECULE_HOST=scenario.host, VLLM_FLEET_MOLECULE_RUN=run_id)
    print(f"==> molecule test -s {scenario.name}  ({scenario.path})", flush=True)
    start = time.monotonic()
    proc = subprocess.run(
        ["molecule", "test", "-s", scenario.name], cwd=scenario.project, env=env, check=False
    )
    return proc.returncode == 0, time.monotonic() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenarios", nargs="*", help="scenario directories (default: all)")
    args = parser.parse_args()
    scenarios = select(discover(ROOT), args.scenarios)
    run_id = f"{os.getpid()}-{int(time.time())}"
    results = [(s, *run(s, run_id)) for s in scenarios]
    leftover = left_behind(run_id)

    print("\nMolecule scenarios:")
    for scenario, passed, seconds in results:
        print(f"  {'PASS' if passed else 'FAIL'}  {seconds:6.1f}s  {scenario.path}")
    print(f"  total {sum(r[2] for r in results):.1f}s for {len(results)} scenarios")
    if leftover:
        print(f"left running: {', '.join(leftover)}; removing", file=sys.stderr)
        subprocess.run(["podman", "rm", "-f", "-t", "0", *leftover], check=False)
    return 0 if all(r[1] for r in results) and not leftover else 1


if __name__ == "__main__":
    sys.exit(main())
