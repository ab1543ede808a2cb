"""Helpers for the monitoring and GitOps tests: paths, the metric contract, a PromQL
metric-name scanner, Grafana variable substitution and a JSON-to-Lua encoder."""

from __future__ import annotations

import datetime as _dt
import json
import re
import socket
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
MONITORING = REPO / "manifests" / "monitoring"
ARGOCD = REPO / "manifests" / "argocd"
DOCKER = REPO / "manifests" / "docker"
FIXTURES = Path(__file__).resolve().parent / "fixtures"

RULES = MONITORING / "rules.yaml"
PROMETHEUS_RULE = MONITORING / "prometheusrule.yaml"
RULE_TESTS = sorted((MONITORING / "tests").glob("*.yaml"))
DASHBOARDS = sorted((MONITORING / "dashboards").glob("*.json"))
SCRAPE_CONFIGS = MONITORING / "prometheus-scrape-configs.yaml"
KSM_CRS = MONITORING / "kube-state-metrics-crs.yaml"
LUA_HEALTH = ARGOCD / "inferencedeployment-health.lua"
ARGOCD_CM = ARGOCD / "argocd-cm.yaml"

# The metric contract (docs/design.md "Metrics" and operator/operator_metrics.py).
RUNTIME_COUNTERS = {
    "shoal_prompt_tokens_total", "shoal_generation_tokens_total", "shoal_num_preemptions_total",
    "shoal_prefix_cache_queries_total", "shoal_prefix_cache_hits_total", "shoal_request_success_total",
}
RUNTIME_GAUGES = {
    "shoal_num_requests_running", "shoal_num_requests_waiting", "shoal_kv_cache_usage_perc",
    "shoal_startup_phase_seconds", "shoal_cpu_threads",
}
RUNTIME_HISTOGRAMS = {
    "shoal_time_to_first_token_seconds", "shoal_inter_token_latency_seconds",
    "shoal_e2e_request_latency_seconds", "shoal_request_queue_time_seconds",
}
OPERATOR_METRICS = {
    "shoal_operator_reconcile_total", "shoal_operator_reconcile_errors_total",
    "shoal_operator_desired_groups", "shoal_operator_ready_groups",
    "shoal_operator_autoscaler_decisions_total",
}
OPERATOR_HISTOGRAMS = {"shoal_operator_reconcile_duration_seconds"}


def _with_series(histograms: set[str]) -> set[str]:
    return {f"{h}{suffix}" for h in histograms for suffix in ("_bucket", "_sum", "_count")}


RUNTIME_METRICS = RUNTIME_COUNTERS | RUNTIME_GAUGES | _with_series(RUNTIME_HISTOGRAMS)
SHOAL_METRICS = RUNTIME_METRICS | OPERATOR_METRICS | _with_series(OPERATOR_HISTOGRAMS)
# Standard series from Prometheus itself, the client library's process collector and
# kube-state-metrics (including our custom resource state, kube_inferencedeployment_*).
STANDARD_PREFIXES = ("kube_", "process_")
STANDARD_NAMES = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}


def allowed_metric(name: str, recorded: set[str] = frozenset()) -> bool:
    return (name in SHOAL_METRICS or name in STANDARD_NAMES or name in recorded
            or name.startswith(STANDARD_PREFIXES))


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def static_scrape_job(job: dict[str, Any], targets: list[tuple[str, dict[str, str]]]) -> dict[str, Any]:
    """A scrape job from prometheus-scrape-configs.yaml with its Kubernetes discovery
    replaced by static targets carrying the __meta_kubernetes_* labels the relabeling
    reads. (Debian's Prometheus is built without Kubernetes service discovery, and the
    tests have no cluster anyway.)"""
    job = dict(job)
    assert "kubernetes_sd_configs" in job, job["job_name"]
    del job["kubernetes_sd_configs"]
    job["static_configs"] = [{"targets": [address], "labels": labels} for address, labels in targets]
    return job


def scrape_jobs() -> dict[str, dict[str, Any]]:
    return {j["job_name"]: j for j in yaml.safe_load(SCRAPE_CONFIGS.read_text())}


# --- PromQL --------------------------------------------------------------------------

