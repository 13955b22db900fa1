"""Turn ansible-runner events into progress: a model, and three renderers.

``FleetModel.handle`` takes one raw runner event (redacted first) and returns
the normalized records it implies (``play_start``, ``task_start``,
``task_result``, ``retry``, ``progress``, ``warning``, ``error``); the model
keeps per-host state (current step and task, counts, progress bars, failure,
node facts) for the live view and the end summary. Renderers draw those
records: ``TtyRenderer`` (a rich live block per host, redrawn in place),
``PlainRenderer`` (one line per record, for logs and pipes) and
``JsonRenderer`` (newline-delimited JSON).

Progress convention (docs/cli.md): a task result carrying
``vllm_fleet_progress: {kind: download|load, done, total, bytes_done,
bytes_total, rate}``, at the top level (``ansible.builtin.debug: var=...``,
a module's return) or in ``ansible_facts`` (``set_fact``); retried and
looped results count too. Failing that, vLLM's and huggingface_hub's own
progress lines in ``msg``/``stdout`` are parsed. A polling task's result
(one that carries ``vllm_fleet_poll``) may name the step its wait has reached
in ``phase`` (the health probe: ``weights loading 60/119``, ``KV cache
sizing``); the views show it beside the waiting task. Node facts for the
summary come the same way under ``vllm_fleet_node``.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import difflib
import json
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from vllm_fleet.redact import Redactor

PROGRESS_KEY = "vllm_fleet_progress"
# A polling task's one-line round (the stdout callback's); beside it, ``phase``.
POLL_KEY = "vllm_fleet_poll"
NODE_KEY = "vllm_fleet_node"
# What a router host reports (playbooks/status.yml): the fleet endpoint.
ROUTER_KEY = "vllm_fleet_router"
# What a full verify found on a storage domain (the model_download role's fact).
VERIFY_KEY = "model_download_verify_report"
RESULT_EVENTS = {
    "runner_on_ok": "ok",
    "runner_on_failed": "failed",
    "runner_on_unreachable": "unreachable",
    "runner_on_skipped": "skipped",
}
PROGRESS_EVENTS = {
    "runner_on_ok",
    "runner_retry",
    "runner_item_on_ok",
    "runner_on_async_poll",
    "runner_on_async_ok",
}
# Bookkeeping tasks whose "ok" says nothing to a person watching a deploy.
QUIET_ACTIONS = {"ansible.builtin.validate_argument_spec", "validate_argument_spec"}
# vLLM's weight loader (tqdm, as the journal shows it with -o cat).
LOAD_LINE = re.compile(
    r"Loading (?:safetensors |pt |)checkpoint shards:\s*(\d+)% Completed \|\s*(\d+)/(\d+)"
)
# huggingface_hub's snapshot_download bar.
FETCH_LINE = re.compile(r"Fetching (\d+) files:\s*(\d+)%\|[^|]*\|\s*(\d+)/(\d+)")
# The service role's failure message: one "Diagnosis: <name>. <advice>" line per match.
DIAGNOSIS = re.compile(r"diagnosis:[ \t]*(.+)", re.IGNORECASE)
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


@dataclass
class Progress:
    """One progress bar of one host: files or shards, and bytes when known."""

    kind: str
    done: float | None = None
    total: float | None = None
    bytes_done: float | None = None
    bytes_total: float | None = None
    rate: float | None = None

    @property
    def fraction(self) -> float | None:
        if self.bytes_total:
            return min(1.0, (self.bytes_done or 0) / self.bytes_total)
        if self.total:
            return min(1.0, (self.done or 0) / self.total)
        return None

    def as_dict(self) -> dict[str, Any]:
        record = {
            "kind": self.kind,
            "done": self.done,
            "total": self.total,
            "bytes_done": self.bytes_done,
            "bytes_total": self.bytes_total,
            "rate": self.rate,
        }
        fraction = self.fraction
        record["percent"] = None if fraction is None else round(fraction * 100, 1)
        return record


@dataclass
class Failure:
    """Where and why a host failed."""

    host: str
    task: str
    play: str | None
    role: str | None
    msg: str
    diagnosis: str | None
    unreachable: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "play": self.play,
            "task": self.task,
            "role": self.role,
            "msg": self.msg,
            "diagnosis": self.diagnosis,
            "unreachable": self.unreachable,
        }


@dataclass
class HostState:
    """Everything the live view and the summary know about one host."""

    name: str
    play: str | None = None
    task: str | None = None
    started: float | None = None
    ended: float | None = None
    counts: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(
            ("ok", "changed", "failed", "skipped", "unreachable", "rescued", "ignored"), 0
        )
    )
    progress: dict[str, Progress] = field(default_factory=dict)
    attempt: tuple[int, int] | None = None
    # The step a polling task's wait has reached (the health probe's phase).
    phase: str | None = None
    failure: Failure | None = None
    node: dict[str, Any] = field(default_factory=dict)
    router: dict[str, Any] = field(default_factory=dict)
    verify: dict[str, Any] = field(default_factory=dict)

    @property
    def duration(self) -> float | None:
        if self.started is None:
            return None
        return (self.ended or time.monotonic()) - self.started


class FleetModel:
    """Per-host state built from runner events; returns normalized records."""

    def __init__(self, redactor: Redactor | None = None, clock: Any = time.monotonic) -> None:
        self.redactor = redactor or Redactor()
        self.clock = clock
        self.hosts: dict[str, HostState] = {}
        self.play: str | None = None
        self.task: str | None = None
        self.role: str | None = None
        self.stats: dict[str, dict[str, int]] | None = None
        self.errors: list[str] = []
        self.started = clock()

    def host(self, name: str) -> HostState:
        if name not in self.hosts:
            self.hosts[name] = HostState(name=name)
        return self.hosts[name]

    def handle(self, raw: dict[str, Any]) -> list[dict[str, Any]]:
        """Fold one runner event into the model; the records it implies."""
        event = self.redactor.data(raw)
        kind = event.get("event", "")
        data = event.get("event_data") or {}
        if kind == "playbook_on_play_start":
            self.play = data.get("play") or data.get("name")
            return [{"type": "play_start", "play": self.play}]
        if kind == "playbook_on_task_start":
            self.task = data.get("task") or data.get("name")
            self.role = data.get("role")
            return [{"type": "task_start", "play": self.play, "task": self.task, "role": self.role}]
        if kind == "runner_on_start":
            state = self.host(data.get("host", "?"))
            if state.play != data.get("play"):
                state.progress.clear()
            else:
                # A finished bar has said its piece; a running one stays while
                # its role polls from the next task.
                state.progress = {
                    name: bar for name, bar in state.progress.items() if (bar.fraction or 0) < 1
                }
            state.play, state.task, state.attempt = data.get("play"), data.get("task"), None
            state.phase = None
            # Working again: its elapsed time moves until this task's result.
            state.ended = None
            if state.started is None:
                state.started = self.clock()
            return []
        records = self._progress(kind, data)
        if kind == "runner_retry":
            records.append(self._retry(data))
        elif kind in RESULT_EVENTS:
            records.append(self._result(kind, data))
        elif kind == "playbook_on_stats":
            self._stats(data)
        elif kind in ("warning", "deprecated"):
            # A warning's event_data may carry a flag rather than the text.
            warning = data.get("warning")
            text = _clean(
                warning if isinstance(warning, str) and warning else event.get("stdout") or ""
            )
            if text:
                records.append({"type": "warning", "text": text})
        elif kind in ("verbose", "error") and event.get("stdout"):
            text = _clean(event["stdout"])
            if text.strip():
                self.errors.append(text)
                records.append({"type": "output", "text": text})
        return records

    def _retry(self, data: dict[str, Any]) -> dict[str, Any]:
        state = self.host(data.get("host", "?"))
        res = data.get("res") or {}
        attempt = int(res.get("attempts") or 0)
        retries = int(res.get("retries") or 0)
        state.attempt = (attempt, retries)
        state.phase = poll_phase(res)
        record = {
            "type": "retry",
            "host": state.name,
            "task": data.get("task"),
            "attempt": attempt,
            "retries": retries,
        }
        if state.phase:
            record["phase"] = state.phase
        return record

    def _result(self, kind: str, data: dict[str, Any]) -> dict[str, Any]:
        state = self.host(data.get("host", "?"))
        res = data.get("res") or {}
        status = RESULT_EVENTS[kind]
        if status == "ok" and res.get("changed"):
            status = "changed"
        if status == "failed" and data.get("ignore_errors"):
            status = "ignored"
        state.ended = self.clock()
        state.attempt = None
        state.phase = poll_phase(res)
        node = _find_key(res, NODE_KEY)
        if isinstance(node, dict):
            state.node.update(node)
        router = _find_key(res, ROUTER_KEY)
        if isinstance(router, dict):
            state.router.update(router)
        verify = _find_key(res, VERIFY_KEY)
        if isinstance(verify, dict):
            state.verify = dict(verify)
        record: dict[str, Any] = {
            "type": "task_result",
            "host": state.name,
            "play": data.get("play"),
            "task": data.get("task"),
            "role": data.get("role"),
            "action": data.get("resolved_action") or data.get("task_action"),
            "status": status,
            "duration": data.get("duration"),
        }
        if state.phase:
            record["phase"] = state.phase
        diff = render_diff(res.get("diff"))
        if diff:
            record["diff"] = diff
        if status in ("failed", "unreachable"):
            failure = _failure(state.name, data, res, unreachable=status == "unreachable")
            state.failure = failure
            record["msg"] = failure.msg
            record["diagnosis"] = failure.diagnosis
        if status in state.counts:
            state.counts[status] += 1
        if status == "changed":
            state.counts["ok"] += 1
        return record

    def _progress(self, kind: str, data: dict[str, Any]) -> list[dict[str, Any]]:
        if kind not in PROGRESS_EVENTS:
            return []
        found = extract_progress(data.get("res") or {})
        if not found:
            return []
        state = self.host(data.get("host", "?"))
        records = []
        for progress in found:
            state.progress[progress.kind] = progress
            records.append(
                {"type": "progress", "host": state.name, "task": data.get("task")}
                | progress.as_dict()
            )
        return records

    def _stats(self, data: dict[str, Any]) -> None:
        names = ("ok", "changed", "failures", "dark", "skipped", "rescued", "ignored")
        self.stats = {name: dict(data.get(name) or {}) for name in names}
        for name in set().union(*self.stats.values()) if self.stats else ():
            state = self.host(name)
            state.counts["ok"] = self.stats["ok"].get(name, 0)
            state.counts["changed"] = self.stats["changed"].get(name, 0)
            state.counts["failed"] = self.stats["failures"].get(name, 0)
            state.counts["unreachable"] = self.stats["dark"].get(name, 0)
            state.counts["skipped"] = self.stats["skipped"].get(name, 0)
            state.counts["rescued"] = self.stats["rescued"].get(name, 0)
            state.counts["ignored"] = self.stats["ignored"].get(name, 0)

    def host_ok(self, state: HostState) -> bool:
        """Failed or unreachable per the final stats (a rescued failure is fine)."""
        if self.stats is not None:
            return not (
                self.stats["failures"].get(state.name) or self.stats["dark"].get(state.name)
            )
        return state.failure is None

    def failures(self) -> list[Failure]:
        """The last failure of each host that ended failed."""
        return [
            state.failure
            for state in self.hosts.values()
            if state.failure is not None and not self.host_ok(state)
        ]


def render_diff(diff: Any) -> str:
    """A task's --diff output as unified diff text ('' when it has none)."""
    entries = diff if isinstance(diff, list) else [diff]
    chunks = []
    for entry in entries:
        if not isinstance(entry, dict):
            continue
        if isinstance(entry.get("prepared"), str):
            chunks.append(entry["prepared"].rstrip("\n"))
            continue
        before, after = entry.get("before", ""), entry.get("after", "")
        if not isinstance(before, str) or not isinstance(after, str) or before == after:
            continue
        lines = difflib.unified_diff(
            before.splitlines(),
            after.splitlines(),
            fromfile=str(entry.get("before_header", "before")),
            tofile=str(entry.get("after_header", "after")),
            lineterm="",
        )
        chunks.append("\n".join(lines))
    return "\n".join(chunk for chunk in chunks if chunk)


