#!/usr/bin/python
"""Probe a vLLM systemd unit: healthy, still loading, or failed (read-only)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: vllm_service_probe
short_description: Wait a bounded time for a vLLM unit to answer /health
description:
  - Polls C(/health) of a vLLM OpenAI-compatible server run by a systemd unit
    for at most O(wait_s) seconds and reports C(healthy), C(loading),
    C(failed) or C(timeout).
  - >-
    Fails fast, without waiting for the HTTP port, when the unit has failed,
    stopped, or restarted since O(restarts) (a crash: the unit uses
    C(Restart=always) because the API server can exit 0 after its engine died).
  - Returns the latest loading milestone from the unit's journal
    (C(journalctl -o cat), which keeps the weight-loading progress lines), so a
    caller looping over rounds can show progress.
  - Changes nothing on the host.
version_added: "0.1.0"
author: vllm-fleet
options:
  unit:
    description: Unit name, with or without the C(.service) suffix.
    type: str
    required: true
  url:
    description: Base URL of the server, e.g. C(http://127.0.0.1:8000).
    type: str
    required: true
  since:
    description:
      - Unix time the current start began (the unit's C(InactiveExitTimestamp));
        the journal is read from there and the timeout counts from there.
      - Defaults to the unit's current C(InactiveExitTimestamp).
    type: int
  restarts:
    description: The unit's C(NRestarts) when the wait began; more means a crash.
    type: int
  timeout_s:
    description: Seconds after O(since) at which the wait reports C(timeout).
    type: int
    default: 600
  wait_s:
    description: Longest time this call waits before returning C(loading).
    type: int
    default: 30
  interval_s:
    description: Seconds between polls.
    type: float
    default: 2.0
  milestones:
    description: Regular expressions of journal lines worth showing as progress.
    type: list
    elements: str
    default: []
attributes:
  check_mode:
    description: Runs in check mode; it reports no change in any mode.
    support: full
  diff_mode:
    description: Returns no diff.
    support: none
notes:
  - Runs C(systemctl show) and C(journalctl) on the node; needs systemd.
"""

EXAMPLES = r"""
- name: Wait up to 30 s for vLLM to answer /health
  vllm_service_probe:
    unit: vllm-tiny-kimi
    url: http://127.0.0.1:8001
    since: "{{ start_time }}"
    restarts: 0
    timeout_s: 2700
    milestones:
      - Starting to load model
      - Application startup complete
  register: probe
"""

RETURN = r"""
state:
  description: C(healthy), C(loading), C(failed) or C(timeout).
  returned: always
  type: str
  sample: loading
healthy:
  description: Whether /health answered 200 while the unit was active.
  returned: always
  type: bool
reason:
  description: Why the state is C(failed) or C(timeout); empty otherwise.
  returned: always
  type: str
  sample: "unit restarted 1 time(s) since the wait began: the server crashed"
active_state:
  description: The unit's C(ActiveState).
  returned: always
  type: str
  sample: active
sub_state:
  description: The unit's C(SubState).
  returned: always
  type: str
  sample: running
n_restarts:
  description: The unit's C(NRestarts).
  returned: always
  type: int
exec_main_status:
  description: Exit status of the last main process.
  returned: always
  type: int
main_pid:
  description: The unit's C(MainPID) (0 when not running).
  returned: always
  type: int
since:
  description: Unix time the wait counts from.
  returned: always
  type: int
elapsed_s:
  description: Seconds since O(since).
  returned: always
  type: int
http_status:
  description: Last C(/health) HTTP status, 0 when nothing answered.
  returned: always
  type: int
milestone:
  description: Latest journal line matching O(milestones), or the latest line.
  returned: always
  type: str
  sample: "Loading safetensors checkpoint shards:  50% Completed | 1/2"
vllm_fleet_poll:
  description:
    - The round as one line (state, seconds since the start, latest milestone), which the
      project's stdout callback prints at every retry.
  returned: always
  type: str
  sample: "loading, 42 s: Loading safetensors checkpoint shards:  50% Completed | 1/2"
vllm_fleet_progress:
  description:
    - Shards loaded so far, from vLLM's last weight-loader line in the journal since
      O(since); the C(vllm-fleet) CLI draws its load bar from it (docs/cli.md).
  returned: once the loader has logged a line
  type: dict
  sample: {"kind": "load", "done": 60, "total": 119}
"""

import re
import subprocess
import time

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.systemd_unit import as_int, health_status, unit_props

_PROPS = (
    "ActiveState",
    "SubState",
    "NRestarts",
    "ExecMainStatus",
    "MainPID",
    "InactiveExitTimestamp",
)
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# vLLM's weight loader (tqdm): "Loading safetensors checkpoint shards:  50% Completed | 1/2".
_SHARDS = re.compile(
    r"Loading (?:safetensors |pt )?checkpoint shards:\s*\d+% Completed"
    r" \|\s*(?P<done>\d+)/(?P<total>\d+)"
)


