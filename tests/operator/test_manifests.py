"""manifests/: the kustomization builds (with the CRD), every object validates (Kubernetes 1.30,
strict), and the ClusterRole grants what the controller does, for every kind it renders."""

from __future__ import annotations

import shutil
import subprocess

import kubernetes_validate
import pytest
import yaml

from shoal.operator import render
from shoal_op_helpers import ROOT, make_body

MANIFESTS = ROOT / "manifests"


def built(path=MANIFESTS) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (for `kubectl kustomize`) is not installed")
    out = subprocess.run([kubectl, "kustomize", str(path)], check=True, capture_output=True, text=True,
                         timeout=60).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def test_kustomization_installs_crd_and_operator():
    objs = built()
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objs}
    assert ("CustomResourceDefinition", "inferencedeployments.shoal.dev") in kinds
    for kind in ("Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment", "Service"):
        assert any(k == kind for k, _ in kinds), kind
    for obj in objs:
        kubernetes_validate.validate(obj, "1.30.0", strict=True)
    dep = next(o for o in objs if o["kind"] == "Deployment")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == ["shoal"] and c["args"][:2] == ["operator", "run"]
    assert "--metrics-port=8080" in c["args"]
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "shoal-operator"


def test_operator_servicemonitor():
    (sm,) = [d for d in yaml.safe_load_all((MANIFESTS / "operator-servicemonitor" / "servicemonitor.yaml").read_text())]
    from test_render import validate_monitor

    validate_monitor(sm)
    svc = yaml.safe_load((MANIFESTS / "operator" / "service.yaml").read_text())
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"]


def allowed(rules, group, resource, verb) -> bool:
    return any(group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"] for r in rules)


def test_cluster_role_is_enough_and_least():
    rules = yaml.safe_load((MANIFESTS / "operator" / "clusterrole.yaml").read_text())["rules"]
    enough_and_least(rules)
    # Issue 19: no blanket pods/patch across the cluster (the role label is best effort).
    assert not allowed(rules, "", "pods", "patch")


def test_namespaced_variant_has_no_cluster_wide_verbs():
    """Issue 19: watching one namespace, the operator holds a Role there and nothing cluster-wide."""
    objs = built(MANIFESTS / "operator-namespaced")
    for obj in objs:
        kubernetes_validate.validate(obj, "1.30.0", strict=True)
    kinds = {o["kind"] for o in objs}
    assert not {"ClusterRole", "ClusterRoleBinding"} & kinds
    (role,) = [o for o in objs if o["kind"] == "Role"]
    (binding,) = [o for o in objs if o["kind"] == "RoleBinding"]
    (dep,) = [o for o in objs if o["kind"] == "Deployment"]
    c = dep["spec"]["template"]["spec"]["containers"][0]
    watched = role["metadata"]["namespace"]
    assert f"--namespace={watched}" in c["args"] and "--all-namespaces" not in c["args"]
    assert {"name": "SHOAL_OPERATOR_SCANNING", "value": "0"} in c["env"]
    assert binding["metadata"]["namespace"] == watched and binding["roleRef"]["kind"] == "Role"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": dep["spec"]["template"]["spec"]["serviceAccountName"],
                                    "namespace": dep["metadata"]["namespace"]}]
    assert any(o["kind"] == "Namespace" and o["metadata"]["name"] == watched for o in objs)
    enough_and_least(role["rules"])
    assert allowed(role["rules"], "", "pods", "patch")   # namespaced: the role label too
    assert not any("apiextensions.k8s.io" in r["apiGroups"] for r in role["rules"])


def enough_and_least(rules):
    plurals = {"StatefulSet": "statefulsets", "Service": "services", "PodDisruptionBudget": "poddisruptionbudgets",
               "ServiceMonitor": "servicemonitors", "PodMonitor": "podmonitors", "NetworkPolicy": "networkpolicies"}
    plurals.update(PersistentVolumeClaim="persistentvolumeclaims", Job="jobs", PodGroup="podgroups",
                   Deployment="deployments", InferencePool="inferencepools")
    pool = {"mode": "inferencePool", "inferencePool": {"endpointPicker": {"name": "epp"}}}
    objs = render.render_all(make_body(monitoring={"serviceMonitor": True},
                                       model={"source": "hf://org/m", "cache": {"enabled": True}},
                                       placement={"gangScheduling": "Volcano"}))
    objs += render.render_all(make_body(routing=pool))
    for obj in objs:
        group = obj["apiVersion"].rpartition("/")[0]
        for verb in ("get", "create", "patch"):  # server-side apply of a new object needs create
            assert allowed(rules, group, plurals[obj["kind"]], verb), (obj["kind"], verb)
    # a routing.mode switch deletes the objects of the mode before
    for api_version, kind, _ in render.ROUTING_KINDS:
        assert allowed(rules, api_version.rpartition("/")[0], plurals[kind], "delete"), kind
    for group, resource, verb in [("shoal.dev", "inferencedeployments", "watch"),
                                  ("shoal.dev", "inferencedeployments/status", "patch"),
                                  ("shoal.dev", "inferencedeployments/finalizers", "update"),
                                  ("apps", "statefulsets", "delete"), ("", "pods", "delete"),
                                  ("", "pods", "list"), ("", "events", "create"),
                                  ("networking.k8s.io", "networkpolicies", "delete"),
                                  ("networking.k8s.io", "networkpolicies", "list")]:
        assert allowed(rules, group, resource, verb), (group, resource, verb)
    # least privilege: no wildcards, no secrets, nothing cluster-admin-like
    for r in rules:
        assert "*" not in r["verbs"] and "*" not in r["resources"] and "*" not in r["apiGroups"]
        assert "secrets" not in r["resources"]
        assert not {"escalate", "bind", "impersonate"} & set(r["verbs"])