def _find_key(res: dict[str, Any], key: str) -> Any:
    if key in res:
        return res[key]
    facts = res.get("ansible_facts")
    if isinstance(facts, dict) and key in facts:
        return facts[key]
    return None


def poll_phase(res: dict[str, Any]) -> str | None:
    """The step a polling task's round reached (``phase`` beside ``vllm_fleet_poll``)."""
    phase = res.get("phase")
    if POLL_KEY in res and isinstance(phase, str) and phase.strip():
        return phase.strip()
    return None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def extract_progress(res: dict[str, Any]) -> list[Progress]:
    """Progress from one task result: the convention, the download's progress.json, log lines."""
    declared = _find_key(res, PROGRESS_KEY)
    entries = declared if isinstance(declared, list) else [declared]
    found = [_declared(entry) for entry in entries if isinstance(entry, dict)]
    found = [progress for progress in found if progress is not None]
    if found:
        return found
    snapshot = _download_snapshot(res)
    if snapshot is not None:
        return [snapshot]
    text = _result_text(res)
    parsed = []
    loads = LOAD_LINE.findall(text)
    if loads:
        _, done, total = loads[-1]
        parsed.append(Progress(kind="load", done=float(done), total=float(total)))
    fetches = FETCH_LINE.findall(text)
    if fetches:
        _, _, done, total = fetches[-1]
        parsed.append(Progress(kind="download", done=float(done), total=float(total)))
    return parsed


