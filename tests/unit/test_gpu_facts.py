"""library/gpu_facts.py on reconstructed nvidia-smi outputs, replayed by a named fake.

The module runs in-process (patch_module_args) and really executes
tests/support/fake_nvidia_smi.py as its nvidia-smi (a subprocess), so the
argument handling, exit codes and parsing are all exercised.
"""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

import pytest
from ansible.module_utils.gpu import (
    GpuParseError,
    classify_link,
    parse_query_csv,
    parse_topology,
    parse_versions,
)

from tests.support.ansible_module import (  # noqa: F401 (patch_ansible_module: autouse fixture)
    fail_module,
    load_module,
    patch_ansible_module,
    run_module,
)

ROOT = Path(__file__).resolve().parents[2]
FAKE = ROOT / "tests" / "support" / "fake_nvidia_smi.py"
FIXTURES = ROOT / "tests" / "fixtures" / "nvidia-smi"
gpu_facts = load_module("gpu_facts")


def run(fixture: str | Path | None, monkeypatch: pytest.MonkeyPatch, **args: Any) -> dict:
    if fixture is not None:
        monkeypatch.setenv("FAKE_NVIDIA_SMI_FIXTURE", str(fixture))
    args.setdefault("nvidia_smi", str(FAKE))
    args.setdefault("infiniband_sysfs", "/nonexistent/infiniband")
    return run_module(gpu_facts, args)


# fixture, count, name, MiB, compute capability, driver, CUDA, interconnect, MIG
TABLE = [
    ("rtx-pro-6000-x8", 8, "NVIDIA RTX PRO 6000 Blackwell Server Edition", 97887, "12.0",
     "580.95.05", "13.0", "pcie", False),
    ("h200-x8", 8, "NVIDIA H200", 143771, "9.0", "570.133.20", "12.8", "nvlink", False),
    ("b200-x8", 8, "NVIDIA B200", 183359, "10.0", "570.133.20", "12.8", "nvlink", False),
    ("l40s-x4", 4, "NVIDIA L40S", 46068, "8.9", "550.127.05", "12.4", "pcie", False),
    ("a100-mig-x2", 2, "NVIDIA A100-SXM4-80GB", 81920, "8.0", "535.216.03", "12.2", "nvlink",
     True),
]  # fmt: skip


@pytest.mark.parametrize(
    ("fixture", "count", "name", "mib", "cc", "driver", "cuda", "interconnect", "mig"),
    TABLE,
    ids=[row[0] for row in TABLE],
)
def test_fixture_facts(
    monkeypatch: pytest.MonkeyPatch,
    fixture: str,
    count: int,
    name: str,
    mib: int,
    cc: str,
    driver: str,
    cuda: str,
    interconnect: str,
    mig: bool,
) -> None:
    result = run(fixture, monkeypatch)
    assert result["changed"] is False
    assert result["nvidia_smi_found"] and result["driver_loaded"]
    assert result["gpu_count"] == count
    assert [g["index"] for g in result["gpus"]] == list(range(count))
    assert {g["name"] for g in result["gpus"]} == {name}
    assert {g["memory_mib"] for g in result["gpus"]} == {mib}
    assert {g["compute_capability"] for g in result["gpus"]} == {cc}
    assert all(g["uuid"].startswith("GPU-") for g in result["gpus"])
    assert len({g["uuid"] for g in result["gpus"]}) == count
    assert (result["driver_version"], result["cuda_version"]) == (driver, cuda)
    assert result["summary"]["interconnect"] == interconnect
    assert result["summary"]["all_nvlink"] is (interconnect == "nvlink")
    assert result["summary"]["pcie_only"] is (interconnect == "pcie")
    assert result["mig_enabled"] is mig
    # One entry per unordered GPU pair.
    assert len(result["interconnect"]) == count * (count - 1) // 2
    assert result["ansible_facts"]["vllm_fleet_gpu"]["gpu_count"] == count


def test_rtx_pcie_paths_per_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    links = {(lk["a"], lk["b"]): lk for lk in run("rtx-pro-6000-x8", monkeypatch)["interconnect"]}
    assert links[(0, 1)]["path"] == "PIX"
    assert links[(0, 2)]["path"] == "NODE"
    assert links[(0, 4)]["path"] == "SYS"
    assert {lk["type"] for lk in links.values()} == {"pcie"}
    assert run("rtx-pro-6000-x8", monkeypatch)["summary"]["widest_pcie_path"] == "SYS"


def test_h200_nvlink_count_and_nics(monkeypatch: pytest.MonkeyPatch) -> None:
    result = run("h200-x8", monkeypatch)
    assert {lk["nvlinks"] for lk in result["interconnect"]} == {18}
    assert result["nics"] == {f"NIC{i}": f"mlx5_{i}" for i in range(4)}


