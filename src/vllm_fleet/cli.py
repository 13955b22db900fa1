"""``vllm-fleet``: deploy, rollback, patch-config, verify and status through ansible-runner.

Exit codes: 0 success; 1 a host failed or was unreachable (the summary names
host, task and diagnosis); 2 bad arguments (nothing ran); 3 Ansible could not
run the play (syntax or configuration error); 4 ``verify --check`` found a bad,
missing or extra file (each is listed; nothing was changed); 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from vllm_fleet import __version__
from vllm_fleet.progress import (
    FleetModel,
    JsonRenderer,
    PlainRenderer,
    Renderer,
    TtyRenderer,
)
from vllm_fleet.redact import Redactor
from vllm_fleet.runner import (
    RunRequest,
    RunResult,
    UsageError,
    find_project_dir,
    list_hosts,
    parse_extravar,
    resolve_inventory,
    run_playbook,
    secrets_in,
)
from vllm_fleet.summary import (
    status_object,
    status_text,
    summary_object,
    summary_text,
    verify_reports,
)

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
# As sha256sum -c: the run worked and found files that do not match.
EXIT_BAD_FILES = 4
PLAYBOOKS = {
    "deploy": "deploy.yml",
    "rollback": "rollback.yml",
    "patch-config": "deploy.yml",
    "verify": "deploy.yml",
    "status": "playbooks/status.yml",
}
RunFn = Callable[[RunRequest, Callable[[dict[str, Any]], None]], RunResult]


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "-i",
        "--inventory",
        help="inventory file or directory (default: the one ansible.cfg names)",
    )
    common.add_argument("-l", "--limit", help="limit to hosts/groups (Ansible pattern)")
    common.add_argument(
        "-e",
        "--extra-vars",
        action="append",
        default=[],
        metavar="VARS",
        help="key=value, @file (YAML/JSON) or a JSON/YAML mapping; repeatable, later wins",
    )
    common.add_argument("--model", help="model profile (playbooks/models/<MODEL>.yml)")
    common.add_argument(
        "--project-dir", help="vllm-fleet checkout (default: $VLLM_FLEET_PROJECT, this package's)"
    )
    common.add_argument(
        "--json", action="store_true", help="newline-delimited JSON events and a final summary"
    )
    common.add_argument("--plain", action="store_true", help="line-by-line text even on a terminal")
    common.add_argument(
        "-v", "--verbose", action="count", default=0, help="more output (passed to Ansible)"
    )

    playbook = argparse.ArgumentParser(add_help=False)
    playbook.add_argument("--check", action="store_true", help="check mode: change nothing")
    playbook.add_argument("--diff", action="store_true", help="show file differences")

    tagged = argparse.ArgumentParser(add_help=False)
    tagged.add_argument("-t", "--tags", help="only these steps (comma-separated tags)")
    tagged.add_argument("--skip-tags", help="skip these steps")

    parser = argparse.ArgumentParser(
        prog="vllm-fleet",
        description="Deploy vLLM to a GPU fleet with the project's playbooks, with live progress.",
    )
    parser.add_argument("--version", action="version", version=f"vllm-fleet {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    deploy = commands.add_parser(
        "deploy",
        parents=[common, playbook, tagged],
        help="validate, preflight, download, install, patch-config, serve",
    )
    deploy.add_argument(
        "--no-status", action="store_true", help="skip the node status check after the run"
    )
    rollback = commands.add_parser(
        "rollback", parents=[common, playbook], help="return nodes to the previous release"
    )
    rollback.add_argument("--release", help="release id to return to (default: the previous)")
    rollback.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
    rollback.add_argument(
        "--no-status", action="store_true", help="skip the node status check after the run"
    )
    commands.add_parser(
        "patch-config",
        parents=[common, playbook],
        help="only the quant-config patch (deploy.yml --tags patch-config)",
    )
    commands.add_parser(
        "verify",
        parents=[common, playbook],
        help="re-hash every checkpoint file against the hub, repairing each bad one "
        "(deploy.yml --tags download -e model_download_verify=full; --check only reports)",
    )
    commands.add_parser(
        "status", parents=[common], help="per node: unit, /health, model, release, vLLM version"
    )
    return parser


def build_request(args: argparse.Namespace) -> RunRequest:
    """Resolve and check everything before Ansible starts (raises UsageError)."""
    project = find_project_dir(args.project_dir)
    inventory = resolve_inventory(project, args.inventory)
    extravars = [parse_extravar(item) for item in args.extra_vars]
    if args.model:
        extravars.append({"vllm_fleet_model": args.model})
    if args.model or not _mentions(extravars, "vllm_fleet_model"):
        _check_profile(project, args.model)
    if args.command == "rollback":
        if args.release:
            extravars.append({"release": args.release})
        extravars.append({"rollback_confirm": "yes"})
    tags = getattr(args, "tags", None)
    if args.command == "patch-config":
        tags = "patch-config"
    if args.command == "verify":
        tags = "download"
        extravars.insert(0, {"model_download_verify": "full"})  # before -e: a user value wins
    return RunRequest(
        project_dir=project,
        playbook=PLAYBOOKS[args.command],
        inventory=inventory,
        limit=args.limit,
        tags=tags,
        skip_tags=getattr(args, "skip_tags", None),
        check=getattr(args, "check", False),
        diff=getattr(args, "diff", False),
        verbosity=args.verbose,
        extravars=extravars,
    )


def _mentions(extravars: list[Any], name: str) -> bool:
    return any(isinstance(item, dict) and name in item for item in extravars)


def _check_profile(project: Any, model: str | None) -> None:
    if model is None:
        return
    profile = project / "playbooks" / "models" / f"{model}.yml"
    if not profile.is_file():
        known = sorted(path.stem for path in (project / "playbooks" / "models").glob("*.yml"))
        raise UsageError(f"--model {model!r}: no profile {profile} (known: {', '.join(known)})")


def confirm_rollback(args: argparse.Namespace, hosts: list[str], stdin: TextIO) -> None:
    """Ask on a terminal; elsewhere --yes is required (a prompt would hang in CI)."""
    if args.yes or args.check:
        return
    if not stdin.isatty():
        raise UsageError("rollback changes running nodes: pass --yes when not on a terminal")
    target = args.release or "the previous release"
    sys.stderr.write(f"Roll back {len(hosts)} node(s) ({', '.join(hosts)}) to {target}? [y/N] ")
    sys.stderr.flush()
    if stdin.readline().strip().lower() not in ("y", "yes"):
        raise UsageError("rollback not confirmed; nothing changed")


def make_renderer(args: argparse.Namespace, model: FleetModel, stream: TextIO) -> Renderer:
    if args.json:
        return JsonRenderer(model, stream)
    verbose = args.verbose > 0
    if not args.plain and stream.isatty() and os.environ.get("TERM", "") != "dumb":
        return TtyRenderer(model, stream, verbose=verbose)
    return PlainRenderer(model, stream, verbose=verbose)


def exit_code_for(model: FleetModel, result: RunResult) -> int:
    if result.status == "canceled":
        return EXIT_INTERRUPTED
    if result.status == "successful" and result.rc == 0:
        return EXIT_OK
    if model.failures() or any(not model.host_ok(state) for state in model.hosts.values()):
        return EXIT_FAILED
    return EXIT_ERROR


def verify_exit_code(model: FleetModel, code: int, check: bool) -> int:
    """--check: EXIT_BAD_FILES when a domain has a bad file; a repair must leave none unmended."""
    if code != EXIT_OK:
        return code
    reports = verify_reports(model).values()
    if check and any(report["bad"] for report in reports):
        return EXIT_BAD_FILES
    if not check and any(report["bad"] and not report["repaired"] for report in reports):
        return EXIT_FAILED
    return EXIT_OK


def header_for(args: argparse.Namespace, request: RunRequest, hosts: list[str]) -> dict[str, Any]:
    return {
        "command": args.command,
        "playbook": request.playbook,
        "inventory": str(request.inventory),
        "limit": request.limit,
        "tags": request.tags,
        "check": request.check,
        "hosts": hosts,
    }


def run_command(
    args: argparse.Namespace,
    stdout: TextIO,
    run: RunFn = run_playbook,
    stdin: TextIO | None = None,
) -> int:
    """Everything after argument parsing; returns the exit code."""
    request = build_request(args)
    hosts = list_hosts(request)
    if args.command == "rollback":
        confirm_rollback(args, hosts, stdin or sys.stdin)
    redactor = Redactor(secrets_in(request.extravars, request.inventory, request.project_dir))
    model = FleetModel(redactor)
    renderer = make_renderer(args, model, stdout)
    header = header_for(args, request, hosts)
    if args.command == "status":
        return _status(args, request, model, renderer, header, stdout, run)
    renderer.start(header)
    try:
        result = run(request, lambda event: _feed(model, renderer, event))
    finally:
        renderer.close()
    code = exit_code_for(model, result)
    if args.command == "verify":
        code = verify_exit_code(model, code, request.check)
    probe = args.command in ("deploy", "rollback") and not (request.check or args.no_status)
    if probe and code != EXIT_INTERRUPTED:
        _merge_status(request, model, redactor, run, stdout, args.json)
    summary = summary_object(model, header, code, result.status, result.rc)
    if args.json:
        JsonRenderer(model, stdout).emit(_dumps(summary))
    else:
        with_node = args.command in ("deploy", "rollback")
        stdout.write(summary_text(summary, with_node=with_node) + "\n")
    return code


def _feed(model: FleetModel, renderer: Renderer, event: dict[str, Any]) -> None:
    for record in model.handle(event):
        renderer.record(record)


def _dumps(value: dict[str, Any]) -> str:
    import json

    return json.dumps(value)


def _status(
    args: argparse.Namespace,
    request: RunRequest,
    model: FleetModel,
    renderer: Renderer,
    header: dict[str, Any],
    stdout: TextIO,
    run: RunFn,
) -> int:
    if args.json:
        renderer.start(header)
        result = run(request, lambda event: _feed(model, renderer, event))
    else:
        # The table is the output; only failures are worth lines of their own.
        result = run(request, model.handle)
    code = exit_code_for(model, result)
    status = status_object(model, code)
    if args.json:
        JsonRenderer(model, stdout).emit(_dumps(status))
    else:
        stdout.write(status_text(status) + "\n")
    return code


def _merge_status(
    request: RunRequest,
    model: FleetModel,
    redactor: Redactor,
    run: RunFn,
    stdout: TextIO,
    quiet: bool,
) -> None:
    """After deploy/rollback, ask each node what it now serves, for the summary."""
    if not quiet:
        stdout.write("checking node status...\n")
        stdout.flush()
    probe = FleetModel(redactor)
    status_request = RunRequest(
        project_dir=request.project_dir,
        playbook=PLAYBOOKS["status"],
        inventory=request.inventory,
        limit=request.limit,
        extravars=request.extravars,
    )
    run(status_request, probe.handle)
    for name, state in probe.hosts.items():
        if name in model.hosts and state.node:
            model.hosts[name].node.update(state.node)
        if state.router:
            model.host(name).router.update(state.router)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return run_command(args, sys.stdout)
    except UsageError as exc:
        parser.exit(EXIT_USAGE, f"vllm-fleet {args.command}: error: {exc}\n")
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return EXIT_INTERRUPTED
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
