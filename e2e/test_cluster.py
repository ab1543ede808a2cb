"""The operator against a real cluster: install, serve, roll out a new revision, delete.

Traffic goes through the Service NAME, which (routing.mode shoal, the default) is the
Shoal router in front of the groups: the runtime image must have `shoal router`.

Run: `make e2e` (or `.venv/bin/pytest -q e2e`) with KUBECONFIG pointing at a cluster
that can pull (or was loaded with) the images. Knobs (environment):

- SHOAL_E2E_OPERATOR_IMAGE: the operator image (default: as in manifests/operator/deployment.yaml)
- SHOAL_E2E_RUNTIME_IMAGE:  the runtime image for the sample (default: the operator's CPU default)
- SHOAL_E2E_TIMEOUT:        seconds to wait for Available (default 900: images + model load)
- SHOAL_E2E_UNINSTALL=1:    also remove the operator and the CRD at the end

Skipped, loudly, when no cluster is reachable (see conftest.py).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NS = "shoal-e2e"
NAME = "smollm2"
TIMEOUT = float(os.environ.get("SHOAL_E2E_TIMEOUT", "900"))


def kubectl(kc: str, *args: str, input: str | None = None, check: bool = True, timeout: float = 120) -> str:
    r = subprocess.run([kc, *args], input=input, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} failed: {r.stderr or r.stdout}")
    return r.stdout


def infd(kc: str) -> dict | None:
    out = kubectl(kc, "-n", NS, "get", "infd", NAME, "-o", "json", check=False)
    return json.loads(out) if out.strip() else None


def condition(obj: dict, ctype: str) -> dict:
    return next((c for c in (obj.get("status") or {}).get("conditions", []) if c["type"] == ctype), {})


def wait_for(what: str, check, timeout: float = TIMEOUT, interval: float = 3.0):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def sample() -> dict:
    with open(os.path.join(ROOT, "manifests", "samples", "smollm2-cpu.yaml"), encoding="utf-8") as f:
        obj = yaml.safe_load(f)
    obj["metadata"]["namespace"] = NS
    spec = obj["spec"]
    spec["replicas"] = 1
    spec["autoscaling"]["enabled"] = False          # a small cluster: one group, no autoscaler noise
    # a small cluster: half a CPU reserved, up to two to burst (a request alone would now cap it: docs/operator.md)
    spec["resources"] = {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"cpu": "2", "memory": "3Gi"}}
    # the router in front (routing.mode shoal): one small pod on a small cluster
    spec["routing"] = {"mode": "shoal", "router": {"replicas": 1, "resources": {
        "requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}}}
    if os.environ.get("SHOAL_E2E_RUNTIME_IMAGE"):
        spec["image"] = os.environ["SHOAL_E2E_RUNTIME_IMAGE"]
        spec["podTemplate"] = {"imagePullPolicy": "IfNotPresent"}
    return obj


@pytest.fixture(scope="module")
def installed(cluster):
    kc = cluster
    kubectl(kc, "apply", "-k", os.path.join(ROOT, "manifests"))
    kubectl(kc, "wait", "--for=condition=Established", "crd/inferencedeployments.shoal.dev", "--timeout=60s")
    if os.environ.get("SHOAL_E2E_OPERATOR_IMAGE"):
        kubectl(kc, "-n", "shoal-system", "set", "image", "deployment/shoal-operator",
                f"operator={os.environ['SHOAL_E2E_OPERATOR_IMAGE']}")
    kubectl(kc, "-n", "shoal-system", "rollout", "status", "deployment/shoal-operator", "--timeout=300s",
            timeout=320)
    kubectl(kc, "create", "namespace", NS, check=False)
    yield kc
    kubectl(kc, "delete", "namespace", NS, "--ignore-not-found", "--wait=false", check=False)
    if os.environ.get("SHOAL_E2E_UNINSTALL") == "1":
        kubectl(kc, "delete", "-k", os.path.join(ROOT, "manifests"), "--ignore-not-found", check=False, timeout=300)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def complete_through_service(kc: str, name: str = NAME, timeout: float = 120) -> dict:
    """A completion through the Service `name` (the router's, in mode shoal)."""
    port = free_port()
    pf = subprocess.Popen([kc, "-n", NS, "port-forward", f"svc/{name}", f"{port}:8000"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def answered():
            try:
                body = json.dumps({"model": name, "prompt": "The capital of France is", "max_tokens": 8,
                                   "temperature": 0}).encode()
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=timeout) as resp:
                    return json.loads(resp.read())
            except OSError:
                return None
        return wait_for("a completion through the Service", answered, timeout=timeout, interval=2)
    finally:
        pf.terminate()
        pf.wait(timeout=10)


def test_install_serve_rollout_delete(installed):
    kc = installed
    kubectl(kc, "apply", "-f", "-", input=yaml.safe_dump(sample()))

    obj = wait_for("Available=True", lambda: (o := infd(kc)) and condition(o, "Available").get("status") == "True"
                   and (o["status"].get("readyReplicas") or 0) >= 1 and o)
    assert obj["status"]["observedGeneration"] == obj["metadata"]["generation"]
    rev1 = obj["status"]["revision"]
    stss = json.loads(kubectl(kc, "-n", NS, "get", "statefulsets", "-l", f"shoal.dev/deployment={NAME}", "-o", "json"))
    assert len(stss["items"]) == 1
    assert stss["items"][0]["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]

    # Issue 20: the Service is the router's; the router finds the group through NAME-leaders.
    svc = json.loads(kubectl(kc, "-n", NS, "get", "service", NAME, "-o", "json"))
    assert svc["spec"]["selector"] == {"shoal.dev/router": NAME}
    kubectl(kc, "-n", NS, "rollout", "status", f"deployment/{NAME}-router", "--timeout=300s", timeout=320)
    leaders = json.loads(kubectl(kc, "-n", NS, "get", "endpoints", f"{NAME}-leaders", "-o", "json"))
    assert sum(len(s.get("addresses") or []) for s in leaders.get("subsets") or []) == 1   # one ready leader
    out = complete_through_service(kc)
    assert out["choices"] and isinstance(out["choices"][0]["text"], str) and out["choices"][0]["text"]
    router = wait_for("status.router", lambda: (infd(kc)["status"].get("router") or {}).get("readyReplicas"),
                      timeout=60)
    assert router == 1
    rpod = json.loads(kubectl(kc, "-n", NS, "get", "pods", "-l", f"shoal.dev/router={NAME}", "-o", "json"))["items"][0]
    assert rpod["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True

    # Issue 19: a Ready condition for `kubectl wait`, the serving URL, least-privilege pods and a
    # NetworkPolicy per group.
    kubectl(kc, "-n", NS, "wait", "--for=condition=Ready", f"infd/{NAME}", "--timeout=120s", timeout=130)
    assert infd(kc)["status"]["url"] == f"http://{NAME}.{NS}.svc.cluster.local:8000"
    group = stss["items"][0]["metadata"]["name"]
    kubectl(kc, "-n", NS, "get", "networkpolicy", group)
    pod = json.loads(kubectl(kc, "-n", NS, "get", "pod", f"{group}-0", "-o", "json"))
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert pod["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True

    # A new model revision: a new group comes up, then the old one goes (maxSurge 1, maxUnavailable 0).
    kubectl(kc, "-n", NS, "patch", "infd", NAME, "--type=merge", "-p",
            json.dumps({"spec": {"model": {"revision": "e2e-2"}}}))
    ready_seen = []

    def rolled_out():
        o = infd(kc)
        st = o.get("status") or {}
        ready_seen.append(st.get("readyReplicas", 0))
        groups = st.get("groups") or []
        return (st.get("observedGeneration") == o["metadata"]["generation"] and st.get("revision") != rev1
                and groups and all(g["revision"] == st["revision"] and g["ready"] for g in groups)
                and len(groups) == 1 and condition(o, "Progressing").get("reason") == "RolloutComplete" and o)
    wait_for("the rollout of revision e2e-2", rolled_out)
    assert min(ready_seen) >= 1, f"ready groups dropped below replicas - maxUnavailable: {ready_seen}"
    assert complete_through_service(kc)["choices"]

    events = kubectl(kc, "-n", NS, "get", "events", "--field-selector", f"involvedObject.name={NAME}", "-o", "json")
    reasons = {e.get("reason") for e in json.loads(events)["items"]}
    assert {"GroupCreated", "GroupDeleted"} <= reasons, reasons

    # Delete: everything it owned goes with it (the real garbage collector this time).
    kubectl(kc, "-n", NS, "delete", "infd", NAME, "--wait=true", "--timeout=300s", timeout=320)

    def all_gone():
        left = kubectl(kc, "-n", NS, "get", "statefulsets,deployments,pods,services,poddisruptionbudgets,"
                       "networkpolicies", "-l", f"shoal.dev/deployment={NAME}", "-o", "name")
        routers = kubectl(kc, "-n", NS, "get", "pods", "-l", f"shoal.dev/router={NAME}", "-o", "name")
        return not left.strip() and not routers.strip()
    wait_for("the children to be garbage-collected", all_gone, timeout=300)


# ---------------------------------------------------------------- issue 19

def with_spec(name: str = NAME, **spec) -> dict:
    obj = sample()
    obj["metadata"]["name"] = name
    for key, value in spec.items():
        if isinstance(value, dict) and isinstance(obj["spec"].get(key), dict):
            obj["spec"][key] = {**obj["spec"][key], **value}
        else:
            obj["spec"][key] = value
    return obj


BAD = {
    "dots in the name": with_spec("llama.v2"),
    "a digit first": with_spec("8b-llama"),
    "gpus != tensor": with_spec(parallelism={"tensor": 2}, resources={"limits": {"nvidia.com/gpu": 4}}),
    "mig != tensor": with_spec(parallelism={"tensor": 2}, resources={"limits": {"nvidia.com/mig-3g.40gb": 1}}),
    "extraArgs --port": with_spec(engine={"extraArgs": ["--port", "9000"]}),
    "volume dshm": with_spec(podTemplate={"volumes": [{"name": "dshm", "emptyDir": {}}]}),
    "a second /dev/shm": with_spec(podTemplate={"volumes": [{"name": "s", "emptyDir": {}}],
                                                "volumeMounts": [{"name": "s", "mountPath": "/dev/shm"}]}),
    "SHOAL_ env": with_spec(podTemplate={"env": [{"name": "SHOAL_GROUP", "value": "x"}]}),
    "negative cacheSize": with_spec(model={"source": "hf://org/m", "cacheSize": "-1Gi"}),
    "pvc ..": with_spec(model={"source": "pvc://models/../../etc"}),
    "interval 0s": with_spec(monitoring={"interval": "0s"}),
    "scale to zero without a router": with_spec(autoscaling={"enabled": True, "minReplicas": 0},
                                                routing={"mode": "service"}),
    "inferencePool without a picker": with_spec(routing={"mode": "inferencePool"}),
    "unknown field": with_spec(replicaz=3),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_inputs_are_refused_by_the_api_server(installed, case):
    kc = installed
    r = subprocess.run([kc, "apply", "--dry-run=server", "--validate=strict", "-f", "-"],
                       input=yaml.safe_dump(BAD[case]), capture_output=True, text=True, timeout=60)
    assert r.returncode != 0, f"{case} was accepted: {r.stdout}"


def test_drift_is_repaired_and_a_fresh_resource_keeps_its_groups(installed):
    kc = installed
    obj = with_spec("drift", replicas=2, autoscaling={"enabled": True, "minReplicas": 1, "maxReplicas": 2,
                                                      "scaleDownStabilizationSeconds": 300})
    kubectl(kc, "apply", "-f", "-", input=yaml.safe_dump(obj))
    started = time.monotonic()

    def two_groups():
        out = kubectl(kc, "-n", NS, "get", "statefulsets", "-l", "shoal.dev/deployment=drift", "-o", "json")
        items = json.loads(out)["items"]
        return len(items) == 2 and items
    stss = wait_for("two groups", two_groups, timeout=120)
    # Defect 1: idle at creation must not scale down within the 300 s window.
    time.sleep(max(0.0, 60 - (time.monotonic() - started)))
    assert json.loads(kubectl(kc, "-n", NS, "get", "infd", "drift", "-o", "json"))["status"]["desiredReplicas"] == 2
    # Defect 2: a group scaled by hand and a Service with an extra selector label are put back.
    group = stss[0]["metadata"]["name"]
    kubectl(kc, "-n", NS, "scale", "statefulset", group, "--replicas=0")
    kubectl(kc, "-n", NS, "patch", "service", "drift", "--type=merge", "-p",
            json.dumps({"spec": {"selector": {"extra": "x"}}}))

    def repaired():
        sts = json.loads(kubectl(kc, "-n", NS, "get", "statefulset", group, "-o", "json"))
        svc = json.loads(kubectl(kc, "-n", NS, "get", "service", "drift", "-o", "json"))
        return sts["spec"]["replicas"] == 1 and "extra" not in svc["spec"]["selector"]
    wait_for("the drift to be repaired", repaired, timeout=120)
    kubectl(kc, "-n", NS, "delete", "infd", "drift", "--wait=true", "--timeout=300s", timeout=320)



def test_partition_stages_a_rollout(installed):
    kc = installed
    kubectl(kc, "apply", "-f", "-", input=yaml.safe_dump(with_spec("canary", replicas=2, rollout={"partition": 1})))
    kubectl(kc, "-n", NS, "wait", "--for=condition=Ready", "infd/canary", f"--timeout={int(TIMEOUT)}s",
            timeout=TIMEOUT + 10)
    kubectl(kc, "-n", NS, "patch", "infd", "canary", "--type=merge", "-p",
            json.dumps({"spec": {"model": {"revision": "canary-2"}}}))

    def staged():
        o = json.loads(kubectl(kc, "-n", NS, "get", "infd", "canary", "-o", "json"))
        st = o.get("status") or {}
        revs = [g["revision"] for g in st.get("groups") or [] if not g.get("terminating")]
        return (st.get("observedGeneration") == o["metadata"]["generation"]
                and condition(o, "Progressing").get("reason") == "PartitionReached"
                and sorted(r == st["revision"] for r in revs) == [False, True] and o)
    wait_for("one canary group beside one old group", staged)
    kubectl(kc, "-n", NS, "patch", "infd", "canary", "--type=merge", "-p",
            json.dumps({"spec": {"rollout": {"partition": 0}}}))
    kubectl(kc, "-n", NS, "wait", "--for=condition=Ready", "infd/canary", f"--timeout={int(TIMEOUT)}s",
            timeout=TIMEOUT + 10)
    o = json.loads(kubectl(kc, "-n", NS, "get", "infd", "canary", "-o", "json"))
    assert condition(o, "Progressing")["reason"] == "RolloutComplete"
    kubectl(kc, "-n", NS, "delete", "infd", "canary", "--wait=true", "--timeout=300s", timeout=320)


# ---------------------------------------------------------------- issue 20

def test_scale_to_zero_and_back_through_the_router(installed):
    """minReplicas 0: idle, the groups go; a request held by the router brings one back and is answered."""
    kc = installed
    obj = with_spec("zero", replicas=1,
                    autoscaling={"enabled": True, "minReplicas": 0, "maxReplicas": 1,
                                 "scaleDownStabilizationSeconds": 30},
                    routing={"mode": "shoal", "router": {"replicas": 1, "pendingTimeoutSeconds": int(TIMEOUT),
                                                         "resources": {"requests": {"cpu": "100m"}}}})
    kubectl(kc, "apply", "-f", "-", input=yaml.safe_dump(obj))

    def zero():
        o = json.loads(kubectl(kc, "-n", NS, "get", "infd", "zero", "-o", "json"))
        st = o.get("status") or {}
        stss = kubectl(kc, "-n", NS, "get", "statefulsets", "-l", "shoal.dev/deployment=zero", "-o", "name")
        return st.get("desiredReplicas") == 0 and not stss.strip() and o
    wait_for("scale to zero", zero)
    kubectl(kc, "-n", NS, "rollout", "status", "deployment/zero-router", "--timeout=300s", timeout=320)
    out = complete_through_service(kc, "zero", timeout=TIMEOUT)   # held, then answered by a new group
    assert out["choices"] and out["choices"][0]["text"]
    events = kubectl(kc, "-n", NS, "get", "events", "--field-selector", "involvedObject.name=zero", "-o", "json")
    assert "ScaledUp" in {e.get("reason") for e in json.loads(events)["items"]}
    kubectl(kc, "-n", NS, "delete", "infd", "zero", "--wait=true", "--timeout=300s", timeout=320)


def test_routing_mode_service_serves_through_a_plain_service(installed):
    kc = installed
    kubectl(kc, "apply", "-f", "-", input=yaml.safe_dump(with_spec("plain", routing={"mode": "service"})))
    kubectl(kc, "-n", NS, "wait", "--for=condition=Ready", "infd/plain", f"--timeout={int(TIMEOUT)}s",
            timeout=TIMEOUT + 10)
    svc = json.loads(kubectl(kc, "-n", NS, "get", "service", "plain", "-o", "json"))
    assert svc["spec"]["selector"] == {"shoal.dev/deployment": "plain", "apps.kubernetes.io/pod-index": "0"}
    assert not kubectl(kc, "-n", NS, "get", "deployments", "-l", "shoal.dev/deployment=plain", "-o", "name").strip()
    assert complete_through_service(kc, "plain")["choices"]
    kubectl(kc, "-n", NS, "delete", "infd", "plain", "--wait=true", "--timeout=300s", timeout=320)
