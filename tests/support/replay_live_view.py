#!/usr/bin/env python3
"""Replay recorded-shape runner events through the CLI's renderers, paced, to watch them.

    python -m tests.support.replay_live_view            # the live view (needs a terminal)
    python -m tests.support.replay_live_view | cat      # the plain lines a pipe gets

Two nodes: node1 downloads and loads (bars fill), node2 fails with the
service role's diagnosis. To check the live view leaves nothing behind, run it
in ``tmux new-session -d -x 120 -y 30`` and read ``tmux capture-pane -p``.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from typing import Any

from tests.unit import cli_events as ev
from vllm_fleet.progress import FleetModel, PlainRenderer, Renderer, TtyRenderer
from vllm_fleet.summary import summary_object, summary_text

HEADER = {
    "command": "deploy",
    "playbook": "deploy.yml",
    "inventory": "inventory/demo",
    "hosts": ["node1", "node2"],
}
DOWNLOAD = "Wait for the download"
PROBE = "Poll /health of vllm-tiny-kimi [bold]"
GB = 1_000_000_000


def events() -> Iterator[dict[str, Any]]:
    """The run, one event at a time; the replay sleeps between them."""
    yield ev.play("Download the checkpoint")
    yield ev.task(DOWNLOAD, "Download the checkpoint")
    for host in ("node1", "node2"):
        yield ev.start(host, DOWNLOAD, "Download the checkpoint")
    for attempt in range(1, 9):
        done = {"done": attempt, "total": 8, "bytes_done": attempt * 0.3 * GB}
        res = {
            "vllm_fleet_progress": {"kind": "download", **done, "bytes_total": 2.4 * GB}
            | {"rate": 200_000_000},
            "attempts": attempt,
            "retries": 100,
        }
        yield ev.retry("node1", DOWNLOAD, res)
    yield ev.result("runner_on_ok", "node1", DOWNLOAD, {"changed": True}, "Download the checkpoint")
    yield ev.result("runner_on_ok", "node2", DOWNLOAD, {"changed": True}, "Download the checkpoint")
    yield ev.play()
    yield ev.task(PROBE)
    for host in ("node1", "node2"):
        yield ev.start(host, PROBE)
    for shard in range(0, 5):
        res = {"vllm_fleet_progress": {"kind": "load", "done": shard, "total": 4}}
        yield ev.retry("node1", PROBE, res | {"attempts": shard + 1, "retries": 62})
    yield ev.ok("node1", PROBE, {"state": "healthy"})
    yield ev.failed("node2", PROBE, {"msg": "unit failed\nDiagnosis: fp8-kv-cache-on-mla."})
    yield ev.stats(ok={"node1": 5, "node2": 3}, changed={"node1": 1}, failures={"node2": 1})


def replay(renderer: Renderer, model: FleetModel, pause: float) -> None:
    renderer.start(HEADER)
    try:
        for event in events():
            for record in model.handle(event):
                renderer.record(record)
            time.sleep(pause)
    finally:
        renderer.close()
    summary = summary_object(model, HEADER, exit_code=1, status="failed", rc=2)
    sys.stdout.write(summary_text(summary, with_node=False) + "\n")


def main() -> None:
    model = FleetModel()
    tty = sys.stdout.isatty() and os.environ.get("TERM", "") != "dumb"
    renderer = TtyRenderer(model) if tty else PlainRenderer(model)
    replay(renderer, model, float(os.environ.get("REPLAY_PAUSE", "0.4")))


if __name__ == "__main__":
    main()
