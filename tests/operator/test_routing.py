"""spec.routing: what stands in front of the groups (issue 20, the operator's half).

- the CRD: defaults, the CEL rules (run by cel-python, as in test_crd.py) and validate.py
  agreeing on scale-to-zero and the endpoint picker;
- render: every routing object validates (kubernetes-validate strict; the InferencePool
  against the Gateway API inference extension's v1 schema, vendored in schemas/ with its
  CEL rules; the PodMonitor against prometheus-operator's), and the selectors pick the
  pods they must (checked against the rendered pod templates' own labels);
- the autoscaler's scale to zero and back (pure), and the controller doing it on the
  routers' shoal_router_pending_requests, written by prometheus_client itself;
- a mode switch deletes the old mode's objects.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from shoal.operator import autoscale, defaults, render, scrape, validate
from shoal.operator import controller as ctl
from shoal_op_helpers import FakeKube, make_body
from test_crd import cel_errors, validate_resource
from test_render import SCHEMAS, validate_k8s

celpy = pytest.importorskip("celpy", reason="cel-python evaluates the CEL rules")

POOL = {"mode": "inferencePool", "inferencePool": {"endpointPicker": {"name": "epp"}}}


def body(**spec):
    return defaults.apply_defaults(make_body(**spec))


def by_kind_name(objs):
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def selects(selector: dict, labels: dict) -> bool:
    return selector.items() <= labels.items()


def leader_pod_labels(b: dict, index: int = 0) -> dict:
    """A group pod's labels as the StatefulSet controller sets them (template + pod index)."""
    sts = next(o for o in render.render_all(b) if o["kind"] == "StatefulSet")
    return {**sts["spec"]["template"]["metadata"]["labels"], render.L_POD_INDEX: str(index)}


# ---------------------------------------------------------------- the CRD

def test_routing_defaults():
    r = body()["spec"]["routing"]
    assert r["mode"] == "shoal"
    assert r["router"] == {"replicas": 2, "maxPending": 256, "pendingTimeoutSeconds": 60}
    validate_resource(make_body())


@pytest.mark.parametrize("mode", ["shoal", "service"])
def test_modes_pass(mode):
    validate_resource(make_body(routing={"mode": mode}))
    assert validate.problems(body(routing={"mode": mode})) == []


def test_inference_pool_needs_an_endpoint_picker():
    validate_resource(make_body(routing=POOL))
    assert body(routing=POOL)["spec"]["routing"]["inferencePool"]["endpointPicker"] == {
        "name": "epp", "port": 9002, "failureMode": "FailClose"}
    bad = make_body(routing={"mode": "inferencePool"})
    with pytest.raises(jsonschema.ValidationError, match="endpointPicker"):
        validate_resource(bad)
    assert any("endpointPicker" in p for p in validate.problems(defaults.apply_defaults(bad)))