def _download_snapshot(res: dict[str, Any]) -> Progress | None:
    """model_download's progress.json (files/bytes done, rate), however the role read it.

    The result itself, ``progress`` (hf_snapshot mode=wait), ``json`` (uri),
    ``content`` (slurp, base64) or ``stdout`` (command: cat) may hold it.
    """
    candidates: list[Any] = [res, res.get("progress"), res.get("json")]
    content = res.get("content")
    if isinstance(content, str) and res.get("encoding") == "base64":
        with contextlib.suppress(ValueError, binascii.Error):
            candidates.append(json.loads(base64.b64decode(content)))
    stdout = res.get("stdout")
    if isinstance(stdout, str) and stdout.lstrip().startswith("{"):
        with contextlib.suppress(ValueError):
            candidates.append(json.loads(stdout))
    for candidate in candidates:
        # A snapshot has counts done; a plan or final result only totals.
        if (
            isinstance(candidate, dict)
            and "bytes_total" in candidate
            and ("files_done" in candidate or "bytes_done" in candidate)
        ):
            return Progress(
                # A full verify's job hashes every file before it fetches any.
                kind="verify" if candidate.get("state") == "hashing" else "download",
                done=_number(candidate.get("files_done")),
                total=_number(candidate.get("files_total")),
                bytes_done=_number(candidate.get("bytes_done")),
                bytes_total=_number(candidate.get("bytes_total")),
                rate=_number(candidate.get("rate_bytes_per_s", candidate.get("rate"))),
            )
    return None


