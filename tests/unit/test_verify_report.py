"""`vllm-fleet verify`: what a full verify found, as findings, text, JSON and exit status."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "module_utils"))

import hf_download as hd

from tests.unit.test_hf_download import checkpoint, opts, record
from vllm_fleet import cli
from vllm_fleet.progress import FleetModel, extract_progress
from vllm_fleet.summary import summary_object, summary_text, verify_reports

__all__ = ["checkpoint", "opts"]  # the fixture and its helper, re-exported for pytest

SHA = "c" * 40


def damage(o: hd.Options, entries: list[hd.Entry]) -> dict[str, Any]:
    """A flipped byte with the mtime restored, a truncated file, a missing one, a stray."""
    base = Path(o.local_dir)
    flip = base / entries[0].path
    st = flip.stat()
    data = bytearray(flip.read_bytes())
    data[100] ^= 0xFF
    flip.write_bytes(bytes(data))
    os.utime(flip, ns=(st.st_atime_ns, st.st_mtime_ns))
    cut = base / entries[1].path
    cut.write_bytes(cut.read_bytes()[:1000])
    (base / entries[2].path).unlink()
    (base / "sub").mkdir()
    (base / "sub" / "stray.safetensors").write_bytes(b"x" * 10)
    return {"flipped": hd.hash_file(str(flip), "sha256"), "cut": hd.hash_file(str(cut), "sha256")}


def plan_for(o: hd.Options, entries: list[hd.Entry]) -> hd.Plan:
    """make_plan's comparison without the hub: the listing is the entries."""
    manifest = hd.load_manifest(o)
    actual: dict[str, str | None] = {}
    strays: list[str] = []
    status, digests, hashed = hd.assess(o, entries, manifest, actual)
    extras = hd.find_extras(o, entries, manifest, strays)
    plan = hd.Plan(SHA, entries, status, digests, 0, 0, extras=extras, hashed=hashed)
    plan.strays = strays
    plan.findings = hd.findings(o, entries, status, actual, strays)
    return plan


def test_a_full_verify_names_each_bad_file_with_both_digests_and_sizes(checkpoint) -> None:
    o, entries = checkpoint
    record(o, entries)
    o.verify = "full"
    got = damage(o, entries)
    plan = plan_for(o, entries)
    found = {f["path"]: f for f in plan.findings}
    assert {path: f["problem"] for path, f in found.items()} == {
        entries[0].path: "content",
        entries[1].path: "truncated",
        entries[2].path: "missing",
        "sub/stray.safetensors": "extra",
    }
    flipped = found[entries[0].path]
    assert (flipped["expected_digest"], flipped["actual_digest"]) == (
        entries[0].sha256,
        got["flipped"],
    )
    assert flipped["expected_size"] == flipped["actual_size"] == 4096
    cut = found[entries[1].path]
    assert (cut["actual_digest"], cut["expected_size"], cut["actual_size"]) == (
        got["cut"],
        4096,
        1000,
    )
    gone = found[entries[2].path]
    assert (gone["algorithm"], gone["expected_digest"]) == ("git-sha1", entries[2].oid)
    assert gone["actual_size"] is None and gone["actual_digest"] is None
    assert found["sub/stray.safetensors"]["actual_size"] == 10
    assert not plan.complete and hd.plan_summary(plan)["findings"] == plan.findings


def test_the_stray_is_moved_aside_not_deleted(checkpoint) -> None:
    o, _ = checkpoint
    (Path(o.local_dir) / "sub").mkdir()
    (Path(o.local_dir) / "sub" / "stray.bin").write_bytes(b"someone's")
    where = hd.set_aside(o, SHA, ["sub/stray.bin"])
    assert (Path(where) / "sub" / "stray.bin").read_bytes() == b"someone's"
    assert where.startswith(o.state_dir) and not (Path(o.local_dir) / "sub").exists()


