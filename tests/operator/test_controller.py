"""The controller's reconcile against an in-memory API (FakeKube plays the API server,
the StatefulSet controller and the garbage collector): group restarts, autoscaling
through the timer path, status, metrics."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from shoal.operator import controller as ctl
from shoal.operator import operator_metrics as metrics
from shoal.operator import render, scrape
from shoal_op_helpers import FakeKube, make_body

METRICS = """# TYPE shoal_num_requests_running gauge
shoal_num_requests_running{model_name="m"} %d
# TYPE shoal_num_requests_waiting gauge
shoal_num_requests_waiting{model_name="m"} %d
shoal_num_requests_waiting{model_name="other"} 1
"""


class Clock:
    def __init__(self):
        self.t = 1_000_000.0

    def __call__(self):
        return self.t


@pytest.fixture
def world():
    kube = FakeKube()
    clock = Clock()
    events = []
    depth = {"running": 0, "waiting": 0}
    c = ctl.Controller(kube, events=lambda b, t, r, m: events.append((t, r, m)), clock=clock,
                       fetch=lambda url: METRICS % (depth["running"], depth["waiting"]))
    return kube, c, clock, events, depth


def idf(kube, **spec):
    body = make_body(**spec)
    body["metadata"]["generation"] = 1
    kube.put(body)
    return body


def status(kube):
    return kube.objects[("InferenceDeployment", "default", "demo")]["status"]


def test_queue_depth_sums_running_and_waiting():
    assert scrape.queue_depth(METRICS % (3, 4)) == 8
    assert scrape.metrics_url({"status": {"podIP": "10.1.2.3"}, "spec": {"containers": [
        {"ports": [{"name": "http", "containerPort": 8000}]}]}}) == "http://10.1.2.3:8000/metrics"
    assert scrape.metrics_url({"status": {}}) is None


def test_reconcile_creates_groups_and_reports_status(world):
    kube, c, clock, events, _ = world
    idf(kube, replicas=2, parallelism={"pipeline": 2})
    c.trigger("default", "demo")
    assert len(kube.of_kind("StatefulSet")) == 2
    st = status(kube)
    assert st["readyReplicas"] == 0 and st["replicas"] == 2
    avail = next(x for x in st["conditions"] if x["type"] == "Available")
    assert avail["status"] == "False" and avail["reason"] == "MinimumGroupsUnavailable"
    kube.run_statefulsets()
    c.trigger("default", "demo")
    st = status(kube)
    assert st["readyReplicas"] == 2 and st["observedGeneration"] == 1
    assert {x["type"]: x["status"] for x in st["conditions"]} == \
        {"Ready": "True", "Available": "True", "Progressing": "False", "Degraded": "False"}
    assert st["url"] == "http://demo.default.svc.cluster.local:8000"
    roles = {p["metadata"]["name"]: p["metadata"]["labels"].get("shoal.dev/role") for p in kube.of_kind("Pod").values()}
    assert sorted(roles.values()) == ["leader", "leader", "worker", "worker"]
    assert [r for _, r, _ in events].count("GroupCreated") == 2


def test_unchanged_children_are_not_rewritten(world):
    kube, c, *_ = world
    idf(kube)
    c.trigger("default", "demo")
    kube.run_statefulsets()
    c.trigger("default", "demo", scrape=True)
    kube.calls.clear()
    c.trigger("default", "demo", scrape=True)
    c.trigger("default", "demo")
    writes = [x for x in kube.calls if x[0] in ("apply", "patch", "delete")]
    assert writes == [], writes


def test_a_failed_pod_restarts_its_whole_group(world):
    kube, c, clock, events, _ = world
    idf(kube, parallelism={"pipeline": 3})
    c.trigger("default", "demo")
    kube.run_statefulsets()
    c.trigger("default", "demo")
    (group,) = kube.of_kind("StatefulSet")
    kube.objects[("Pod", "default", f"{group}-2")]["status"]["containerStatuses"][0]["restartCount"] = 1
    c.trigger("default", "demo")
    assert [p for p in kube.of_kind("Pod")] == []         # every pod of the group went, not just the failed one
    st = status(kube)
    deg = next(x for x in st["conditions"] if x["type"] == "Degraded")
    assert deg["status"] == "True" and deg["reason"] == "GroupFailing"
    assert st["groups"][0]["restarts"] == 1
    assert ("Warning", "GroupRestarted") in [(t, r) for t, r, _ in events]
    kube.run_statefulsets()                                # the StatefulSet recreates them together
    clock.t += 5
    c.trigger("default", "demo")
    # Issue 19, defect 5: Degraded lasted one second; it holds until the group has been ready a while.
    deg = next(x for x in status(kube)["conditions"] if x["type"] == "Degraded")
    assert deg["status"] == "True" and deg["reason"] == "GroupRecovering", deg
    assert status(kube)["groups"][0]["restarts"] == 1 and status(kube)["groups"][0]["recentRestarts"] == 1
    clock.t += 60
    c.trigger("default", "demo", scrape=True)
    assert next(x for x in status(kube)["conditions"] if x["type"] == "Degraded")["status"] == "True"
    clock.t += 61
    c.trigger("default", "demo", scrape=True)
    assert next(x for x in status(kube)["conditions"] if x["type"] == "Degraded")["status"] == "False"
    assert status(kube)["groups"][0]["restarts"] == 1


def test_autoscaling_on_the_timer_path(world):
    kube, c, clock, events, depth = world
    idf(kube, autoscaling={"enabled": True, "minReplicas": 1, "maxReplicas": 4, "targetQueueDepth": 10,
                           "scaleDownStabilizationSeconds": 60})
    c.trigger("default", "demo")
    kube.run_statefulsets()
    depth.update(running=20, waiting=9)                   # 20 + 9 + 1 = 30 on one group, target 10
    c.trigger("default", "demo", scrape=True)
    st = status(kube)
    assert st["desiredReplicas"] == 3 and st["queueDepth"] == 30
    assert kube.objects[("InferenceDeployment", "default", "demo")]["spec"].get("replicas") is None  # spec untouched
    assert len(kube.of_kind("StatefulSet")) == 3           # a scale-up creates its groups at once
    kube.run_statefulsets()
    depth.update(running=0, waiting=0)                     # idle: total 1 per leader -> ceil(3/10) = 1
    for _ in range(3):
        clock.t += 15
        c.trigger("default", "demo", scrape=True)
        assert status(kube)["desiredReplicas"] == 3        # within the 60 s window
    clock.t += 60
    c.trigger("default", "demo", scrape=True)
    assert status(kube)["desiredReplicas"] == 1
    assert len(kube.of_kind("StatefulSet")) == 1
    assert [r for _, r, _ in events].count("ScaledUp") == 1 and [r for _, r, _ in events].count("ScaledDown") == 1
    text = generate_latest(metrics.REGISTRY).decode()
    assert 'shoal_operator_autoscaler_decisions_total{direction="up",name="demo",namespace="default"}' in text
    assert 'shoal_operator_desired_groups{name="demo",namespace="default"} 1.0' in text


def test_scale_down_removes_the_least_loaded_group(world):
    kube, c, clock, _, depth = world
    idf(kube, replicas=3)
    c.trigger("default", "demo")
    kube.run_statefulsets()
    loads = {}
    names = sorted(kube.of_kind("StatefulSet"))
    for i, n in enumerate(names):
        kube.objects[("Pod", "default", f"{n}-0")]["status"]["podIP"] = f"10.0.0.{i}"
        loads[f"10.0.0.{i}"] = [7, 1, 4][i]
    c.fetch = lambda url: METRICS % (loads[url.split("//")[1].split(":")[0]], 0)
    c.trigger("default", "demo", scrape=True)
    body = kube.objects[("InferenceDeployment", "default", "demo")]
    body["spec"]["replicas"] = 2                            # kubectl scale
    c.trigger("default", "demo")
    assert sorted(kube.of_kind("StatefulSet")) == [names[0], names[2]]


def test_monitors_follow_the_spec(world):
    kube, c, *_ = world
    idf(kube, monitoring={"serviceMonitor": True})
    c.trigger("default", "demo", scrape=True)
    assert {"ServiceMonitor", "PodMonitor"} <= {k for k, _, _ in kube.objects}
    kube.objects[("InferenceDeployment", "default", "demo")]["spec"]["monitoring"]["serviceMonitor"] = False
    c.trigger("default", "demo", scrape=True)
    assert not {"ServiceMonitor", "PodMonitor"} & {k for k, _, _ in kube.objects}


def test_reconcile_errors_are_reported_and_counted(world):
    kube, c, *_ = world
    idf(kube)

    def broken(obj):
        raise RuntimeError("no room")
    kube.apply = broken
    before = metrics.RECONCILE_ERRORS._value.get()
    with pytest.raises(RuntimeError):
        c.trigger("default", "demo")
    assert metrics.RECONCILE_ERRORS._value.get() == before + 1
    deg = next(x for x in status(kube)["conditions"] if x["type"] == "Degraded")
    assert deg["reason"] == "ReconcileError" and "no room" in deg["message"]


def test_missing_or_deleting_resource_is_a_no_op(world):
    kube, c, *_ = world
    assert c.reconcile("default", "nope") is None
    body = idf(kube)
    body["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert c.reconcile("default", "demo") is None
    assert kube.of_kind("StatefulSet") == {}


def test_steady_autoscaling_does_not_rewrite_status_every_round(world):
    # Issue 19, defect 6: the resourceVersion climbed every tick with autoscaling on.
    kube, c, clock, _, depth = world
    idf(kube, autoscaling={"enabled": True, "minReplicas": 1, "maxReplicas": 4, "targetQueueDepth": 10})
    c.trigger("default", "demo")
    kube.run_statefulsets()
    depth.update(running=4, waiting=0)
    for _ in range(3):
        clock.t += 10
        c.trigger("default", "demo", scrape=True)
    kube.calls.clear()
    for _ in range(10):
        clock.t += 10
        c.trigger("default", "demo", scrape=True)
    assert [x for x in kube.calls if x[0] == "patch"] == []
    auto = status(kube)["autoscaler"]
    assert all(isinstance(r["time"], str) and r["time"].endswith("Z") for r in auto["recommendations"])
    assert len(auto["recommendations"]) <= 2


def _series(name):
    text = generate_latest(metrics.REGISTRY).decode()
    return [line for line in text.splitlines() if f'name="{name}"' in line and not line.startswith("#")]


def test_a_delete_during_a_reconcile_leaves_no_series(world):
    # Issue 19, defect 7: a round that was running when the resource was deleted set the
    # gauges again after the delete handler had removed them.
    kube, c, clock, _, depth = world
    idf(kube, autoscaling={"enabled": True})
    c.trigger("default", "demo")
    kube.run_statefulsets()
    c.trigger("default", "demo", scrape=True)
    assert _series("demo")
    real_patch = kube.merge_patch

    def patch_then_delete(api_version, kind, namespace, name, patch, subresource=None):
        out = real_patch(api_version, kind, namespace, name, patch, subresource)
        if subresource == "status":   # the delete handler runs while this round is still going
            c.forget(namespace, name)
        return out
    kube.merge_patch = patch_then_delete
    depth.update(running=100)
    clock.t += 10
    c.trigger("default", "demo", scrape=True)
    assert _series("demo") == []


def test_a_deleting_resource_drops_its_series(world):
    kube, c, *_ = world
    body = idf(kube)
    c.trigger("default", "demo")
    assert _series("demo")
    body["metadata"]["deletionTimestamp"] = "2026-12-04T00:00:00Z"
    c.trigger("default", "demo")
    assert _series("demo") == []


def test_forget_keeps_the_applied_hashes_of_a_longer_name(world):
    kube, c, *_ = world
    idf(kube)
    other = make_body(name="demo2", uid="uid-2")
    kube.put(other)
    c.trigger("default", "demo")
    c.trigger("default", "demo2")
    c.forget("default", "demo")
    assert {k[4] for k in c.applier.applied} == {"demo2"}


def test_drift_in_children_is_repaired(world):
    # Issue 19, defect 2: a group scaled to 1 pod of 2 and a Service given an extra selector
    # label stayed so, and status still said Available.
    kube, c, clock, *_ = world
    idf(kube, replicas=2, parallelism={"pipeline": 2})
    c.trigger("default", "demo")
    kube.run_statefulsets()
    c.trigger("default", "demo", scrape=True)
    g0, g1 = sorted(kube.of_kind("StatefulSet"))
    kube.objects[("StatefulSet", "default", g0)]["spec"]["replicas"] = 1
    del kube.objects[("Pod", "default", f"{g0}-1")]
    kube.objects[("Service", "default", "demo")]["spec"]["selector"]["extra"] = "x"
    # An event-driven round already judges the group by its pipeline size, not its replicas.
    c.trigger("default", "demo")
    st = status(kube)
    assert {g["name"]: g["ready"] for g in st["groups"]} == {g0: False, g1: True}
    # The timer round re-checks the cluster and repairs both.
    clock.t += 10
    c.trigger("default", "demo", scrape=True)
    assert kube.objects[("StatefulSet", "default", g0)]["spec"]["replicas"] == 2
    assert "extra" not in kube.objects[("Service", "default", "demo")]["spec"]["selector"]
    kube.run_statefulsets()
    c.trigger("default", "demo", scrape=True)
    assert status(kube)["readyReplicas"] == 2


def test_a_scale_down_keeps_the_healthy_group_over_a_drifted_one(world):
    kube, c, *_ = world
    idf(kube, replicas=2, parallelism={"pipeline": 2})
    c.trigger("default", "demo")
    kube.run_statefulsets()
    c.trigger("default", "demo")
    g0, g1 = sorted(kube.of_kind("StatefulSet"))
    kube.objects[("StatefulSet", "default", g0)]["spec"]["replicas"] = 1
    del kube.objects[("Pod", "default", f"{g0}-1")]
    kube.objects[("InferenceDeployment", "default", "demo")]["spec"]["replicas"] = 1
    c.trigger("default", "demo")
    assert sorted(kube.of_kind("StatefulSet")) == [g1]


def test_a_crash_looping_group_stays_degraded(world):
    kube, c, clock, events, _ = world
    idf(kube, parallelism={"pipeline": 2})
    c.trigger("default", "demo")
    kube.run_statefulsets()
    c.trigger("default", "demo")
    (group,) = kube.of_kind("StatefulSet")
    seen = []
    for _ in range(4):
        kube.run_statefulsets(ready=False)
        kube.objects[("Pod", "default", f"{group}-1")]["status"]["containerStatuses"][0]["restartCount"] = 1
        for _ in range(4):   # the timer, every 10 s, between and through the restarts
            clock.t += 10
            c.trigger("default", "demo", scrape=True)
            seen.append(next(x for x in status(kube)["conditions"] if x["type"] == "Degraded")["status"])
    assert set(seen) == {"True"}, seen
    assert status(kube)["groups"][0]["recentRestarts"] >= 3


def test_without_pods_patch_the_role_label_is_left_off(world):
    # Issue 19: the ClusterRole grants no pods/patch; the operator must work without it.
    from shoal.operator.kube import ApiError

    kube, c, *_ = world
    idf(kube, parallelism={"pipeline": 2})
    real_patch = kube.merge_patch
    refused = []

    def patch(api_version, kind, namespace, name, patch, subresource=None):
        if kind == "Pod":
            refused.append(name)
            raise ApiError(403, "pods is forbidden")
        return real_patch(api_version, kind, namespace, name, patch, subresource)
    kube.merge_patch = patch
    c.trigger("default", "demo")
    kube.run_statefulsets()
    c.trigger("default", "demo")
    c.trigger("default", "demo", scrape=True)
    assert len(refused) == 1                                   # tried once, then not again
    assert status(kube)["readyReplicas"] == 1
    assert not any(p["metadata"]["labels"].get("shoal.dev/role") for p in kube.of_kind("Pod").values())


def test_group_network_policies_follow_the_groups(world):
    kube, c, *_ = world
    idf(kube, replicas=2)
    c.trigger("default", "demo")
    assert sorted(kube.of_kind("NetworkPolicy")) == sorted(kube.of_kind("StatefulSet"))
    kube.objects[("InferenceDeployment", "default", "demo")]["spec"]["replicas"] = 1
    kube.run_statefulsets()
    c.trigger("default", "demo")
    assert sorted(kube.of_kind("NetworkPolicy")) == sorted(kube.of_kind("StatefulSet"))
    # an orphaned policy (say, a delete that failed) goes on the next timer round
    orphan = dict(next(iter(kube.of_kind("NetworkPolicy").values())))
    orphan = {**orphan, "metadata": {**orphan["metadata"], "name": "demo-old-9",
                                     "labels": {**orphan["metadata"]["labels"], "shoal.dev/group": "demo-old-9"}}}
    kube.put(orphan)
    c.trigger("default", "demo", scrape=True)
    assert sorted(kube.of_kind("NetworkPolicy")) == sorted(kube.of_kind("StatefulSet"))


def test_restart_policy_none_leaves_a_failed_group_alone(world):
    # Issue 19: LeaderWorkerSet's restart policies: RecreateGroupOnPodRestart (default) and None.
    kube, c, clock, events, _ = world
    idf(kube, parallelism={"pipeline": 2}, restartPolicy="None")
    c.trigger("default", "demo")
    kube.run_statefulsets()
    c.trigger("default", "demo")
    (group,) = kube.of_kind("StatefulSet")
    kube.objects[("Pod", "default", f"{group}-1")]["status"]["containerStatuses"][0]["restartCount"] = 1
    c.trigger("default", "demo")
    assert len(kube.of_kind("Pod")) == 2                       # nothing deleted
    deg = next(x for x in status(kube)["conditions"] if x["type"] == "Degraded")
    assert deg["status"] == "True" and "restartPolicy None" in deg["message"]
    assert "GroupRestarted" not in [r for _, r, _ in events]


def test_partition_keeps_old_groups_and_says_so(world):
    kube, c, clock, *_ = world
    idf(kube, replicas=3, rollout={"partition": 2})
    c.trigger("default", "demo")
    kube.run_statefulsets()
    c.trigger("default", "demo")
    body = kube.objects[("InferenceDeployment", "default", "demo")]
    body["spec"]["model"]["revision"] = "v2"
    body["metadata"]["generation"] = 2
    for _ in range(6):
        c.trigger("default", "demo")
        kube.run_statefulsets()
    st = status(kube)
    revs = sorted(g["revision"] for g in st["groups"])
    assert len(revs) == 3 and revs.count(st["revision"]) == 1, revs
    conds = {x["type"]: (x["status"], x["reason"]) for x in st["conditions"]}
    assert conds["Progressing"] == ("False", "PartitionReached") and conds["Ready"][0] == "True"


def test_pod_failed_predicate_for_the_pod_watch():
    ok = {"metadata": {"name": "g-0"}, "status": {"phase": "Running",
                                                  "containerStatuses": [{"name": "shoal", "restartCount": 0}]}}
    assert not ctl.pod_failed(ok)
    assert ctl.pod_failed({"metadata": {"name": "g-0"}, "status": {"phase": "Failed"}})
    assert ctl.pod_failed({"metadata": {"name": "g-0"}, "status": {
        "containerStatuses": [{"name": "shoal", "restartCount": 2}]}})
    assert not ctl.pod_failed({})


def test_the_pod_watch_handler_triggers_the_owner(monkeypatch):
    from shoal.operator import main

    calls = []

    class Recorder:
        def trigger(self, namespace, name, scrape=False):
            calls.append((namespace, name, scrape))
    monkeypatch.setattr(main, "get_controller", lambda: Recorder())
    main.pod_failed(namespace="ns", labels={render.L_DEPLOYMENT: "demo"}, type="MODIFIED")
    main.pod_failed(namespace="ns", labels={render.L_DEPLOYMENT: "demo"}, type=None)   # initial listing
    assert calls == [("ns", "demo", False)]
    import kopf
    registry = kopf.get_default_registry()
    handlers = [h for h in registry._watching.get_all_handlers() if getattr(h, "id", "").endswith("pod_failed")]
    assert handlers and handlers[0].when is not None


def test_the_model_cache_is_filled_once_before_groups_start(world):
    kube, c, clock, events, _ = world
    idf(kube, model={"source": "hf://org/name", "cache": {"enabled": True}}, parallelism={"pipeline": 2})
    c.trigger("default", "demo")
    (job,) = kube.of_kind("Job")
    assert "demo-model-cache" in kube.of_kind("PersistentVolumeClaim")
    assert kube.of_kind("StatefulSet") == {}                    # nothing to load yet
    st = status(kube)
    assert st["modelCache"]["phase"] == "Pending"
    assert next(x for x in st["conditions"] if x["type"] == "Progressing")["reason"] == "FetchingModel"
    kube.objects[("Job", "default", job)]["status"] = {"active": 1, "startTime": "2026-12-04T10:00:00Z"}
    c.trigger("default", "demo")
    assert status(kube)["modelCache"]["phase"] == "Fetching" and kube.of_kind("StatefulSet") == {}
    kube.objects[("Job", "default", job)]["status"] = {"succeeded": 1, "conditions": [
        {"type": "Complete", "status": "True"}], "completionTime": "2026-12-04T10:05:00Z"}
    c.trigger("default", "demo")
    assert status(kube)["modelCache"]["phase"] == "Ready" and len(kube.of_kind("StatefulSet")) == 1
    assert "ModelFetched" in [r for _, r, _ in events]
    del kube.objects[("Job", "default", job)]                   # gone (TTL, by hand): Ready is remembered
    kube.run_statefulsets()
    c.trigger("default", "demo", scrape=True)
    assert kube.of_kind("Job") == {} and status(kube)["readyReplicas"] == 1
    # a new revision: a new Job; the old group serves until the new one is fetched and ready
    body = kube.objects[("InferenceDeployment", "default", "demo")]
    body["spec"]["model"]["revision"] = "v2"
    c.trigger("default", "demo")
    (job2,) = kube.of_kind("Job")
    assert job2 != job and len(kube.of_kind("StatefulSet")) == 1
    kube.objects[("Job", "default", job2)]["status"] = {"failed": 5, "conditions": [
        {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]}
    c.trigger("default", "demo")
    deg = next(x for x in status(kube)["conditions"] if x["type"] == "Degraded")
    assert deg["status"] == "True" and deg["reason"] == "ModelFetchFailed"
    assert status(kube)["readyReplicas"] == 1                   # still serving the old revision


def test_switching_the_model_cache_off_removes_its_status(world):
    kube, c, *_ = world
    idf(kube, model={"source": "hf://org/name", "cache": {"enabled": True}})
    c.trigger("default", "demo")
    assert "modelCache" in status(kube)
    kube.objects[("InferenceDeployment", "default", "demo")]["spec"]["model"]["cache"]["enabled"] = False
    c.trigger("default", "demo")
    assert "modelCache" not in status(kube) and len(kube.of_kind("StatefulSet")) == 1


def test_pod_and_statefulset_watches_select_server_side(monkeypatch):
    # kopf filters handler labels client-side: the watches themselves must carry the selector,
    # or the operator would stream every pod of the cluster.
    import kopf

    from shoal.operator import main

    monkeypatch.setattr(main, "_controller", None)
    settings = kopf.OperatorSettings()
    main.configure(settings=settings)
    sel = settings.watching.label_selectors
    assert list(sel.collect(kopf.Resource("", "v1", "pods"))) == [render.L_DEPLOYMENT]
    assert list(sel.collect(kopf.Resource("apps", "v1", "statefulsets"))) == [render.L_DEPLOYMENT]
    assert list(sel.collect(kopf.Resource("shoal.dev", "v1alpha1", "inferencedeployments"))) == []


def test_volcano_pod_groups_follow_the_groups(world):
    kube, c, *_ = world
    idf(kube, replicas=2, parallelism={"pipeline": 2}, placement={"gangScheduling": "Volcano"})
    c.trigger("default", "demo")
    assert sorted(kube.of_kind("PodGroup")) == sorted(kube.of_kind("StatefulSet"))
    kube.objects[("InferenceDeployment", "default", "demo")]["spec"]["replicas"] = 1
    c.trigger("default", "demo")
    assert sorted(kube.of_kind("PodGroup")) == sorted(kube.of_kind("StatefulSet")) and len(kube.of_kind("PodGroup")) == 1


def test_a_name_still_draining_is_not_counted_as_created(world):
    """Issue 36: a resource deleted and made again at once finds its old groups still draining
    (foreground deletion; another owner's, so not its groups): the apply waits for the name, and
    no event or status counts a group that does not exist."""
    kube, c, clock, events, _ = world
    idf(kube, replicas=1)
    c.trigger("default", "demo")
    (gname,) = kube.of_kind("StatefulSet")
    old = kube.objects[("StatefulSet", "default", gname)]
    old["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"    # the old resource's, draining
    kube.objects[("InferenceDeployment", "default", "demo")] = idf(kube, replicas=1)   # made again
    kube.objects[("InferenceDeployment", "default", "demo")]["metadata"]["uid"] = "uid-2"
    events.clear()
    for _ in range(3):
        c.trigger("default", "demo")
    assert [r for _, r, _ in events].count("GroupCreated") == 0
    st = status(kube)
    assert st["replicas"] == 0 and st["groups"] == []
    assert kube.objects[("StatefulSet", "default", gname)]["metadata"]["deletionTimestamp"]   # untouched
    del kube.objects[("StatefulSet", "default", gname)]              # drained: the name is free
    c.trigger("default", "demo")
    assert [r for _, r, _ in events].count("GroupCreated") == 1
    assert status(kube)["replicas"] == 1 and [g["name"] for g in status(kube)["groups"]] == [gname]


# ---------------------------------------------------------------- LoRA adapters (issue 31)

@pytest.fixture
def lora_server(tmp_path, builtin_dir, monkeypatch):
    """A real `shoal serve --enable-lora` (tiny random model, PEFT adapters made by PEFT) that
    starts with a0, as a group's leader would from its --lora-modules."""
    from engine_helpers import make_lora_models, make_peft_adapter
    from shoal_op_helpers import ROOT

    monkeypatch.syspath_prepend(str(ROOT / "tests" / "server"))
    from server_helpers import start_server

    base, adapters = make_lora_models(tmp_path, builtin_dir, count=2)
    adapters["big"] = make_peft_adapter(base, tmp_path / "big", seed=9, r=32, lora_alpha=32, target_modules=["q_proj"])
    server = start_server([str(base), "--served-model-name", "demo", "--enable-lora", "--max-loras", "2",
                           "--max-lora-rank", "16", "--lora-modules", f"a0={adapters['a0']}"])
    yield server, base, {k: str(v) for k, v in adapters.items()}
    assert server.stop() == 0, server.log()[-3000:]


def test_adapters_are_loaded_into_and_unloaded_from_a_real_server(world, lora_server, monkeypatch):
    import httpx

    kube, c, clock, events, _ = world
    server, base, paths = lora_server
    monkeypatch.setattr(scrape, "pod_url", lambda pod: server.base_url if pod["status"].get("podIP") else None)

    def served():
        cards = httpx.get(server.v1 + "/models").json()["data"]
        return {m["id"]: m["root"] for m in cards if m.get("parent")}

    def states():
        return {a["name"]: [(g["state"], g.get("message", "")) for g in a["groups"]] for a in status(kube)["adapters"]}

    idf(kube, model={"source": f"file://{base}", "adapters": [
        {"name": "a0", "source": f"file://{paths['a0']}"}, {"name": "a1", "source": f"file://{paths['a1']}"}]})
    c.trigger("default", "demo")
    assert states() == {"a0": [("Pending", "the group is not ready")], "a1": [("Pending", "the group is not ready")]}
    kube.run_statefulsets()
    c.trigger("default", "demo", scrape=True)
    assert served() == {"a0": paths["a0"], "a1": paths["a1"]}
    assert states() == {"a0": [("Loaded", "")], "a1": [("Loaded", "")]}
    assert [m for _, r, m in events if r.startswith("Adapter")] == \
        [f"loaded adapter a1 ({paths['a1']}) on group {next(iter(kube.of_kind('StatefulSet')))}"]
    groups = set(kube.of_kind("StatefulSet"))

    # a0 out, a rank the server refuses in: an event-driven round (the list changed) does it
    body = kube.objects[("InferenceDeployment", "default", "demo")]
    body["spec"]["model"]["adapters"] = [{"name": "a1", "source": f"file://{paths['a1']}"},
                                         {"name": "big", "source": f"file://{paths['big']}"}]
    c.trigger("default", "demo")
    assert served() == {"a1": paths["a1"]}
    (big,) = states()["big"]
    assert big[0] == "Failed" and big[1].startswith("400: ") and "--max-lora-rank 16" in big[1], big
    assert states()["a1"] == [("Loaded", "")] and "a0" not in states()
    assert set(kube.of_kind("StatefulSet")) == groups                   # no group replaced
    reply = httpx.post(server.v1 + "/completions", json={"model": "a1", "prompt": "The sea", "max_tokens": 2})
    assert reply.status_code == 200 and reply.json()["model"] == "a1"
    assert httpx.post(server.v1 + "/completions", json={"model": "a0", "prompt": "x", "max_tokens": 1}).status_code == 404
    # the refusal is reported once, not at every round
    c.trigger("default", "demo", scrape=True)
    assert [r for _, r, _ in events].count("AdapterFailed") == 1


def test_adapters_in_the_shared_cache_load_once_their_job_is_done(world, monkeypatch):
    from shoal_op_helpers import FakeLeaders

    kube, c, clock, events, _ = world
    leaders = FakeLeaders(check_files=False)
    monkeypatch.setattr(scrape, "pod_url", leaders.url)
    idf(kube, model={"source": "hf://org/name", "cache": {"enabled": True},
                     "adapters": [{"name": "sql", "source": "hf://org/sql-lora"}]})
    c.trigger("default", "demo")
    jobs = kube.of_kind("Job")
    assert len(jobs) == 2                                       # the model's and the adapter's, side by side
    (plan,) = render.adapter_plans(kube.objects[("InferenceDeployment", "default", "demo")]["spec"])
    adapter_job = f"demo-fetch-{plan['cacheKey']}"
    assert adapter_job in jobs
    for name in jobs:
        kube.objects[("Job", "default", name)]["status"] = {"active": 1}
    c.trigger("default", "demo")
    kube.objects[("Job", "default", next(n for n in jobs if n != adapter_job))]["status"] = {"succeeded": 1}
    c.trigger("default", "demo")
    kube.run_statefulsets()
    c.trigger("default", "demo", scrape=True)
    (sql,) = status(kube)["adapters"]
    assert sql["cache"] == "Fetching" and [g["state"] for g in sql["groups"]] == ["Fetching"]
    assert [h.calls for _, h in leaders.servers.values()] == [[]]   # nothing asked of the leader yet
    kube.objects[("Job", "default", adapter_job)]["status"] = {"failed": 5, "conditions": [
        {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]}
    c.trigger("default", "demo", scrape=True)
    (sql,) = status(kube)["adapters"]
    assert sql["cache"] == "Failed" and [g["state"] for g in sql["groups"]] == ["Failed"]
    kube.objects[("Job", "default", adapter_job)]["status"] = {"succeeded": 1}   # retried (deleted and run again)
    c.trigger("default", "demo", scrape=True)
    (sql,) = status(kube)["adapters"]
    assert sql["cache"] == "Ready" and sql["loadedGroups"] == 1
    ((_, leader),) = leaders.servers.values()
    assert leader.calls == [("/v1/load_lora_adapter", "sql")] and leader.adapters == {"sql": plan["path"]}
    del kube.objects[("Job", "default", adapter_job)]           # gone (TTL): Ready is remembered, not fetched again
    c.trigger("default", "demo", scrape=True)
    assert adapter_job not in kube.of_kind("Job") and status(kube)["adapters"][0]["cache"] == "Ready"
    leaders.close()
