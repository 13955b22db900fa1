"""The API key on every route of the vLLM server but /health and /metrics.

Managed by Ansible (role vllm_service); loaded by vLLM's own option
``--middleware vllm_fleet_auth.RequireKey`` (this directory is on the unit's
PYTHONPATH). vLLM checks ``VLLM_API_KEY`` only on paths under a few prefixes
(``/v1``, ``/v2``, ``/inference``, ``/cohere`` in 0.32; ``/v1`` alone in older
releases): ``/invocations``, ``/tokenize``, ``/pooling``, ``/classify``,
``/score``, ``/rerank``, ``/start_profile``, ``/load``, ``/version`` and the
routes a later release adds answer anyone who reaches the port. This guard
inverts the rule: a request without the key gets 401 unless its path is one
the fleet needs open, the load balancers' ``/health`` and Prometheus's
``/metrics`` (neither runs the model). With no key set the server is open, as
vLLM is; the fleet sets one.

The key is read from the environment the unit's 0600 EnvironmentFile fills,
never from argv. OPTIONS passes (a CORS preflight carries no credentials and
runs no route), as vLLM's own check lets it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/health", "/metrics"})
KEY_ENV = "VLLM_API_KEY"


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8")).digest()


def _bearer(scope: Scope) -> str | None:
    for name, value in scope.get("headers") or []:
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


def _path(scope: Scope) -> str:
    path = scope.get("path") or "/"
    root = scope.get("root_path") or ""
    return path[len(root) :] if root and path.startswith(root) else path


class RequireKey:
    """Pure ASGI middleware: 401 without the key, except on :data:`OPEN_PATHS`."""

    def __init__(self, app: App) -> None:
        self.app = app
        key = os.environ.get(KEY_ENV, "")
        self._key = _digest(key) if key else None

    def allowed(self, scope: Scope) -> bool:
        if self._key is None or scope.get("method") == "OPTIONS":
            return True
        if _path(scope).rstrip("/") in OPEN_PATHS:
            return True
        token = _bearer(scope)
        return token is not None and hmac.compare_digest(_digest(token), self._key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self.allowed(scope):
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            # Closed before the handshake completes: the client sees HTTP 403.
            await send({"type": "websocket.close", "code": 1008})
        else:
            body = json.dumps({"error": "Unauthorized"}).encode()
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"www-authenticate", b"Bearer"),
            ]
            await send({"type": "http.response.start", "status": 401, "headers": headers})
            await send({"type": "http.response.body", "body": body})


# The watchdog's restarts on vLLM's own /metrics (no port of its own): its
# companion unit writes their count and time to a world-readable JSON file
# (VLLM_FLEET_WATCHDOG_STATE), read at each scrape. Always exported, 0 before
# the first restart, so that the fleet's alert sees a series from the start.
WATCHDOG_ENV = "VLLM_FLEET_WATCHDOG_STATE"


class WatchdogCollector:
    """Prometheus collector of the watchdog's state file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def state(self) -> dict[str, Any]:
        try:
            with open(self.path, encoding="utf-8") as handle:
                state = json.load(handle)
        except (OSError, ValueError):
            return {}
        return state if isinstance(state, dict) else {}

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        state = self.state()
        yield CounterMetricFamily(
            "vllm_fleet_watchdog_restarts",
            "Restarts of this node's vLLM by the vllm-fleet watchdog (no progress proved).",
            value=float(state.get("restarts", 0) or 0),
        )
        yield GaugeMetricFamily(
            "vllm_fleet_watchdog_last_restart_timestamp_seconds",
            "Unix time of the watchdog's last restart of this node's vLLM (0: none).",
            value=float(state.get("last_restart", 0) or 0),
        )


def register_watchdog_metrics(path: str | None = os.environ.get(WATCHDOG_ENV)) -> bool:
    """Add the collector to prometheus_client's default registry, which vLLM's
    /metrics serves (one API server process; vLLM's multiprocess mode has its own)."""
    if not path:
        return False
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        return False
    REGISTRY.register(WatchdogCollector(path))
    return True


register_watchdog_metrics()
