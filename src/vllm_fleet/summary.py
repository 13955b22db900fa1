"""End-of-run summary and the status table, as text and as JSON objects."""

from __future__ import annotations

from typing import Any

from vllm_fleet.progress import FleetModel, HostState, human_bytes, human_duration

# Node facts reported by playbooks/status.yml (and by roles, under
# vllm_fleet_node), in table order; load and crash_loop are shown apart.
NODE_FIELDS = (
    "unit",
    "health",
    "served_model",
    "release",
    "vllm_version",
    "endpoint",
    "load",
    "crash_loop",
)
# A unit in a crash loop (role status, under "crash_loop"; {} when none):
# state (restarting, or stopped: systemd gave up), result, restarts,
# last_exit, and role vllm_service's diagnosis of its journal (diagnosis,
# advice, lines); the node's health line says it in one line.
CRASH_LOOP_PREFIX = "crash loop: "
# A node's load (playbooks/status.yml, under "load"): Prometheus's figures when
# the fleet has one, else the node's own /metrics; columns of the status table.
# throughput: generated tokens per second (a key without "token", which the
# redactor would hide).
LOAD_FIELDS = ("running", "waiting", "kv_cache_usage", "throughput")
LOAD_SOURCES = {
    "prometheus": "Prometheus; tokens/s over the last minute",
    "metrics": "each node's /metrics; tokens/s between two reads",
}
# The fleet endpoint, as each router host reports it (playbooks/status.yml).
ROUTER_FIELDS = ("endpoint", "unit", "health", "workers")
HEADINGS = {
    "host": "HOST",
    "result": "RESULT",
    "changed": "CHANGED",
    "unit": "UNIT",
    "health": "HEALTH",
    "served_model": "MODEL",
    "release": "RELEASE",
    "vllm_version": "VLLM",
    "endpoint": "ENDPOINT",
    "duration": "DURATION",
    "router": "ROUTER",
    "workers": "WORKERS (as the router sees them)",
    "running": "RUNNING",
    "waiting": "WAITING",
    "kv_cache_usage": "KV CACHE",
    "throughput": "TOKENS/S",
}


def routers(model: FleetModel) -> dict[str, dict[str, Any]]:
    """Each router host's report: endpoint, unit, health, workers (URL -> state)."""
    return {
        name: {field: state.router.get(field) for field in ROUTER_FIELDS}
        for name, state in model.hosts.items()
        if state.router
    }


def routers_text(found: dict[str, dict[str, Any]]) -> str:
    """The routers table ('' without routers)."""
    rows = []
    for name, router in found.items():
        workers = router.get("workers")
        listed = [f"{url} {state}" for url, state in (workers or {}).items()]
        rows.append({**router, "router": name, "workers": ", ".join(listed) or "none"})
    return table(rows, ["router", "endpoint", "unit", "health", "workers"]) if rows else ""


def verify_reports(model: FleetModel) -> dict[str, dict[str, Any]]:
    """Per storage domain, what a full verify found (model_download_verify_report)."""
    found: dict[str, dict[str, Any]] = {}
    for name, state in model.hosts.items():
        if state.verify:
            report = verify_report(state.verify)
            found[str(report["domain"])] = {"host": name} | report
    return found


def verify_report(raw: dict[str, Any]) -> dict[str, Any]:
    """One domain's counts, each bad file with what was done about it, and the verdict."""
    check = _truthy(raw.get("check"))
    repaired = _truthy(raw.get("repaired"))
    fetched = set(raw.get("fetched") or [])
    aside = set(raw.get("set_aside") or [])
    files = []
    for finding in raw.get("findings") or []:
        files.append(finding | {"action": _action(finding, check, repaired, fetched, aside)})
    return {
        "domain": raw.get("domain"),
        "dir": raw.get("dir"),
        "sha": raw.get("sha"),
        "check": check,
        "files_checked": _int(raw.get("files_total")),
        "bytes_total": _int(raw.get("bytes_total")),
        "files_hashed": _int(raw.get("hashed")),
        "elapsed_s": _float(raw.get("elapsed_s")),
        "bad": files,
        "set_aside_dir": raw.get("set_aside_dir") or None,
        "clean": not files,
        "repaired": bool(files) and all(f["action"] != "none" for f in files) and not check,
    }


def _action(
    finding: dict[str, Any],
    check: bool,
    repaired: bool,
    fetched: set[str],
    aside: set[str],
) -> str:
    if check or not repaired:
        return "none"
    if finding.get("path") in aside:
        return "moved aside"
    return "refetched" if finding.get("path") in fetched else "none"


def _truthy(value: Any) -> bool:
    return value is True or str(value).lower() in ("true", "yes", "1")


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def _float(value: Any) -> float | None:
    try:
        return round(float(value), 2)
    except (TypeError, ValueError):
        return None


