"""The rest of manifests/monitoring: the kustomization and what it lists, the plain
Prometheus scrape jobs (their relabeling run by promtool), kube-state-metrics' custom
resource config against the kube_inferencedeployment_* series the rules use."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import yaml

from monitoring_helpers import (
    DASHBOARDS, KSM_CRS, MONITORING, REPO, SCRAPE_CONFIGS, dashboard_exprs, load_rules, promql_metric_names,
    scrape_jobs, static_scrape_job,
)


def kustomization():
    return yaml.safe_load((MONITORING / "kustomization.yaml").read_text())


def test_kustomization_lists_existing_files():
    k = kustomization()
    files = list(k["resources"])
    for gen in k.get("configMapGenerator", []):
        files += [f.split("=", 1)[-1] for f in gen.get("files", [])]
    for f in files:
        assert (MONITORING / f).is_file(), f
    assert "prometheusrule.yaml" in k["resources"]
    assert any(f.endswith(".json") for f in files), "the dashboard must be in the kustomization"
    for f in k["resources"]:
        for doc in yaml.safe_load_all((MONITORING / f).read_text()):
            assert doc["apiVersion"] and doc["kind"] and doc["metadata"]["name"], f


def test_dashboard_configmap_is_found_by_grafanas_sidecar():
    gens = {g["name"]: g for g in kustomization()["configMapGenerator"]}
    dash = gens["shoal-grafana-dashboard"]
    assert dash["options"]["labels"]["grafana_dashboard"] == "1"
    assert dash["options"]["disableNameSuffixHash"] is True
    listed = {f.split("=", 1)[-1] for f in dash["files"]}
    assert {f"dashboards/{p.name}" for p in DASHBOARDS} == listed


def test_kubectl_kustomize_builds():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("SKIPPED LOUDLY: kubectl is not installed; `kubectl kustomize manifests/monitoring` "
                    "was not run (the file checks above still ran)")
    out = subprocess.run([kubectl, "kustomize", str(MONITORING)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    kinds = {d["kind"] for d in yaml.safe_load_all(out.stdout) if d}
    assert {"PrometheusRule", "ConfigMap", "ClusterRole"} <= kinds


def test_operator_servicemonitor_keeps_the_operators_labels():
    """The operator's series carry the namespace and name of the InferenceDeployment they
    describe; the rules and the dashboard read that namespace. Without honorLabels,
    Prometheus renames it exported_namespace and puts the operator pod's there."""
    sm = yaml.safe_load((REPO / "manifests" / "operator-servicemonitor" / "servicemonitor.yaml").read_text())
    assert sm["kind"] == "ServiceMonitor"
    for ep in sm["spec"]["endpoints"]:
        assert ep.get("honorLabels") is True, (
            "manifests/operator-servicemonitor/servicemonitor.yaml: set honorLabels: true on the endpoint")


def ksm_metric_names() -> set[str]:
    cfg = yaml.safe_load(KSM_CRS.read_text())
    names = set()
    for res in cfg["spec"]["resources"]:
        assert res["groupVersionKind"] == {"group": "shoal.dev", "version": "v1alpha1", "kind": "InferenceDeployment"}
        assert res["labelsFromPath"] == {"namespace": ["metadata", "namespace"],
                                         "inference_deployment": ["metadata", "name"]}
        names |= {f"{res['metricNamePrefix']}_{m['name']}" for m in res["metrics"]}
    return names


def test_kube_inferencedeployment_series_come_from_the_ksm_config():
    used = set()
    for g in load_rules()["groups"]:
        for r in g["rules"]:
            used |= promql_metric_names(r["expr"])
    for path in DASHBOARDS:
        for _, expr in dashboard_exprs(json.loads(path.read_text())):
            used |= promql_metric_names(expr)
    used = {n for n in used if n.startswith("kube_inferencedeployment_")}
    assert used, "the Degraded alert should read kube_inferencedeployment_status_condition"
    assert used <= ksm_metric_names()


def test_ksm_config_paths_exist_in_the_crd_status_shape():
    # spec/status fields named in docs/design.md
    known = {
        ("status", "conditions"), ("spec", "replicas"), ("spec", "autoscaling", "targetQueueDepth"),
        ("status", "replicas"), ("status", "readyReplicas"), ("status", "updatedReplicas"),
        ("status", "desiredReplicas"), ("status", "queueDepth"), ("metadata", "generation"),
        ("status", "observedGeneration"),
    }
    cfg = yaml.safe_load(KSM_CRS.read_text())
    for m in cfg["spec"]["resources"][0]["metrics"]:
        each = m["each"]
        if each["type"] == "Gauge":
            assert tuple(each["gauge"]["path"]) in known, m["name"]


