"""Render: every object validates against Kubernetes 1.30 (kubernetes-validate, strict); group shape."""

from __future__ import annotations

import json

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes.utils.quantity import parse_quantity

from shoal.operator import defaults, render
from shoal_op_helpers import ROOT, make_body

K8S_VERSION = "1.30.0"  # kubernetes-validate 1.37 ships 1.28 .. 1.37 schemas; 1.30 is the issue's target


def validate_k8s(obj):
    if obj["apiVersion"].startswith("monitoring.coreos.com/"):
        validate_monitor(obj)
    else:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


SCHEMAS = ROOT / "tests" / "operator" / "schemas"


def validate_monitor(obj):
    """prometheus-operator kinds are not in kubernetes-validate: they are validated against JSON
    schemas of ServiceMonitor/PodMonitor exported from cloudcoil-models-prometheus-operator (models
    generated from prometheus-operator's own CRDs), with unknown fields rejected. The schemas are
    stored in tests/operator/schemas/ (importing the models takes ~15 s); regenerate them with
    `Model.model_json_schema(by_alias=True)` plus `additionalProperties: false` on every object."""
    assert obj["kind"] in ("ServiceMonitor", "PodMonitor")
    schema = json.loads((SCHEMAS / f"{obj['kind'].lower()}.json").read_text())
    jsonschema.validate(obj, schema)


SPECS = {
    "cpu": {},
    "gpu-tp2-pp2": {"replicas": 3, "parallelism": {"tensor": 2, "pipeline": 2},
                    "resources": {"limits": {"nvidia.com/gpu": 1, "memory": "32Gi"}, "requests": {"cpu": "4"}},
                    "monitoring": {"serviceMonitor": True}},
    "hf": {"model": {"source": "hf://HuggingFaceTB/SmolLM2-135M-Instruct", "revision": "v1",
                     "tokenSecret": {"name": "hf"}}, "parallelism": {"pipeline": 3}},
    "pvc": {"model": {"source": "pvc://models/llama/8b"}, "podTemplate": {
        "nodeSelector": {"pool": "gpu"}, "env": [{"name": "X", "value": "1"}, {"name": "SHOAL_GROUP", "value": "no"}],
        "tolerations": [{"key": "gpu", "operator": "Exists"}], "metadata": {"labels": {"team": "a"}}}},
    "file": {"model": {"source": "file:///opt/models/tiny"}},
    "cpu-guaranteed": {"resources": {"requests": {"cpu": "2", "memory": "4Gi"}}, "parallelism": {"pipeline": 2},
                       "model": {"source": "hf://org/name"}},
    "hf-cache": {"model": {"source": "hf://org/name", "revision": "v2", "tokenSecret": {"name": "hf"},
                           "cache": {"enabled": True, "size": "40Gi", "storageClassName": "nfs"}},
                 "parallelism": {"pipeline": 2}, "podTemplate": {"nodeSelector": {"pool": "gpu"}}},
    "adapters": {"model": {"source": "pvc://models/llama/8b", "tokenSecret": {"name": "hf"}, "adapters": [
        {"name": "sql", "source": "hf://org/sql-lora"}, {"name": "chat", "source": "pvc://adapters/chat"},
        {"name": "same-claim", "source": "pvc://models/loras/x"}, {"name": "baked", "source": "file:///opt/a"}]},
        "parallelism": {"pipeline": 2}},
    "adapters-cache": {"model": {"source": "hf://org/name", "cache": {"enabled": True}, "adapters": [
        {"name": "sql", "source": "hf://org/sql-lora"}, {"name": "chat", "source": "pvc://adapters/chat"}]}},
}


@pytest.mark.parametrize("case", sorted(SPECS))
def test_every_rendered_object_validates_strict(case):
    objs = render.render_all(make_body(**SPECS[case]))
    assert objs
    for obj in objs:
        validate_k8s(obj)


def test_samples_render_and_validate(sample):
    sample["metadata"]["uid"] = "0000"
    for obj in render.render_all(sample):
        validate_k8s(obj)


