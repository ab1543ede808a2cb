"""The Grafana dashboard: well formed, every query parses as PromQL in a real
Prometheus, and every query names only metrics the runtime, the operator or the
standard exporters export."""

from __future__ import annotations

import json

import pytest

from monitoring_helpers import (
    DASHBOARDS, allowed_metric, dashboard_exprs, dashboard_panels, grafana_substitute, grafana_variables,
    promql_metric_names, variable_selector,
)

DASHBOARD_IDS = [p.name for p in DASHBOARDS]


def load(path):
    return json.loads(path.read_text())


@pytest.fixture(params=DASHBOARDS, ids=DASHBOARD_IDS)
def dashboard(request):
    return load(request.param)


def test_there_is_a_dashboard():
    assert DASHBOARDS


def test_dashboard_is_well_formed(dashboard):
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    panels = dashboard_panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
            assert p["targets"], p["title"]
            for t in p["targets"]:
                assert t["datasource"] == p["datasource"]
    # no two panels overlap
    cells = set()
    for p in panels:
        g = p["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps another panel"
                cells.add((x, y))


def test_dashboard_variables(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in ("namespace", "inference_deployment", "model_name", "group"):
        v = variables[name]
        assert v["type"] == "query" and v["includeAll"] and v["multi"] and v["allValue"] == ".*", name
    defined = set(variables) | {"__rate_interval", "__interval", "__range", "__range_s"}
    for where, expr in dashboard_exprs(dashboard):
        assert grafana_variables(expr) <= defined, f"{where} uses undefined variables"


def test_dashboard_covers_the_issue(dashboard):
    exprs = "\n".join(e for _, e in dashboard_exprs(dashboard))
    for h in ("shoal_time_to_first_token_seconds", "shoal_inter_token_latency_seconds",
              "shoal_e2e_request_latency_seconds"):
        assert f"histogram_quantile(0.99, sum by (model_name, le) (rate({h}_bucket" in exprs, h
    for needle in ("shoal_generation_tokens_total", "shoal_prompt_tokens_total", "shoal_kv_cache_usage_perc",
                   "shoal_num_preemptions_total", "shoal_num_requests_waiting", "shoal_operator_desired_groups",
                   "sum by (inference_deployment, group)", "sum by (model_name"):
        assert needle in exprs, needle


def test_every_query_names_only_exported_metrics(dashboard):
    queries = list(dashboard_exprs(dashboard))
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":
            queries.append((f"variable {v['name']}", variable_selector(v["query"]["query"])))
    for where, expr in queries:
        names = promql_metric_names(grafana_substitute(expr))
        assert names, f"{where}: no metric in {expr!r}"
        unknown = {n for n in names if not allowed_metric(n)}
        assert not unknown, f"{where} names metrics nobody exports: {unknown}"


def test_every_query_parses_in_real_prometheus(dashboard, prometheus):
    queries = list(dashboard_exprs(dashboard))
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":
            queries.append((f"variable {v['name']}", variable_selector(v["query"]["query"])))
    failures = []
    for where, expr in queries:
        try:
            prometheus.query(grafana_substitute(expr))  # empty results are fine, errors are not
        except AssertionError as exc:
            failures.append(f"{where}: {exc}")
    assert not failures, "\n".join(failures)


def test_real_prometheus_rejects_a_bad_query(prometheus):
    # the check above means something: a broken expression is an error, not an empty result
    with pytest.raises(AssertionError, match="bad_data"):
        prometheus.query("sum by (le (rate(shoal_time_to_first_token_seconds_bucket[5m]))")
