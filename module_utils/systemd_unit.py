"""What the vllm_service modules read of a systemd unit and its server, in one place."""

from __future__ import annotations

import subprocess
import urllib.error
import urllib.request


def unit_props(unit: str, names: tuple[str, ...]) -> dict[str, str]:
    """The unit's properties from systemctl show (timestamps as unix time, "@N");
    a property systemd does not report is empty."""
    cmd = ["systemctl", "show", "--timestamp=unix", unit] + [f"--property={p}" for p in names]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    props = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    return {key: props.get(key, "") for key in names}


def as_int(value: str) -> int:
    """A numeric property ("123", "@1700000000"); 0 when empty or not a number."""
    value = value.strip().lstrip("@")
    return int(value) if value.isdigit() else 0


def health_status(url: str, timeout: float = 5.0) -> int:
    """HTTP status of GET <url>/health; 0 when nothing answers (still loading)."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code
    except (OSError, ValueError):
        return 0
