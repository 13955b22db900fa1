"""The metric names PromQL expressions reference: alert rules and Grafana dashboards.

A small lexer, not a PromQL parser: it drops strings, comments, label matchers
({...}), ranges and subqueries ([...]), the label lists of by/without/on/
ignoring/group_left/group_right, numbers and durations, Grafana variables
($node, ${node}, $__rate_interval), keywords and function names; every
identifier left is a metric name. Metric names may contain ':'
(vllm:num_requests_running).

    referenced_metrics('sum by (node) (rate(vllm:prompt_tokens_total[5m]))')
    -> {'vllm:prompt_tokens_total'}
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import yaml

# PromQL's aggregation operators: one is followed by '(' or by by/without
# (`sum by (node) (x)`).
AGGREGATIONS = frozenset(
    {
        *("sum", "min", "max", "avg", "group", "stddev", "stdvar", "count"),
        *("count_values", "bottomk", "topk", "quantile"),
    }
)
# PromQL's functions (Prometheus 2.42, the role's) and the @ modifier's
# start()/end(). A name in here is a function only when a '(' follows it.
FUNCTIONS = frozenset(
    {
        *("abs", "absent", "absent_over_time", "ceil", "changes", "clamp"),
        *("clamp_max", "clamp_min", "day_of_month", "day_of_week", "day_of_year"),
        *("days_in_month", "delta", "deriv", "exp", "floor", "histogram_count"),
        *("histogram_fraction", "histogram_quantile", "histogram_sum", "holt_winters"),
        *("hour", "idelta", "increase", "irate", "label_join", "label_replace"),
        *("ln", "log2", "log10", "minute", "month", "predict_linear", "rate"),
        *("resets", "round", "scalar", "sgn", "sort", "sort_desc", "sqrt", "time"),
        *("timestamp", "vector", "year"),
        *("avg_over_time", "min_over_time", "max_over_time", "sum_over_time"),
        *("count_over_time", "quantile_over_time", "stddev_over_time"),
        *("stdvar_over_time", "last_over_time", "present_over_time"),
        *("acos", "acosh", "asin", "asinh", "atan", "atanh", "cos", "cosh"),
        *("sin", "sinh", "tan", "tanh", "deg", "rad", "pi"),
        # the @ modifier's start() and end()
        *("start", "end"),
    }
)
# Keywords and literals that are never metric names.
KEYWORDS = frozenset(
    {"and", "or", "unless", "atan2", "bool", "offset", "inf", "nan"}
    | {"by", "without", "on", "ignoring", "group_left", "group_right"}
)
# Keywords a parenthesised list of label names may follow.
LABEL_LIST_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

_TOKEN = re.compile(
    r"""
    (?P<space>\s+)
  | (?P<comment>\#[^\n]*)
  | (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
  | (?P<variable>\$\{[^}]*\}|\$\w+|\[\[[^\]]*\]\])
  | (?P<duration>(?:\d+(?:ms|[smhdwy]))+\b)
  | (?P<number>0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<punct>.)
    """,
    re.VERBOSE | re.DOTALL,
)
_CLOSING = {"{": "}", "[": "]", "(": ")"}


def _tokens(expr: str) -> list[tuple[str, str]]:
    """(kind, text) for every token but white space, comments, strings and variables."""
    dropped = {"space", "comment", "string", "variable"}
    return [
        (m.lastgroup or "punct", m.group())
        for m in _TOKEN.finditer(expr)
        if m.lastgroup not in dropped
    ]


def _skip_group(tokens: list[tuple[str, str]], start: int) -> int:
    """The index after the bracket group that opens at tokens[start]."""
    opening = tokens[start][1]
    closing = _CLOSING[opening]
    depth = 0
    for i in range(start, len(tokens)):
        text = tokens[i][1]
        if text == opening:
            depth += 1
        elif text == closing:
            depth -= 1
            if depth == 0:
                return i + 1
    return len(tokens)


def _next_text(tokens: list[tuple[str, str]], i: int) -> str:
    return tokens[i][1] if i < len(tokens) else ""


def _is_call(name: str, following: str) -> bool:
    """Whether an identifier followed by the token `following` calls a function."""
    if name in AGGREGATIONS:
        return following.lower() in {"(", "by", "without"}
    return name in FUNCTIONS and following == "("


def _identifiers(tokens: list[tuple[str, str]]) -> Iterator[str]:
    """The metric names among the tokens."""
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        if text in ("{", "["):
            # label matchers; ranges, subqueries
            i = _skip_group(tokens, i)
            continue
        i += 1
        if kind != "ident":
            continue
        word = text.lower()
        following = _next_text(tokens, i)
        if word in LABEL_LIST_KEYWORDS and following == "(":
            i = _skip_group(tokens, i)
        elif word not in KEYWORDS and not _is_call(text, following):
            yield text


def referenced_metrics(expr: str) -> set[str]:
    """The metric names a PromQL expression selects."""
    return set(_identifiers(_tokens(expr)))


def base_metric(name: str, families: Collection[str] | None = None) -> str:
    """The histogram (or summary) family of a _bucket/_sum/_count series name.

    Without `families` every such suffix is stripped; with it only where the
    stripped name is one of them, so a counter that merely ends in _count
    keeps its name. Any other name is returned as it is.
    """
    for suffix in HISTOGRAM_SUFFIXES:
        if name.endswith(suffix):
            family = name.removesuffix(suffix)
            if families is None or family in families:
                return family
    return name


def templating_expr(query: str) -> str | None:
    """The PromQL inside a Grafana Prometheus variable query, None if there is none.

    label_values(expr, label) -> expr; label_values(label) and metrics(regex)
    -> None; query_result(expr) -> expr; anything else is PromQL already.
    """
    query = query.strip()
    call = re.fullmatch(r"(\w+)\s*\((.*)\)", query, re.DOTALL)
    if call is None:
        return query or None
    function, args = call.group(1), call.group(2).strip()
    if function == "label_values":
        selector, comma, _label = args.rpartition(",")
        return selector.strip() if comma and selector.strip() else None
    if function == "query_result":
        return args or None
    if function == "metrics":
        return None
    return query


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, rows' nested panels included (rows come with them)."""
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def dashboard_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel of a dashboard (schema 16+ panels and legacy rows), rows included."""
    panels = list(_panels(dashboard.get("panels", [])))
    for row in dashboard.get("rows", []):
        panels.extend(_panels(row.get("panels", [])))
    return panels


def panel_exprs(panel: dict[str, Any]) -> list[str]:
    """The PromQL expressions of one panel's targets."""
    return [target["expr"] for target in panel.get("targets", []) if target.get("expr")]


def _variable_query(variable: dict[str, Any]) -> str:
    query = variable.get("query", "")
    if isinstance(query, dict):
        query = query.get("query", "")
    return query if isinstance(query, str) else ""


def templating_exprs(dashboard: dict[str, Any]) -> list[str]:
    """The PromQL of the dashboard's query variables."""
    exprs = []
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            expr = templating_expr(_variable_query(variable))
            if expr:
                exprs.append(expr)
    return exprs


def dashboard_exprs(path: Path | str) -> list[str]:
    """Every panel target's expr (nested rows' panels too) and every templating query."""
    dashboard = json.loads(Path(path).read_text())
    exprs = [expr for panel in dashboard_panels(dashboard) for expr in panel_exprs(panel)]
    return exprs + templating_exprs(dashboard)


def rule_exprs(path: Path | str) -> list[str]:
    """Every rule's expr (alerting and recording) of a Prometheus rule file."""
    document = yaml.safe_load(Path(path).read_text())
    return [rule["expr"] for group in document["groups"] for rule in group["rules"]]