@pytest.mark.parametrize("routing", [{"mode": "shoal"}, {}])
def test_scale_to_zero_with_a_router(routing):
    spec = {"autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 4}, "routing": routing}
    validate_resource(make_body(**spec))
    assert validate.problems(body(**spec)) == []


@pytest.mark.parametrize("routing", [{"mode": "service"}, POOL])
def test_scale_to_zero_without_a_router_is_refused(routing):
    spec = {"autoscaling": {"enabled": True, "minReplicas": 0}, "routing": routing}
    with pytest.raises(jsonschema.ValidationError, match="minReplicas 0 needs routing.mode shoal"):
        validate_resource(make_body(**spec))
    assert any("minReplicas 0 needs routing.mode shoal" in p for p in validate.problems(body(**spec)))


@pytest.mark.parametrize("routing", [
    {"mode": "nginx"},
    {"router": {"replicas": 0}},
    {"router": {"prefixWeight": -1}},
    {"router": {"pendingTimeoutSeconds": 0}},
    {"router": {"resources": {"limits": {"memory": "-1Gi"}}}},
    {"router": {"weights": 1}},
    {"mode": "inferencePool", "inferencePool": {"endpointPicker": {"port": 9002}}},
    {"mode": "inferencePool", "inferencePool": {"endpointPicker": {"name": "e", "failureMode": "Maybe"}}},
])
def test_bad_routing_fails(routing):
    with pytest.raises(jsonschema.ValidationError):
        validate_resource(make_body(routing=routing))


# ---------------------------------------------------------------- render

CASES = {
    "shoal": {},
    "shoal-tuned": {"routing": {"router": {"replicas": 3, "prefixWeight": 0.7, "loadWeight": 1.5,
                                           "sessionHeader": "x-session-id", "maxPending": 32,
                                           "pendingTimeoutSeconds": 600,
                                           "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}}}},
                    "monitoring": {"serviceMonitor": True}, "podTemplate": {"imagePullSecrets": [{"name": "r"}]}},
    "shoal-hf": {"model": {"source": "hf://org/m", "revision": "v3", "tokenSecret": {"name": "hf"}}},
    "shoal-pvc": {"model": {"source": "pvc://models/llama/8b"}, "resources": {"limits": {"nvidia.com/gpu": 1}}},
    "service": {"routing": {"mode": "service"}, "monitoring": {"serviceMonitor": True}},
    "pool": {"routing": POOL, "monitoring": {"serviceMonitor": True}},
}


def validate_pool(obj):
    """The InferencePool against the v1 CRD's schema, with its defaults and CEL rules as the API server runs them."""
    schema = json.loads((SCHEMAS / "inferencepool.json").read_text())
    jsonschema.validate(obj, schema)
    spec_schema = schema["properties"]["spec"]
    errors = cel_errors(defaults.apply_defaults(obj["spec"], spec_schema), spec_schema)
    if errors:
        raise jsonschema.ValidationError("; ".join(errors))


def validate_any(obj):
    if obj["kind"] == "InferencePool":
        validate_pool(obj)
    else:
        validate_k8s(obj)


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_routing_object_validates(case):
    objs = render.render_all(make_body(**CASES[case]))
    for obj in objs:
        validate_any(obj)
    names = by_kind_name(objs)
    mode = case.split("-")[0]
    assert (("Deployment", "demo-router") in names) == (mode == "shoal")
    assert (("Service", "demo") in names) == (mode != "pool")
    assert (("Service", "demo-leaders") in names) == (mode != "service")
    assert (("InferencePool", "demo") in names) == (mode == "pool")
    assert all(o["metadata"]["ownerReferences"][0]["uid"] == "uid-1" for o in objs)


def test_a_broken_inference_pool_fails_its_schema():
    pool = render.inference_pool(body(routing=POOL))
    validate_pool(pool)
    for breakage in (lambda p: p["spec"]["targetPorts"].clear(),
                     lambda p: p["spec"]["targetPorts"].append({"number": 8000}),      # CEL: unique
                     lambda p: p["spec"]["endpointPickerRef"].pop("port"),             # CEL: Service needs a port
                     lambda p: p["spec"].update(selector={"matchExpressions": []}),
                     lambda p: p["spec"]["endpointPickerRef"].update(portNumber=9002),  # the pre-v1 field
                     lambda p: p["spec"]["selector"]["matchLabels"].update({"bad key!": "x"})):
        broken = json.loads(json.dumps(pool))
        breakage(broken)
        with pytest.raises(jsonschema.ValidationError):
            validate_pool(broken)


def test_the_router_deployment():
    b = body(**CASES["shoal-tuned"])
    dep = render.router_deployment(b)
    pod = dep["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    args = c["args"]
    assert c["command"] == ["shoal"] and args[0] == "router"

    def flag(name):
        return args[args.index(name) + 1]
    assert flag("--backends-from-dns") == "demo-leaders.default.svc.cluster.local:8000"
    assert flag("--host") == "0.0.0.0" and flag("--port") == "8000"
    assert flag("--model") == "builtin://smollm2-135m-instruct"   # the same MODEL argument as `shoal serve`
    assert flag("--served-model-name") == "demo"
    assert flag("--prefix-weight") == "0.7" and flag("--load-weight") == "1.5"
    assert flag("--session-header") == "x-session-id"
    assert flag("--max-pending") == "32" and flag("--pending-timeout") == "600"
    serve = render.pod_template(b, "g")["spec"]["containers"][0]
    assert c["image"] == serve["image"]                       # one image for the runtime and the router
    assert dep["spec"]["replicas"] == 3
    assert c["resources"] == {"requests": {"cpu": "500m", "memory": "1Gi"}}
    assert c["startupProbe"]["httpGet"]["path"] == "/health" and c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["securityContext"] == serve["securityContext"]  # non-root, read-only root, no capabilities
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert {m["mountPath"] for m in c["volumeMounts"]} >= {"/tmp", "/home/shoal"}
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert pod["spec"]["imagePullSecrets"] == [{"name": "r"}]
    assert pod["spec"]["terminationGracePeriodSeconds"] >= 600   # a held request may wait that long
    assert selects(dep["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
    # weights left unset: the router's own defaults, no flag
    plain = render.router_deployment(body())["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not {"--prefix-weight", "--load-weight", "--session-header"} & set(plain)


def test_router_model_files():
    hf = render.router_deployment(body(**CASES["shoal-hf"]))["spec"]["template"]["spec"]
    (init,) = hf["initContainers"]
    assert init["name"] == "fetch-tokenizer" and "allow_patterns" in init["command"][-1]
    env = {e["name"]: e for e in init["env"]}
    assert env["SHOAL_MODEL_REPO"]["value"] == "org/m" and env["SHOAL_MODEL_REVISION"]["value"] == "v3"
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "hf"
    args = hf["containers"][0]["args"]
    serve_args = render.pod_template(body(**CASES["shoal-hf"]), "g")["spec"]["containers"][0]["args"]
    assert args[args.index("--model") + 1] == serve_args[1] == "/models/org/m"
    pvc = render.router_deployment(body(**CASES["shoal-pvc"]))["spec"]["template"]["spec"]
    assert pvc["volumes"][-1]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert pvc["containers"][0]["args"][pvc["containers"][0]["args"].index("--model") + 1] == "/models/llama/8b"
    assert "nvidia.com/gpu" not in json.dumps(pvc["containers"][0]["resources"])   # no accelerator for the router
    # compiled as Python: the script the init container runs
    compile(init["command"][-1], "fetch-tokenizer", "exec")


def test_selectors_pick_the_right_pods():
    b = body(monitoring={"serviceMonitor": True})
    objs = by_kind_name(render.render_all(b))
    router_pod = objs[("Deployment", "demo-router")]["spec"]["template"]["metadata"]["labels"]
    leader, worker = leader_pod_labels(b, 0), leader_pod_labels(b, 1)
    traffic, leaders = objs[("Service", "demo")], objs[("Service", "demo-leaders")]
    assert selects(traffic["spec"]["selector"], router_pod) and not selects(traffic["spec"]["selector"], leader)
    assert leaders["spec"]["clusterIP"] == "None" and not leaders["spec"].get("publishNotReadyAddresses")
    assert selects(leaders["spec"]["selector"], leader)
    assert not selects(leaders["spec"]["selector"], worker) and not selects(leaders["spec"]["selector"], router_pod)
    # one PodDisruptionBudget per pod: a pod under two cannot be evicted at all
    pdbs = [o for o in objs.values() if o["kind"] == "PodDisruptionBudget"]
    for pod in (router_pod, leader, worker):
        assert sum(selects(p["spec"]["selector"]["matchLabels"], pod) for p in pdbs) == 1
    # the groups' spread constraint and the headless Service see no router pod
    assert not selects(objs[("Service", "demo-headless")]["spec"]["selector"], router_pod)
    rpm = objs[("PodMonitor", "demo-router")]
    assert selects(rpm["spec"]["selector"]["matchLabels"], router_pod)
    assert not selects(objs[("PodMonitor", "demo-pods")]["spec"]["selector"]["matchLabels"], router_pod)


def test_the_inference_pool_selects_the_leaders():
    b = body(routing={"mode": "inferencePool",
                      "inferencePool": {"endpointPicker": {"name": "epp", "port": 9100, "failureMode": "FailOpen"}}})
    pool = render.inference_pool(b)
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert selects(pool["spec"]["selector"]["matchLabels"], leader_pod_labels(b, 0))
    assert not selects(pool["spec"]["selector"]["matchLabels"], leader_pod_labels(b, 1))
    assert pool["spec"]["targetPorts"] == [{"number": render.HTTP_PORT}]
    assert pool["spec"]["endpointPickerRef"] == {"kind": "Service", "name": "epp", "port": {"number": 9100},
                                                 "failureMode": "FailOpen"}


@pytest.mark.parametrize("spec", [{}, {"monitoring": {"serviceMonitor": True}}, {"routing": {"mode": "service"}},
                                  {"routing": POOL}])
def test_absent_objects_are_exactly_the_other_modes(spec):
    b = body(**spec)
    rendered = {(o["kind"], o["metadata"]["name"]) for o in render.routing_objects(b)}
    absent = {(k, n) for _, k, n in render.routing_objects_absent(b)}
    every = {(k, "demo" + s) for _, k, s in render.ROUTING_KINDS}
    assert not rendered & absent and rendered | absent == every


# ---------------------------------------------------------------- autoscale

AUTO = {"minReplicas": 0, "maxReplicas": 4, "targetQueueDepth": 10, "scaleUpStabilizationSeconds": 30,
        "scaleDownStabilizationSeconds": 300}


def test_wakes_from_zero_on_held_requests_at_once():
    idle = autoscale.decide(now=1000, current=0, loads=[], config=AUTO, state={}, pending=0)
    assert (idle.replicas, idle.direction) == (0, "hold")
    woke = autoscale.decide(now=1010, current=0, loads=[], config=AUTO, state=idle.state, pending=3)
    assert (woke.replicas, woke.direction) == (1, "up") and "held by the router" in woke.reason
    # with minReplicas above 0 (a CEL rule keeps 0 to mode shoal) waking goes to minReplicas
    assert autoscale.decide(now=0, current=0, loads=[], config={**AUTO, "minReplicas": 2}, pending=1).replicas == 2


def test_back_to_zero_after_the_scale_down_window_without_traffic():
    state = autoscale.decide(now=0, current=0, loads=[], config=AUTO, pending=2).state   # woke: 1 group
    t, current = 0.0, 1
    while t < 400:
        t += 10
        d = autoscale.decide(now=t, current=current, loads=[0.0], config=AUTO, state=state, pending=0)
        current, state = d.replicas, d.state
        if current == 0:
            break
    assert current == 0 and t >= AUTO["scaleDownStabilizationSeconds"]


def test_held_requests_keep_a_group():
    state = autoscale.decide(now=0, current=1, loads=[0.0], config=AUTO, pending=0).state
    d = autoscale.decide(now=1000, current=1, loads=[0.0], config=AUTO, state=state, pending=5)
    assert d.replicas == 1 and d.raw == 1


# ---------------------------------------------------------------- the controller

def router_metrics(pending: float) -> str:
    """The router's /metrics as prometheus_client writes them (the router uses the same library)."""
    reg = CollectorRegistry()
    Gauge("shoal_router_pending_requests", "requests held for want of a ready group", registry=reg).set(pending)
    return generate_latest(reg).decode()


def test_pending_requests_parse():
    assert scrape.pending_requests(router_metrics(7)) == 7
    assert scrape.pending_requests("# TYPE other gauge\nother 3\n") == 0


class Clock:
    t = 1_000_000.0

    def __call__(self):
        return self.t


def put(kube, **spec):
    b = make_body(**spec)
    b["metadata"]["generation"] = 1
    kube.put(b)
    return b


def status(kube):
    return kube.objects[("InferenceDeployment", "default", "demo")]["status"]


def test_scale_from_zero_and_back_through_the_router():
    kube, clock, held = FakeKube(), Clock(), {"n": 0.0}
    seen = []

    def fetch(url):
        seen.append(url)
        if url.startswith("http://10.9.9.9:"):   # the router pods' IP (below)
            return router_metrics(held["n"])
        return "# TYPE shoal_num_requests_running gauge\nshoal_num_requests_running 0\n"
    c = ctl.Controller(kube, clock=clock, fetch=fetch)
    put(kube, autoscaling={"enabled": True, "minReplicas": 0, "maxReplicas": 3, "targetQueueDepth": 10,
                           "scaleDownStabilizationSeconds": 60}, replicas=0)
    c.trigger("default", "demo")
    kube.run_statefulsets(ip="10.9.9.9", router_pods=True)
    c.trigger("default", "demo", scrape=True)
    st = status(kube)
    assert st["desiredReplicas"] == 0 and kube.of_kind("StatefulSet") == {}
    assert st["router"] == {"readyReplicas": 2, "pendingRequests": 0}
    assert {x["type"]: x["status"] for x in st["conditions"]}["Ready"] == "True"   # scaled to zero, router up

    held["n"] = 4.0
    clock.t += 10
    c.trigger("default", "demo", scrape=True)
    st = status(kube)
    assert st["desiredReplicas"] == 1 and len(kube.of_kind("StatefulSet")) == 1
    assert st["router"]["pendingRequests"] == 8   # two router pods, 4 each
    assert any(u.startswith("http://10.9.9.9:8000/metrics") for u in seen)

    held["n"] = 0.0
    kube.run_statefulsets(ip="10.0.0.1")
    for _ in range(8):   # 80 s of idle rounds > the 60 s window
        clock.t += 10
        c.trigger("default", "demo", scrape=True)
    assert status(kube)["desiredReplicas"] == 0 and kube.of_kind("StatefulSet") == {}


def test_router_not_ready_means_not_ready():
    kube, clock = FakeKube(), Clock()
    c = ctl.Controller(kube, clock=clock, fetch=lambda url: "")
    put(kube)
    c.trigger("default", "demo")
    kube.run_statefulsets()
    kube.objects[("Deployment", "default", "demo-router")]["status"] = {"readyReplicas": 0}
    c.trigger("default", "demo")
    ready = next(x for x in status(kube)["conditions"] if x["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "RouterUnavailable")
    kube.run_statefulsets()
    c.trigger("default", "demo")
    assert next(x for x in status(kube)["conditions"] if x["type"] == "Ready")["status"] == "True"


def test_a_mode_switch_deletes_the_old_modes_objects():
    kube, clock = FakeKube(), Clock()
    c = ctl.Controller(kube, clock=clock, fetch=lambda url: "")
    b = put(kube)
    c.trigger("default", "demo")
    assert set(kube.of_kind("Deployment")) == {"demo-router"}
    assert {"demo", "demo-leaders", "demo-headless"} == set(kube.of_kind("Service"))
    assert status(kube)["url"] == "http://demo.default.svc.cluster.local:8000"

    for routing, deployments, services, pools in (
            (POOL, set(), {"demo-leaders", "demo-headless"}, {"demo"}),
            ({"mode": "service"}, set(), {"demo", "demo-headless"}, set()),
            ({"mode": "shoal"}, {"demo-router"}, {"demo", "demo-leaders", "demo-headless"}, set())):
        b["spec"]["routing"] = routing
        b["metadata"]["generation"] += 1
        kube.put(b)
        c.trigger("default", "demo")          # an event round: what this process applied goes at once
        assert set(kube.of_kind("Deployment")) == deployments, routing
        assert set(kube.of_kind("Service")) == services, routing
        assert set(kube.of_kind("InferencePool")) == pools, routing
        assert set(kube.of_kind("PodDisruptionBudget")) == {"demo"} | ({"demo-router"} if deployments else set())
        st = status(kube)
        assert ("router" in st) == bool(deployments)
        assert ("url" in st) == (routing["mode"] != "inferencePool")
        traffic = kube.objects.get(("Service", "default", "demo"))
        if traffic:
            want = render.router_selector_labels("demo") if deployments else render.leader_selector_labels("demo")
            assert traffic["spec"]["selector"] == want


def test_a_timer_round_deletes_what_another_process_applied():
    """After an operator restart the applied-hash memory is empty: the timer finds the old mode's objects."""
    kube, clock = FakeKube(), Clock()
    put(kube)
    ctl.Controller(kube, clock=clock, fetch=lambda url: "").trigger("default", "demo")
    b = kube.objects[("InferenceDeployment", "default", "demo")]
    b["spec"]["routing"] = {"mode": "service"}
    fresh = ctl.Controller(kube, clock=clock, fetch=lambda url: "")
    fresh.trigger("default", "demo")
    assert "demo-router" in kube.of_kind("Deployment")      # an event round trusts its (empty) memory
    fresh.trigger("default", "demo", scrape=True)
    assert kube.of_kind("Deployment") == {} and "demo-leaders" not in kube.of_kind("Service")
    assert kube.objects[("Service", "default", "demo")]["spec"]["selector"] == render.leader_selector_labels("demo")
