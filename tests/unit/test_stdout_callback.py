"""callback_plugins/vllm_fleet.py through ansible-playbook: a retried wait prints its
progress line at every round, other retries keep Ansible's default line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def playbook(tmp_path: Path, verbosity: int = 0) -> str:
    """Two retried tasks: hf_snapshot's wait on a job that never ends, and a command."""
    state = tmp_path / "state"
    state.mkdir()
    progress = {"state": "running", "pid": os.getpid(), "files_done": 3, "files_total": 7}
    # Newer than the job file: progress of this job, not left by an earlier one.
    (state / "progress.json").write_text(json.dumps({**progress, "updated": time.time() + 60}))
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"started": 1, "finished": 0}))
    wait = {
        "hf_snapshot": {"mode": "wait", "repo_id": "org/model", "local_dir": str(tmp_path / "m"),
                        "state_dir": str(state), "wait_s": 0, "job_file": str(job)},
        "register": "w", "until": "w.ended", "retries": 2, "delay": 0, "ignore_errors": True,
    }  # fmt: skip
    other = {
        "ansible.builtin.command": {"argv": ["false"]}, "register": "c",
        "until": "c.rc == 0", "retries": 1, "delay": 0, "ignore_errors": True,
    }  # fmt: skip
    play = [{"hosts": "localhost", "gather_facts": False, "tasks": [
        {"name": "Follow a job", **wait}, {"name": "Retry a command", **other}]}]  # fmt: skip
    (tmp_path / "play.yml").write_text(json.dumps(play))
    # hf_snapshot is role model_download's module, run here outside the role.
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
           "ANSIBLE_LIBRARY": str(ROOT / "roles/model_download/library")}  # fmt: skip
    args = [str(Path(sys.executable).parent / "ansible-playbook"), "-i", "localhost,",
            "-c", "local", "-e", f"ansible_python_interpreter={sys.executable}",
            str(tmp_path / "play.yml")]  # fmt: skip
    args += ["-" + "v" * verbosity] if verbosity else []
    proc = subprocess.run(args, capture_output=True, text=True, env=env, check=False, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    return proc.stdout


def test_each_wait_round_prints_its_progress_line(tmp_path: Path) -> None:
    out = playbook(tmp_path)
    polls = [line for line in out.splitlines() if line.startswith("POLLING [localhost]")]
    assert len(polls) == 2, out
    assert "Follow a job: 3/7 files" in polls[0] and "(2 rounds left)" in polls[0], polls
    assert "(1 rounds left)" in polls[1], polls
    # A retried task without a poll line keeps Ansible's own wording.
    assert "FAILED - RETRYING: [localhost]: Retry a command (1 retries left)." in out


def test_at_vvv_the_default_retry_line_with_the_result_returns(tmp_path: Path) -> None:
    out = playbook(tmp_path, verbosity=3)
    assert "POLLING" not in out
    assert "FAILED - RETRYING: [localhost]: Follow a job (2 retries left).Result was:" in out
