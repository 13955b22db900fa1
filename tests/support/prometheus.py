"""A small client for a fleet's Prometheus HTTP API (demo and end-to-end tests)."""

from __future__ import annotations

import json
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

Series = list[dict[str, Any]]


def api(port: int, path: str, **params: str) -> Any:
    """GET /api/v1/<path> on 127.0.0.1:<port>; its ``data`` (raises on an error status)."""
    url = f"http://127.0.0.1:{port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = json.loads(resp.read())
    if body.get("status") != "success":
        raise RuntimeError(f"Prometheus {path}: {body}")
    return body["data"]


def query(port: int, expr: str) -> Series:
    """An instant query's series: each a {"metric": labels, "value": [t, "v"]}."""
    return api(port, "query", query=expr)["result"]


def by_label(series: Series, label: str = "node") -> dict[str, float]:
    """Instant-query series as {label value: value}."""
    return {s["metric"].get(label, ""): float(s["value"][1]) for s in series}


def wait_for(port: int, expr: str, done: Callable[[Series], bool], timeout: float = 60.0) -> Series:
    """Query until ``done(series)``; the last series, or TimeoutError naming them."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            series = query(port, expr)
        except OSError:  # not up yet
            series = []
        if done(series) or time.monotonic() > deadline:
            break
        time.sleep(1)
    if not done(series):
        raise TimeoutError(f"{expr} after {timeout:.0f} s: {series}")
    return series


def targets(port: int) -> dict[str, dict[str, Any]]:
    """Active targets as {scrape URL: {"job", "node", "health", "lastError"}}."""
    active = api(port, "targets", state="active")["activeTargets"]
    return {
        t["scrapeUrl"]: {
            "job": t["labels"].get("job"),
            "node": t["labels"].get("node"),
            "health": t["health"],
            "lastError": t.get("lastError", ""),
        }
        for t in active
    }
