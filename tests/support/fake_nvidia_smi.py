#!/usr/bin/env python3
"""FAKE nvidia-smi: replays a fixture directory of reconstructed outputs (no GPU here).

Select the fixture with FAKE_NVIDIA_SMI_FIXTURE (a directory name under
tests/fixtures/nvidia-smi/ or a path). Answers the three invocations gpu_facts makes:
  --query-gpu=... --format=csv,noheader,nounits   -> query.csv
  topo -m                                          -> topo.txt
  (no arguments)                                   -> nvidia-smi.txt
A fixture with an `rc` file prints error.txt and exits with that status (driver not loaded).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "nvidia-smi"
EXPECTED_QUERY = (
    "--query-gpu=index,name,uuid,memory.total,compute_cap,driver_version,"
    "mig.mode.current,pci.bus_id"
)


def fixture_dir() -> Path:
    name = os.environ.get("FAKE_NVIDIA_SMI_FIXTURE", "")
    if not name:
        sys.exit("fake nvidia-smi: set FAKE_NVIDIA_SMI_FIXTURE to a fixture directory")
    path = Path(name) if os.sep in name else FIXTURES / name
    if not path.is_dir():
        sys.exit(f"fake nvidia-smi: no fixture directory {path}")
    return path


def replay(path: Path, args: list[str]) -> int:
    rc_file = path / "rc"
    if rc_file.exists():
        sys.stdout.write((path / "error.txt").read_text())
        return int(rc_file.read_text().strip())
    if not args:
        name = "nvidia-smi.txt"
    elif args[:2] == ["topo", "-m"]:
        name = "topo.txt"
    elif args[0] == EXPECTED_QUERY and "--format=csv,noheader,nounits" in args:
        name = "query.csv"
    else:
        # Like the real one on an unknown field: a message and a non-zero status.
        sys.stderr.write(f"fake nvidia-smi: no recording for arguments {args}\n")
        return 2
    sys.stdout.write((path / name).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(replay(fixture_dir(), sys.argv[1:]))
