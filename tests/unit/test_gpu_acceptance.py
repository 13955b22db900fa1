"""tools/gpu-acceptance against a fixture replayed by the named FAKE nvidia-smi."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FAKE = ROOT / "tests/support/fake_nvidia_smi.py"


def test_capture_replays_and_plans_with_the_fake(tmp_path: Path) -> None:
    out = tmp_path / "capture"
    env = {**os.environ, "FAKE_NVIDIA_SMI_FIXTURE": "rtx-pro-6000-x8", "PYTHON": sys.executable}
    proc = subprocess.run(
        [str(ROOT / "tools/gpu-acceptance"), "--nvidia-smi", str(FAKE), "--out", str(out)],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    fixture = ROOT / "tests/fixtures/nvidia-smi/rtx-pro-6000-x8"
    for name in ("query.csv", "topo.txt", "nvidia-smi.txt"):
        assert (out / name).read_text() == (fixture / name).read_text()
    note = (out / "acceptance.md").read_text()
    assert "no real GPU was used" in note
    assert "8 x NVIDIA RTX PRO 6000 Blackwell Server Edition (SM12.0, 97887 MiB)" in note
    assert "[sm11-sm12-mla-fp8-before-pr34597], backend TRITON_MLA" in note
    assert '"NCCL_P2P_LEVEL": "SYS"' in note
    assert "- problems: none" in note


def test_no_driver_fails_with_the_reason(tmp_path: Path) -> None:
    env = {**os.environ, "FAKE_NVIDIA_SMI_FIXTURE": "no-driver", "PYTHON": sys.executable}
    proc = subprocess.run(
        [str(ROOT / "tools/gpu-acceptance"), "--nvidia-smi", str(FAKE), "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "nvidia-smi did not answer query.csv" in proc.stderr