def test_hashing_writes_progress_for_the_download_job_only(checkpoint) -> None:
    o, entries = checkpoint
    o.verify = "full"
    with hd.HashProgress(o, entries, wanted=False) as tick:
        assert tick is None
    assert not os.path.exists(hd.progress_path(o))
    with hd.HashProgress(o, entries, wanted=True) as tick:
        hd.assess(o, entries, {}, None, tick)
    snapshot = hd.read_progress(o, None)
    assert snapshot["state"] == "hashing"
    assert (snapshot["files_done"], snapshot["bytes_done"]) == (3, sum(e.size for e in entries))
    (bar,) = extract_progress({"progress": snapshot})
    assert (bar.kind, bar.done, bar.total) == ("verify", 3, 3)


FINDINGS = [
    {"path": "model-00001.safetensors", "problem": "content", "algorithm": "sha256",
     "expected_digest": "a" * 64, "actual_digest": "b" * 64,
     "expected_size": 4096, "actual_size": 4096},
    {"path": "model-00002.safetensors", "problem": "truncated", "algorithm": "sha256",
     "expected_digest": "c" * 64, "actual_digest": "d" * 64,
     "expected_size": 4096, "actual_size": 1000},
    {"path": "config.json", "problem": "missing", "algorithm": "git-sha1",
     "expected_digest": "e" * 40, "actual_digest": None,
     "expected_size": 9, "actual_size": None},
    {"path": "stray.bin", "problem": "extra", "algorithm": None, "expected_digest": None,
     "actual_digest": None, "expected_size": None, "actual_size": 10},
]  # fmt: skip


def verify_event(
    check: bool, repaired: bool, fetched: list[str], aside: list[str], clean: bool = False
) -> dict:
    fact = {
        "domain": "shared", "dir": "/srv/models/m", "check": str(check), "repaired": repaired,
        "sha": SHA, "files_total": "7", "bytes_total": "10000", "hashed": "7",
        "elapsed_s": "2.5", "findings": [] if clean else FINDINGS,
        "fetched": fetched, "set_aside": aside, "set_aside_dir": "/srv/state/set-aside/x",
    }  # fmt: skip
    return {
        "event": "runner_on_ok",
        "event_data": {
            "host": "node1",
            "task": "Record what the full verify found",
            "res": {"ansible_facts": {"model_download_verify_report": fact}, "changed": False},
        },
    }


def run_verify(event: dict, check: bool) -> tuple[int, dict[str, Any], str]:
    model = FleetModel()
    model.handle(event)
    model.handle({"event": "playbook_on_stats", "event_data": {"ok": {"node1": 3}}})
    code = cli.verify_exit_code(model, cli.EXIT_OK, check)
    header = {"command": "verify", "playbook": "deploy.yml", "check": check}
    summary = summary_object(model, header, code, "successful", 0)
    return code, summary, summary_text(summary, with_node=False)


def test_check_mode_lists_each_bad_file_and_exits_4() -> None:
    code, summary, text = run_verify(verify_event(True, False, [], []), check=True)
    assert code == cli.EXIT_BAD_FILES == 4
    report = summary["verify"]["shared"]
    assert (report["files_checked"], report["files_hashed"], report["bytes_total"]) == (7, 7, 10000)
    assert [b["action"] for b in report["bad"]] == ["none"] * 4
    assert "verify shared (node1: /srv/models/m): 7 files checked, 7 hashed, 10.0 KB" in text
    assert "  BAD model-00001.safetensors: content differs" in text
    assert f"    expected sha256 {'a' * 64}\n    actual   sha256 {'b' * 64}" in text
    assert "    size     expected 4096 bytes, actual 1000 bytes" in text
    assert "  BAD config.json: missing" in text and "actual absent" in text
    assert "  BAD stray.bin: not in the hub's listing" in text
    assert text.count("action   none (check mode)") == 4
    assert "verify found bad files (exit 4)" in text


