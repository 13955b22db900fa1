"""The vllm_service_probe module's decisions: crash, stopped, loading, stalled; progress lines."""

from __future__ import annotations

import http.server
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.ansible_module import (  # noqa: F401 (patch_ansible_module: autouse fixture)
    load_module,
    patch_ansible_module,
    run_module,
)

probe = load_module("vllm_service_probe", "roles/vllm_service/library")


def props(active: str, sub: str, restarts: int = 0, status: int = 0) -> dict[str, str]:
    return {
        "ActiveState": active,
        "SubState": sub,
        "NRestarts": str(restarts),
        "ExecMainStatus": str(status),
        "MainPID": "42",
        "InactiveExitTimestamp": "@1700000000",
    }


def test_running_unit_is_not_a_failure() -> None:
    assert probe.failure_reason(props("active", "running"), restarts=0) == ""


def test_restart_counter_increase_is_a_crash_even_when_running_again() -> None:
    reason = probe.failure_reason(props("active", "running", restarts=2), restarts=1)
    assert "restarted 1 time(s)" in reason
    assert "crashed" in reason


def test_exit_zero_waiting_for_restart_is_a_failure() -> None:
    # The API server exits 0 after its engine died; Restart=always schedules a restart.
    reason = probe.failure_reason(props("activating", "auto-restart", status=0), restarts=0)
    assert "not running" in reason
    assert "auto-restart" in reason


def test_failed_and_stopped_units_are_failures() -> None:
    assert "failed" in probe.failure_reason(props("failed", "failed", status=1), restarts=None)
    assert "not running" in probe.failure_reason(props("inactive", "dead"), restarts=None)


def test_clean_line_keeps_the_last_progress_redraw_without_colours() -> None:
    line = "\x1b[32mLoading 10%\x1b[0m\rLoading 50%\rLoading 100% | 4/4\r"
    assert probe.clean_line(line) == "Loading 100% | 4/4"
    assert probe.clean_line("\r \r") == ""


def test_health_status_is_zero_when_nothing_listens() -> None:
    assert probe.health_status("http://127.0.0.1:9", timeout=1) == 0


LOAD_LOG = [
    "Starting to load model /srv/vllm-fleet/models/tiny-kimi...",
    "Loading safetensors checkpoint shards:   0% Completed | 0/119 [00:00<?, ?it/s]",
    "Loading safetensors checkpoint shards:  50% Completed | 60/119 [07:30<07:22, 7.5s/it]",
    "KV cache size: 1,024 tokens",
]


def test_load_progress_reads_the_last_loader_line_behind_later_milestones() -> None:
    assert probe.load_progress(LOAD_LOG) == {"kind": "load", "done": 60, "total": 119}
    # The milestone has moved on; the progress still says where the load got.
    assert probe.latest_milestone(LOAD_LOG, ["KV cache size"]) == "KV cache size: 1,024 tokens"


def test_load_progress_is_none_before_the_loader_starts() -> None:
    assert probe.load_progress(LOAD_LOG[:1]) is None
    assert probe.load_progress([]) is None
    assert probe.latest_milestone([], ["x"]) == ""


