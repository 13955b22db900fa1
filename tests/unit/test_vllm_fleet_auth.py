"""roles/vllm_service/files/vllm_fleet_auth.py: the API key on every route but /health, /metrics."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-guard-test"


def load() -> Any:
    spec = importlib.util.spec_from_file_location(
        "vllm_fleet_auth", ROOT / "roles/vllm_service/files/vllm_fleet_auth.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def call(path: str, key: str | None, *, method: str = "POST", kind: str = "http") -> Any:
    """The status the guard (in front of an app that answers 200) gives one request."""
    sent: list[dict] = []

    async def app(scope: dict, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        return {"type": "http.request"}

    headers = [(b"authorization", f"Bearer {key}".encode())] if key is not None else []
    scope = {"type": kind, "path": path, "method": method, "headers": headers}
    asyncio.run(load().RequireKey(app)(scope, receive, send))
    first = sent[0]
    return first["status"] if first["type"] == "http.response.start" else first["type"]


@pytest.mark.parametrize(
    "path", ["/invocations", "/tokenize", "/pooling", "/version", "/v1/completions", "//v1/models"]
)
def test_every_route_asks_the_key(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    assert call(path, None) == 401
    assert call(path, "sk-wrong") == 401
    assert call(path, KEY) == 200


def test_health_and_metrics_stay_open(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    assert call("/health", None, method="GET") == 200
    assert call("/metrics", None, method="GET") == 200
    assert call("/metrics/", None, method="GET") == 200
    # A preflight carries no credentials and runs no route.
    assert call("/invocations", None, method="OPTIONS") == 200


def test_a_websocket_without_the_key_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    assert call("/v1/realtime", None, kind="websocket") == "websocket.close"


def test_without_a_key_the_server_is_open(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert call("/invocations", None) == 200
