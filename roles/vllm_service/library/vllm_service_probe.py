#!/usr/bin/python
"""Probe a vLLM systemd unit: healthy, still loading, stalled or failed (read-only)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: vllm_service_probe
short_description: Wait a bounded time for a vLLM unit to answer /health
description:
  - Polls C(/health) of a vLLM OpenAI-compatible server run by a systemd unit
    for at most O(wait_s) seconds and reports C(healthy), C(loading),
    C(failed), C(timeout) or C(stalled).
  - >-
    Fails fast, without waiting for the HTTP port, when the unit has failed,
    stopped, or restarted since O(restarts) (a crash: the unit uses
    C(Restart=always) because the API server can exit 0 after its engine died).
  - Returns the latest loading milestone from the unit's journal
    (C(journalctl -o json), which keeps the weight-loading progress lines and
    each line's time), and the load's phase named from vLLM's own milestones,
    so a caller looping over rounds can show progress.
  - >-
    With O(stall_s), a load that stops advancing ends early: while the unit is
    active and not yet healthy, every new journal line of the unit (any of its
    processes, a carriage-return progress redraw included) is progress, and so
    is CPU time its processes use (at least a twentieth of a core between two
    reads of its cgroup's C(cpu.stat)): journald sees a progress bar only when
    its line ends, and torch.compile or a 119-shard load drawn by one rank logs
    nothing for minutes while it works. O(stall_s) seconds without either (from
    the last, or from O(since)) report C(stalled): a stopped engine, a hung
    storage mount (processes asleep in I/O). An engine that spins while it waits
    (some NCCL waits) counts as working; the total timeout bounds it.
  - >-
    Changes nothing on the host but its own bookkeeping: the last CPU reading
    per unit, in C(/run/vllm-fleet-probe/) (root only, gone at reboot).
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
  stall_s:
    description:
      - Seconds without a new journal line or CPU work of the active, still loading unit
        after which the wait reports C(stalled) (the fleet's C(vllm_fleet_load_stall_s)).
      - 0 turns the check off; the total O(timeout_s) still applies.
    type: int
    default: 0
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
    stall_s: 600
    milestones:
      - Starting to load model
      - Application startup complete
  register: probe
"""

RETURN = r"""
state:
  description: C(healthy), C(loading), C(failed), C(timeout) or C(stalled).
  returned: always
  type: str
  sample: loading
phase:
  description:
    - How far the load got, named from the last of vLLM's known milestones in the journal
      since O(since) (C(starting) before the first; C(serving) once healthy), with the
      weight loader's shard count while it loads.
  returned: always
  type: str
  sample: weights loading 60/119
healthy:
  description: Whether /health answered 200 while the unit was active.
  returned: always
  type: bool
reason:
  description: Why the state is C(failed), C(timeout) or C(stalled); empty otherwise.
  returned: always
  type: str
  sample: "unit restarted 1 time(s) since the wait began: the server crashed"
quiet_s:
  description:
    - Seconds since the unit's last journal line or CPU use (since O(since) before
      either); 0 when O(stall_s) is 0 or the unit is not loading.
  returned: always
  type: int
  sample: 12
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
    - The round as one line (state, seconds since the start, phase, latest milestone), which
      the project's stdout callback prints at every retry.
  returned: always
  type: str
  sample: >-
    loading, 42 s, weights loading 1/2: Loading safetensors checkpoint shards:  50% Completed | 1/2
vllm_fleet_progress:
  description:
    - Shards loaded so far, from vLLM's last weight-loader line in the journal since
      O(since); the C(vllm-fleet) CLI draws its load bar from it (docs/cli.md).
  returned: once the loader has logged a line
  type: dict
  sample: {"kind": "load", "done": 60, "total": 119}
"""