def _declared(entry: dict[str, Any]) -> Progress | None:
    kind = str(entry.get("kind") or "")
    if not kind:
        return None
    return Progress(
        kind=kind,
        done=_number(entry.get("done")),
        total=_number(entry.get("total")),
        bytes_done=_number(entry.get("bytes_done")),
        bytes_total=_number(entry.get("bytes_total")),
        rate=_number(entry.get("rate")),
    )


def _result_text(res: dict[str, Any]) -> str:
    parts: list[str] = []
    for key in ("msg", "stdout", "stderr", "stdout_lines", "stderr_lines", "milestone"):
        value = res.get(key)
        if isinstance(value, str):
            parts.append(value)
        elif isinstance(value, list):
            parts.extend(str(line) for line in value)
    # tqdm redraws with carriage returns; each redraw is a line of its own.
    return "\n".join(parts).replace("\r", "\n")


def _failure(host: str, data: dict[str, Any], res: dict[str, Any], unreachable: bool) -> Failure:
    msg = res.get("msg")
    if not isinstance(msg, str) or not msg:
        msg = json.dumps(msg) if msg else ""
    if res.get("results") and not msg.strip():
        failed = [item for item in res["results"] if item.get("failed")]
        if failed:
            msg = str(failed[-1].get("msg", ""))
    stderr = res.get("stderr")
    if isinstance(stderr, str) and stderr.strip() and "non-zero return code" in msg:
        msg = f"{msg}: {stderr.strip().splitlines()[-1]}"
    diagnosis = res.get("diagnosis")
    if not isinstance(diagnosis, str) or not diagnosis:
        found = [line.strip() for line in DIAGNOSIS.findall(msg)]
        diagnosis = "; ".join(found) if found else None
    return Failure(
        host=host,
        task=str(data.get("task") or ""),
        play=data.get("play"),
        role=data.get("role"),
        msg=_clean(msg),
        diagnosis=diagnosis,
        unreachable=unreachable,
    )