_PROMQL_WORDS = {
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk",
    "topk", "quantile", "limitk", "limit_ratio", "by", "without", "on", "ignoring", "group_left",
    "group_right", "offset", "bool", "and", "or", "unless", "atan2", "inf", "nan", "start", "end",
}


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (a scanner, not a parser: it drops
    strings, label matchers, ranges and grouping clauses, then keeps identifiers that
    are neither keywords nor followed by a parenthesis)."""
    s = re.sub(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`', '""', expr)
    s = re.sub(r"#[^\n]*", " ", s)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    names = set()
    for m in re.finditer(r"(?<![\w:.])([A-Za-z_:][\w:]*)", s):
        token = m.group(1)
        if token.lower() in _PROMQL_WORDS or s[m.end():].lstrip().startswith("("):
            continue
        names.add(token)
    return names


def load_rules() -> dict[str, Any]:
    return yaml.safe_load(RULES.read_text())


def recorded_names(rules: dict[str, Any]) -> set[str]:
    return {r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r}


def alert_names(rules: dict[str, Any]) -> list[str]:
    return [r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r]


# --- Grafana -------------------------------------------------------------------------

GRAFANA_INTERVALS = {"__rate_interval": "5m", "__interval": "1m", "__range": "1h", "__range_s": "3600"}
_GRAFANA_VAR = re.compile(r"\$\{([A-Za-z_]\w*)(?::\w+)?\}|\$([A-Za-z_]\w*)|\[\[([A-Za-z_]\w*)\]\]")


def grafana_variables(expr: str) -> set[str]:
    return {next(g for g in m.groups() if g) for m in _GRAFANA_VAR.finditer(expr)}


def grafana_substitute(expr: str) -> str:
    """What Grafana sends for 'All' selections (allValue .*) and its interval macros."""

    def repl(m: re.Match) -> str:
        name = next(g for g in m.groups() if g)
        return GRAFANA_INTERVALS.get(name, ".*")

    return _GRAFANA_VAR.sub(repl, expr)


def dashboard_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in dashboard.get("panels", []):
        out.append(panel)
        out.extend(panel.get("panels", []))  # collapsed rows keep theirs inside
    return out


def dashboard_exprs(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, expr) for every PromQL expression: panel targets and annotations."""
    out = []
    for panel in dashboard_panels(dashboard):
        for target in panel.get("targets", []):
            if target.get("expr"):
                out.append((f"panel {panel.get('id')} {panel.get('title')!r} {target.get('refId')}", target["expr"]))
    for ann in dashboard.get("annotations", {}).get("list", []):
        if ann.get("expr"):
            out.append((f"annotation {ann.get('name')!r}", ann["expr"]))
    return out


_LABEL_VALUES = re.compile(r"^\s*label_values\((?:(?P<sel>.*),)?\s*(?P<label>[A-Za-z_]\w*)\s*\)\s*$", re.S)


def variable_selector(query: str) -> str | None:
    """The series selector inside a Grafana `label_values(selector, label)` query."""
    m = _LABEL_VALUES.match(query)
    if not m:
        raise ValueError(f"not a label_values() query: {query!r}")
    return m.group("sel")


# --- Lua -----------------------------------------------------------------------------


def plain_json(obj: Any) -> Any:
    """What Argo CD hands the script: JSON, so YAML timestamps become RFC 3339 strings."""

    def default(value):
        if isinstance(value, (_dt.datetime, _dt.date)):
            return value.isoformat().replace("+00:00", "Z")
        raise TypeError(type(value))

    return json.loads(json.dumps(obj, default=default))


def _lua_string(text: str) -> str:
    out = []
    for byte in text.encode("utf-8"):
        ch = chr(byte)
        if ch in '"\\' or byte < 32 or byte > 126:
            out.append(f"\\{byte:03d}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def lua_literal(value: Any) -> str:
    """A Lua table constructor for a JSON value (null members are left out, as
    Argo CD's decoder does)."""
    if value is None:
        return "nil"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return _lua_string(value)
    if isinstance(value, list):
        return "{" + ", ".join(lua_literal(v) for v in value if v is not None) + "}"
    if isinstance(value, dict):
        items = (f"[{_lua_string(str(k))}] = {lua_literal(v)}" for k, v in value.items() if v is not None)
        return "{" + ", ".join(items) + "}"
    raise TypeError(f"cannot encode {type(value).__name__} for Lua")