def test_a_broken_monitor_fails_validation():
    sm = next(o for o in render.render_all(make_body(monitoring={"serviceMonitor": True}))
              if o["kind"] == "ServiceMonitor")
    sm["spec"]["endpoints"][0]["interval"] = "often"
    with pytest.raises(jsonschema.ValidationError):
        validate_monitor(sm)
    sm["spec"]["endpoints"][0]["interval"] = "15s"
    validate_monitor(sm)
    sm["spec"]["endpoints"][0]["bogus"] = 1
    with pytest.raises(jsonschema.ValidationError):
        validate_monitor(sm)


def test_a_broken_object_fails_validation():
    sts = render.render_all(make_body())[-1]
    sts["spec"]["template"]["spec"]["containers"][0]["bogus"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, K8S_VERSION, strict=True)


@pytest.mark.parametrize("replicas,tensor,pipeline", [(1, 1, 1), (2, 1, 3), (3, 2, 2), (2, 4, 1)])
def test_group_shape(replicas, tensor, pipeline):
    body = make_body(name="m", namespace="ns", replicas=replicas, parallelism={"tensor": tensor, "pipeline": pipeline},
                     resources={"limits": {"nvidia.com/gpu": 1}})
    objs = render.render_all(body)
    stss = [o for o in objs if o["kind"] == "StatefulSet"]
    assert len(stss) == replicas
    rev = render.revision_hash(defaults.apply_defaults(body))
    assert sorted(s["metadata"]["name"] for s in stss) == [f"m-{rev}-{i}" for i in range(replicas)]
    for sts in stss:
        group = sts["metadata"]["name"]
        spec = sts["spec"]
        assert spec["replicas"] == pipeline and spec["podManagementPolicy"] == "Parallel"
        assert spec["serviceName"] == "m-headless"
        pod = spec["template"]
        assert pod["metadata"]["labels"][render.L_GROUP] == group
        assert pod["metadata"]["labels"][render.L_REVISION] == rev
        c = pod["spec"]["containers"][0]
        env = {e["name"]: e for e in c["env"]}
        assert env["SHOAL_GROUP"]["value"] == group
        assert env["SHOAL_PIPELINE_SIZE"]["value"] == str(pipeline)
        assert env["SHOAL_TENSOR_SIZE"]["value"] == str(tensor)
        assert env["SHOAL_LEADER_ADDR"]["value"] == f"{group}-0.m-headless.ns.svc.cluster.local"
        assert env["SHOAL_DIST_PORT"]["value"] == str(render.DIST_PORT)
        # the rank is the pod index (pod `<group>-k` has rank k), via the downward API
        assert env["SHOAL_PIPELINE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == \
            "metadata.labels['apps.kubernetes.io/pod-index']"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == tensor
        args = c["args"]
        assert args[args.index("--tensor-parallel-size") + 1] == str(tensor)
        assert args[args.index("--pipeline-parallel-size") + 1] == str(pipeline)
        inits = [i["name"] for i in pod["spec"].get("initContainers", [])]
        assert ("wait-for-leader" in inits) == (pipeline > 1)
        shm = next(v for v in pod["spec"]["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": f"{2 * tensor}Gi"}


def test_no_gpus_unless_asked():
    c = render.render_all(make_body(parallelism={"tensor": 2}))[-1]["spec"]["template"]["spec"]["containers"][0]
    assert "limits" not in c["resources"] or "nvidia.com/gpu" not in c["resources"]["limits"]
    assert c["image"] == defaults.DEFAULT_IMAGE
    gpu = render.render_all(make_body(resources={"limits": {"nvidia.com/gpu": 1}}))[-1]
    assert gpu["spec"]["template"]["spec"]["containers"][0]["image"] == defaults.DEFAULT_GPU_IMAGE


def test_serve_args_match_the_runtime_contract(defaulted):
    body = defaulted(engine={"enablePrefixCaching": False, "schedulingPolicy": "priority", "drainTimeoutSeconds": 45})
    args = render.serve_args(body, "builtin://smollm2-135m-instruct")
    assert args[:2] == ["serve", "builtin://smollm2-135m-instruct"]
    for flag in ("--host", "--port", "--served-model-name", "--tensor-parallel-size", "--pipeline-parallel-size",
                 "--max-num-seqs", "--max-num-batched-tokens", "--max-model-len", "--block-size",
                 "--scheduling-policy", "--drain-timeout"):
        assert flag in args
    assert "--no-enable-prefix-caching" in args and args[args.index("--drain-timeout") + 1] == "45"
    assert args[args.index("--served-model-name") + 1] == "demo"
    pod = render.pod_template(body, "g")
    assert pod["spec"]["terminationGracePeriodSeconds"] >= 45 + render.PRESTOP_SLEEP_SECONDS


def test_probes_security_and_leader_services(defaulted):
    body = defaulted()
    pod = render.pod_template(body, "g")
    c = pod["spec"]["containers"][0]
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 600
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    traffic = render.traffic_service(defaulted(routing={"mode": "service"}))
    assert traffic["spec"]["selector"] == {"shoal.dev/deployment": "demo", "apps.kubernetes.io/pod-index": "0"}
    assert render.traffic_service(body)["spec"]["selector"] == {"shoal.dev/router": "demo"}   # mode shoal
    assert render.leaders_service(body)["spec"]["selector"] == traffic["spec"]["selector"]
    assert render.selector("demo") == "shoal.dev/deployment=demo,apps.kubernetes.io/pod-index=0"
    headless = render.headless_service(body)
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True


def test_model_sources(defaulted):
    plan = render.model_plan(defaulted(model={"source": "pvc://claim/sub/dir"})["spec"])
    assert plan["arg"] == "/models/sub/dir"
    assert plan["volumes"][0]["persistentVolumeClaim"] == {"claimName": "claim", "readOnly": True}
    assert plan["mounts"][0]["readOnly"] is True
    hf = render.model_plan(defaulted(model={"source": "hf://org/name", "tokenSecret": {"name": "s"}})["spec"])
    assert hf["arg"] == "/models/org/name" and hf["init"][0]["name"] == "fetch-model"
    env = {e["name"]: e for e in hf["init"][0]["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "s", "key": "token"}
    assert env["SHOAL_MODEL_REVISION"]["value"] == "main"
    assert render.model_plan(defaulted(model={"source": "file:///m/x"})["spec"])["arg"] == "/m/x"
    assert render.model_plan(defaulted()["spec"])["arg"] == "builtin://smollm2-135m-instruct"


def test_owner_references_on_everything():
    for obj in render.render_all(make_body(monitoring={"serviceMonitor": True})):
        (ref,) = obj["metadata"]["ownerReferences"]
        assert ref["uid"] == "uid-1" and ref["controller"] is True and ref["kind"] == "InferenceDeployment"
        for key in ("shoal.dev/deployment", "app.kubernetes.io/name", "app.kubernetes.io/instance"):
            assert key in obj["metadata"]["labels"]
    assert "ownerReferences" not in render.render_all(make_body(uid=None))[0]["metadata"]


def test_monitoring_modes():
    plain = render.render_all(make_body())
    assert not [o for o in plain if o["apiVersion"].startswith("monitoring")]
    ann = plain[-1]["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == "8000"
    assert ann["prometheus.io/path"] == "/metrics"
    mon = render.render_all(make_body(monitoring={"serviceMonitor": True, "labels": {"release": "prom"}}))
    kinds = {o["kind"]: o for o in mon}
    assert "prometheus.io/scrape" not in kinds["StatefulSet"]["spec"]["template"]["metadata"]["annotations"]
    sm, pm = kinds["ServiceMonitor"], kinds["PodMonitor"]
    assert sm["metadata"]["labels"]["release"] == "prom"
    # the leaders' Service: NAME-leaders in front of a router (mode shoal), NAME itself in mode service
    assert sm["spec"]["selector"]["matchLabels"] == {"shoal.dev/deployment": "demo", "shoal.dev/service": "leaders"}
    leaders = next(o for o in mon if o["kind"] == "Service" and o["metadata"]["name"] == "demo-leaders")
    assert sm["spec"]["selector"]["matchLabels"].items() <= leaders["metadata"]["labels"].items()
    plain_svc = render.service_monitor(defaults.apply_defaults(make_body(routing={"mode": "service"},
                                                                         monitoring={"serviceMonitor": True})))
    assert plain_svc["spec"]["selector"]["matchLabels"]["shoal.dev/service"] == "traffic"
    assert pm["spec"]["selector"]["matchLabels"] == {"shoal.dev/deployment": "demo"}
    for m, eps in ((sm, "endpoints"), (pm, "podMetricsEndpoints")):
        targets = {r["targetLabel"]: r["sourceLabels"] for r in m["spec"][eps][0]["relabelings"]}
        assert targets["inference_deployment"] == ["__meta_kubernetes_pod_label_shoal_dev_deployment"]
        assert targets["group"] == ["__meta_kubernetes_pod_label_shoal_dev_group"]


def test_revision_hash_covers_pod_fields_only(defaulted):
    base = render.revision_hash(defaulted())
    assert render.revision_hash(defaulted(replicas=5)) == base
    assert render.revision_hash(defaulted(autoscaling={"enabled": True, "maxReplicas": 3})) == base
    assert render.revision_hash(defaulted(rollout={"maxSurge": 3})) == base
    for change in ({"model": {"source": "builtin://smollm2-135m-instruct", "revision": "v2"}},
                   {"engine": {"maxNumSeqs": 8}}, {"image": "x:1"}, {"parallelism": {"tensor": 2}},
                   {"podTemplate": {"nodeSelector": {"a": "b"}}}):
        assert render.revision_hash(defaulted(**change)) != base, change
    assert len(base) == 8


def test_reserved_env_is_not_overridable(defaulted):
    body = defaulted(podTemplate={"env": [{"name": "SHOAL_GROUP", "value": "evil"}, {"name": "A", "value": "1"}]})
    env = render.pod_template(body, "g")["spec"]["containers"][0]["env"]
    assert [e["value"] for e in env if e["name"] == "SHOAL_GROUP"] == ["g"]
    assert {"name": "A", "value": "1"} in env


def test_worker_pods_get_the_drain_timeout(defaulted):
    # Issue 19, defect 4: a worker pod keeps serving after SIGTERM, bounded by the drain timeout.
    body = defaulted(parallelism={"pipeline": 2}, engine={"drainTimeoutSeconds": 90})
    sts = render.group_statefulset(body, render.revision_hash(body), 0)
    env = {e["name"]: e.get("value") for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["SHOAL_DRAIN_TIMEOUT"] == "90"
    assert sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > 90 + 10


def test_mig_slices_are_accelerators(defaulted):
    # Issue 19: nvidia.com/mig-* was not treated as an accelerator (CPU image, no per-rank count).
    body = defaulted(parallelism={"tensor": 2}, resources={"limits": {"nvidia.com/mig-3g.40gb": 2}})
    sts = render.group_statefulset(body, render.revision_hash(body), 0)
    c = sts["spec"]["template"]["spec"]["containers"][0]
    assert c["image"] == defaults.DEFAULT_GPU_IMAGE
    assert c["resources"]["limits"]["nvidia.com/mig-3g.40gb"] == 2
    validate_k8s(sts)


def test_least_privilege_pods(defaulted):
    # Issue 19: no API token, a read-only root with writable emptyDirs where the runtime writes.
    body = defaulted(model={"source": "hf://org/name"})
    pod = render.pod_template(body, "g")["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert "serviceAccountName" not in pod
    for c in pod["containers"] + pod["initContainers"]:
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
    mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    for path in ("/tmp", "/home/shoal", "/dev/shm"):
        assert "emptyDir" in volumes[mounts[path]], path
    fetch = next(c for c in pod["initContainers"] if c["name"] == "fetch-model")
    assert {"/tmp", "/models"} <= {m["mountPath"] for m in fetch["volumeMounts"]}


def test_a_group_network_policy_guards_the_rendezvous_port(defaulted):
    body = defaulted(replicas=2, parallelism={"pipeline": 2})
    objs = render.render_all(body)
    nps = [o for o in objs if o["kind"] == "NetworkPolicy"]
    stss = [o for o in objs if o["kind"] == "StatefulSet"]
    assert sorted(n["metadata"]["name"] for n in nps) == sorted(s["metadata"]["name"] for s in stss)
    for np_, sts in zip(sorted(nps, key=lambda o: o["metadata"]["name"]),
                        sorted(stss, key=lambda o: o["metadata"]["name"])):
        validate_k8s(np_)
        pods = sts["spec"]["template"]["metadata"]["labels"]
        sel = np_["spec"]["podSelector"]["matchLabels"]
        assert sel.items() <= pods.items()
        http, own = np_["spec"]["ingress"]
        assert http == {"ports": [{"protocol": "TCP", "port": render.HTTP_PORT}]}      # anyone: HTTP only
        assert own == {"from": [{"podSelector": {"matchLabels": sel}}]}             # the group: any port
        assert render.L_GROUP in sel


def test_placement_keeps_a_group_together_and_spreads_groups(defaulted):
    # Issue 19: pod affinity on the group label, groups spread, an opt-in scheduler and Kueue pod groups.
    body = defaulted(parallelism={"pipeline": 2}, placement={"colocateGroup": "Required",
                     "groupTopologyKey": "example.com/rack", "schedulerName": "gang",
                     "gangScheduling": "Kueue"},
                     podTemplate={"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                         "nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}]}}}})
    rev = render.revision_hash(body)
    sts = render.group_statefulset(body, rev, 0)
    validate_k8s(sts)
    group = sts["metadata"]["name"]
    tpl = sts["spec"]["template"]
    pod = tpl["spec"]
    (term,) = pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term == {"labelSelector": {"matchLabels": {render.L_GROUP: group}}, "topologyKey": "example.com/rack"}
    assert "nodeAffinity" in pod["affinity"]                       # the user's affinity is kept
    (spread,) = pod["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname" and spread["matchLabelKeys"] == [render.L_POD_INDEX]
    assert pod["schedulerName"] == "gang"
    assert tpl["metadata"]["labels"][render.L_KUEUE_GROUP] == group
    assert tpl["metadata"]["annotations"][render.A_KUEUE_COUNT] == "2"
    # defaults: preferred colocation within a zone, and a placement change is a new revision
    plain = defaulted(parallelism={"pipeline": 2})
    p = render.group_statefulset(plain, render.revision_hash(plain), 0)["spec"]["template"]["spec"]
    (pref,) = p["affinity"]["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert pref["podAffinityTerm"]["topologyKey"] == "topology.kubernetes.io/zone"
    assert "schedulerName" not in p
    assert render.revision_hash(plain) != rev
    off = defaulted(placement={"colocateGroup": "None", "spreadGroups": False})
    p = render.group_statefulset(off, render.revision_hash(off), 0)["spec"]["template"]["spec"]
    assert "affinity" not in p and "topologySpreadConstraints" not in p


def test_the_shared_model_cache(defaulted):
    # Issue 19: one PVC per deployment, filled once per revision by a Job, mounted read-only.
    body = defaulted(**SPECS["hf-cache"])
    objs = render.render_all(body)
    (pvc,) = [o for o in objs if o["kind"] == "PersistentVolumeClaim"]
    (job,) = [o for o in objs if o["kind"] == "Job"]
    assert pvc["metadata"]["name"] == "demo-model-cache"
    assert pvc["spec"] == {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "40Gi"}},
                           "storageClassName": "nfs"}
    key = render.model_cache_key(body["spec"])
    assert job["metadata"]["name"] == f"demo-fetch-{key}"
    jpod = job["spec"]["template"]["spec"]
    env = {e["name"]: e for e in jpod["containers"][0]["env"]}
    assert env["SHOAL_MODEL_DIR"]["value"] == f"/models/org/name/{key}" and "HF_TOKEN" in env
    assert jpod["volumes"][0]["persistentVolumeClaim"] == {"claimName": "demo-model-cache"}
    assert jpod["nodeSelector"] == {"pool": "gpu"}
    sts = next(o for o in objs if o["kind"] == "StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    assert "initContainers" not in pod or all(c["name"] != "fetch-model" for c in pod["initContainers"])
    vol = next(v for v in pod["volumes"] if v["name"] == "model-cache")
    assert vol["persistentVolumeClaim"] == {"claimName": "demo-model-cache", "readOnly": True}
    args = pod["containers"][0]["args"]
    assert args[1] == f"/models/org/name/{key}"
    # another revision: another key, so another Job and directory
    other = defaulted(**{**SPECS["hf-cache"], "model": {**SPECS["hf-cache"]["model"], "revision": "v3"}})
    assert render.model_cache_key(other["spec"]) != key


def test_volcano_gang_scheduling(defaulted):
    body = defaulted(parallelism={"pipeline": 3}, placement={"gangScheduling": "Volcano"})
    rev = render.revision_hash(body)
    objs = render.render_all(body)
    (pg,) = [o for o in objs if o["kind"] == "PodGroup"]
    sts = next(o for o in objs if o["kind"] == "StatefulSet")
    validate_k8s(sts)
    group = sts["metadata"]["name"]
    assert pg["apiVersion"] == "scheduling.volcano.sh/v1beta1" and pg["metadata"]["name"] == group
    assert pg["spec"] == {"minMember": 3} and pg["metadata"]["ownerReferences"][0]["kind"] == "InferenceDeployment"
    tpl = sts["spec"]["template"]
    assert tpl["metadata"]["annotations"][render.A_VOLCANO_GROUP] == group
    assert tpl["spec"]["schedulerName"] == "volcano"
    assert objs.index(pg) < objs.index(sts) and rev in group


@pytest.mark.parametrize("routing", [{}, {"mode": "service"},
                                     {"mode": "inferencePool", "inferencePool": {"endpointPicker": {"name": "e"}}}])
@pytest.mark.parametrize("monitor", [False, True])
def test_desired_is_what_the_controller_writes_and_removes(defaulted, routing, monitor):
    """Every routing and monitor object is either rendered or listed absent, never both; a
    group's objects end with its StatefulSet, named as status and the rollout expect."""
    body = defaulted(routing=routing, monitoring={"serviceMonitor": monitor})
    d = render.desired(body)
    rendered = {(o["apiVersion"], o["kind"], o["metadata"]["name"]) for o in d.shared}
    optional = {(api, kind, "demo" + suffix) for api, kind, suffix in render.ROUTING_KINDS} | {
        ("monitoring.coreos.com/v1", "ServiceMonitor", "demo"), ("monitoring.coreos.com/v1", "PodMonitor", "demo-pods")}
    assert not rendered & set(d.absent) and optional <= rendered | set(d.absent)
    assert render.render_all(body) == d.shared + d.group(0)
    *companions, sts = d.group(2)
    assert sts["kind"] == "StatefulSet" and sts["metadata"]["name"] == f"demo-{d.revision}-2"
    assert {c["metadata"]["name"] for c in companions} == {sts["metadata"]["name"]}
    assert (d.url is None) == (routing.get("mode") == "inferencePool")
    assert (d.router is not None) == (routing.get("mode") is None)


def pod_qos(pod_spec: dict) -> str:
    """The pod's QoS class as Kubernetes computes it: the API server's defaulting (a container's
    missing cpu/memory request takes its limit, init containers too), then GetPodQOS
    (pkg/apis/core/v1/helper/qos/qos.go), transcribed; quantities parsed by the kubernetes client."""
    requests: dict = {}
    limits: dict = {}
    guaranteed = True
    for c in pod_spec["containers"] + pod_spec.get("initContainers", []):
        res = c.get("resources") or {}
        lim = {k: parse_quantity(v) for k, v in (res.get("limits") or {}).items() if k in ("cpu", "memory")}
        req = {**lim, **{k: parse_quantity(v) for k, v in (res.get("requests") or {}).items() if k in ("cpu", "memory")}}
        for k, v in req.items():
            if v > 0:
                requests[k] = requests.get(k, 0) + v
        found = set()
        for k, v in lim.items():
            if v > 0:
                found.add(k)
                limits[k] = limits.get(k, 0) + v
        guaranteed = guaranteed and {"cpu", "memory"} <= found
    if not requests and not limits:
        return "BestEffort"
    if guaranteed and all(k in limits and limits[k] == v for k, v in requests.items()) and len(requests) == len(limits):
        return "Guaranteed"
    return "Burstable"


def group_pod(objs: list) -> dict:
    return next(o for o in objs if o["kind"] == "StatefulSet")["spec"]["template"]["spec"]


@pytest.mark.parametrize("resources,qos", [
    ({"requests": {"cpu": "2", "memory": "4Gi"}}, "Guaranteed"),            # limits follow the requests
    ({"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"cpu": "500m"}}, "Guaranteed"),
    ({"limits": {"cpu": 2, "memory": "4Gi"}}, "Guaranteed"),                # requests default to limits
    ({"requests": {"cpu": "2"}}, "Burstable"),                               # no memory: cannot be
    ({"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "4Gi"}}, "Burstable"),   # the user's limit
    ({}, "BestEffort"),
])
@pytest.mark.parametrize("source,pipeline", [("builtin://smollm2-135m-instruct", 1), ("hf://org/name", 2)])
def test_cpu_pods_are_guaranteed_where_the_spec_gives_requests(resources, qos, source, pipeline):
    """Issue 32: a CPU pod gets a limit equal to each cpu/memory request it has no limit for; its
    init containers (fetch-model, wait-for-leader) follow, as Kubernetes counts them in the class."""
    objs = render.render_all(make_body(resources=resources, model={"source": source},
                                       parallelism={"pipeline": pipeline}))
    pod = group_pod(objs)
    assert len(pod.get("initContainers", [])) == (source.startswith("hf://") + (pipeline > 1))
    assert pod_qos(pod) == qos
    main = pod["containers"][0]["resources"]
    for key, value in (resources.get("requests") or {}).items():
        assert main["requests"][key] == value and main["limits"][key] == (resources.get("limits") or {}).get(key, value)
    for obj in objs:
        validate_k8s(obj)


def test_gpu_pods_and_routers_keep_the_resources_given():
    spec = {"resources": {"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"nvidia.com/gpu": 1}},
            "routing": {"router": {"resources": {"requests": {"cpu": "250m", "memory": "512Mi"}}}}}
    objs = render.render_all(make_body(**spec))
    assert group_pod(objs)["containers"][0]["resources"] == {
        "requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"nvidia.com/gpu": 1}}
    router = next(o for o in objs if o["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert router["containers"][0]["resources"] == {"requests": {"cpu": "250m", "memory": "512Mi"}}
    assert pod_qos(group_pod(objs)) == "Burstable"


def test_the_cpu_samples_are_guaranteed():
    for name in ("smollm2-cpu.yaml", "smollm2-scale-to-zero.yaml"):
        sample = yaml.safe_load((ROOT / "manifests" / "samples" / name).read_text())
        pod = group_pod(render.render_all(sample))
        assert pod_qos(pod) == "Guaranteed", name
        assert pod["containers"][0]["resources"]["limits"]["cpu"] == "1"   # a whole CPU: an exclusive core


# ---------------------------------------------------------------- LoRA adapters (issue 31)

ADAPTERS = [{"name": "sql", "source": "hf://org/sql-lora"}, {"name": "chat", "source": "pvc://adapters/chat/v2"},
            {"name": "same-claim", "source": "pvc://models/loras/x"}, {"name": "baked", "source": "file:///opt/a"}]


def runtime_args(pod: dict) -> "argparse.Namespace":
    """The pod's arguments as `shoal serve` itself parses them (the runtime's own parser)."""
    import argparse

    from shoal.runtime.entrypoints import serve_args

    parser = argparse.ArgumentParser()
    serve_args.add_arguments(parser)
    args = pod["spec"]["containers"][0]["args"]
    assert args[0] == "serve"
    return parser.parse_args(args[1:])


def mounted(pod: dict, path: str) -> dict | None:
    """The container mount that holds `path`, if any."""
    for m in pod["spec"]["containers"][0]["volumeMounts"]:
        if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/"):
            return m
    return None


def test_adapters_reach_the_runtime_through_its_own_flags(defaulted):
    body = defaulted(model={"source": "pvc://models/llama/8b", "adapters": ADAPTERS},
                     engine={"extraArgs": ["--max-loras", "4"]})
    pod = render.pod_template(body, "g")
    args = runtime_args(pod)
    assert args.enable_lora and args.max_loras == 4
    paths = {m["name"]: m["path"] for m in args.lora_modules}
    assert set(paths) == {"sql", "chat", "same-claim", "baked"}
    assert paths["baked"] == "/opt/a" and mounted(pod, "/opt/a") is None     # in the image
    for name in ("sql", "chat", "same-claim"):                               # on a read-only volume of the pod
        m = mounted(pod, paths[name])
        assert m and m["readOnly"], name
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    # the model's own claim serves an adapter on it; another claim is mounted for its adapter
    assert volumes[mounted(pod, paths["same-claim"])["name"]]["persistentVolumeClaim"]["claimName"] == "models"
    assert volumes[mounted(pod, paths["chat"])["name"]]["persistentVolumeClaim"] == {"claimName": "adapters",
                                                                                    "readOnly": True}
    assert paths["chat"].endswith("/chat/v2")
    # hf:// without the shared cache: downloaded at pod start into the volume it is read from
    fetch = next(ic for ic in pod["spec"]["initContainers"] if ic["name"] == "fetch-adapters")
    env = {e["name"]: e.get("value") for e in fetch["env"]}
    assert env["SHOAL_ADAPTER_REPOS"] == "org/sql-lora"
    target = next(m for m in fetch["volumeMounts"] if m["name"] == mounted(pod, paths["sql"])["name"])
    assert paths["sql"] == target["mountPath"] + "/org/sql-lora" and not target.get("readOnly")


def test_no_adapter_field_no_lora(defaulted):
    args = runtime_args(render.pod_template(defaulted(), "g"))
    assert not args.enable_lora and not args.lora_modules
    args = runtime_args(render.pod_template(defaulted(model={"source": "hf://o/m", "adapters": []}), "g"))
    assert args.enable_lora and not args.lora_modules


def test_the_adapter_list_is_not_part_of_the_revision(defaulted):
    def with_adapters(adapters):
        return defaulted(model={"source": "pvc://models/llama/8b", "adapters": adapters})
    empty = with_adapters([])
    rev = render.revision_hash(empty)
    for adapters in (ADAPTERS[:1], ADAPTERS, ADAPTERS[::-1], [{"name": "sql", "source": "hf://org/other"}]):
        body = with_adapters(adapters)
        assert render.revision_hash(body) == rev, adapters
        # the StatefulSet's template follows the list (OnDelete: no pod is replaced; a group's next start has it)
        assert render.group_statefulset(body, rev, 0) != render.group_statefulset(empty, rev, 0)
    # turning LoRA on or off is a pod change: a new revision
    assert render.revision_hash(defaulted(model={"source": "pvc://models/llama/8b"})) != rev
    assert render.revision_hash(defaulted(model={"source": "pvc://models/llama/9b", "adapters": ADAPTERS})) != rev


def test_adapters_through_the_shared_cache(defaulted):
    body = defaulted(model={"source": "hf://org/name", "cache": {"enabled": True}, "tokenSecret": {"name": "hf"},
                            "adapters": [{"name": "sql", "source": "hf://org/sql-lora"}]})
    want = render.desired(body)
    (plan,) = want.adapters
    pod = render.pod_template(body, "g")
    # not among the flags a pod starts with (its Job may still download): the operator loads it
    args = runtime_args(pod)
    assert args.enable_lora and not args.lora_modules
    assert mounted(pod, plan["path"])["name"] == "model-cache" and render.adapter_on_pod(plan, pod)
    job = want.adapter_fetch_job(plan)
    validate_k8s(job)
    env = {e["name"]: e.get("value") for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["SHOAL_MODEL_DIR"] == plan["path"] and env["SHOAL_MODEL_REPO"] == "org/sql-lora"
    assert env["SHOAL_MODEL_REVISION"] == "main"
    assert "HF_TOKEN" in env
    assert job["metadata"]["name"] != want.fetch_job()["metadata"]["name"]   # its own directory, its own Job
    assert plan["path"] != render.model_plan(body["spec"], "demo")["arg"]


def test_whether_a_running_pod_has_an_adapters_files(defaulted):
    old = render.pod_template(defaulted(model={"source": "pvc://models/llama/8b", "adapters": ADAPTERS[:1]}), "g")
    body = defaulted(model={"source": "pvc://models/llama/8b", "adapters": ADAPTERS})
    new = render.pod_template(body, "g")
    plans = {p["name"]: p for p in render.adapter_plans(body["spec"])}
    assert [n for n in plans if render.adapter_on_pod(plans[n], old)] == ["sql", "same-claim", "baked"]
    assert all(render.adapter_on_pod(p, new) for p in plans.values())


def test_a_pod_without_lora_loads_no_adapter(defaulted):
    # a group of the revision before `adapters` was added: the rollout replaces it, nothing is loaded there
    body = defaulted(model={"source": "pvc://models/llama/8b", "adapters": ADAPTERS})
    before = render.pod_template(defaulted(model={"source": "pvc://models/llama/8b"}), "g")
    assert not any(render.adapter_on_pod(p, before) for p in render.adapter_plans(body["spec"]))
