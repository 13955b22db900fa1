"""The event model and its renderers, fed runner-shaped event dicts."""

from __future__ import annotations

import base64
import io
import json
import time

import pytest
from rich.console import Console

from tests.unit import cli_events as ev
from vllm_fleet.progress import (
    FleetModel,
    JsonRenderer,
    PlainRenderer,
    TtyRenderer,
    describe_progress,
    extract_progress,
    human_bytes,
)
from vllm_fleet.summary import status_object, status_text, summary_object, summary_text

HEADER = {
    "command": "deploy",
    "playbook": "deploy.yml",
    "inventory": "inventory/demo",
    "limit": None,
    "tags": None,
    "check": False,
    "hosts": ["node1", "node2"],
}

SERVICE_DIAGNOSIS_MSG = (
    "vllm-tiny-kimi on node2 is not serving.\n"
    "What failed: vllm-tiny-kimi on node2 did not become healthy: unit failed.\n"
    "Unit: ActiveState=failed SubState=failed\n"
    "Diagnosis: fp8-kv-cache-on-mla. Patch the checkpoint: --tags patch-config.\n"
    "Journal lines:\n"
    "  NotImplementedError: fp8 KV cache for CPU MLA is not yet implemented\n"
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def feed(model: FleetModel, events: list[dict]) -> list[dict]:
    records: list[dict] = []
    for event in events:
        records.extend(model.handle(event))
    return records


PROBE = "Poll /health of vllm-tiny-kimi"


def deploy_events() -> list[dict]:
    """Two nodes: node1 loads and serves, node2 fails with the service role's diagnosis."""
    load = "Loading safetensors checkpoint shards:  50% Completed | 2/4 [00:02<00:02, 1.01s/it]"
    return [
        ev.play("Download the checkpoint"),
        ev.task("Wait for the download", "Download the checkpoint", role="model_download"),
        ev.start("node1", "Wait for the download", "Download the checkpoint"),
        ev.retry(
            "node1",
            "Wait for the download",
            {
                "vllm_fleet_progress": {
                    "kind": "download",
                    "done": 3,
                    "total": 8,
                    "bytes_done": 1_200_000_000,
                    "bytes_total": 2_400_000_000,
                    "rate": 200_000_000,
                },
                "attempts": 2,
                "retries": 100,
            },
        ),
        ev.result(
            "runner_on_ok",
            "node1",
            "Wait for the download",
            {"changed": True},
            play_name="Download the checkpoint",
        ),
        ev.play(),
        # The service role's probe: one task, retried while the model loads.
        ev.task(PROBE, role="vllm_service"),
        ev.start("node1", PROBE),
        ev.retry(
            "node1",
            PROBE,
            {
                "state": "loading",
                "phase": "weights loading 2/4",
                "milestone": load,
                "vllm_fleet_poll": f"loading, 12 s, weights loading 2/4: {load}",
                "vllm_fleet_progress": {"kind": "load", "done": 2, "total": 4},
                "attempts": 1,
                "retries": 62,
            },
        ),
        ev.ok(
            "node1",
            PROBE,
            {
                "state": "healthy",
                "phase": "serving",
                "vllm_fleet_poll": "healthy, 15 s, serving: Application startup complete.",
                "attempts": 2,
            },
        ),
        ev.task("Fail with the diagnosis", role="vllm_service"),
        ev.start("node2", "Fail with the diagnosis"),
        ev.failed("node2", "Fail with the diagnosis", {"msg": SERVICE_DIAGNOSIS_MSG}),
        ev.stats(
            ok={"node1": 5, "node2": 3},
            changed={"node1": 1},
            failures={"node2": 1},
        ),
    ]


def test_model_normalizes_results_progress_and_failures() -> None:
    model = FleetModel()
    records = feed(model, deploy_events())
    types = [record["type"] for record in records]
    assert types.count("play_start") == 2
    assert "retry" in types

    download = [r for r in records if r["type"] == "progress" and r["kind"] == "download"]
    assert download[0]["done"] == 3 and download[0]["bytes_total"] == 2_400_000_000
    assert download[0]["percent"] == 50.0

    load = [r for r in records if r["type"] == "progress" and r["kind"] == "load"]
    assert (load[0]["done"], load[0]["total"]) == (2, 4)

    results = [r for r in records if r["type"] == "task_result"]
    assert [r["status"] for r in results] == ["changed", "ok", "failed"]
    failure = results[-1]
    assert failure["host"] == "node2"
    assert failure["diagnosis"] == "fp8-kv-cache-on-mla. Patch the checkpoint: --tags patch-config."

    assert [f.host for f in model.failures()] == ["node2"]
    assert model.hosts["node1"].counts["changed"] == 1
    assert model.hosts["node2"].counts["failed"] == 1


def test_rescued_failure_is_not_a_host_failure() -> None:
    model = FleetModel()
    feed(
        model,
        [
            ev.play(),
            ev.failed("node1", "Wait for /health", {"msg": "timeout"}),
            ev.ok("node1", "Restore the previous release", {"changed": True}),
            ev.stats(ok={"node1": 4}, changed={"node1": 1}, rescued={"node1": 1}),
        ],
    )
    assert model.failures() == []
    assert model.host_ok(model.hosts["node1"])


def test_ignored_and_unreachable_statuses() -> None:
    model = FleetModel()
    records = feed(
        model,
        [
            ev.failed("node1", "Probe", {"msg": "nope"}, ignore_errors=True),
            ev.result("runner_on_unreachable", "node2", "Gather", {"msg": "ssh: timed out"}),
            ev.result("runner_on_skipped", "node1", "Optional", {"changed": False}),
            ev.stats(ok={"node1": 1}, dark={"node2": 1}, ignored={"node1": 1}),
        ],
    )
    assert [r["status"] for r in records] == ["ignored", "unreachable", "skipped"]
    failures = model.failures()
    assert [(f.host, f.unreachable) for f in failures] == [("node2", True)]


@pytest.mark.parametrize(
    ("res", "expected"),
    [
        # The convention through ansible.builtin.debug var=vllm_fleet_progress.
        ({"vllm_fleet_progress": {"kind": "load", "done": 1, "total": 4}}, ("load", 1, 4)),
        # ... and through set_fact.
        (
            {"ansible_facts": {"vllm_fleet_progress": {"kind": "download", "done": 2, "total": 5}}},
            ("download", 2, 5),
        ),
        # model_download's progress.json read back with slurp.
        (
            {
                "encoding": "base64",
                "content": base64.b64encode(
                    json.dumps(
                        {
                            "files_done": 7,
                            "files_total": 119,
                            "bytes_done": 10,
                            "bytes_total": 100,
                            "rate_bytes_per_s": 5,
                        }
                    ).encode()
                ).decode(),
            },
            ("download", 7, 119),
        ),
        # hf_snapshot mode=wait returns it under progress.
        (
            {
                "ended": False,
                "msg": "40/132 files, 0.2 GB/0.7 GB",
                "progress": {
                    "state": "running",
                    "files_done": 40,
                    "files_total": 132,
                    "bytes_done": 2e8,
                    "bytes_total": 7e8,
                },
            },
            ("download", 40, 132),
        ),
        # ... or with command: cat.
        (
            {"stdout": json.dumps({"files_done": 1, "files_total": 2, "bytes_total": 9})},
            ("download", 1, 2),
        ),
        # vLLM's own tqdm line, with carriage-return redraws, in a probe's milestone.
        (
            {
                "milestone": "Loading safetensors checkpoint shards:   0% Completed | 0/119"
                "\rLoading safetensors checkpoint shards:  13% Completed | 16/119 [02:24<15:27]"
            },
            ("load", 16, 119),
        ),
        # huggingface_hub's snapshot bar.
        (
            {"stdout_lines": ["Fetching 26 files:  15%|#5   | 4/26 [00:03<00:20]"]},
            ("download", 4, 26),
        ),
    ],
)
def test_extract_progress_sources(res: dict, expected: tuple) -> None:
    found = extract_progress(res)
    assert [(p.kind, p.done, p.total) for p in found] == [expected]


def test_extract_progress_ignores_unrelated_results() -> None:
    assert extract_progress({"msg": "All assertions passed", "changed": False}) == []
    # hf_snapshot's plan and final results carry totals only: no bar from them.
    assert extract_progress({"files_total": 119, "bytes_total": 10, "files_to_fetch": 3}) == []
    assert extract_progress({"stdout": "{not json"}) == []


def test_describe_progress_shows_files_bytes_and_rate() -> None:
    model = FleetModel()
    feed(model, deploy_events()[:4])
    line = describe_progress(model.hosts["node1"].progress["download"], width=10)
    assert line == "download [#####.....]  50.0%  3/8 files  1.2 GB/2.4 GB  200.0 MB/s"
    assert human_bytes(999) == "999 B"
    assert human_bytes(540e9) == "540.0 GB"


def test_finished_bar_is_dropped_when_the_next_task_starts() -> None:
    model = FleetModel()
    feed(
        model,
        [
            ev.play(),
            ev.start("node1", "Load"),
            ev.ok(
                "node1", "Load", {"vllm_fleet_progress": {"kind": "load", "done": 4, "total": 4}}
            ),
            ev.start("node1", "Smoke-test"),
        ],
    )
    assert model.hosts["node1"].progress == {}


def test_elapsed_time_moves_while_a_task_runs() -> None:
    """A long silent task (a model load) after a finished one: the live view's
    elapsed time keeps growing until that task's result."""
    model = FleetModel()
    feed(model, [ev.play(), ev.start("node1", "Restart"), ev.ok("node1", "Restart", {})])
    state = model.hosts["node1"]
    done = state.duration
    time.sleep(0.01)
    assert done is not None and state.duration == done  # finished: it stands still
    feed(model, [ev.start("node1", "Poll /health")])
    first = state.duration
    time.sleep(0.01)
    assert first is not None and state.duration > first
    feed(model, [ev.ok("node1", "Poll /health", {})])
    finished = state.duration
    time.sleep(0.01)
    assert state.duration == finished


def test_plain_renderer_lines() -> None:
    model = FleetModel()
    out = io.StringIO()
    renderer = PlainRenderer(model, out)
    renderer.start(HEADER)
    for event in deploy_events():
        for record in model.handle(event):
            renderer.record(record)
    text = out.getvalue()
    assert text.splitlines()[0] == (
        "vllm-fleet deploy: deploy.yml | inventory inventory/demo | 2 host(s): node1, node2"
    )
    assert "== Download the checkpoint" in text
    assert "progress    node1: download [##########..........]  50.0%  3/8 files" in text
    assert "progress    node1: load     [##########..........]  50.0%  2/4 shards" in text
    assert "failed      node2: Fail with the diagnosis" in text
    assert "    diagnosis: fp8-kv-cache-on-mla." in text
    assert "\x1b[" not in text


def test_plain_renderer_throttles_progress() -> None:
    model = FleetModel()
    out = io.StringIO()
    renderer = PlainRenderer(model, out)
    for done in range(0, 101):
        res = {"vllm_fleet_progress": {"kind": "load", "done": done, "total": 100}}
        for record in model.handle(ev.retry("node1", "Wait", res)):
            renderer.record(record)
    lines = [line for line in out.getvalue().splitlines() if line.startswith("progress")]
    # 0%, every 10 points, and the finish: not 101 lines.
    assert len(lines) == 11
    assert lines[-1].endswith("100/100 shards")


def tty_renderer(model: FleetModel, out: io.StringIO, width: int = 160) -> TtyRenderer:
    """A TtyRenderer on a forced terminal without colour; draws only when a line is printed."""
    console = Console(file=out, force_terminal=True, width=width, color_system=None)
    renderer = TtyRenderer(model, out, console=console)
    renderer.live.auto_refresh = False  # no refresh thread: the output is deterministic
    return renderer


def live_lines(renderer: TtyRenderer, width: int = 160) -> list[str]:
    """The live block as the terminal shows it, trailing padding stripped."""
    console = Console(file=io.StringIO(), force_terminal=True, width=width, color_system=None)
    with console.capture() as capture:
        console.print(renderer.live_view())
    return [line.rstrip() for line in capture.get().splitlines()]


def test_tty_renderer_redraws_live_block() -> None:
    model = FleetModel()
    out = io.StringIO()
    renderer = tty_renderer(model, out)
    renderer.start(HEADER)
    for event in deploy_events()[:4]:
        for record in model.handle(event):
            renderer.record(record)
    live = live_lines(renderer)
    assert live[0].startswith("  node1")
    assert "Wait for the download  (waiting, attempt 2/100)" in live[0]
    # Half of rich's bar is drawn; without colour the rest is blank.
    bar = "━" * 12 + " " * 12
    assert f"download {bar}  50.0%  3/8 files  1.2 GB/2.4 GB  200.0 MB/s" in live[1]
    renderer.record({"type": "play_start", "play": "Serve"})
    # The block is erased (cursor up + clear, line by line) before the next line
    # scrolls in, and drawn again below it.
    erase = "\r\x1b[2K" + "\x1b[1A\x1b[2K" * (len(live) - 1)
    text = out.getvalue()
    assert f"{erase}== Serve\n{live[0]}" in text
    assert text.index("waiting     node1: Wait for the download") < text.rindex(live[0])
    renderer.close()
    # Closing clears the block and shows the cursor again.
    assert out.getvalue().endswith("\x1b[?25h\r" + "\x1b[1A\x1b[2K" * len(live))


def test_the_probe_phase_shows_beside_the_waiting_task() -> None:
    """The health probe's phase, in every view, while its task waits; gone with the task."""
    probe_round = deploy_events()[:9]
    assert probe_round[-1]["event"] == "runner_retry"
    model = FleetModel()
    out = io.StringIO()
    renderer = tty_renderer(model, out)
    for event in probe_round:
        for record in model.handle(event):
            renderer.record(record)
    live = live_lines(renderer)
    assert f"{PROBE}  (waiting, attempt 1/62, phase: weights loading 2/4)" in live[0]
    assert (
        f"waiting     node1: {PROBE} (attempt 1/62, phase: weights loading 2/4)" in out.getvalue()
    )
    renderer.close()

    model = FleetModel()
    records = feed(model, probe_round)
    (retry,) = [r for r in records if r["type"] == "retry" and r["task"] == PROBE]
    assert retry["phase"] == "weights loading 2/4"
    # The download's rounds name no phase: their waiting line stays as it was.
    (download,) = [r for r in records if r["type"] == "retry" and r["task"] != PROBE]
    assert "phase" not in download
    assert PlainRenderer(model).format(download) == (
        "waiting     node1: Wait for the download (attempt 2/100)"
    )
    # The last round's phase is the result's; the next task has none.
    (done,) = model.handle(deploy_events()[9])
    assert done["phase"] == "serving"
    model.handle(ev.start("node1", "Smoke-test the server"))
    assert model.hosts["node1"].phase is None


def test_a_phase_outside_a_polling_result_is_not_shown() -> None:
    model = FleetModel()
    feed(model, [ev.play(), ev.start("node1", "Read pods")])
    (record,) = model.handle(ev.retry("node1", "Read pods", {"phase": "Running", "attempts": 1}))
    assert "phase" not in record
    assert model.hosts["node1"].phase is None


def test_tty_renderer_prints_task_text_literally_and_cuts_long_lines() -> None:
    model = FleetModel()
    out = io.StringIO()
    renderer = tty_renderer(model, out, width=60)
    name = "Render [bold]templates[/bold] :smile: " + "x" * 80
    for event in [ev.play(), ev.start("node1", name), ev.ok("node1", name, {"changed": True})]:
        for record in model.handle(event):
            renderer.record(record)
    # Brackets and emoji codes are data, not rich markup; the terminal wraps the line.
    assert f"changed     node1: {name}\n" in out.getvalue()
    model.handle(ev.start("node1", name))
    (line,) = live_lines(renderer, width=60)
    assert line.startswith("  node1  ") and line.endswith("…")
    assert len(line) <= 60
    renderer.close()


def test_json_renderer_and_summary_schema() -> None:
    clock = FakeClock()
    model = FleetModel(clock=clock)
    out = io.StringIO()
    renderer = JsonRenderer(model, out)
    renderer.start(HEADER)
    for event in deploy_events():
        clock.now += 1
        for record in model.handle(event):
            renderer.record(record)
    model.hosts["node1"].node.update(
        {"release": "20261129T140000Z", "vllm_version": "0.32.0", "health": "ok"}
    )
    summary = summary_object(model, HEADER, exit_code=1, status="failed", rc=2)
    out.write(json.dumps(summary) + "\n")

    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert lines[0]["type"] == "run_start" and lines[0]["hosts"] == ["node1", "node2"]
    assert all("type" in line and "time" in line for line in lines[1:-1])
    final = lines[-1]
    assert final["type"] == "summary"
    assert set(final) == {
        "type",
        "command",
        "playbook",
        "check",
        "ok",
        "exit_code",
        "runner_status",
        "ansible_rc",
        "duration",
        "hosts",
        "routers",
        "verify",
        "failures",
        "errors",
    }
    assert final["ok"] is False and final["exit_code"] == 1
    node1 = final["hosts"]["node1"]
    assert node1["result"] == "ok" and node1["release"] == "20261129T140000Z"
    assert set(node1) >= {"counts", "duration", "vllm_version", "endpoint", "health", "unit"}
    assert final["hosts"]["node2"]["result"] == "failed"
    assert final["failures"][0]["task"] == "Fail with the diagnosis"
    assert final["failures"][0]["role"] is None
    assert final["failures"][0]["diagnosis"].startswith("fp8-kv-cache-on-mla")


def test_summary_text_names_host_task_and_diagnosis() -> None:
    model = FleetModel()
    feed(model, deploy_events())
    model.hosts["node1"].node.update(
        {"release": "r1", "vllm_version": "0.32.0", "endpoint": "http://n1:8001", "health": "ok"}
    )
    text = summary_text(summary_object(model, HEADER, 1, "failed", 2), with_node=True)
    lines = text.splitlines()
    heading = next(line for line in lines if line.startswith("HOST"))
    assert heading.split() == [
        "HOST",
        "RESULT",
        "CHANGED",
        "RELEASE",
        "VLLM",
        "ENDPOINT",
        "HEALTH",
        "DURATION",
    ]
    node1 = next(line for line in lines if line.startswith("node1"))
    assert node1.split()[:7] == ["node1", "ok", "1", "r1", "0.32.0", "http://n1:8001", "ok"]
    assert "FAILED node2: Fail with the diagnosis" in text
    assert "  diagnosis: fp8-kv-cache-on-mla." in text
    assert text.rstrip().splitlines()[-1].startswith("deploy failed (exit 1)")


def test_status_table_and_object() -> None:
    model = FleetModel()
    node = {
        "unit": "active/running",
        "health": "ok",
        "served_model": "tiny-kimi",
        "release": "r2",
        "vllm_version": "0.32.0",
        "endpoint": "http://127.0.0.1:8001",
        "load": {
            "running": 2.0,
            "waiting": 1.0,
            "kv_cache_usage": 0.4237,
            "throughput": 57.25,
            "source": "prometheus",
        },
        "crash_loop": {},
    }
    feed(
        model,
        [
            ev.ok("node1", "Report the node status", {"vllm_fleet_node": node}),
            ev.result("runner_on_unreachable", "node2", "Read the unit state", {"msg": "down"}),
            ev.stats(ok={"node1": 7}, dark={"node2": 1}),
        ],
    )
    status = status_object(model, exit_code=1)
    assert status["hosts"]["node1"] == node | {"reachable": True}
    assert status["hosts"]["node2"]["reachable"] is False
    assert status["hosts"]["node2"]["load"] is None
    text = status_text(status)
    rows = [line.split() for line in text.splitlines()]
    assert rows[0] == [
        "HOST", "UNIT", "HEALTH", "MODEL", "RELEASE", "VLLM", "ENDPOINT",
        "RUNNING", "WAITING", "KV", "CACHE", "TOKENS/S",
    ]  # fmt: skip
    assert rows[1] == [
        "node1",
        "active/running",
        "ok",
        "tiny-kimi",
        "r2",
        "0.32.0",
        node["endpoint"],
        "2",
        "1",
        "42.4%",
        "57.2",
    ]
    assert rows[2][:2] == ["node2", "unreachable"]
    assert rows[2][-4:] == ["-", "-", "-", "-"]
    assert text.splitlines()[3] == "(load from Prometheus; tokens/s over the last minute)"


def test_status_load_from_the_nodes_metrics() -> None:
    model = FleetModel()
    load = {"running": 0.0, "waiting": 0.0, "kv_cache_usage": 0.0, "throughput": 0.0}
    feed(
        model,
        [
            ev.ok("node1", "Report the node status",
                  {"vllm_fleet_node": {"unit": "active/running",
                                       "load": load | {"source": "metrics"}}}),
            ev.ok("node2", "Report the node status",
                  {"vllm_fleet_node": {"unit": "inactive/dead", "load": {}}}),
        ],
    )  # fmt: skip
    lines = status_text(status_object(model, exit_code=0)).splitlines()
    assert lines[1].split()[-4:] == ["0", "0", "0.0%", "0.0"]
    assert lines[2].split()[-4:] == ["-", "-", "-", "-"]
    assert lines[3] == "(load from each node's /metrics; tokens/s between two reads)"


# A node whose unit hit its start limit, as role status reports it.
CRASH_LOOP_NODE = {
    "unit": "failed/failed",
    "health": "crash loop: start limit hit after 5 restarts: unrecognized-argument",
    "served_model": "",
    "release": "r2",
    "vllm_version": "",
    "endpoint": "http://127.0.0.1:8002",
    "load": {},
    "crash_loop": {
        "state": "stopped",
        "result": "start-limit-hit",
        "restarts": 5,
        "last_exit": "exit status 2",
        "diagnosis": "unrecognized-argument",
        "advice": "vLLM rejected an engine argument: "
        "fix vllm_fleet_engine_args in the model profile.",
        "lines": ["api_server.py: error: unrecognized arguments: --no-such-flag 1"],
    },
}


def test_status_names_a_crash_loop_and_its_diagnosis() -> None:
    model = FleetModel()
    serving = {"unit": "active/running", "health": "ok", "crash_loop": {}}
    feed(
        model,
        [
            ev.ok("node1", "Report the node status", {"vllm_fleet_node": serving}),
            ev.ok("node2", "Report the node status", {"vllm_fleet_node": CRASH_LOOP_NODE}),
            ev.stats(ok={"node1": 9, "node2": 14}),
        ],
    )
    status = status_object(model, exit_code=0)
    assert status["hosts"]["node2"]["crash_loop"] == CRASH_LOOP_NODE["crash_loop"]
    assert status["hosts"]["node1"]["crash_loop"] == {}
    lines = status_text(status).splitlines()
    assert lines[0].split()[:3] == ["HOST", "UNIT", "HEALTH"]
    row = next(line for line in lines if line.startswith("node2"))
    cells = [cell.strip() for cell in row.split("  ") if cell.strip()]
    assert cells[:3] == [
        "node2",
        "failed/failed",
        "crash loop: start limit hit after 5 restarts: unrecognized-argument",
    ]
    paragraph = lines[lines.index("CRASH LOOP node2: start limit hit after 5 restarts: "
                                  "unrecognized-argument (last exit: exit status 2)"):]  # fmt: skip
    assert paragraph[1:4] == [
        "  vLLM rejected an engine argument: fix vllm_fleet_engine_args in the model profile.",
        "    api_server.py: error: unrecognized arguments: --no-such-flag 1",
        "  systemd no longer restarts it: fix the cause, then deploy again.",
    ]
    # The serving node gets no paragraph.
    assert not any(line.startswith("CRASH LOOP node1") for line in lines)


def test_a_restarting_unit_without_a_known_diagnosis() -> None:
    model = FleetModel()
    node = {
        "unit": "activating/auto-restart",
        "health": "crash loop: restarting, 1 restart so far: no known diagnosis",
        "crash_loop": {
            "state": "restarting",
            "result": "success",
            "restarts": 1,
            "last_exit": "exit status 0",
            "diagnosis": "",
            "advice": "No known failure matched: read journalctl -u vllm-tiny-kimi.service -o cat "
            "on the node for the cause.",
            "lines": [],
        },
    }
    feed(model, [ev.ok("node1", "Report the node status", {"vllm_fleet_node": node})])
    lines = status_text(status_object(model, exit_code=0)).splitlines()
    start = lines.index(
        "CRASH LOOP node1: restarting, 1 restart so far: no known diagnosis "
        "(last exit: exit status 0)"
    )
    # systemd still restarts it: no "no longer restarts" line, the advice is the way on.
    assert lines[start + 1 :] == [
        "  No known failure matched: read journalctl -u vllm-tiny-kimi.service -o cat on the node "
        "for the cause."
    ]


def test_deploy_summary_names_a_node_in_a_crash_loop() -> None:
    """After a deploy, the status probe's crash loop reaches the summary and its JSON."""
    model = FleetModel()
    feed(model, deploy_events())
    model.hosts["node2"].node.update(CRASH_LOOP_NODE)
    summary = summary_object(model, HEADER, 1, "failed", 2)
    assert summary["hosts"]["node2"]["crash_loop"]["diagnosis"] == "unrecognized-argument"
    assert summary["hosts"]["node2"]["crash_loop"]["restarts"] == 5
    assert summary["hosts"]["node1"]["crash_loop"] is None
    json.dumps(summary)
    text = summary_text(summary, with_node=True)
    row = next(line for line in text.splitlines() if line.startswith("node2"))
    assert "crash loop: start limit hit after 5 restarts: unrecognized-argument" in row
    assert (
        "\nCRASH LOOP node2: start limit hit after 5 restarts: unrecognized-argument "
        "(last exit: exit status 2)\n"
        "  vLLM rejected an engine argument: fix vllm_fleet_engine_args in the model profile.\n"
        "    api_server.py: error: unrecognized arguments: --no-such-flag 1\n"
    ) in text
    # Then the failure of the deploy itself, as before.
    assert text.index("CRASH LOOP node2") < text.index("FAILED node2: Fail with the diagnosis")


def test_ansible_error_output_is_kept_for_the_summary() -> None:
    model = FleetModel()
    feed(
        model,
        [
            {"event": "verbose", "stdout": "\x1b[0;31m[ERROR]: YAML parsing failed\x1b[0m"},
            {"event": "verbose", "stdout": "Origin: deploy.yml:3:1"},
        ],
    )
    summary = summary_object(model, HEADER, 3, "failed", 4)
    assert summary["errors"] == ["[ERROR]: YAML parsing failed", "Origin: deploy.yml:3:1"]
    assert "could not run the play" in summary_text(summary, with_node=False)


def test_plain_renderer_collapses_polling_rounds() -> None:
    model = FleetModel()
    out = io.StringIO()
    renderer = PlainRenderer(model, out)
    progress = {"files_done": 0, "files_total": 10, "bytes_done": 0, "bytes_total": 1000}
    for round_ in range(1, 6):
        progress |= {"files_done": round_ * 2, "bytes_done": round_ * 200}
        content = base64.b64encode(json.dumps(progress).encode()).decode()
        events = [
            ev.ok(
                "node1", "Read the download progress", {"content": content, "encoding": "base64"}
            ),
            ev.ok("node1", "Keep following the download"),
        ]
        for event in events:
            for record in model.handle(event):
                renderer.record(record)
    for record in model.handle(ev.ok("node1", "Record the manifest", {"changed": True})):
        renderer.record(record)
    lines = out.getvalue().splitlines()
    assert lines.count("ok          node1: Read the download progress") == 1
    assert lines.count("ok          node1: Keep following the download") == 1
    assert len([line for line in lines if line.startswith("progress")]) == 5
    assert lines[-1] == "changed     node1: Record the manifest"


def test_diff_mode_results_show_a_unified_diff() -> None:
    model = FleetModel()
    res = {
        "changed": True,
        "diff": [
            {
                "before": '{\n  "kv_cache_quant_algo": "FP8",\n  "group_size": 16\n}\n',
                "after": '{\n  "group_size": 16\n}\n',
                "before_header": "hf_quant_config.json (before)",
                "after_header": "hf_quant_config.json (after)",
            }
        ],
    }
    (record,) = model.handle(ev.ok("node1", "Ensure the KV-cache quantization is absent", res))
    assert record["diff"].splitlines() == [
        "--- hf_quant_config.json (before)",
        "+++ hf_quant_config.json (after)",
        "@@ -1,4 +1,3 @@",
        " {",
        '-  "kv_cache_quant_algo": "FP8",',
        '   "group_size": 16',
        " }",
    ]
    out = io.StringIO()
    PlainRenderer(model, out).record(record)
    assert '\n    -  "kv_cache_quant_algo": "FP8",' in out.getvalue()


def test_router_status_table_lists_each_worker_as_the_router_sees_it() -> None:
    model = FleetModel()
    router = {
        "endpoint": "http://127.0.0.1:8000",
        "unit": "active/running",
        "health": "ok",
        "workers": {"http://127.0.0.1:8001": "healthy", "http://127.0.0.1:8002": "unhealthy"},
    }
    feed(
        model,
        [
            ev.ok("node1", "Report the router status", {"vllm_fleet_router": router}),
            ev.stats(ok={"node1": 3}),
        ],
    )
    status = status_object(model, exit_code=0)
    assert status["routers"] == {"node1": router}
    lines = status_text(status).splitlines()
    header = lines.index(next(line for line in lines if line.startswith("ROUTER")))
    assert lines[header + 1].split() == [
        "node1",
        "http://127.0.0.1:8000",
        "active/running",
        "ok",
        "http://127.0.0.1:8001",
        "healthy,",
        "http://127.0.0.1:8002",
        "unhealthy",
    ]
    summary = summary_object(model, HEADER, exit_code=0, status="successful", rc=0)
    assert summary["routers"] == {"node1": router}
    assert "http://127.0.0.1:8002 unhealthy" in summary_text(summary, with_node=True)
    # Without a router the summary has no routers table.
    assert "ROUTER" not in status_text(status_object(FleetModel(), exit_code=0))


def test_a_warning_event_without_its_text_in_event_data_shows_its_stdout() -> None:
    """ansible-runner's warning events can carry a flag in event_data["warning"] (the
    CLI printed `cannot display an event (TypeError ...)` for each before)."""
    model = FleetModel()
    event = {"event": "warning", "event_data": {"warning": True}, "stdout": "[WARNING]: x y"}
    assert model.handle(event) == [{"type": "warning", "text": "[WARNING]: x y"}]
    named = {"event": "warning", "event_data": {"warning": "named"}, "stdout": "other"}
    assert model.handle(named) == [{"type": "warning", "text": "named"}]