def clean_line(line: str) -> str:
    """Keep what a terminal would show: the text after the last carriage return."""
    parts = [part for part in _ANSI.sub("", line).split("\r") if part.strip()]
    return parts[-1].strip() if parts else ""


def journal_lines(unit: str, since: int) -> list[str]:
    """The unit's last 200 journal lines since ``since``, as a terminal shows them."""
    cmd = ["journalctl", "--no-pager", "-o", "cat", "-u", unit, "-n", "200"]
    if since:
        cmd.append(f"--since=@{since}")
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [clean_line(line) for line in result.stdout.splitlines()]
    return [line for line in lines if line]


def latest_milestone(lines: list[str], patterns: list[str]) -> str:
    regexes = [re.compile(pattern) for pattern in patterns]
    for line in reversed(lines):
        if any(regex.search(line) for regex in regexes):
            return line
    return lines[-1] if lines else ""


def load_progress(lines: list[str]) -> dict | None:
    """Shards loaded so far, from vLLM's last weight-loader line (the CLI's progress bar).

    Read apart from the milestone: a later line (KV cache, startup) hides the
    loader's from the milestone, and a small load is over between two polls.
    """
    for line in reversed(lines):
        match = _SHARDS.search(line)
        if match:
            return {"kind": "load", "done": int(match["done"]), "total": int(match["total"])}
    return None


def failure_reason(props: dict[str, str], restarts: int | None) -> str:
    """Why the unit counts as failed, or an empty string."""
    active, sub = props["ActiveState"], props["SubState"]
    n_restarts = as_int(props["NRestarts"])
    if restarts is not None and n_restarts > restarts:
        return (
            f"unit restarted {n_restarts - restarts} time(s) since the wait began: "
            f"the server crashed (last exit status {props['ExecMainStatus']})"
        )
    if active == "failed":
        return f"unit failed ({sub}, exit status {props['ExecMainStatus']})"
    if active in ("inactive", "deactivating") or sub == "auto-restart":
        return f"unit is not running ({active}/{sub}, exit status {props['ExecMainStatus']})"
    return ""


def probe(params: dict) -> dict:
    unit = params["unit"] if params["unit"].endswith(".service") else f"{params['unit']}.service"
    props = unit_props(unit, _PROPS)
    since = params["since"]
    if since is None:
        since = as_int(props["InactiveExitTimestamp"])
    wait_until = time.time() + params["wait_s"]
    state, reason, status = "loading", "", 0
    while True:
        props = unit_props(unit, _PROPS)
        reason = failure_reason(props, params["restarts"])
        if reason:
            state = "failed"
            break
        status = health_status(params["url"])
        if status == 200 and props["ActiveState"] == "active":
            state = "healthy"
            break
        now = time.time()
        if since and now - since >= params["timeout_s"]:
            state = "timeout"
            reason = f"no healthy answer {params['timeout_s']} s after the start"
            break
        if now >= wait_until:
            break
        time.sleep(min(params["interval_s"], max(wait_until - now, 0.1)))
    lines = journal_lines(unit, since)
    result = {
        "state": state,
        "healthy": state == "healthy",
        "reason": reason,
        "active_state": props["ActiveState"],
        "sub_state": props["SubState"],
        "n_restarts": as_int(props["NRestarts"]),
        "exec_main_status": as_int(props["ExecMainStatus"]),
        "main_pid": as_int(props["MainPID"]),
        "since": since,
        "elapsed_s": int(time.time() - since) if since else 0,
        "http_status": status,
        "milestone": latest_milestone(lines, params["milestones"]),
    }
    result["vllm_fleet_poll"] = f"{state}, {result['elapsed_s']} s: {result['milestone']}"
    shards = load_progress(lines)
    if shards:
        result["vllm_fleet_progress"] = shards
    return result


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "unit": {"type": "str", "required": True},
            "url": {"type": "str", "required": True},
            "since": {"type": "int"},
            "restarts": {"type": "int"},
            "timeout_s": {"type": "int", "default": 600},
            "wait_s": {"type": "int", "default": 30},
            "interval_s": {"type": "float", "default": 2.0},
            "milestones": {"type": "list", "elements": "str", "default": []},
        },
        supports_check_mode=True,
    )
    try:
        result = probe(module.params)
    except (OSError, subprocess.CalledProcessError) as err:
        module.fail_json(msg=f"cannot read the state of unit {module.params['unit']}: {err}")
    module.exit_json(changed=False, **result)


if __name__ == "__main__":
    main()