LEADER = {
    "__meta_kubernetes_pod_annotation_prometheus_io_scrape": "true",
    "__meta_kubernetes_pod_annotation_prometheus_io_port": "8000",
    "__meta_kubernetes_pod_annotation_prometheus_io_path": "/metrics",
    "__meta_kubernetes_namespace": "llm",
    "__meta_kubernetes_pod_name": "chat-0-0",
    "__meta_kubernetes_pod_label_shoal_dev_deployment": "chat",
    "__meta_kubernetes_pod_label_shoal_dev_group": "chat-0",
}


def test_scrape_configs_relabel_runtime_leaders(promtool, tmp_path):
    jobs = scrape_jobs()
    assert set(jobs) == {"shoal-runtime", "shoal-router", "shoal-operator"}
    assert jobs["shoal-operator"].get("honor_labels") is True
    unannotated = {k: v for k, v in LEADER.items() if "annotation" not in k}
    runtime = static_scrape_job(jobs["shoal-runtime"], [("10.1.2.3:9999", LEADER), ("10.1.2.4:8000", unannotated)])
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({"scrape_configs": [runtime]}))
    check = subprocess.run([promtool, "check", "config", str(config)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    out = subprocess.run([promtool, "check", "service-discovery", "--timeout=1s", str(config), "shoal-runtime"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    results = json.loads(out.stdout[out.stdout.index("["):])
    kept = [r["labels"] for r in results if r["labels"]]
    assert len(kept) == 1, "only the annotated leader is scraped"
    labels = kept[0]
    assert labels["__address__"] == "10.1.2.3:8000"
    assert labels["__metrics_path__"] == "/metrics"
    assert {k: labels[k] for k in ("namespace", "pod", "inference_deployment", "group")} == {
        "namespace": "llm", "pod": "chat-0-0", "inference_deployment": "chat", "group": "chat-0"}


def test_scrape_config_labels_are_the_ones_rules_aggregate_by():
    by = set()
    for g in load_rules()["groups"]:
        for r in g["rules"]:
            for m in re.finditer(r"\bby \(([^)]*)\)", r["expr"]):
                by |= {x.strip() for x in m.group(1).split(",")}
    relabeled = {rc["target_label"] for j in yaml.safe_load(SCRAPE_CONFIGS.read_text())
                 for rc in j.get("relabel_configs", []) if "target_label" in rc}
    target_labels = {"namespace", "inference_deployment", "group"}
    assert target_labels <= by and target_labels <= relabeled


ROUTER = {
    "__meta_kubernetes_pod_annotation_prometheus_io_scrape": "true",
    "__meta_kubernetes_pod_annotation_prometheus_io_port": "8000",
    "__meta_kubernetes_pod_annotation_prometheus_io_path": "/metrics",
    "__meta_kubernetes_namespace": "llm",
    "__meta_kubernetes_pod_name": "chat-router-5d9f-x2",
    "__meta_kubernetes_pod_label_shoal_dev_router": "chat",
}


def test_scrape_configs_split_routers_from_runtime_pods(promtool, tmp_path):
    """Routing mode shoal: the router pods go to the shoal-router job (and only there), the
    group pods to shoal-runtime; the labels come from the pod templates the operator renders."""
    from shoal.operator import defaults, render

    body = defaults.apply_defaults({"apiVersion": "shoal.dev/v1alpha1", "kind": "InferenceDeployment",
                                    "metadata": {"name": "chat", "namespace": "llm"},
                                    "spec": {"model": {"source": "builtin://smollm2-135m-instruct"}}})
    tpl = render.router_deployment(body)["spec"]["template"]["metadata"]
    sd = {f"__meta_kubernetes_pod_label_{k.replace('.', '_').replace('/', '_').replace('-', '_')}": v
          for k, v in tpl["labels"].items()}
    sd.update({f"__meta_kubernetes_pod_annotation_{k.replace('.', '_').replace('/', '_')}": v
               for k, v in tpl["annotations"].items()})
    assert {k: v for k, v in ROUTER.items() if "label" in k or "annotation" in k}.items() <= sd.items()
    jobs = scrape_jobs()
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({"scrape_configs": [
        static_scrape_job(jobs[name], [("10.1.2.5:9999", ROUTER), ("10.1.2.3:9999", LEADER)])
        for name in ("shoal-router", "shoal-runtime")]}))
    check = subprocess.run([promtool, "check", "config", str(config)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    kept = {}
    for name in ("shoal-router", "shoal-runtime"):
        out = subprocess.run([promtool, "check", "service-discovery", "--timeout=1s", str(config), name],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        kept[name] = [r["labels"] for r in json.loads(out.stdout[out.stdout.index("["):]) if r["labels"]]
    (router,) = kept["shoal-router"]
    assert router["__address__"] == "10.1.2.5:8000" and router["__metrics_path__"] == "/metrics"
    assert {k: router[k] for k in ("namespace", "pod", "inference_deployment")} == {
        "namespace": "llm", "pod": "chat-router-5d9f-x2", "inference_deployment": "chat"}
    (runtime,) = kept["shoal-runtime"]
    assert runtime["pod"] == "chat-0-0"