def _clean(text: str) -> str:
    return ANSI.sub("", text).replace("\r\n", "\n").strip("\n")


# ---------------------------------------------------------------- formatting


def human_bytes(value: float | None) -> str:
    if value is None:
        return "?"
    size = float(value)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(size) < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"


def human_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = round(seconds)
    minutes, secs = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def bar(fraction: float | None, width: int = 24) -> str:
    if fraction is None:
        return "[" + "?" * width + "]"
    filled = round(fraction * width)
    return "[" + "#" * filled + "." * (width - filled) + "]"


def _count(value: float | None) -> str:
    return "?" if value is None else f"{value:.0f}"


def describe_progress(progress: Progress, width: int = 24) -> str:
    """'download [####....] 42.0%  3/8 files  1.2 GB/2.9 GB  210.0 MB/s'."""
    percent, *figures = progress_figures(progress)
    return "  ".join([f"{progress.kind:<8} {bar(progress.fraction, width)} {percent:>6}", *figures])


def progress_figures(progress: Progress) -> list[str]:
    """A bar's figures, shared by plain lines and the live view: percent, count, bytes, rate."""
    unit = "shards" if progress.kind == "load" else "files"
    fraction = progress.fraction
    figures = ["?%" if fraction is None else f"{fraction * 100:.1f}%"]
    if progress.total is not None or progress.done is not None:
        figures.append(f"{_count(progress.done)}/{_count(progress.total)} {unit}")
    if progress.bytes_total is not None or progress.bytes_done is not None:
        figures.append(f"{human_bytes(progress.bytes_done)}/{human_bytes(progress.bytes_total)}")
    if progress.rate:
        if progress.kind == "load":
            figures.append(f"{progress.rate:.2f} shards/s")
        else:
            figures.append(f"{human_bytes(progress.rate)}/s")
    return figures


def describe_result(record: dict[str, Any]) -> str:
    status = record["status"]
    line = f"{status:<11} {record['host']}: {record.get('task') or ''}"
    if record.get("duration") is not None and float(record["duration"]) >= 1:
        line += f" ({human_duration(float(record['duration']))})"
    if status in ("failed", "unreachable", "ignored") and record.get("msg"):
        line += "\n    " + _first_lines(record["msg"], 6).replace("\n", "\n    ")
    if record.get("diagnosis"):
        line += f"\n    diagnosis: {record['diagnosis']}"
    if record.get("diff"):
        line += "\n    " + record["diff"].replace("\n", "\n    ")
    return line


