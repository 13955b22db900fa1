"""Argument parsing, request building and argument errors (nothing runs Ansible here)."""

from __future__ import annotations

import argparse
import io
import json
import stat
from pathlib import Path

import pytest

from tests.unit import cli_events as ev
from vllm_fleet import cli, runner
from vllm_fleet.runner import (
    RunRequest,
    RunResult,
    UsageError,
    find_project_dir,
    parse_extravar,
    resolve_inventory,
)

PROJECT = Path(__file__).resolve().parents[2]
LOCAL = PROJECT / "inventory" / "local" / "hosts.yml"


def parse(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(list(argv))


def request(*argv: str) -> RunRequest:
    return cli.build_request(parse(*argv))


def test_deploy_passes_everything_through() -> None:
    req = request(
        "deploy",
        "-i",
        str(LOCAL),
        "-l",
        "gpu-nodes",
        "--tags",
        "download,install",
        "--skip-tags",
        "service",
        "--check",
        "--diff",
        "-vv",
        "-e",
        "a=1 b='two words'",
        "-e",
        '{"c": [1, 2]}',
        "--model",
        "tiny-kimi",
    )
    assert req.project_dir == PROJECT
    assert req.playbook == "deploy.yml"
    assert req.inventory == LOCAL
    assert (req.limit, req.tags, req.skip_tags) == ("gpu-nodes", "download,install", "service")
    assert (req.check, req.diff, req.verbosity) == (True, True, 2)
    assert req.extravars == [
        {"a": "1", "b": "two words"},
        {"c": [1, 2]},
        {"vllm_fleet_model": "tiny-kimi"},
    ]


def test_patch_config_runs_deploy_with_its_tag_only() -> None:
    req = request("patch-config", "-i", str(LOCAL))
    assert (req.playbook, req.tags) == ("deploy.yml", "patch-config")
    with pytest.raises(SystemExit) as exc:
        parse("patch-config", "--tags", "service")
    assert exc.value.code == 2


def test_verify_runs_the_download_step_with_a_full_rehash() -> None:
    req = request("verify", "-i", str(LOCAL), "--check", "-e", "a=1")
    assert (req.playbook, req.tags, req.check) == ("deploy.yml", "download", True)
    assert req.extravars == [{"model_download_verify": "full"}, {"a": "1"}]


def test_rollback_release_and_confirmation_vars() -> None:
    req = request("rollback", "-i", str(LOCAL), "--release", "20261129T1400Z", "--yes")
    assert req.playbook == "rollback.yml"
    assert req.extravars == [{"release": "20261129T1400Z"}, {"rollback_confirm": "yes"}]


def test_rollback_needs_yes_off_a_terminal() -> None:
    args = parse("rollback", "-i", str(LOCAL))
    with pytest.raises(UsageError, match="pass --yes"):
        cli.confirm_rollback(args, ["node1"], io.StringIO("y\n"))


def test_status_uses_the_status_playbook() -> None:
    assert request("status", "-i", str(LOCAL)).playbook == "playbooks/status.yml"


@pytest.mark.parametrize(
    "argv",
    [
        ["deploy", "--bogus"],
        ["status", "--check"],
        ["frobnicate"],
        [],
        ["rollback", "--tags", "x"],
    ],
)
def test_unknown_options_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("item", "expected"),
    [
        ("key=value", {"key": "value"}),
        ("a=1 b=2", {"a": "1", "b": "2"}),
        ("msg='hello world'", {"msg": "hello world"}),
        ("url=http://x/?a=b", {"url": "http://x/?a=b"}),
        ('{"n": 1, "l": [true]}', {"n": 1, "l": [True]}),
        ("{n: 1}", {"n": 1}),
    ],
)
def test_parse_extravar(item: str, expected: dict) -> None:
    assert parse_extravar(item) == expected


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("novalue", "expected key=value"),
        ("1bad=x", "expected key=value"),
        ("", "-e needs a value"),
        ("{unclosed", "not valid JSON/YAML"),
        ("@/does/not/exist.yml", "file not found"),
    ],
)
def test_parse_extravar_errors(item: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        parse_extravar(item)


def test_extravars_file_is_resolved(tmp_path: Path) -> None:
    path = tmp_path / "vars.yml"
    path.write_text("a: 1\n")
    assert parse_extravar(f"@{path}") == path


def test_extravars_travel_in_private_files_in_order(tmp_path: Path) -> None:
    user_file = tmp_path / "site.yml"
    user_file.write_text("x: 1\n")
    (tmp_path / "private").mkdir(mode=0o700)
    args = runner._write_extravars(
        tmp_path / "private", [{"vllm_fleet_hf_token": "s3cr3t"}, user_file]
    )
    assert args[0] == "-e" and args[2:] == ["-e", f"@{user_file}"]
    written = Path(args[1][1:])
    assert json.loads(written.read_text()) == {"vllm_fleet_hf_token": "s3cr3t"}
    assert stat.S_IMODE(written.stat().st_mode) == 0o600
    assert "s3cr3t" not in " ".join(args)


def test_project_dir_discovery(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(runner.PROJECT_ENV, raising=False)
    assert find_project_dir() == PROJECT
    monkeypatch.setenv(runner.PROJECT_ENV, str(tmp_path))
    with pytest.raises(UsageError, match=r"\$VLLM_FLEET_PROJECT .* is not a vllm-fleet project"):
        find_project_dir()
    with pytest.raises(UsageError, match="--project-dir"):
        find_project_dir(str(tmp_path))
    for name in ("ansible.cfg", "deploy.yml"):
        (tmp_path / name).write_text("")
    (tmp_path / "playbooks").mkdir()
    assert find_project_dir() == tmp_path.resolve()


def test_inventory_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=r"inventory 'inventory/nope' not found"):
        resolve_inventory(PROJECT, "inventory/nope")
    # Relative to the project when not relative to cwd.
    assert resolve_inventory(PROJECT, "inventory/local/hosts.yml") == LOCAL
    project = tmp_path / "proj"
    (project / "playbooks").mkdir(parents=True)
    (project / "ansible.cfg").write_text("[defaults]\ninventory = inventory/demo/hosts.yml\n")
    with pytest.raises(
        UsageError, match=r"default inventory .*inventory/demo/hosts\.yml does not exist"
    ):
        resolve_inventory(project, None)


def test_main_reports_a_missing_inventory(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["deploy", "-i", "no/such/inventory.yml"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "vllm-fleet deploy: error: inventory 'no/such/inventory.yml' not found" in err


def test_unknown_model_profile(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["deploy", "-i", str(LOCAL), "--model", "nope"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--model 'nope': no profile" in err and "known: " in err and "tiny-kimi" in err


def replay(events: list[dict], result: RunResult):
    """A run function that plays recorded events instead of starting Ansible."""
    seen: list[RunRequest] = []

    def run(req: RunRequest, handler) -> RunResult:
        seen.append(req)
        if req.playbook == "playbooks/status.yml":
            return RunResult("successful", 0)
        for event in events:
            handler(event)
        return result

    return run, seen


@pytest.fixture
def one_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "list_hosts", lambda req: ["node1"])


@pytest.mark.usefixtures("one_host")
@pytest.mark.parametrize(
    ("result", "events", "code"),
    [
        (RunResult("successful", 0), [ev.ok("node1", "t"), ev.stats(ok={"node1": 1})], 0),
        (
            RunResult("failed", 2),
            [ev.failed("node1", "t", {"msg": "x"}), ev.stats(failures={"node1": 1})],
            1,
        ),
        (RunResult("failed", 4), [ev.stats(dark={"node1": 1})], 1),
        (RunResult("failed", 4), [{"event": "verbose", "stdout": "[ERROR]: bad yaml"}], 3),
        (RunResult("canceled", 0), [], 130),
    ],
)
def test_exit_codes(result: RunResult, events: list[dict], code: int) -> None:
    run, _ = replay(events, result)
    args = parse("deploy", "-i", str(LOCAL), "--json", "--no-status")
    assert cli.run_command(args, io.StringIO(), run=run) == code


@pytest.mark.usefixtures("one_host")
def test_deploy_summary_merges_node_status() -> None:
    node = {"release": "r7", "vllm_version": "0.32.0", "health": "ok", "endpoint": "http://n:8001"}

    def run(req: RunRequest, handler) -> RunResult:
        if req.playbook == "playbooks/status.yml":
            handler(ev.ok("node1", "Report the node status", {"vllm_fleet_node": node}))
        else:
            handler(ev.ok("node1", "Start", {"changed": True}))
            handler(ev.stats(ok={"node1": 1}, changed={"node1": 1}))
        return RunResult("successful", 0)

    out = io.StringIO()
    code = cli.run_command(parse("deploy", "-i", str(LOCAL), "--json"), out, run=run)
    assert code == 0
    summary = json.loads(out.getvalue().splitlines()[-1])
    assert summary["hosts"]["node1"] | node == summary["hosts"]["node1"]
    assert summary["hosts"]["node1"]["counts"]["changed"] == 1


@pytest.mark.usefixtures("one_host")
def test_check_mode_skips_the_status_probe() -> None:
    run, seen = replay([ev.stats(ok={"node1": 1})], RunResult("successful", 0))
    cli.run_command(parse("deploy", "-i", str(LOCAL), "--check", "--plain"), io.StringIO(), run=run)
    assert [req.playbook for req in seen] == ["deploy.yml"]
    assert seen[0].check is True


class FakeTty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_renderer_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TERM", "xterm")
    model = cli.FleetModel()
    assert type(cli.make_renderer(parse("deploy"), model, io.StringIO())) is cli.PlainRenderer
    assert type(cli.make_renderer(parse("deploy"), model, FakeTty())) is cli.TtyRenderer
    assert (
        type(cli.make_renderer(parse("deploy", "--plain"), model, FakeTty())) is cli.PlainRenderer
    )
    assert type(cli.make_renderer(parse("deploy", "--json"), model, FakeTty())) is cli.JsonRenderer
    monkeypatch.setenv("TERM", "dumb")
    assert type(cli.make_renderer(parse("deploy"), model, FakeTty())) is cli.PlainRenderer


@pytest.mark.usefixtures("one_host")
def test_interrupted_run_skips_the_probe_and_says_so() -> None:
    run, seen = replay([ev.ok("node1", "Plan the download")], RunResult("canceled", 0))
    out = io.StringIO()
    code = cli.run_command(parse("deploy", "-i", str(LOCAL), "--plain"), out, run=run)
    assert code == 130
    assert [req.playbook for req in seen] == ["deploy.yml"]
    lines = out.getvalue().splitlines()
    assert next(line for line in lines if line.startswith("node1")).split()[1] == "interrupted"
    assert lines[-1].startswith("deploy interrupted (exit 130)")
