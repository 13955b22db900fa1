"""vllm-fleet watchdog: proves that a vLLM engine makes progress, restarts it when not.

Managed by Ansible (role vllm_service); runs in its own unit beside the vLLM
unit it watches, so that it does not freeze with the engine. vLLM's /health
answers 200 while the engine core process exists, hung or not; this watch
asks for proof of progress instead, every INTERVAL seconds:

- requests running or waiting: vLLM's token counters on /metrics (prompt and
  generated tokens, engine steps) must have moved since the last check;
- no request: a one-token completion (the canary, with the unit's API key,
  sent to the node itself, not through a router) must finish within
  CANARY_TIMEOUT seconds, unless the counters moved anyway.

A busy engine is never a miss: any token produced counts, however long the
queue, and /health (which a busy engine can answer late) is not asked once
the engine served. MISSES checks in a row without proof (MISSES x INTERVAL
seconds with nothing produced) and the watchdog logs why, into its own
journal and the vLLM unit's (``journalctl -u UNIT``, where the deploy's
diagnosis and status read), then kills the unit's processes (SIGKILL: a hung
engine cannot drain) and systemd's Restart=always starts it again. Its port
closes at once, so every router's health check takes the node out, and puts
it back once the new engine answers. The count and time of its restarts go to
STATE (JSON, world-readable, no secret), which the API key guard exports on
vLLM's /metrics for the fleet's alerts.

The watch arms once per start of the unit (its MainPID), after /health first
answers: a load is the deploy's probe's to judge, not the watchdog's.

    vllm_watchdog.py --unit UNIT --url URL --env-file FILE --state FILE
                     [--interval S] [--misses N] [--canary-timeout S] [--metrics-timeout S]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

# Counters that move whenever the engine produces anything: prompt tokens
# (prefill), generated tokens, and engine steps (histogram count).
PROGRESS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total",
            "vllm:iteration_tokens_total_count")  # fmt: skip
QUEUED = ("vllm:num_requests_running", "vllm:num_requests_waiting")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? ([-+0-9.eEnaNIf]+)")
JOURNAL_SOCKET = "/run/systemd/journal/socket"


@dataclass
class Sample:
    """What one read of /metrics says: tokens produced so far, requests queued."""

    progress: float
    running: float
    waiting: float


@dataclass
class Watch:
    """The watch of one start of the unit."""

    pid: int = 0
    last: Sample | None = None
    misses: int = 0
    model: str = ""


def parse_metrics(text: str) -> Sample:
    """Sum each family of interest over its labels (one engine, or several)."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        found = _SAMPLE.match(line)
        if found and found.group(1) in PROGRESS + QUEUED:
            sums[found.group(1)] = sums.get(found.group(1), 0.0) + float(found.group(3))
    return Sample(
        progress=sum(sums.get(name, 0.0) for name in PROGRESS),
        running=sums.get(QUEUED[0], 0.0),
        waiting=sums.get(QUEUED[1], 0.0),
    )


def api_key(env_file: str) -> str:
    """VLLM_API_KEY from the unit's environment file (systemd's double quotes);
    read at each canary, so that a rotated key needs no restart of the watch."""
    try:
        text = open(env_file, encoding="utf-8").read()  # noqa: SIM115 - one short read
    except OSError:
        return ""
    for line in text.splitlines():
        name, sep, value = line.partition("=")
        if sep and name.strip() == "VLLM_API_KEY":
            value = value.strip()
            if len(value) >= 2 and value[0] == value[-1] == '"':
                value = re.sub(r"\\(.)", r"\1", value[1:-1])
            return value
    return ""


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """The key goes to the node's own server only: a redirect (to whatever now holds
    its port) is an error, never followed with the Authorization header."""

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any,
                         newurl: str) -> None:  # fmt: skip
        raise urllib.error.HTTPError(
            req.full_url, code, f"redirect to {newurl} refused", headers, fp
        )


_OPENER = urllib.request.build_opener(_NoRedirect)


