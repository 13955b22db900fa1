"""A vLLM unit's crash loop, from what systemd and the journal say about it.

Restart=always brings a dead engine back, and StartLimitBurst stops a unit
that dies again and again: it ends ``failed`` with ``Result=start-limit-hit``
and nothing restarts it any more. ``systemctl show`` says so, but not why; the
journal does, and role vllm_service's diagnosis (entry point ``diagnose``,
the one list of known failures) names it. These filters turn both into the
node report's ``crash_loop`` record and its ``health`` line.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable, Mapping
from typing import Any

# ExecMainCode: how the last main process ended (siginfo's CLD_* codes).
_EXITED, _KILLED, _DUMPED = 1, 2, 3


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def last_exit(props: Mapping[str, str]) -> str:
    """How the unit's last main process ended, in words ('' when it never ran)."""
    code, status = _int(props.get("ExecMainCode")), _int(props.get("ExecMainStatus"))
    if code == _EXITED:
        return f"exit status {status}"
    if code == _KILLED:
        return f"killed by {_signal_name(status)}"
    if code == _DUMPED:
        return f"dumped core on {_signal_name(status)}"
    return ""


def crash_loop(
    props: Mapping[str, str],
    diagnosis: Iterable[Mapping[str, Any]] | None = None,
    unit: str = "",
) -> dict[str, Any]:
    """The crash_loop record of a unit's ``systemctl show`` properties ({} when not in one).

    A unit is in a crash loop when systemd gave up restarting it
    (``Result=start-limit-hit``), when it failed after restarts, or when it is
    dead between two restarts (``activating/auto-restart``) after at least one.
    A unit that runs (perhaps loading again after a crash) is not: one read
    cannot tell a loop from a single restart. ``diagnosis`` is role
    vllm_service's ``vllm_service_diagnosis`` (first match first).
    """
    props = props or {}
    active, sub = props.get("ActiveState", ""), props.get("SubState", "")
    result, restarts = props.get("Result", ""), _int(props.get("NRestarts"))
    if props.get("LoadState") == "not-found":
        return {}
    if active == "failed" and restarts > 0 and props.get("Restart") == "always":
        # Restart=always restarts on any exit: a unit left failed after restarts
        # was refused by its start limit. systemd 252 (Debian 12) says so only in
        # the journal ("Start request repeated too quickly") and keeps the last
        # exit's Result; later versions report start-limit-hit.
        state, result = "stopped", "start-limit-hit"
    elif result == "start-limit-hit" or (active == "failed" and restarts > 0):
        state = "stopped"
    elif active == "activating" and sub == "auto-restart" and restarts > 0:
        state = "restarting"
    else:
        return {}
    found = list(diagnosis or [])
    first = found[0] if found else {}
    journal = f"journalctl -u {unit} -o cat" if unit else "the unit's journal"
    return {
        "state": state,
        "result": result,
        "restarts": restarts,
        "last_exit": last_exit(props),
        "diagnosis": first.get("name", ""),
        "advice": first.get("advice")
        or f"No known failure matched: read {journal} on the node for the cause.",
        "lines": list(first.get("lines") or []),
    }


def crash_loop_health(record: Mapping[str, Any]) -> str:
    """The node's health line for a crash loop ('' when there is none)."""
    if not record:
        return ""
    count = _int(record.get("restarts"))
    restarts = f"{count} restart{'' if count == 1 else 's'}"
    if record.get("result") == "start-limit-hit":
        what = f"start limit hit after {restarts}"
    elif record.get("state") == "stopped":
        what = f"failed ({record.get('result') or 'unknown'}) after {restarts}"
    else:
        what = f"restarting, {restarts} so far"
    return f"crash loop: {what}: {record.get('diagnosis') or 'no known diagnosis'}"


class FilterModule:
    """Role status's filters."""

    def filters(self) -> dict[str, Any]:
        return {
            "vllm_fleet_crash_loop": crash_loop,
            "vllm_fleet_crash_loop_health": crash_loop_health,
        }
