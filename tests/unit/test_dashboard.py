"""The monitoring role's Grafana dashboard: its shape, panels and queries.

Whether vLLM really exports the metrics it queries is the end-to-end test's
question (a live node's /metrics); here only their kind: vLLM's own (vllm:*)
and the scrape's and the API server's few.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.promql import (
    dashboard_exprs,
    dashboard_panels,
    panel_exprs,
    referenced_metrics,
    templating_expr,
)

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "roles/monitoring/files/vllm-fleet-dashboard.json"
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
# Panel title -> a metric its queries must use.
PANELS = {
    "Targets up": "up",
    "Requests running": "vllm:num_requests_running",
    "Requests waiting": "vllm:num_requests_waiting",
    "KV cache usage": "vllm:kv_cache_usage_perc",
    "Generation tokens/s": "vllm:generation_tokens_total",
    "Prompt tokens/s": "vllm:prompt_tokens_total",
    "Request success rate by finished_reason": "vllm:request_success_total",
    "E2E request latency p50/p95": "vllm:e2e_request_latency_seconds_bucket",
    "Time to first token p95": "vllm:time_to_first_token_seconds_bucket",
    "HTTP 5xx rate": "http_requests_total",
}
NON_VLLM_METRICS = {"up", "http_requests_total", "process_start_time_seconds"}


def load() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def query_panels() -> list[dict[str, Any]]:
    return [panel for panel in dashboard_panels(load()) if panel["type"] != "row"]


def test_dashboard_identity() -> None:
    dashboard = load()
    assert dashboard["uid"] == "vllm-fleet"
    assert dashboard["title"] == "vLLM fleet"
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert dashboard["id"] is None
    assert [item["name"] for item in dashboard["__inputs"]] == ["DS_PROMETHEUS"]


def test_templating() -> None:
    variables = {variable["name"]: variable for variable in load()["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    node = variables["node"]
    assert node["datasource"] == DATASOURCE
    assert node["query"]["query"] == "label_values(vllm:num_requests_running, node)"
    assert node["multi"] and node["includeAll"]


def test_the_panels() -> None:
    panels = {panel["title"]: panel for panel in query_panels()}
    assert set(PANELS) <= set(panels)
    for title, metric in PANELS.items():
        metrics = set().union(*(referenced_metrics(e) for e in panel_exprs(panels[title])))
        assert metric in metrics, title
    quantiles = " ".join(panel_exprs(panels["E2E request latency p50/p95"]))
    assert "histogram_quantile(0.5," in quantiles
    assert "histogram_quantile(0.95," in quantiles


def test_panel_ids_are_unique() -> None:
    ids = [panel["id"] for panel in dashboard_panels(load())]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("panel", query_panels(), ids=lambda panel: panel["title"])
def test_every_panel_queries_the_fleets_prometheus(panel: dict[str, Any]) -> None:
    assert panel["datasource"] == DATASOURCE
    assert panel["targets"]
    for target in panel["targets"]:
        assert target["datasource"] == DATASOURCE
        assert target["expr"].strip()
    assert panel_exprs(panel)


def test_dashboard_queries_only_vllm_and_scrape_metrics() -> None:
    metrics = set().union(*(referenced_metrics(expr) for expr in dashboard_exprs(DASHBOARD)))
    assert metrics
    assert {m for m in metrics if not m.startswith("vllm:")} <= NON_VLLM_METRICS


def test_panel_queries_select_the_node_variable() -> None:
    for panel in query_panels():
        for expr in panel_exprs(panel):
            if 'job="vllm"' in expr:
                assert 'node=~"$node"' in expr, expr


def test_dashboard_exprs_walks_rows_and_templating(tmp_path: Path) -> None:
    dashboard = {
        "panels": [
            {"type": "timeseries", "targets": [{"expr": "a"}, {"refId": "B"}]},
            {
                "type": "row",
                "collapsed": True,
                "panels": [{"type": "stat", "targets": [{"expr": "sum(b)"}]}],
            },
        ],
        "rows": [{"panels": [{"type": "graph", "targets": [{"expr": "c"}]}]}],
        "templating": {
            "list": [
                {"type": "datasource", "name": "ds", "query": "prometheus"},
                {"type": "query", "name": "node", "query": "label_values(d, node)"},
                {"type": "query", "name": "e", "query": {"query": "query_result(e)"}},
                {"type": "query", "name": "f", "query": "label_values(node)"},
                {"type": "custom", "name": "g", "query": "1,2"},
            ]
        },
    }
    path = tmp_path / "dashboard.json"
    path.write_text(json.dumps(dashboard))
    assert dashboard_exprs(path) == ["a", "sum(b)", "c", "d", "e"]


@pytest.mark.parametrize(
    ("query", "expr"),
    [
        ("label_values(vllm:num_requests_running, node)", "vllm:num_requests_running"),
        ('label_values(up{job="vllm"}, instance)', 'up{job="vllm"}'),
        ("label_values(node)", None),
        ("metrics(vllm:.*)", None),
        ("query_result(topk(3, up))", "topk(3, up)"),
        ("sum(up)", "sum(up)"),
        ("", None),
    ],
)
def test_templating_expr(query: str, expr: str | None) -> None:
    assert templating_expr(query) == expr