def _text(url: str, timeout: float, key: str = "", body: dict | None = None) -> str:
    """The body of a GET (or, with ``body``, a JSON POST) to the node's own server."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers=headers)
    with _OPENER.open(req, timeout=timeout) as resp:
        return resp.read().decode()


def _json(url: str, timeout: float, key: str, body: dict | None = None) -> Any:
    return json.loads(_text(url, timeout, key, body))


def canary(url: str, key: str, model: str, timeout: float) -> str:
    """One token from the engine: '' when it came, else why not."""
    body = {"model": model, "prompt": "ping", "max_tokens": 1, "temperature": 0}
    started = time.monotonic()
    try:
        answer = _json(f"{url}/v1/completions", timeout, key, body)
    except (OSError, urllib.error.URLError, ValueError) as err:
        return f"the one-token canary did not complete in {timeout:g} s ({_short(err)})"
    if not answer.get("choices"):
        return f"the canary came back without a choice ({time.monotonic() - started:.1f} s)"
    return ""


def _short(err: BaseException) -> str:
    text = str(getattr(err, "reason", err)) or type(err).__name__
    return text[:120]


def check(watch: Watch, args: argparse.Namespace) -> str:
    """One check: '' when the engine proved progress, else the reason of the miss."""
    try:
        sample = parse_metrics(_text(f"{args.url}/metrics", args.metrics_timeout))
    except (OSError, urllib.error.URLError, ValueError) as err:
        return f"/metrics did not answer in {args.metrics_timeout:g} s ({_short(err)})"
    last, watch.last = watch.last, sample
    moved = last is None or sample.progress > last.progress
    if moved:
        return ""
    if sample.running or sample.waiting:
        return (f"{sample.running:g} requests running and {sample.waiting:g} waiting, "
                f"no token produced in {args.interval:g} s")  # fmt: skip
    if not watch.model:
        watch.model = served_model(args)
    if not watch.model:
        return "the canary found no model at /v1/models"
    return canary(args.url, api_key(args.env_file), watch.model, args.canary_timeout)


def served_model(args: argparse.Namespace) -> str:
    """The model the server serves (the canary asks for it by name), or ''."""
    try:
        models = _json(f"{args.url}/v1/models", args.metrics_timeout, api_key(args.env_file))
        return str(models["data"][0]["id"])
    except (OSError, urllib.error.URLError, ValueError, KeyError, IndexError, TypeError):
        return ""


def unit_pid(unit: str) -> int:
    """The unit's MainPID while it is active and running, else 0."""
    out = subprocess.run(
        ["systemctl", "show", "--property=MainPID", "--property=ActiveState",
         "--property=SubState", unit],
        capture_output=True, text=True, check=False,
    ).stdout  # fmt: skip
    props = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    if (props.get("ActiveState"), props.get("SubState")) != ("active", "running"):
        return 0
    return int(props.get("MainPID") or 0)


def healthy(url: str, timeout: float) -> bool:
    try:
        _text(f"{url}/health", timeout)
    except (OSError, urllib.error.URLError, ValueError):
        return False
    return True


def log(unit: str, message: str, priority: int = 6) -> None:
    """A line in the watchdog's journal and, as root, in the vLLM unit's too
    (journalctl -u matches OBJECT_SYSTEMD_UNIT of root's messages)."""
    line = f"vllm-fleet watchdog: {message}"
    print(line, file=sys.stderr, flush=True)
    fields = {"MESSAGE": line, "PRIORITY": str(priority),
              "SYSLOG_IDENTIFIER": "vllm-fleet-watchdog", "OBJECT_SYSTEMD_UNIT": unit}  # fmt: skip
    datagram = "".join(f"{k}={v}\n" for k, v in fields.items()).encode(errors="replace")
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.sendto(datagram, JOURNAL_SOCKET)


def load_state(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as handle:
            state = json.load(handle)
        return state if isinstance(state, dict) else {}
    except (OSError, ValueError):
        return {}


def save_state(path: str, state: dict[str, Any]) -> None:
    """Atomically, world-readable: vLLM's user reads it for /metrics."""
    tmp = f"{path}.tmp"
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), "w") as handle:
        json.dump(state, handle)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def restart(unit: str, state_file: str, reason: str) -> None:
    state = load_state(state_file)
    state.update(restarts=int(state.get("restarts", 0)) + 1, last_restart=time.time(),
                 last_reason=reason)  # fmt: skip
    save_state(state_file, state)
    subprocess.run(["systemctl", "kill", "--signal=SIGKILL", unit], check=False)


def step(watch: Watch, args: argparse.Namespace) -> Watch:
    """One round: arm on a new start, check an armed engine, restart after MISSES."""
    pid = unit_pid(args.unit)
    if pid == 0:
        return Watch()
    if pid != watch.pid:
        if not healthy(args.url, args.metrics_timeout):
            return Watch()
        log(args.unit, f"watching {args.unit} (pid {pid}): proof of progress every "
                       f"{args.interval:g} s, restart after {args.misses} misses")  # fmt: skip
        return Watch(pid=pid)
    reason = check(watch, args)
    if not reason:
        if watch.misses:
            log(args.unit, f"{args.unit} made progress again after {watch.misses} misses")
        return Watch(pid=pid, last=watch.last, model=watch.model)
    watch.misses += 1
    log(args.unit, f"miss {watch.misses}/{args.misses}: {reason}", priority=4)
    if watch.misses < args.misses:
        return watch
    log(args.unit, f"{args.unit} (pid {pid}) made no progress for {watch.misses} checks "
                   f"({watch.misses * args.interval:g} s): {reason}; restarting it: the "
                   "routers' health checks take the node out until it serves again",
        priority=3)  # fmt: skip
    restart(args.unit, args.state, reason)
    return Watch()


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unit", required=True)
    parser.add_argument("--url", required=True)
    parser.add_argument("--env-file", required=True)
    parser.add_argument("--state", required=True)
    parser.add_argument("--interval", type=float, default=15.0)
    parser.add_argument("--misses", type=int, default=4)
    parser.add_argument("--canary-timeout", type=float, default=30.0)
    parser.add_argument("--metrics-timeout", type=float, default=10.0)
    args = parser.parse_args(argv)
    args.url = args.url.rstrip("/")
    return args


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if not load_state(args.state):
        save_state(args.state, {"restarts": 0, "last_restart": 0, "last_reason": ""})
    watch = Watch()
    while True:
        started = time.monotonic()
        watch = step(watch, args)
        time.sleep(max(0.0, args.interval - (time.monotonic() - started)))


if __name__ == "__main__":
    main(sys.argv[1:])