def test_mig_mode_per_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    modes = [g["mig_mode"] for g in run("a100-mig-x2", monkeypatch)["gpus"]]
    assert modes == ["enabled", "disabled"]
    # GPUs without MIG support print [N/A].
    assert {g["mig_mode"] for g in run("rtx-pro-6000-x8", monkeypatch)["gpus"]} == {"unsupported"}


def test_infiniband_from_sysfs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "mlx5_0").mkdir()
    result = run("rtx-pro-6000-x8", monkeypatch, infiniband_sysfs=str(tmp_path))
    assert result["infiniband"] is True
    assert result["infiniband_devices"] == ["mlx5_0"]
    assert run("rtx-pro-6000-x8", monkeypatch)["infiniband"] is False


def test_driver_not_loaded_is_a_clean_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    result = run("no-driver", monkeypatch)
    assert result["nvidia_smi_found"] is True
    assert result["driver_loaded"] is False
    assert result["gpu_count"] == 0 and result["gpus"] == []
    assert "couldn't communicate with the NVIDIA driver" in result["message"]


def test_no_nvidia_smi_binary(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    result = run(None, monkeypatch, nvidia_smi=str(tmp_path / "nvidia-smi"))
    assert result["nvidia_smi_found"] is False
    assert result["driver_loaded"] is False
    assert result["gpu_count"] == 0


def test_bare_name_not_in_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    result = run(None, monkeypatch, nvidia_smi="nvidia-smi-not-installed-here")
    assert result["nvidia_smi_found"] is False


def test_check_mode_same_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    normal = run("h200-x8", monkeypatch)
    checked = run("h200-x8", monkeypatch, _ansible_check_mode=True)
    assert checked["gpus"] == normal["gpus"] and checked["changed"] is False


def _copy_fixture(src: str, dest: Path, **overrides: str) -> Path:
    dest.mkdir()
    for path in (FIXTURES / src).iterdir():
        (dest / path.name).write_text(overrides.get(path.name, path.read_text()))
    return dest


def test_garbage_query_fails_clearly(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fixture = _copy_fixture("h200-x8", tmp_path / "bad", **{"query.csv": "0, NVIDIA H200, 9.0\n"})
    monkeypatch.setenv("FAKE_NVIDIA_SMI_FIXTURE", str(fixture))
    msg = fail_module(gpu_facts, {"nvidia_smi": FAKE})
    assert "cannot parse nvidia-smi output" in msg and "expected 8 fields" in msg


def test_other_nvidia_smi_failure_fails(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    script = tmp_path / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\necho 'Unable to determine the device handle for GPU0' >&2\nexit 15\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    msg = fail_module(gpu_facts, {"nvidia_smi": script})
    assert "rc=15" in msg
    assert "Unable to determine the device handle" in msg


# ---- the parsers directly, on edge cases


def test_query_na_values() -> None:
    (gpu,) = parse_query_csv("0, Tesla T4, GPU-1, [N/A], [N/A], 535.1, [N/A], 00000000:3B:00.0\n")
    assert gpu["memory_mib"] is None and gpu["compute_capability"] is None
    assert gpu["mig_mode"] == "unsupported"


def test_query_bad_number() -> None:
    with pytest.raises(GpuParseError, match="line 1"):
        parse_query_csv("x, Tesla T4, GPU-1, 15360, 7.5, 535.1, [N/A], 00000000:3B:00.0\n")


def test_topology_unknown_cell() -> None:
    text = "\tGPU0\tGPU1\nGPU0\t X \tNVX\nGPU1\tNVX\t X \n"
    with pytest.raises(GpuParseError, match="unknown nvidia-smi topo link type 'NVX'"):
        parse_topology(text)


def test_topology_without_header() -> None:
    with pytest.raises(GpuParseError, match="no GPU header"):
        parse_topology("garbage\n")


def test_topology_ansi_bold_header() -> None:
    text = "\t\x1b[4mGPU0\tGPU1\x1b[0m\nGPU0\t X \tNV4\nGPU1\tNV4\t X \n"
    assert parse_topology(text)["links"] == [
        {"a": 0, "b": 1, "type": "nvlink", "path": "NV4", "nvlinks": 4}
    ]


def test_soc_is_old_name_for_sys() -> None:
    assert classify_link("SOC") == {"type": "pcie", "path": "SYS", "nvlinks": 0}


def test_versions_missing_banner() -> None:
    assert parse_versions("") == {"driver_version": None, "cuda_version": None}
