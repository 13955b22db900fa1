"""The monitoring role's alert rules: promtool checks them and runs their tests.

promtool comes from $VLLM_FLEET_PROMTOOL (`make promtool` fetches Debian
bookworm's, the one the role installs, and `make unit` sets it) or PATH. Without
one the tests fail: a rule file nobody checked must not pass as tested.

Also tests/support/promql.py, which the end-to-end test uses to compare the
metrics the rules and the dashboard reference with a live node's /metrics.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import jinja2
import pytest
import yaml

from tests.support.promql import base_metric, referenced_metrics, rule_exprs

ROOT = Path(__file__).resolve().parents[2]
FILES = ROOT / "roles/monitoring/files"
TEMPLATE = ROOT / "roles/monitoring/templates/vllm-fleet.rules.yml.j2"
RULE_TESTS = FILES / "rules.test.yml"
DEFAULTS = yaml.safe_load((ROOT / "roles/monitoring/defaults/main.yml").read_text())
ALERTS = {
    "VllmEngineDown",
    "VllmEngineRestarted",
    "VllmEngineStalled",
    "VllmWatchdogRestarted",
    "VllmKvCacheHigh",
    "VllmRequestsWaiting",
    "VllmErrorRate",
    "VllmRouterDown",
}


def render_rules(**variables: str) -> str:
    """The rules file as the role's template task renders it ([[ ]] delimiters)."""
    env = jinja2.Environment(
        variable_start_string="[[", variable_end_string="]]", undefined=jinja2.StrictUndefined
    )
    return env.from_string(TEMPLATE.read_text()).render({**DEFAULTS, **variables})