# The module run whole against a stand-in systemd on PATH: systemctl reports an
# active unit, journalctl prints the journal as `journalctl -o json` does (a line
# with control characters as a list of its bytes), honouring -n.
FAKE_SYSTEMCTL = """\
import os, sys
sys.stdout.write(open(os.environ["FAKE_UNIT_PROPS"]).read())
"""
FAKE_JOURNALCTL = """\
import json, os, sys, time
entries = json.load(open(os.environ["FAKE_JOURNAL"]))
if os.environ.get("FAKE_JOURNAL_LIVE"):
    # A unit that keeps writing: a new line at every read.
    entries.append([time.time(), "(EngineCore_DP0 pid=7) INFO still working"])
count = int(sys.argv[sys.argv.index("-n") + 1])
for stamp, message in entries[-count:]:
    text = message if message.isprintable() else list(message.encode())
    print(json.dumps({"__REALTIME_TIMESTAMP": str(int(stamp * 1e6)), "MESSAGE": text}))
"""
SHARD_BAR = (
    "Loading safetensors checkpoint shards:   0% Completed | 0/4 [00:00<?, ?it/s]\r"
    "Loading safetensors checkpoint shards:  25% Completed | 1/4 [00:09<00:27, 9.1s/it]"
)


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., dict]:
    """Runs the probe on a unit loading since 1000 s ago; journal: (seconds ago, line)."""
    for name, script in (("systemctl", FAKE_SYSTEMCTL), ("journalctl", FAKE_JOURNALCTL)):
        path = tmp_path / name
        path.write_text(f"#!{sys.executable}\n{script}")
        path.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    props = tmp_path / "props"
    props.write_text(
        "ActiveState=active\nSubState=running\nNRestarts=0\nExecMainStatus=0\n"
        "MainPID=42\nInactiveExitTimestamp=@1\n"
    )
    monkeypatch.setenv("FAKE_UNIT_PROPS", str(props))

    def run(journal: list[tuple[float, str]], **args: object) -> dict:
        now = time.time()
        path = tmp_path / "journal.json"
        path.write_text(json.dumps([[now - ago, line] for ago, line in journal]))
        monkeypatch.setenv("FAKE_JOURNAL", str(path))
        params = {
            "unit": "vllm-tiny-kimi",
            # Nothing listens there: the server is still loading.
            "url": "http://127.0.0.1:9",
            "since": int(now) - 1000,
            "restarts": 0,
            "timeout_s": 2700,
            "wait_s": 0,
            "interval_s": 0.2,
            "milestones": ["Starting to load model", "checkpoint shards", "KV cache"],
        }
        return run_module(probe, params | args)

    return run


LOADING = [
    (990.0, "INFO 12-01 10:00:00 [config.py:1] Resolved architecture: DeepseekV3ForCausalLM"),
    (950.0, "(EngineCore_DP0 pid=7) INFO 12-01 10:00:40 [runner.py:2] Starting to load model x"),
]


def test_a_silent_load_is_reported_stalled_with_its_phase(node: Callable[..., dict]) -> None:
    result = node([*LOADING, (200.0, SHARD_BAR)], stall_s=180)
    assert result["state"] == "stalled"
    assert result["healthy"] is False
    assert result["phase"] == "weights loading 1/4"
    assert 199 <= result["quiet_s"] <= 202
    reason = result["reason"]
    assert reason.startswith(
        f"the load made no progress (no journal line, no CPU work) for {result['quiet_s']} s "
    )
    assert "(stall budget vllm_fleet_load_stall_s=180)" in reason
    assert reason.endswith(
        "; last phase: weights loading 1/4 (Loading safetensors checkpoint shards:  25% "
        "Completed | 1/4 [00:09<00:27, 9.1s/it])"
    )
    assert result["vllm_fleet_progress"] == {"kind": "load", "done": 1, "total": 4}
    assert result["vllm_fleet_poll"].startswith("stalled, ")


def test_a_stall_before_the_first_line_counts_from_the_start(node: Callable[..., dict]) -> None:
    result = node([], stall_s=180, since=int(time.time()) - 190)
    assert result["state"] == "stalled"
    assert result["phase"] == "starting"
    assert result["reason"].endswith("last phase: starting (no milestone since the start)")
    # The same start 100 s ago is within the budget.
    result = node([], stall_s=180, since=int(time.time()) - 100)
    assert (result["state"], result["phase"], result["reason"]) == ("loading", "starting", "")


