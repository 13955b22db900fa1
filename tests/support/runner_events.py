"""Reading an ansible-runner run's events (anything with ``.events``)."""

from __future__ import annotations

from typing import Any


def task_hosts(runner: Any, task: str, event: str = "runner_on_ok") -> list[str]:
    """The hosts of each ``event`` of the named task, in event order."""
    return [
        ev["event_data"]["host"]
        for ev in runner.events
        if ev["event"] == event and ev["event_data"].get("task") == task
    ]
