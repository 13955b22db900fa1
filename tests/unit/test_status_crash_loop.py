"""A unit in a crash loop, as `vllm-fleet status` reports it (role status).

The filters are fed ``systemctl show`` properties as a unit that hit its start
limit, one between restarts and one that serves report them; the role runs
under ansible-playbook with ``systemctl`` and ``journalctl`` stubbed on PATH,
so its node report, the journal it reads and role vllm_service's diagnosis of
that journal are the role's own.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_SPEC = importlib.util.spec_from_file_location(
    "status_crash_loop", ROOT / "roles/status/filter_plugins/status_crash_loop.py"
)
status_crash_loop = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(status_crash_loop)

UNIT = "vllm-tiny-kimi.service"
START_LIMIT_HIT = {
    "LoadState": "loaded",
    "ActiveState": "failed",
    "SubState": "failed",
    "Result": "start-limit-hit",
    "NRestarts": "5",
    "ExecMainCode": "1",
    "ExecMainStatus": "2",
}
BAD_ARGUMENT = "api_server.py: error: unrecognized arguments: --no-such-flag 1"
DIAGNOSIS = [
    {"name": "unrecognized-argument", "advice": "Fix the profile.", "lines": [BAD_ARGUMENT]},
    {"name": "permission-denied", "advice": "Fix the modes.", "lines": ["Permission denied"]},
]


def test_start_limit_hit_is_a_stopped_crash_loop_with_the_first_diagnosis() -> None:
    record = status_crash_loop.crash_loop(START_LIMIT_HIT, DIAGNOSIS, UNIT)
    assert record == {
        "state": "stopped",
        "result": "start-limit-hit",
        "restarts": 5,
        "last_exit": "exit status 2",
        "diagnosis": "unrecognized-argument",
        "advice": "Fix the profile.",
        "lines": [BAD_ARGUMENT],
    }
    assert status_crash_loop.crash_loop_health(record) == (
        "crash loop: start limit hit after 5 restarts: unrecognized-argument"
    )


def test_between_restarts_it_is_restarting() -> None:
    # The engine died, the API server exited 0, and systemd waits RestartSec.
    props = {"LoadState": "loaded", "ActiveState": "activating", "SubState": "auto-restart",
             "Result": "success", "NRestarts": "1",
             "ExecMainCode": "1", "ExecMainStatus": "0"}  # fmt: skip
    record = status_crash_loop.crash_loop(props, [], UNIT)
    assert (record["state"], record["restarts"], record["last_exit"]) == (
        "restarting",
        1,
        "exit status 0",
    )
    assert record["diagnosis"] == "" and record["lines"] == []
    assert f"journalctl -u {UNIT} -o cat" in record["advice"]
    assert status_crash_loop.crash_loop_health(record) == (
        "crash loop: restarting, 1 restart so far: no known diagnosis"
    )


def test_systemd_252_keeps_the_last_exit_as_the_result_of_a_start_limit_hit() -> None:
    """Debian 12's systemd says "Start request repeated too quickly" in the journal
    only, and leaves Result=exit-code: under Restart=always, failed after restarts
    is the start limit (the e2e fleet's nodes showed exactly this)."""
    props = START_LIMIT_HIT | {"Result": "exit-code", "Restart": "always"}
    record = status_crash_loop.crash_loop(props, DIAGNOSIS, UNIT)
    assert (record["state"], record["result"]) == ("stopped", "start-limit-hit")
    assert status_crash_loop.crash_loop_health(record).startswith(
        "crash loop: start limit hit after 5 restarts"
    )
    # Without Restart=always a failed unit is not known to have hit its limit.
    other = status_crash_loop.crash_loop(props | {"Restart": "on-failure"}, DIAGNOSIS, UNIT)
    assert other["result"] == "exit-code"


def test_failed_after_restarts_names_its_result_and_signal() -> None:
    props = {"ActiveState": "failed", "SubState": "failed", "Result": "signal",
             "NRestarts": "3", "ExecMainCode": "2", "ExecMainStatus": "9"}  # fmt: skip
    record = status_crash_loop.crash_loop(props, DIAGNOSIS[1:])
    assert (record["state"], record["last_exit"]) == ("stopped", "killed by SIGKILL")
    assert status_crash_loop.crash_loop_health(record) == (
        "crash loop: failed (signal) after 3 restarts: permission-denied"
    )
    props |= {"ExecMainCode": "3", "ExecMainStatus": "11"}
    assert status_crash_loop.last_exit(props) == "dumped core on SIGSEGV"


@pytest.mark.parametrize(
    "props",
    [
        # Serving, after restarts long ago (or loading again: one read cannot tell).
        {"LoadState": "loaded", "ActiveState": "active", "SubState": "running", "NRestarts": "4"},
        # Between the first crash and the first restart.
        {"ActiveState": "activating", "SubState": "auto-restart", "NRestarts": "0"},
        # Failed once, never restarted.
        {"ActiveState": "failed", "SubState": "failed", "Result": "exit-code", "NRestarts": "0"},
        # Nothing deployed yet; no systemd at all.
        {"LoadState": "not-found", "ActiveState": "inactive", "Result": "success"},
        {},
    ],
)
def test_no_crash_loop(props: dict) -> None:
    assert status_crash_loop.crash_loop(props, DIAGNOSIS, UNIT) == {}
    assert status_crash_loop.crash_loop_health({}) == ""


STUB = """#!{python}
import json, os, sys
with open(os.environ["STUB_LOG"], "a") as log:
    log.write(json.dumps([os.path.basename(sys.argv[0]), *sys.argv[1:]]) + "\\n")
if sys.argv[0].endswith("journalctl"):
    print(os.environ["STUB_JOURNAL"])
else:
    props = json.loads(os.environ["STUB_PROPS"])
    for arg in sys.argv[1:]:
        if arg.startswith("--property="):
            for name in arg.split("=", 1)[1].split(","):
                if name in props:
                    print(f"{{name}}={{props[name]}}")
"""


def run_play(tmp_path: Path, tasks: list, props: dict) -> tuple[subprocess.CompletedProcess, list]:
    """One play on localhost with systemctl/journalctl stubbed; its run and the stubs' calls."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("systemctl", "journalctl"):
        (bin_dir / name).write_text(STUB.format(python=sys.executable))
        (bin_dir / name).chmod(0o755)
    play = [{"hosts": "localhost", "gather_facts": False, "roles": ["vllm_fleet"], "tasks": tasks}]
    (tmp_path / "play.yml").write_text(json.dumps(play))
    log = tmp_path / "calls.log"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
        "ANSIBLE_ROLES_PATH": str(ROOT / "roles"),
        "ANSIBLE_STDOUT_CALLBACK": "ansible.builtin.json",
        "STUB_LOG": str(log),
        "STUB_PROPS": json.dumps(props | {"ExecMainStartTimestamp": "@1700000000"}),
        "STUB_JOURNAL": f"INFO Starting to load model\n{BAD_ARGUMENT}",
    }
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "ansible-playbook"), "-i", "localhost,", "-c", "local",
         "-e", f"ansible_python_interpreter={sys.executable}",
         "-e", f"vllm_fleet_profiles_dir={ROOT / 'playbooks/models'}",
         # Nothing listens here: the node's server is down, as in a crash loop.
         "-e", '{"vllm_fleet_port": 9}', str(tmp_path / "play.yml")],
        capture_output=True, text=True, env=env, check=False, cwd=ROOT,
    )  # fmt: skip
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return proc, calls


def node_report(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    tasks = json.loads(proc.stdout)["plays"][0]["tasks"]
    (report,) = [t for t in tasks if t["task"]["name"].endswith("Report the node status")]
    return report["hosts"]["localhost"]["vllm_fleet_node"]


STATUS = [{"ansible.builtin.import_role": {"name": "status"}}]


def test_status_reports_the_crash_loop_with_vllm_service_diagnosis(tmp_path: Path) -> None:
    proc, calls = run_play(tmp_path, STATUS, START_LIMIT_HIT)
    node = node_report(proc)
    assert node["unit"] == "failed/failed"
    assert node["health"] == "crash loop: start limit hit after 5 restarts: unrecognized-argument"
    loop = node["crash_loop"]
    assert (loop["state"], loop["result"], loop["restarts"], loop["last_exit"]) == (
        "stopped",
        "start-limit-hit",
        5,
        "exit status 2",
    )
    # Role vllm_service's own advice for the pattern (vars/main.yml), not a copy.
    assert loop["diagnosis"] == "unrecognized-argument"
    assert loop["advice"].startswith("vLLM rejected an engine argument")
    assert loop["lines"] == [BAD_ARGUMENT]
    # The journal of the unit's current run: since it last left inactive.
    (journal,) = [call for call in calls if call[0] == "journalctl"]
    assert journal[journal.index("-u") + 1] == UNIT
    assert "--since=@1700000000" in journal


def test_a_serving_unit_costs_no_journal_read(tmp_path: Path) -> None:
    props = {"LoadState": "loaded", "ActiveState": "active", "SubState": "running",
             "Result": "success", "NRestarts": "2",
             "ExecMainCode": "0", "ExecMainStatus": "0"}  # fmt: skip
    proc, calls = run_play(tmp_path, STATUS, props)
    node = node_report(proc)
    assert node["crash_loop"] == {}
    assert node["unit"] == "active/running" and node["health"] == "down"
    assert [call[0] for call in calls] == ["systemctl"]


def test_the_health_waits_rescue_still_fails_with_the_diagnosis(tmp_path: Path) -> None:
    """Entry point diagnose fails by default (the rolling path's rescue relies on it)."""
    tasks = [{"ansible.builtin.include_role": {"name": "vllm_service",
                                               "tasks_from": "diagnose.yml"}}]  # fmt: skip
    proc, _ = run_play(tmp_path, tasks, START_LIMIT_HIT)
    assert proc.returncode == 2
    results = [t["hosts"]["localhost"] for t in json.loads(proc.stdout)["plays"][0]["tasks"]]
    failed = [result for result in results if result.get("failed")]
    assert len(failed) == 1 and "Diagnosis: unrecognized-argument." in failed[0]["msg"]
