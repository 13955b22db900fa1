# Parsers for nvidia-smi output, shared by library/gpu_facts.py and the unit tests.
# Pure functions on text: no subprocess, no Ansible imports, stdlib only (runs on nodes).
from __future__ import annotations

import re
from typing import Any

# The --query-gpu fields gpu_facts asks for, in this order.
QUERY_FIELDS = (
    "index",
    "name",
    "uuid",
    "memory.total",
    "compute_cap",
    "driver_version",
    "mig.mode.current",
    "pci.bus_id",
)
QUERY_ARGS = [
    "--query-gpu=" + ",".join(QUERY_FIELDS),
    "--format=csv,noheader,nounits",
]

# `nvidia-smi topo -m` cell values and what they mean (from its own legend).
PCIE_PATHS = ("PIX", "PXB", "PHB", "NODE", "SYS", "SOC")
_NVLINK_RE = re.compile(r"^NV(\d+)$")
_ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")
_GPU_LABEL_RE = re.compile(r"^GPU(\d+)$")
_NIC_LEGEND_RE = re.compile(r"^\s*(NIC\d+):\s*(\S+)\s*$")
_DRIVER_RE = re.compile(r"Driver Version:\s*([0-9][0-9.]*)")
_CUDA_RE = re.compile(r"CUDA Version:\s*([0-9][0-9.]*)")
_NA_VALUES = {"[N/A]", "N/A", "[Not Supported]", "Not Supported", ""}

# What nvidia-smi prints (exit 9) when the binary exists but the kernel driver is not loaded.
NO_DRIVER_MARKERS = (
    "couldn't communicate with the NVIDIA driver",
    "NVIDIA driver is not loaded",
    "No devices were found",
)


class GpuParseError(ValueError):
    """nvidia-smi printed something this parser does not understand."""


def _clean(value: str) -> str | None:
    value = value.strip()
    return None if value in _NA_VALUES else value


def _mig_mode(value: str | None) -> str:
    # "Enabled" / "Disabled"; GPUs without MIG support print [N/A].
    if value is None:
        return "unsupported"
    return value.lower()


def parse_query_csv(text: str) -> list[dict[str, Any]]:
    """Parse `nvidia-smi --query-gpu=<QUERY_FIELDS> --format=csv,noheader,nounits`."""
    gpus: list[dict[str, Any]] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(QUERY_FIELDS):
            raise GpuParseError(
                f"nvidia-smi query line {lineno}: expected {len(QUERY_FIELDS)} fields "
                f"({','.join(QUERY_FIELDS)}), got {len(cells)}: {line.strip()!r}"
            )
        row = dict(zip(QUERY_FIELDS, cells, strict=True))
        try:
            index = int(row["index"])
            memory = _clean(row["memory.total"])
            memory_mib = int(float(memory)) if memory is not None else None
        except ValueError as exc:
            raise GpuParseError(f"nvidia-smi query line {lineno}: {exc}") from exc
        gpus.append(
            {
                "index": index,
                "name": row["name"],
                "uuid": row["uuid"],
                "memory_mib": memory_mib,
                "compute_capability": _clean(row["compute_cap"]),
                "driver_version": _clean(row["driver_version"]),
                "mig_mode": _mig_mode(_clean(row["mig.mode.current"])),
                "pci_bus_id": _clean(row["pci.bus_id"]),
            }
        )
    return sorted(gpus, key=lambda g: g["index"])


def parse_versions(text: str) -> dict[str, str | None]:
    """Driver and CUDA versions from the banner of plain `nvidia-smi`."""
    driver = _DRIVER_RE.search(text)
    cuda = _CUDA_RE.search(text)
    return {
        "driver_version": driver.group(1) if driver else None,
        "cuda_version": cuda.group(1) if cuda else None,
    }


def classify_link(cell: str) -> dict[str, Any]:
    """One `topo -m` cell -> {'type': 'nvlink'|'pcie'|'self', 'path': ..., 'nvlinks': n}."""
    cell = cell.strip()
    if cell == "X":
        return {"type": "self", "path": "X", "nvlinks": 0}
    match = _NVLINK_RE.match(cell)
    if match:
        return {"type": "nvlink", "path": cell, "nvlinks": int(match.group(1))}
    if cell in PCIE_PATHS:
        return {"type": "pcie", "path": "SYS" if cell == "SOC" else cell, "nvlinks": 0}
    raise GpuParseError(f"unknown nvidia-smi topo link type {cell!r}")


