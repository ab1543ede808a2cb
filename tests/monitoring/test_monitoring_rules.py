"""The alerting and recording rules: promtool accepts them and their unit tests pass,
every alert is tested both firing and silent, the PrometheusRule says the same as the
plain file, a real Prometheus loads them, and they name only contracted metrics."""

from __future__ import annotations

import subprocess
import sys

import yaml

from monitoring_helpers import (
    MONITORING, PROMETHEUS_RULE, RULE_TESTS, RULES, alert_names, allowed_metric, load_rules,
    promql_metric_names, recorded_names,
)


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)


def test_promtool_check_rules(promtool):
    out = run([promtool, "check", "rules", str(RULES)])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_promtool_unit_tests_pass(promtool):
    assert RULE_TESTS, "no promtool unit test files in manifests/monitoring/tests/"
    out = run([promtool, "test", "rules", *map(str, RULE_TESTS)])
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_is_tested_firing_and_silent():
    fired, silent = set(), set()
    for path in RULE_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for t in case.get("alert_rule_test", []):
                (fired if t.get("exp_alerts") else silent).add(t["alertname"])
    alerts = set(alert_names(load_rules()))
    assert alerts - fired == set(), "alerts never tested firing"
    assert alerts - silent == set(), "alerts never tested staying silent"


def test_the_issue_asks_for_these_alerts():
    alerts = set(alert_names(load_rules()))
    assert {
        "ShoalQueueDepthAboveTarget", "ShoalKVCacheSaturated", "ShoalInferenceDeploymentDegraded",
        "ShoalTimeToFirstTokenP99High", "ShoalGroupRestartingRepeatedly", "ShoalOperatorReconcileErrors",
    } <= alerts


def test_alerts_carry_severity_and_summary():
    for group in load_rules()["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                assert rule.get("labels", {}).get("severity") in {"info", "warning", "critical"}, rule["alert"]
                assert rule.get("annotations", {}).get("summary"), rule["alert"]
                assert rule.get("annotations", {}).get("description"), rule["alert"]


def test_prometheusrule_is_generated_from_rules_file():
    out = run([sys.executable, str(MONITORING / "gen_prometheusrule.py"), "--check"])
    assert out.returncode == 0, out.stderr + "\n(run python manifests/monitoring/gen_prometheusrule.py)"
    obj = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert obj["apiVersion"] == "monitoring.coreos.com/v1"
    assert obj["kind"] == "PrometheusRule"
    assert obj["metadata"]["name"]
    assert obj["spec"]["groups"] == load_rules()["groups"]


def test_rules_name_only_contracted_metrics():
    rules = load_rules()
    recorded = recorded_names(rules)
    for group in rules["groups"]:
        for rule in group["rules"]:
            names = promql_metric_names(rule["expr"])
            assert names, f"no metric found in {rule['expr']!r}"
            unknown = {n for n in names if not allowed_metric(n, recorded)}
            assert not unknown, f"{rule.get('record') or rule.get('alert')} uses unknown metrics {unknown}"


def test_recording_rule_names_are_namespaced():
    # shoal:<what>[:<operation>], the colon marking them as recorded (never exported)
    for name in recorded_names(load_rules()):
        assert name.startswith("shoal:") and name.count(":") in (1, 2), name


def test_metric_scanner():
    expr = ('histogram_quantile(0.99, sum by (namespace, le) (rate(shoal_time_to_first_token_seconds_bucket'
            '{group=~"a|b", x="sum(y)"}[5m] offset 1m))) > on (namespace) group_left () 2e3 * foo:bar:baz'
            ' or label_replace(up, "dst", "$1", "src", "(.*)") and max(process_start_time_seconds)[30m:1m]')
    assert promql_metric_names(expr) == {"shoal_time_to_first_token_seconds_bucket", "foo:bar:baz", "up",
                                         "process_start_time_seconds"}


def test_real_prometheus_loads_the_rules(prometheus):
    loaded = {g["name"]: g for g in prometheus.rules()}
    for group in load_rules()["groups"]:
        assert group["name"] in loaded, f"{group['name']} not loaded:\n{prometheus.log_tail()}"
        assert len(loaded[group["name"]]["rules"]) == len(group["rules"])