def _first_lines(text: str, count: int) -> str:
    lines = text.splitlines()
    if len(lines) <= count:
        return text
    return "\n".join([*lines[:count], f"... ({len(lines) - count} more lines)"])


# ---------------------------------------------------------------- renderers


class Renderer:
    """Base: receives normalized records and the model, draws them."""

    def __init__(self, model: FleetModel, stream: TextIO | None = None) -> None:
        self.model = model
        self.stream = stream or sys.stdout

    def start(self, header: dict[str, Any]) -> None:
        """Called once before the run."""

    def record(self, record: dict[str, Any]) -> None:
        """Called for each normalized record."""

    def close(self) -> None:
        """Called once after the run (before the summary)."""

    def emit(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()


class JsonRenderer(Renderer):
    """Newline-delimited JSON: one object per record, each with a ``type``."""

    def start(self, header: dict[str, Any]) -> None:
        self.emit(json.dumps({"type": "run_start", **header}))

    def record(self, record: dict[str, Any]) -> None:
        self.emit(json.dumps({**record, "time": round(time.time(), 3)}))


class PlainRenderer(Renderer):
    """Line-oriented text for logs and pipes: no cursor movement, no colour."""

    # Progress lines are throttled: a new line per host and kind when the
    # percentage moved by this much (or the bar finished).
    STEP = 10.0

    def __init__(
        self, model: FleetModel, stream: TextIO | None = None, verbose: bool = False
    ) -> None:
        super().__init__(model, stream)
        self.verbose = verbose
        self._last: dict[tuple[str, str], float] = {}
        self._seen_ok: set[tuple[Any, ...]] = set()

    def start(self, header: dict[str, Any]) -> None:
        self.emit(header_line(header))

    def record(self, record: dict[str, Any]) -> None:
        text = self.format(record)
        if text is not None:
            self.emit(text)

    def format(self, record: dict[str, Any]) -> str | None:
        kind = record["type"]
        if kind == "play_start":
            return f"== {record['play']}"
        if kind == "task_start" and self.verbose:
            return f"-- {record['task']}"
        if kind == "task_result":
            return None if self._quiet(record) and not self.verbose else describe_result(record)
        if kind == "progress":
            return self._progress(record)
        if kind == "retry":
            attempt = f"attempt {record['attempt']}/{record['retries']}"
            if record.get("phase"):
                attempt += f", phase: {record['phase']}"
            return f"waiting     {record['host']}: {record['task']} ({attempt})"
        if kind == "warning":
            return f"warning: {record['text']}"
        if kind == "output" and self.verbose:
            return record["text"]
        return None

    def _quiet(self, record: dict[str, Any]) -> bool:
        """Skipped tasks, bookkeeping, and the same "ok" again (a polling loop's rounds)."""
        status = record["status"]
        if status == "skipped":
            return True
        if status != "ok":
            return False
        if record.get("action") in QUIET_ACTIONS:
            return True
        key = (record["host"], record.get("play"), record.get("task"))
        if key in self._seen_ok:
            return True
        self._seen_ok.add(key)
        return False

    def _progress(self, record: dict[str, Any]) -> str | None:
        key = (record["host"], record["kind"])
        percent = record.get("percent")
        last = self._last.get(key)
        if percent is not None and last is not None:
            if percent < 100 and percent - last < self.STEP and percent >= last:
                return None
            if percent == last:
                return None
        self._last[key] = percent if percent is not None else 0.0
        progress = self.model.hosts[record["host"]].progress[record["kind"]]
        return f"progress    {record['host']}: {describe_progress(progress, 20)}"


class TtyRenderer(PlainRenderer):
    """Finished tasks scroll above a rich ``Live`` block: one row per host, its bars below.

    Rich owns the terminal: it redraws the block on its own thread (so elapsed
    times move during a long silent task), prints scrolled lines above it,
    and clears it on close.
    """

    # Elapsed times change once a second; a quicker redraw only animates the
    # pulse of a bar whose total is unknown.
    REFRESH_PER_SECOND = 2.0
    BAR_WIDTH = 24

    def __init__(
        self,
        model: FleetModel,
        stream: TextIO | None = None,
        verbose: bool = False,
        console: Console | None = None,
    ) -> None:
        super().__init__(model, stream, verbose)
        # Task names and messages are data: no markup, emoji codes or highlighting.
        self.console = console or Console(
            file=self.stream, markup=False, emoji=False, highlight=False
        )
        self._last_view: RenderableType = Group()
        # The renderer is the live renderable: each draw reads the model afresh.
        self.live = Live(
            self,
            console=self.console,
            refresh_per_second=self.REFRESH_PER_SECOND,
            transient=True,
        )

    def start(self, header: dict[str, Any]) -> None:
        super().start(header)
        self.live.start()

    def record(self, record: dict[str, Any]) -> None:
        # Progress also scrolls (throttled like plain text), so the history
        # keeps how a download or load went; the live block shows it now.
        text = self.format(record)
        if text is not None:
            self.emit(text)

    def close(self) -> None:
        self.live.stop()

    def emit(self, text: str) -> None:
        # While live, Console.print scrolls the text in above the block; Text
        # is never parsed as markup, and soft wrap leaves long lines to the terminal.
        self.console.print(Text(text), soft_wrap=True)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        # rich's refresh thread draws this while events change the model: an
        # exception here would end that thread silently (and the elapsed
        # times would freeze), so a failed draw shows the last good one.
        with contextlib.suppress(Exception):  # a race with the event thread: redrawn in 0.5 s
            self._last_view = self.live_view()
        yield self._last_view

    def live_view(self) -> RenderableType:
        """The live block: per host its name, elapsed time, task, attempt and phase, then bars."""
        grid = Table.grid(padding=(0, 2), pad_edge=True)
        grid.add_column(no_wrap=True, style="bold")
        grid.add_column(justify="right", no_wrap=True)
        # Only the task column gives way on a narrow terminal: its text is cut.
        grid.add_column()
        # Snapshots: rich calls this from its refresh thread while events arrive.
        for state in list(self.model.hosts.values()):
            if state.ended is not None and state.task is None:
                continue
            # Read each field once: the event thread may change it meanwhile.
            task = Text(state.task or "", no_wrap=True, overflow="ellipsis")
            attempt, phase = state.attempt, state.phase
            if attempt:
                note = f"waiting, attempt {attempt[0]}/{attempt[1]}"
                task.append(f"  ({note}, phase: {phase})" if phase else f"  ({note})", "cyan")
            grid.add_row(state.name, human_duration(state.duration), task)
            for progress in list(state.progress.values()):
                grid.add_row("", "", self._progress_row(progress))
        return grid if grid.row_count else Group()

    def _progress_row(self, progress: Progress) -> Table:
        row = Table.grid(padding=(0, 1))
        row.add_column(min_width=8, no_wrap=True)
        row.add_column(width=self.BAR_WIDTH, no_wrap=True)
        row.add_column()
        fraction = progress.fraction
        # No fraction: rich pulses the bar instead of drawing question marks.
        meter = ProgressBar(
            total=None if fraction is None else 1.0,
            completed=fraction or 0.0,
            width=self.BAR_WIDTH,
        )
        percent, *figures = progress_figures(progress)
        text = Text("  ".join([f"{percent:>6}", *figures]), no_wrap=True, overflow="ellipsis")
        row.add_row(progress.kind, meter, text)
        return row


def header_line(header: dict[str, Any]) -> str:
    parts = [f"vllm-fleet {header['command']}: {header['playbook']}"]
    parts.append(f"inventory {header['inventory']}")
    if header.get("limit"):
        parts.append(f"limit {header['limit']}")
    if header.get("tags"):
        parts.append(f"tags {header['tags']}")
    if header.get("check"):
        parts.append("check mode")
    hosts = header.get("hosts") or []
    parts.append(f"{len(hosts)} host(s): {', '.join(hosts)}")
    return " | ".join(parts)