def test_no_stall_while_lines_keep_coming(
    node: Callable[..., dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Silent for 500 s at the start of the call, then a line at every read: the
    # round waits its whole 3 s (it would end at once if the old silence counted).
    monkeypatch.setenv("FAKE_JOURNAL_LIVE", "1")
    began = time.monotonic()
    result = node([*LOADING, (500.0, SHARD_BAR)], stall_s=2, wait_s=3)
    assert time.monotonic() - began >= 3
    assert result["state"] == "loading"
    assert result["reason"] == ""
    assert result["quiet_s"] < 2
    assert result["phase"] == "weights loading 1/4"


def test_stall_s_0_turns_the_check_off(node: Callable[..., dict]) -> None:
    journal = [*LOADING, (600.0, "INFO [gpu_worker.py:3] GPU KV cache size: 1,024 tokens")]
    result = node(journal, stall_s=0)
    assert (result["state"], result["reason"], result["quiet_s"]) == ("loading", "", 0)
    assert result["phase"] == "KV cache sizing"
    # The same journal with a budget: stalled.
    assert node(journal, stall_s=300)["state"] == "stalled"


def test_a_carriage_return_progress_line_is_progress(node: Callable[..., dict]) -> None:
    # journalctl -o json writes this line as a list of bytes (carriage returns);
    # 10 s old, it is the load's latest sign of life.
    bar = SHARD_BAR + "\rLoading safetensors checkpoint shards:  50% Completed | 2/4 [00:18<00:18]"
    result = node([*LOADING, (10.0, bar)], stall_s=180)
    assert result["state"] == "loading"
    assert 9 <= result["quiet_s"] <= 12
    assert result["phase"] == "weights loading 2/4"
    assert result["milestone"].endswith("2/4 [00:18<00:18]")
    assert result["vllm_fleet_progress"] == {"kind": "load", "done": 2, "total": 4}


def test_a_failed_unit_keeps_the_phase_it_reached(
    node: Callable[..., dict], tmp_path: Path
) -> None:
    props = tmp_path / "props"
    props.write_text(props.read_text().replace("ActiveState=active", "ActiveState=failed"))
    # A crash is a failure, not a stall, however long the journal was silent.
    result = node([*LOADING, (900.0, SHARD_BAR)], stall_s=180)
    assert result["state"] == "failed"
    assert result["reason"].startswith("unit failed")
    assert result["phase"] == "weights loading 1/4"


def test_a_healthy_unit_is_serving_however_long_it_was_silent(node: Callable[..., dict]) -> None:
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        result = node([*LOADING, (600.0, "Application startup complete.")], stall_s=180, url=url)
    finally:
        server.shutdown()
    assert (result["state"], result["phase"], result["reason"]) == ("healthy", "serving", "")


# Real vLLM lines (V1 engine, 0.1x-0.3x), the phase each begins; the logging
# prefix of the process that writes them (the unit's processes share its journal).
API = "(APIServer pid=700) INFO 12-01 10:00:00"
CORE = "(EngineCore_DP0 pid=812) INFO 12-01 10:00:05"
WORKER = "(Worker_TP0 pid=900) INFO 12-01 10:00:20"
VLLM_LINES = [
    ("INFO 12-01 10:00:00 [model.py:547] Resolved architecture: KimiK25ForCausalLM", "engine init"),
    (f"{CORE} [core.py:93] Initializing a V1 LLM engine (v0.34.0) with config: ", "engine init"),
    (f"{WORKER} [pynccl.py:70] vLLM is using nccl==2.27.3", "distributed init"),
    (f"{WORKER} [gpu_model_runner.py:2602] Starting to load model /srv/m...", "weights loading"),
    (
        "Loading safetensors checkpoint shards:  50% Completed | 60/119 [07:30<07:22, 7.5s/it]",
        "weights loading 60/119",
    ),
    (f"{WORKER} [default_loader.py:267] Loading weights took 1050.21 seconds", "weights loaded"),
    (
        f"{WORKER} [gpu_model_runner.py:2653] Model loading took 67.8 GiB, 1057.9 s",
        "weights loaded",
    ),
    (f"{WORKER} [backends.py:548] Dynamo bytecode transform time: 25.14 s", "torch.compile"),
    (f"{WORKER} [monitor.py:34] torch.compile takes 95.3 s in total", "torch.compile"),
    (f"{WORKER} [gpu_worker.py:298] Available KV cache memory: 12.5 GiB", "KV cache sizing"),
    (f"{CORE} [kv_cache_utils.py:1087] GPU KV cache size: 812,160 tokens", "KV cache sizing"),
    (
        f"{CORE} [kv_cache_utils.py:1091] Maximum concurrency for 262144 tokens per request: 3.10x",
        "KV cache sizing",
    ),
    (
        "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE):  45%|####5     | 30/67 [00:05]",
        "CUDA graph capture",
    ),
    (
        f"{WORKER} [gpu_model_runner.py:3480] Graph capturing finished in 88 secs, took 1.52 GiB",
        "engine ready",
    ),
    (
        f"{CORE} [core.py:210] init engine (profile, create kv cache, warmup model) took 180.33 s",
        "engine ready",
    ),
    (
        f"{API} [api_server.py:1951] Starting vLLM API server 0 on http://10.0.0.5:8000",
        "API server starting",
    ),
    ("(APIServer pid=700) INFO:     Application startup complete.", "serving"),
]


@pytest.mark.parametrize(("line", "phase"), VLLM_LINES)
def test_each_vllm_milestone_names_its_phase(line: str, phase: str) -> None:
    assert probe.phase_of(["INFO an unrelated line", line, "WARNING a later unrelated line"]) == (
        phase,
        line,
    )


def test_the_last_milestone_names_the_phase_and_is_shortened_for_the_reason() -> None:
    lines = [line for line, _ in VLLM_LINES[:8]]
    assert probe.phase_of(lines) == ("torch.compile", lines[-1])
    assert probe.phase_of(["no milestone at all"]) == ("starting", "")
    assert probe.shorten(lines[5]) == "Loading weights took 1050.21 seconds"
    assert probe.shorten("x" * 300) == "x" * 117 + "..."


def test_segments_split_redraws_and_a_line_another_process_wrote_behind_a_bar() -> None:
    # journald ends a half-written bar when another process of the unit writes.
    merged = "\x1b[32mLoading safetensors checkpoint shards:  13% Completed | 16/119\x1b[0m\rINFO x"
    assert probe.segments([merged, "\r \r", "a\nb"]) == [
        "Loading safetensors checkpoint shards:  13% Completed | 16/119",
        "INFO x",
        "a",
        "b",
    ]
    assert probe.load_progress(probe.segments([merged])) == {
        "kind": "load",
        "done": 16,
        "total": 119,
    }


def test_cpu_work_counts_as_progress_between_rounds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A silent phase that works (a bar journald sees only at its end, torch.compile)
    uses CPU: the unit's cgroup cpu.stat, read at each call, the last reading kept
    in the probe's state file between rounds; a stopped engine uses none."""
    cgroup = tmp_path / "cgroup" / "system.slice" / "vllm-tiny-kimi.service"
    cgroup.mkdir(parents=True)
    monkeypatch.setattr(probe, "_CGROUP_ROOT", str(tmp_path / "cgroup"))
    monkeypatch.setattr(probe, "_PROBE_STATE_DIR", str(tmp_path / "state"))
    unit, group = "vllm-tiny-kimi.service", "/system.slice/vllm-tiny-kimi.service"

    def reading(usec: int, now: float, since: int = 1000) -> float:
        (cgroup / "cpu.stat").write_text(f"usage_usec {usec}\nuser_usec 1\nsystem_usec 1\n")
        return probe.last_cpu_work(unit, group, since, now)

    assert reading(5_000_000, 2000.0) == 0.0  # the first reading: nothing to compare
    assert reading(25_000_000, 2010.0) == 2010.0  # 20 s of CPU in 10 s: working
    assert reading(25_100_000, 2020.0) == 2010.0  # 0.01 of a core: asleep (stopped, hung I/O)
    assert reading(25_100_000, 2030.0) == 2010.0
    assert reading(25_100_000, 2040.0, since=1900) == 0.0  # a new start forgets the last
    assert (tmp_path / "state").stat().st_mode & 0o777 == 0o700
    assert probe.last_cpu_work(unit, "", 1000, 2050.0) == 0.0  # no cgroup: the journal alone
    assert probe.cgroup_cpu_usec("/nonexistent") is None