@pytest.fixture(scope="module")
def rules_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The rendered rules (role defaults) beside their promtool tests."""
    directory = tmp_path_factory.mktemp("rules")
    (directory / "vllm-fleet.rules.yml").write_text(render_rules())
    shutil.copy(RULE_TESTS, directory / RULE_TESTS.name)
    return directory


def run_promtool(promtool: str, where: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool, *args], cwd=where, capture_output=True, text=True, timeout=120, check=False
    )


def alert_rules(**variables: str) -> list[dict]:
    document = yaml.safe_load(render_rules(**variables))
    return [rule for group in document["groups"] for rule in group["rules"] if "alert" in rule]


def test_promtool_check_rules(promtool: str, rules_dir: Path) -> None:
    result = run_promtool(promtool, rules_dir, "check", "rules", "vllm-fleet.rules.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in result.stdout


def test_promtool_test_rules(promtool: str, rules_dir: Path) -> None:
    result = run_promtool(promtool, rules_dir, "test", "rules", RULE_TESTS.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_engine_down_for_is_the_roles_variable() -> None:
    (engine_down,) = [
        rule for rule in alert_rules(monitoring_engine_down_for="10s")
        if rule["alert"] == "VllmEngineDown"
    ]  # fmt: skip
    assert engine_down["for"] == "10s"
    assert "for more than 10s:" in engine_down["annotations"]["description"]


def test_the_alerts() -> None:
    document = yaml.safe_load(render_rules())
    assert [group["name"] for group in document["groups"]] == ["vllm-fleet"]
    names = [rule["alert"] for rule in alert_rules()]
    assert sorted(names) == sorted(ALERTS)


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda rule: rule["alert"])
def test_alert_labels_and_annotations(rule: dict) -> None:
    assert rule["labels"]["severity"] in {"critical", "warning"}
    for annotation in ("summary", "description"):
        assert "{{ $labels.node }}" in rule["annotations"][annotation]


def test_engine_down_waits_one_minute() -> None:
    (engine_down,) = [rule for rule in alert_rules() if rule["alert"] == "VllmEngineDown"]
    assert engine_down["expr"] == 'up{job="vllm"} == 0'
    assert engine_down["for"] == "1m"


def test_rule_tests_cover_every_alert() -> None:
    """Each alert has a case where it fires and one where it stays silent."""
    document = yaml.safe_load(RULE_TESTS.read_text())
    cases = [case for test in document["tests"] for case in test["alert_rule_test"]]
    fires = {case["alertname"] for case in cases if case.get("exp_alerts")}
    silent = {case["alertname"] for case in cases if not case.get("exp_alerts")}
    assert fires == ALERTS
    assert silent == ALERTS


def test_rules_reference_the_scraped_metrics() -> None:
    referenced = set().union(*(referenced_metrics(expr) for expr in rule_exprs(TEMPLATE)))
    assert referenced == {
        "up",
        "process_start_time_seconds",
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:generation_tokens_total",
        "vllm:prompt_tokens_total",
        "http_requests_total",
        # The watchdog's, exported by the key guard on vLLM's /metrics.
        "vllm_fleet_watchdog_last_restart_timestamp_seconds",
    }


@pytest.mark.parametrize(
    ("expr", "metrics"),
    [
        ('up{job="vllm"} == 0', {"up"}),
        ("sum by (node) (vllm:num_requests_running)", {"vllm:num_requests_running"}),
        ("sum(vllm:num_requests_waiting) by (node, instance)", {"vllm:num_requests_waiting"}),
        (
            'sum by (node) (rate(http_requests_total{job="vllm", status="5xx"}[5m]))'
            " / sum by (node) (rate(http_requests_total[5m])) > 0.05",
            {"http_requests_total"},
        ),
        (
            "histogram_quantile(0.95, sum by (le) "
            "(rate(vllm:e2e_request_latency_seconds_bucket[5m])))",
            {"vllm:e2e_request_latency_seconds_bucket"},
        ),
        ("changes(process_start_time_seconds[15m]) > 0", {"process_start_time_seconds"}),
        # Grafana variables, a label value holding braces, offset and a subquery.
        (
            'rate(vllm:prompt_tokens_total{node=~"$node", x="}{"}[$__rate_interval] offset 1h)',
            {"vllm:prompt_tokens_total"},
        ),
        ("max_over_time(vllm:kv_cache_usage_perc[1h:5m]) > bool 0.9", {"vllm:kv_cache_usage_perc"}),
        # Binary operators with label lists, keywords, a function-named label.
        (
            "a_total * on (instance) group_left (node, rate) b_info"
            " and c unless d or count without (engine) (e)",
            {"a_total", "b_info", "c", "d", "e"},
        ),
        ('label_replace(up, "dst", "$1", "instance", "(.*):.*")', {"up"}),
        ("topk(3, vllm:num_requests_running) @ end()", {"vllm:num_requests_running"}),
        ("vector(1) + 1e3 - 0x1f # up", set()),
    ],
)
def test_referenced_metrics(expr: str, metrics: set[str]) -> None:
    assert referenced_metrics(expr) == metrics


@pytest.mark.parametrize(
    ("name", "families", "family"),
    [
        ("vllm:e2e_request_latency_seconds_bucket", None, "vllm:e2e_request_latency_seconds"),
        ("vllm:time_to_first_token_seconds_sum", None, "vllm:time_to_first_token_seconds"),
        ("vllm:time_to_first_token_seconds_count", None, "vllm:time_to_first_token_seconds"),
        ("vllm:generation_tokens_total", None, "vllm:generation_tokens_total"),
        ("vllm:kv_cache_usage_perc", None, "vllm:kv_cache_usage_perc"),
        # With families: only a known histogram loses its suffix.
        (
            "vllm:e2e_request_latency_seconds_bucket",
            {"vllm:e2e_request_latency_seconds"},
            "vllm:e2e_request_latency_seconds",
        ),
        ("retries_count", {"vllm:e2e_request_latency_seconds"}, "retries_count"),
    ],
)
def test_base_metric(name: str, families: set[str] | None, family: str) -> None:
    assert base_metric(name, families) == family