def test_a_repair_that_mended_everything_exits_0_and_lists_it() -> None:
    fetched = [f["path"] for f in FINDINGS[:3]]
    code, summary, text = run_verify(verify_event(False, True, fetched, ["stray.bin"]), False)
    assert code == 0 and summary["ok"]
    actions = {b["path"]: b["action"] for b in summary["verify"]["shared"]["bad"]}
    assert actions == dict.fromkeys(fetched, "refetched") | {"stray.bin": "moved aside"}
    assert text.count("action   refetched from the hub, digest proved") == 3
    assert "action   moved aside to /srv/state/set-aside/x" in text
    assert "verify succeeded" in text


def test_a_repair_that_left_a_file_unmended_fails() -> None:
    code, _, _ = run_verify(verify_event(False, True, ["config.json"], []), check=False)
    assert code == cli.EXIT_FAILED


def test_a_clean_checkpoint_exits_0_with_its_counts() -> None:
    for check in (True, False):
        code, summary, text = run_verify(verify_event(check, not check, [], [], clean=True), check)
        assert code == 0 and summary["verify"]["shared"]["bad"] == []
        assert "7 files checked, 7 hashed, 10.0 KB in 2s; 0 bad" in text


def test_other_commands_keep_their_exit_code() -> None:
    model = FleetModel()
    assert verify_reports(model) == {}
    assert cli.verify_exit_code(model, cli.EXIT_FAILED, True) == cli.EXIT_FAILED
    args = argparse.Namespace()
    assert not hasattr(args, "check")


def tree(path: str) -> list[str]:
    found = (os.path.join(where, name) for where, _, names in os.walk(path) for name in names)
    return sorted(os.path.relpath(name, path) for name in found)


def test_check_mode_hashes_in_a_followed_job_outside_the_state_tree(checkpoint) -> None:
    """verify --check: the plan runs as a job whose hashing progress wait reads back; its
    results and progress live in a private temp dir (gone after), never in state_dir."""
    o, entries = checkpoint
    record(o, entries)
    o.verify = "full"
    state_before = tree(o.state_dir)

    def work(job_opts: hd.Options) -> dict[str, Any]:
        with hd.HashProgress(job_opts, entries, wanted=True) as tick:
            hd.assess(job_opts, entries, {}, None, tick)
            time.sleep(3)  # the writer thread's once-a-second snapshots land meanwhile
        return {"complete": True, "hashed": len(entries), "changed": False}

    started = hd.start_check_job(o, 60, work)
    assert started["check_job"] and started["started"]
    private = os.path.dirname(started["results_file"])
    assert not private.startswith(o.state_dir) and oct(os.stat(private).st_mode & 0o777) == "0o700"
    # Followed as a download is: rounds of wait until the job ends, each with progress.
    rounds = [hd.wait_progress(o, 0.3, started["results_file"])]
    while not rounds[-1]["ended"]:
        rounds.append(hd.wait_progress(o, 0.3, started["results_file"]))
    running = [r for r in rounds if not r["ended"] and r["progress"].get("files_done") == 3]
    assert running and running[-1]["progress"]["state"] == "hashing", rounds
    (bar,) = extract_progress(running[-1])
    assert (bar.kind, bar.done, bar.total) == ("verify", 3, 3)
    result = rounds[-1]
    assert result["job"]["hashed"] == 3 and not result["job"]["failed"]
    assert not os.path.exists(private)
    assert tree(o.state_dir) == state_before


def test_a_failed_check_mode_job_reports_its_error(checkpoint) -> None:
    o, _ = checkpoint
    o.verify = "full"

    def work(job_opts: hd.Options) -> dict[str, Any]:
        raise hd.DownloadError("Revision 'nope' not found on the hub.")

    started = hd.start_check_job(o, 60, work)
    result = hd.wait_progress(o, 30, started["results_file"])
    assert result["ended"] and result["job"]["failed"], result
    assert "Revision 'nope' not found" in result["job"]["msg"]
