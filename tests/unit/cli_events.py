"""Builders for ansible-runner event dicts, shaped as runner 2.4 emits them.

The field names and nesting follow events recorded from a real
``ansible_runner.run`` (event, event_data.play/task/host/res/duration,
playbook_on_stats with ok/changed/failures/dark/...); the renderer tests feed
these to the model instead of starting Ansible.
"""

from __future__ import annotations

from typing import Any

PLAY = "Serve"


def play(name: str = PLAY) -> dict[str, Any]:
    return {"event": "playbook_on_play_start", "event_data": {"play": name, "name": name}}


def task(name: str, play_name: str = PLAY, role: str | None = None) -> dict[str, Any]:
    data = {"play": play_name, "task": name, "name": name}
    if role:
        data["role"] = role
    return {"event": "playbook_on_task_start", "event_data": data}


def start(host: str, name: str, play_name: str = PLAY) -> dict[str, Any]:
    return {
        "event": "runner_on_start",
        "event_data": {"play": play_name, "task": name, "host": host},
    }


def result(
    kind: str,
    host: str,
    name: str,
    res: dict[str, Any] | None = None,
    play_name: str = PLAY,
    **extra: Any,
) -> dict[str, Any]:
    data = {
        "play": play_name,
        "task": name,
        "host": host,
        "res": res or {"changed": False},
        "duration": 0.5,
    }
    data.update(extra)
    return {"event": kind, "event_data": data, "stdout": ""}


def ok(host: str, name: str, res: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    return result("runner_on_ok", host, name, res, **extra)


def failed(host: str, name: str, res: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return result("runner_on_failed", host, name, res, **extra)


def retry(host: str, name: str, res: dict[str, Any]) -> dict[str, Any]:
    return result("runner_retry", host, name, res)


def stats(**counts: dict[str, int]) -> dict[str, Any]:
    names = ("ok", "changed", "failures", "dark", "skipped", "rescued", "ignored", "processed")
    return {
        "event": "playbook_on_stats",
        "event_data": {name: counts.get(name, {}) for name in names},
    }