PROBLEMS = {
    "content": "content differs",
    "truncated": "truncated",
    "size": "size differs",
    "missing": "missing",
    "extra": "not in the hub's listing",
}


def verify_text(reports: dict[str, dict[str, Any]]) -> str:
    """Per domain: counts, then each bad file (path, expected/actual digest and size, action)."""
    lines = []
    for domain, report in reports.items():
        took = human_duration(report["elapsed_s"]) if report["elapsed_s"] is not None else "?"
        lines.append(
            f"\nverify {domain} ({report['host']}: {report['dir']}): "
            f"{report['files_checked']} files checked, {report['files_hashed']} hashed, "
            f"{human_bytes(report['bytes_total'])} in {took}; {len(report['bad'])} bad"
        )
        for bad in report["bad"]:
            lines.extend(_bad_lines(bad, report))
    return "\n".join(lines)


def _bad_lines(bad: dict[str, Any], report: dict[str, Any]) -> list[str]:
    lines = [f"  BAD {bad['path']}: {PROBLEMS.get(bad['problem'], bad['problem'])}"]
    if bad.get("expected_digest"):
        lines.append(f"    expected {bad['algorithm']} {bad['expected_digest']}")
        lines.append(f"    actual   {bad['algorithm']} {bad.get('actual_digest') or '-'}")
    if bad.get("expected_size") != bad.get("actual_size"):
        want = "-" if bad.get("expected_size") is None else f"{bad['expected_size']} bytes"
        got = "absent" if bad.get("actual_size") is None else f"{bad['actual_size']} bytes"
        lines.append(f"    size     expected {want}, actual {got}")
    lines.append(f"    action   {_action_text(bad, report)}")
    return lines


def _action_text(bad: dict[str, Any], report: dict[str, Any]) -> str:
    if report["check"]:
        return "none (check mode)"
    if bad["action"] == "moved aside":
        return f"moved aside to {report['set_aside_dir']} (not deleted: no download recorded it)"
    return "refetched from the hub, digest proved" if bad["action"] == "refetched" else "none"


def host_result(model: FleetModel, state: HostState, status: str = "successful") -> str:
    if state.counts.get("unreachable"):
        return "unreachable"
    if not model.host_ok(state):
        return "failed"
    # Cancelled before the recap: the host's work was cut short.
    return "interrupted" if status == "canceled" and model.stats is None else "ok"


def host_summary(model: FleetModel, state: HostState, status: str = "successful") -> dict[str, Any]:
    record: dict[str, Any] = {
        "result": host_result(model, state, status),
        "counts": dict(state.counts),
        "duration": None if state.duration is None else round(state.duration, 1),
    }
    for name in NODE_FIELDS:
        record[name] = state.node.get(name)
    return record


def summary_object(
    model: FleetModel, header: dict[str, Any], exit_code: int, status: str, rc: int
) -> dict[str, Any]:
    """The final ``--json`` record: one object a tool can rely on."""
    return {
        "type": "summary",
        "command": header["command"],
        "playbook": header["playbook"],
        "check": bool(header.get("check")),
        "ok": exit_code == 0,
        "exit_code": exit_code,
        "runner_status": status,
        "ansible_rc": rc,
        "duration": round(model.clock() - model.started, 1),
        "hosts": {name: host_summary(model, state, status) for name, state in model.hosts.items()},
        "routers": routers(model),
        "verify": verify_reports(model),
        "failures": [failure.as_dict() for failure in model.failures()],
        "errors": model.errors[-20:] if exit_code not in (0, 1) else [],
    }


def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """A plain aligned text table; missing values show as '-'."""
    cells = [[HEADINGS.get(column, column.upper()) for column in columns]]
    for row in rows:
        cells.append([_cell(row.get(column)) for column in columns])
    widths = [max(len(line[index]) for line in cells) for index in range(len(columns))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in cells
    )


def _cell(value: Any) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, list):
        return ",".join(str(item) for item in value) or "-"
    return str(value)


def crash_loop_text(hosts: dict[str, dict[str, Any]]) -> list[str]:
    """A paragraph per node whose unit is in a crash loop: what systemd says, the diagnosis."""
    lines = []
    for name, host in hosts.items():
        loop = host.get("crash_loop")
        if not isinstance(loop, dict) or not loop:
            continue
        health = str(host.get("health") or "")
        what = health.removeprefix(CRASH_LOOP_PREFIX) or str(loop.get("state") or "crash loop")
        if loop.get("last_exit"):
            what += f" (last exit: {loop['last_exit']})"
        lines.append(f"\nCRASH LOOP {name}: {what}")
        lines.append(f"  {loop.get('advice') or ''}".rstrip())
        lines.extend(f"    {line}" for line in loop.get("lines") or [])
        if loop.get("state") == "stopped":
            lines.append("  systemd no longer restarts it: fix the cause, then deploy again.")
    return lines


