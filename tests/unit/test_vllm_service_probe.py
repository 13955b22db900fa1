"""The vllm_service_probe module's decisions: crash, stopped, loading; progress lines."""

from __future__ import annotations

from tests.support.ansible_module import load_module

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