import json
import os
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
    "ControlGroup",
)
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# vLLM's weight loader (tqdm): "Loading safetensors checkpoint shards:  50% Completed | 1/2".
_SHARDS = re.compile(
    r"Loading (?:safetensors |pt )?checkpoint shards:\s*\d+% Completed"
    r" \|\s*(?P<done>\d+)/(?P<total>\d+)"
)
# The journal lines read per round (milestone, phase, shard count).
_JOURNAL_LINES = 200
# vLLM's start-up milestones, latest first, and the phase each begins; a line
# takes the first name that matches (tested against real lines in
# tests/unit/test_vllm_service_probe.py).
_PHASES = (
    ("serving", re.compile(r"Application startup complete")),
    ("API server starting", re.compile(r"Starting vLLM (?:API )?server")),
    ("engine ready", re.compile(r"init engine .* took|Graph capturing finished")),
    ("CUDA graph capture", re.compile(r"Capturing (?:CUDA |cuda ?)graph")),
    (
        "KV cache sizing",
        re.compile(r"KV cache size|Available KV cache memory|Maximum concurrency"),
    ),
    (
        "torch.compile",
        re.compile(r"torch\.compile|Dynamo bytecode transform|Compiling a graph|compiled graph"),
    ),
    ("weights loaded", re.compile(r"Loading weights took|[Mm]odel loading took")),
    ("weights loading", re.compile(r"Starting to load model|" + _SHARDS.pattern)),
    (
        "distributed init",
        re.compile(r"vLLM is using nccl|is assigned as DP rank|distributed_init_method"),
    ),
    ("engine init", re.compile(r"Initializing an? (?:V1 )?LLM engine|Resolved architecture")),
)
# vLLM's logging prefix ("(EngineCore_DP0 pid=12) INFO 12-01 10:00:00 [loader.py:42] "),
# left out where a line is quoted in a reason.
_LOG_PREFIX = re.compile(
    r"^(?:\([^)]*pid=\d+\)\s*)?(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+\S+\s+\S+\s+\[[^\]]*\]\s*"
)


def clean_line(line: str) -> str:
    """Keep what a terminal would show: the text after the last carriage return."""
    parts = [part for part in _ANSI.sub("", line).split("\r") if part.strip()]
    return parts[-1].strip() if parts else ""


def _message(value: object) -> str:
    """A journal field as ``journalctl -o json`` writes it: a string, or the bytes as a
    list of numbers when the text holds control characters (a tqdm redraw's carriage
    returns, colours); several values of one field, one per line."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(byte, int) for byte in value):
        return bytes(byte & 0xFF for byte in value).decode("utf-8", "replace")
    if isinstance(value, list):
        return "\n".join(_message(item) for item in value)
    return ""


def journal_entries(unit: str, since: int, count: int = _JOURNAL_LINES) -> list[tuple[float, str]]:
    """The unit's last ``count`` journal lines since ``since``: (unix time, message).

    JSON keeps each line's time (the stall check's clock) and its bytes; ``--all``
    keeps a long line (a tqdm bar redrawn for many shards) that would read as null.
    """
    cmd = ["journalctl", "--no-pager", "--all", "-o", "json", "--output-fields=MESSAGE"]
    cmd += ["-u", unit, "-n", str(count)]
    if since:
        cmd.append(f"--since=@{since}")
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    entries = []
    for raw in result.stdout.splitlines():
        try:
            record = json.loads(raw)
            stamp = int(record["__REALTIME_TIMESTAMP"]) / 1e6
        except (ValueError, KeyError, TypeError):
            continue
        entries.append((stamp, _message(record.get("MESSAGE"))))
    return entries


def segments(messages: list[str]) -> list[str]:
    """Every redraw of every line, in order: a tqdm bar's counts, and a line another
    process of the unit wrote behind a half-written bar, each on its own."""
    found = []
    for message in messages:
        for part in _ANSI.sub("", message).replace("\r", "\n").split("\n"):
            if part.strip():
                found.append(part.strip())
    return found


def latest_milestone(lines: list[str], patterns: list[str]) -> str:
    regexes = [re.compile(pattern) for pattern in patterns]
    for line in reversed(lines):
        if any(regex.search(line) for regex in regexes):
            return line
    return lines[-1] if lines else ""


def phase_of(lines: list[str]) -> tuple[str, str]:
    """The load's phase from its last known milestone, and that line ("starting", "")."""
    for line in reversed(lines):
        for name, regex in _PHASES:
            if regex.search(line):
                shards = _SHARDS.search(line)
                if name == "weights loading" and shards:
                    name = f"{name} {shards['done']}/{shards['total']}"
                return name, line
    return "starting", ""