def summary_text(summary: dict[str, Any], with_node: bool) -> str:
    """The human end summary: a row per host, then each failure with its diagnosis."""
    rows = []
    for name, host in summary["hosts"].items():
        rows.append(
            {
                "host": name,
                "result": host["result"],
                "changed": host["counts"].get("changed", 0),
                "duration": human_duration(host["duration"]),
            }
            | {field: host.get(field) for field in NODE_FIELDS}
        )
    columns = ["host", "result", "changed"]
    if with_node:
        columns += ["release", "vllm_version", "endpoint", "health"]
    columns.append("duration")
    lines = ["", table(rows, columns)] if rows else [""]
    if summary.get("routers"):
        lines += ["", routers_text(summary["routers"])]
    if summary.get("verify"):
        lines.append(verify_text(summary["verify"]))
    lines.extend(crash_loop_text(summary["hosts"]))
    for failure in summary["failures"]:
        where = failure["task"] + (f" (role {failure['role']})" if failure.get("role") else "")
        kind = "UNREACHABLE" if failure.get("unreachable") else "FAILED"
        lines.append(f"\n{kind} {failure['host']}: {where}")
        if failure.get("msg"):
            lines.extend("  " + line for line in _head(failure["msg"], 30))
        if failure.get("diagnosis"):
            lines.append(f"  diagnosis: {failure['diagnosis']}")
    if summary["errors"]:
        lines.append("\nansible-playbook could not run the play:")
        for text in summary["errors"][-12:]:
            lines.extend("  " + line for line in text.splitlines())
    verdict = "succeeded" if summary["ok"] else f"failed (exit {summary['exit_code']})"
    if summary.get("verify") and summary["exit_code"] == 4:
        verdict = "found bad files (exit 4)"
    if summary.get("check"):
        verdict += " (check mode: nothing was changed; CHANGED = would change)"
    if summary["runner_status"] == "canceled":
        verdict = f"interrupted (exit {summary['exit_code']})"
    lines.append(f"\n{summary['command']} {verdict} in {human_duration(summary['duration'])}")
    return "\n".join(lines)


def _head(text: str, count: int) -> list[str]:
    lines = text.splitlines()
    if len(lines) > count:
        return [*lines[:count], f"... ({len(lines) - count} more lines)"]
    return lines


def status_object(model: FleetModel, exit_code: int) -> dict[str, Any]:
    """The ``status --json`` final record."""
    hosts = {}
    for name, state in model.hosts.items():
        node = {field: state.node.get(field) for field in NODE_FIELDS}
        node["reachable"] = not state.counts.get("unreachable")
        hosts[name] = node
    return {
        "type": "status",
        "ok": exit_code == 0,
        "exit_code": exit_code,
        "hosts": hosts,
        "routers": routers(model),
        "failures": [failure.as_dict() for failure in model.failures()],
        "errors": model.errors[-20:] if exit_code not in (0, 1) else [],
    }


def load_cells(load: dict[str, Any] | None) -> dict[str, str]:
    """A node's load figures as table cells ('-' where unknown)."""
    load = load or {}
    cells = {field: "-" for field in LOAD_FIELDS}
    for field in ("running", "waiting"):
        if isinstance(load.get(field), int | float):
            cells[field] = f"{load[field]:.0f}"
    if isinstance(load.get("kv_cache_usage"), int | float):
        cells["kv_cache_usage"] = f"{100 * load['kv_cache_usage']:.1f}%"
    if isinstance(load.get("throughput"), int | float):
        cells["throughput"] = f"{load['throughput']:.1f}"
    return cells


def status_text(status: dict[str, Any]) -> str:
    rows = [
        {"host": name} | node | load_cells(node.get("load"))
        for name, node in status["hosts"].items()
    ]
    for row in rows:
        if not row.get("reachable", True):
            row["unit"] = "unreachable"
    fields = [field for field in NODE_FIELDS if field not in ("load", "crash_loop")]
    text = table(rows, ["host", *fields, *LOAD_FIELDS])
    sources = sorted(
        {
            node["load"]["source"]
            for node in status["hosts"].values()
            if isinstance(node.get("load"), dict) and node["load"].get("source")
        }
    )
    if sources:
        text += "\n(load from " + " and ".join(LOAD_SOURCES.get(s, s) for s in sources) + ")"
    if status.get("routers"):
        text += "\n\n" + routers_text(status["routers"])
    text += "".join(f"\n{line}" for line in crash_loop_text(status["hosts"]))
    for failure in status["failures"]:
        text += f"\n{failure['host']}: {failure['task']}: {failure['msg']}"
    if status["errors"]:
        text += "\n" + "\n".join(status["errors"][-12:])
    return text