def parse_topology(text: str) -> dict[str, Any]:
    """Parse `nvidia-smi topo -m` into GPU-pair links and the NIC legend."""
    lines = [_ANSI_RE.sub("", line) for line in text.splitlines()]
    header: list[str] | None = None
    links: list[dict[str, Any]] = []
    nics: dict[str, str] = {}
    for line in lines:
        cells = [c.strip() for c in line.split("\t")]
        if header is None:
            if any(_GPU_LABEL_RE.match(c) for c in cells):
                header = cells
            continue
        legend = _NIC_LEGEND_RE.match(line)
        if legend:
            nics[legend.group(1)] = legend.group(2)
            continue
        label = _GPU_LABEL_RE.match(cells[0]) if cells else None
        if not label:
            continue
        row = int(label.group(1))
        for col_name, cell in zip(header[1:], cells[1:], strict=False):
            col = _GPU_LABEL_RE.match(col_name)
            if not col or int(col.group(1)) <= row:
                continue
            link = classify_link(cell)
            links.append({"a": row, "b": int(col.group(1)), **link})
    if header is None:
        raise GpuParseError("nvidia-smi topo -m: no GPU header line found")
    return {"links": links, "nics": nics}


def summarize_links(links: list[dict[str, Any]], gpu_count: int) -> dict[str, Any]:
    """all_nvlink / pcie_only over every GPU pair; interconnect as one word."""
    pair_types = {link["type"] for link in links}
    all_nvlink = gpu_count > 1 and pair_types == {"nvlink"}
    pcie_only = gpu_count > 1 and pair_types == {"pcie"}
    if gpu_count <= 1:
        interconnect = "none"
    elif all_nvlink:
        interconnect = "nvlink"
    elif pcie_only:
        interconnect = "pcie"
    else:
        interconnect = "mixed"
    worst = None
    order = ["PIX", "PXB", "PHB", "NODE", "SYS"]
    for link in links:
        if link["type"] == "pcie" and (
            worst is None or order.index(link["path"]) > order.index(worst)
        ):
            worst = link["path"]
    return {
        "all_nvlink": all_nvlink,
        "pcie_only": pcie_only,
        "interconnect": interconnect,
        "widest_pcie_path": worst,
    }


def no_driver_output(text: str) -> bool:
    """True when nvidia-smi says the driver is missing rather than failing otherwise."""
    return any(marker in text for marker in NO_DRIVER_MARKERS)


def build_facts(
    query_text: str,
    topo_text: str | None,
    banner_text: str | None,
    infiniband_devices: list[str],
) -> dict[str, Any]:
    """Everything gpu_facts reports for a host whose driver answered."""
    gpus = parse_query_csv(query_text)
    versions = parse_versions(banner_text or "")
    if versions["driver_version"] is None and gpus:
        versions["driver_version"] = gpus[0]["driver_version"]
    topo = parse_topology(topo_text) if topo_text and len(gpus) > 1 else {"links": [], "nics": {}}
    summary = summarize_links(topo["links"], len(gpus))
    return {
        "nvidia_smi_found": True,
        "driver_loaded": True,
        "gpu_count": len(gpus),
        "gpus": gpus,
        "driver_version": versions["driver_version"],
        "cuda_version": versions["cuda_version"],
        "interconnect": topo["links"],
        "nics": topo["nics"],
        "infiniband": bool(infiniband_devices),
        "infiniband_devices": sorted(infiniband_devices),
        "mig_enabled": any(g["mig_mode"] == "enabled" for g in gpus),
        "summary": summary,
    }


def empty_facts(found: bool, message: str) -> dict[str, Any]:
    """The clean 'no NVIDIA driver' answer."""
    return {
        "nvidia_smi_found": found,
        "driver_loaded": False,
        "gpu_count": 0,
        "gpus": [],
        "driver_version": None,
        "cuda_version": None,
        "interconnect": [],
        "nics": {},
        "infiniband": False,
        "infiniband_devices": [],
        "mig_enabled": False,
        "summary": summarize_links([], 0),
        "message": message,
    }