def shorten(line: str, width: int = 120) -> str:
    """A journal line for a one-line message: no logging prefix, at most ``width`` characters."""
    text = _LOG_PREFIX.sub("", line)
    return text if len(text) <= width else text[: width - 3] + "..."


# The unit's CPU use that counts as work between two readings, in cores, and
# where the last reading is kept between rounds (one module run per round).
_CPU_BUSY = 0.05
_CGROUP_ROOT = "/sys/fs/cgroup"
_PROBE_STATE_DIR = "/run/vllm-fleet-probe"


def cgroup_cpu_usec(control_group: str) -> int | None:
    """CPU time the unit's processes used so far (cgroup v2 cpu.stat), or None."""
    if not control_group:
        return None
    try:
        with open(f"{_CGROUP_ROOT}{control_group}/cpu.stat", encoding="ascii") as handle:
            for line in handle:
                name, _, value = line.partition(" ")
                if name == "usage_usec":
                    return int(value)
    except (OSError, ValueError):
        return None
    return None


def last_cpu_work(unit: str, control_group: str, since: int, now: float) -> float:
    """When the unit's processes last used CPU (_CPU_BUSY between two readings) in
    this start, from the reading kept since the last call; 0 when unknown."""
    usage = cgroup_cpu_usec(control_group)
    if usage is None:
        return 0.0
    path = os.path.join(_PROBE_STATE_DIR, f"{unit}.json")
    try:
        with open(path, encoding="utf-8") as handle:
            kept = json.load(handle)
    except (OSError, ValueError):
        kept = {}
    if not isinstance(kept, dict) or kept.get("since") != since:
        kept = {"since": since, "usec": usage, "t": now, "busy": 0.0}
    elif now > kept["t"] and (usage - kept["usec"]) / 1e6 / (now - kept["t"]) >= _CPU_BUSY:
        kept["busy"] = now
    kept.update(usec=usage, t=now)
    try:
        os.makedirs(_PROBE_STATE_DIR, mode=0o700, exist_ok=True)
        with open(f"{path}.tmp", "w", encoding="utf-8") as handle:
            json.dump(kept, handle)
        os.replace(f"{path}.tmp", path)
    except OSError:
        pass  # read-only /run: the journal alone judges
    return float(kept["busy"])


def quiet_seconds(unit: str, since: int, now: float, control_group: str = "") -> int:
    """Seconds since the unit's last journal line or CPU work, or since ``since``."""
    entries = journal_entries(unit, since, 1)
    busy = last_cpu_work(unit, control_group, since, now)
    last = max([since, busy, *(stamp for stamp, _ in entries)])
    return max(int(now - last), 0)


def stall_reason(quiet: int, stall_s: int, phase: str, line: str) -> str:
    where = f"{phase} ({shorten(line)})" if line else f"{phase} (no milestone since the start)"
    return (
        f"the load made no progress (no journal line, no CPU work) for {quiet} s "
        f"(stall budget vllm_fleet_load_stall_s={stall_s}); last phase: {where}"
    )


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
    state, reason, status, quiet = "loading", "", 0, 0
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
        # Loading: the unit runs (Type=exec: active once started) and does not answer yet.
        if params["stall_s"] > 0 and since and props["ActiveState"] == "active":
            quiet = quiet_seconds(unit, since, now, props.get("ControlGroup", ""))
            if quiet >= params["stall_s"]:
                state = "stalled"
                break
        if now >= wait_until:
            break
        time.sleep(min(params["interval_s"], max(wait_until - now, 0.1)))
    messages = [message for _, message in journal_entries(unit, since)]
    lines = [line for line in (clean_line(message) for message in messages) if line]
    redraws = segments(messages)
    phase, phase_line = phase_of(redraws)
    if state == "healthy":
        phase = "serving"
    elif state == "stalled":
        reason = stall_reason(quiet, params["stall_s"], phase, phase_line)
    result = {
        "state": state,
        "healthy": state == "healthy",
        "reason": reason,
        "phase": phase,
        "quiet_s": quiet,
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
    result["vllm_fleet_poll"] = f"{state}, {result['elapsed_s']} s, {phase}: {result['milestone']}"
    shards = load_progress(redraws)
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
            "stall_s": {"type": "int", "default": 0},
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
