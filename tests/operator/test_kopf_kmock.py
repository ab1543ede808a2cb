"""The kopf handlers with their real registration and event loop, against KMock over HTTP.

`kopf.testing.KopfRunner` runs `kopf run -m shoal.operator.main` in a thread (its own
event loop; the same handlers, timers and watches as in a cluster). KMock (the in-memory
Kubernetes API emulator) serves it on a loopback port; the operator's own REST client
talks to the same port through a kubeconfig.

KMock stores and serves objects but is not a whole control plane, so this test plays,
explicitly, the parts it lacks:

- the API server's `metadata.generation` counter and `uid` (set on create / spec change);
- the StatefulSet controller and the kubelet: for every group StatefulSet it creates
  the pods from the template (with the pod-index label) and, a moment later, marks
  them Ready, with a pod IP, and keeps the StatefulSet's status.readyReplicas in step;
- the Deployment controller, for the router: its status says every replica is ready;
- the garbage collector: objects whose owner is gone are deleted (the test checks that
  every object the operator made has an ownerReference that lets the real one do it);
- the runtime's /metrics: the leaders' scrapes are answered by a tiny in-test server.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import threading
import time
from typing import Any

import pytest
import yaml

from shoal.operator import kube as kube_mod
from shoal.operator import render

NS = "default"
IDF = "/apis/shoal.dev/v1alpha1/namespaces/default/inferencedeployments"
STS = "/apis/apps/v1/namespaces/default/statefulsets"
PODS = "/api/v1/namespaces/default/pods"
NPS = "/apis/networking.k8s.io/v1/namespaces/default/networkpolicies"
DEPS = "/apis/apps/v1/namespaces/default/deployments"
SVCS = "/api/v1/namespaces/default/services"
PDBS = "/apis/policy/v1/namespaces/default/poddisruptionbudgets"
POOLS = "/apis/inference.networking.k8s.io/v1/namespaces/default/inferencepools"
RESOURCES = {
    "shoal.dev/v1alpha1/inferencedeployments": dict(kind="InferenceDeployment", namespaced=True,
                                                    subresources={"status", "scale"},
                                                    verbs={"get", "list", "watch", "patch", "create", "delete"}),
    "apps/v1/statefulsets": dict(kind="StatefulSet", namespaced=True,
                                 verbs={"get", "list", "watch", "patch", "create", "delete"}),
    "apps/v1/deployments": dict(kind="Deployment", namespaced=True,
                                verbs={"get", "list", "watch", "patch", "create", "delete"}),
    "inference.networking.k8s.io/v1/inferencepools": dict(kind="InferencePool", namespaced=True,
                                                          verbs={"get", "list", "patch", "create", "delete"}),
    "v1/pods": dict(kind="Pod", namespaced=True, verbs={"get", "list", "watch", "patch", "create", "delete"}),
    "v1/services": dict(kind="Service", namespaced=True, verbs={"get", "list", "patch", "create", "delete"}),
    "v1/events": dict(kind="Event", namespaced=True, verbs={"create", "list"}),
    "networking.k8s.io/v1/networkpolicies": dict(kind="NetworkPolicy", namespaced=True,
                                                 verbs={"get", "list", "patch", "create", "delete"}),
    "policy/v1/poddisruptionbudgets": dict(kind="PodDisruptionBudget", namespaced=True,
                                           verbs={"get", "list", "patch", "create", "delete"}),
    "v1/namespaces": dict(kind="Namespace", namespaced=False, verbs={"get", "list", "watch"}),
    "apiextensions.k8s.io/v1/customresourcedefinitions": dict(kind="CustomResourceDefinition", namespaced=False,
                                                              verbs={"list", "watch"}),
}


class FakeMetrics(http.server.BaseHTTPRequestHandler):
    """The runtime's /metrics, as the leaders would answer (queue depth set by the test)."""
    depth = {"running": 0.0, "waiting": 0.0}

    def do_GET(self):  # noqa: N802
        body = (
            "# TYPE shoal_num_requests_running gauge\n"
            f'shoal_num_requests_running{{model_name="demo"}} {self.depth["running"]}\n'
            "# TYPE shoal_num_requests_waiting gauge\n"
            f'shoal_num_requests_waiting{{model_name="demo"}} {self.depth["waiting"]}\n'
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_metrics():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeMetrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    FakeMetrics.depth = {"running": 0.0, "waiting": 0.0}
    yield server.server_address[1]
    server.shutdown()


@pytest.fixture
def cluster(kmock, tmp_path, monkeypatch, fake_metrics):
    for res, info in RESOURCES.items():
        kmock.resources[res] = kmock.ResourceInfo(**info)
    kmock.objects["v1/namespaces", None, NS] = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": str(kmock.url).rstrip("/")}}],
        "users": [{"name": "kmock", "user": {"token": "test"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock", "namespace": NS}}],
    }))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    # KMock 0.8 cannot parse the cluster-wide `GET /api/v1/namespaces` (a 500 from its URL parser):
    # with scanning off, kopf takes the --namespace as given instead of listing namespaces.
    monkeypatch.setenv("SHOAL_OPERATOR_SCANNING", "0")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    kube_mod.reset_default()
    from shoal.operator import main, scrape

    main._controller = None
    # The pods' IPs point at 127.0.0.1; the runtime's port 8000 is the in-test server's port.
    real_url = scrape.metrics_url
    monkeypatch.setattr(scrape, "metrics_url",
                        lambda pod: (real_url(pod) or "").replace(f":{render.HTTP_PORT}/", f":{fake_metrics}/") or None)
    yield kmock
    kube_mod.reset_default()
    main._controller = None


@contextlib.asynccontextmanager
async def operator_running():
    from kopf.testing import KopfRunner

    runner = KopfRunner(["run", "--standalone", "--verbose", "--namespace", NS, "-m", "shoal.operator.main"],
                        timeout=60)  # fail, never hang, if the operator does not stop
    runner.__enter__()
    try:
        yield runner
    finally:
        # Stop in a thread: the operator needs the (this-loop) API server while it shuts down.
        await asyncio.to_thread(runner.__exit__, None, None, None)


async def get(k: Any, path: str) -> Any:
    async with k.get(path) as resp:
        return await resp.json() if resp.status == 200 else None


async def items(k: Any, path: str) -> list[dict]:
    data = await get(k, path)
    return (data or {}).get("items", [])


async def eventually(check, timeout: float = 45.0, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        result = await check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {check.__name__}")
        await asyncio.sleep(interval)


def stored(k: Any, plural: str) -> list[dict]:
    """Read KMock's store directly (no HTTP: the player polls often and must not load the server)."""
    import copy

    return [copy.deepcopy(obj.raw) for (res, _, _), obj in list(k.objects.items())
            if res.plural == plural and not obj.deleted]


class ClusterPlayer:
    """Plays the StatefulSet controller + kubelet, and the garbage collector."""

    def __init__(self, k: Any, ready_after: float = 0.2, hold_deletions: bool = False):
        self.k = k
        self.ready_after = ready_after
        self.born: dict[str, float] = {}
        self.ready_groups_seen: list[int] = []
        self.stop = False
        # The API server's foreground deletion: a deleted StatefulSet keeps its name, with a
        # deletionTimestamp, until its pods are gone; here until the test calls release().
        self.hold_deletions = hold_deletions
        self.statefulsets_seen: set[str] = set()

    async def release(self) -> None:
        """The draining groups' pods are gone: their StatefulSets go (KMock deletes an object
        whose deletionTimestamp is set once its finalizers are removed)."""
        for sts in stored(self.k, "statefulsets"):
            if sts["metadata"].get("deletionTimestamp"):
                async with self.k.patch(f"{STS}/{sts['metadata']['name']}",
                                        json={"metadata": {"finalizers": None}}) as resp:
                    assert resp.status == 200, await resp.text()

    async def step(self) -> None:
        k = self.k
        stss = {s["metadata"]["name"]: s for s in stored(k, "statefulsets")}
        self.statefulsets_seen |= set(stss)
        for name, sts in stss.items():
            if not sts["metadata"].get("uid"):   # the API server's: set once, on create
                uid = f"uid-{name}-{time.monotonic_ns()}"
                async with k.patch(f"{STS}/{name}", json={"metadata": {"uid": uid}}) as resp:
                    assert resp.status == 200, await resp.text()
                sts["metadata"]["uid"] = uid
            if self.hold_deletions and not sts["metadata"].get("finalizers"):
                async with k.patch(f"{STS}/{name}", json={"metadata": {"finalizers": ["foregroundDeletion"]}}) as resp:
                    assert resp.status == 200, await resp.text()
        pods = stored(k, "pods")
        names = {p["metadata"]["name"] for p in pods}
        # StatefulSet controller: pods from the template, named <sts>-<ordinal>, with the pod-index label.
        for name, sts in stss.items():
            for i in range(sts["spec"]["replicas"]):
                pname = f"{name}-{i}"
                if pname in names:
                    continue
                tpl = sts["spec"]["template"]
                pod = {
                    "apiVersion": "v1", "kind": "Pod",
                    "metadata": {
                        "name": pname, "namespace": NS, "uid": f"uid-{pname}-{time.monotonic_ns()}",
                        "labels": {**tpl["metadata"]["labels"], render.L_POD_INDEX: str(i)},
                        "annotations": dict(tpl["metadata"].get("annotations") or {}),
                        "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": name,
                                             "uid": sts["metadata"].get("uid", name), "controller": True}],
                    },
                    "spec": tpl["spec"],
                    "status": {"phase": "Pending"},
                }
                async with k.post(PODS, json=pod) as resp:
                    assert resp.status in (200, 201), await resp.text()
                self.born[pname] = time.monotonic()
        # Kubelet: a pod turns Ready a moment after it was created.
        for pod in pods:
            pname = pod["metadata"]["name"]
            st = pod.get("status") or {}
            if st.get("phase") != "Running" and time.monotonic() - self.born.get(pname, 0) >= self.ready_after:
                patch = {"status": {"phase": "Running", "podIP": "127.0.0.1",
                                    "conditions": [{"type": "Ready", "status": "True"}],
                                    "containerStatuses": [{"name": "shoal", "restartCount": 0, "ready": True}]}}
                async with k.patch(f"{PODS}/{pname}/status", json=patch) as resp:
                    assert resp.status == 200
        # StatefulSet controller again: its status follows its pods (what the operator watches).
        counts: dict[str, int] = {}
        for pod in stored(k, "pods"):
            if (pod.get("status") or {}).get("phase") == "Running":
                g = pod["metadata"]["labels"][render.L_GROUP]
                counts[g] = counts.get(g, 0) + 1
        for name, sts in stss.items():
            want = {"replicas": sts["spec"]["replicas"], "readyReplicas": counts.get(name, 0)}
            if {k_: (sts.get("status") or {}).get(k_) for k_ in want} != want:
                async with k.patch(f"{STS}/{name}/status", json={"status": want}) as resp:
                    assert resp.status == 200
        # Deployment controller (the router): every replica ready.
        for dep in stored(k, "deployments"):
            want = {"replicas": dep["spec"]["replicas"], "readyReplicas": dep["spec"]["replicas"]}
            if {k_: (dep.get("status") or {}).get(k_) for k_ in want} != want:
                async with k.patch(f"{DEPS}/{dep['metadata']['name']}/status", json={"status": want}) as resp:
                    assert resp.status == 200
        # Garbage collector: pods whose StatefulSet is gone.
        for pod in pods:
            owner = pod["metadata"]["ownerReferences"][0]["name"]
            if owner not in stss:
                async with k.delete(f"{PODS}/{pod['metadata']['name']}"):
                    pass
        # Record the ready groups for the invariant check.
        fresh = stored(k, "pods")
        ready_by_group: dict[str, int] = {}
        for p in fresh:
            if (p.get("status") or {}).get("phase") == "Running":
                g = p["metadata"]["labels"][render.L_GROUP]
                ready_by_group[g] = ready_by_group.get(g, 0) + 1
        self.ready_groups_seen.append(sum(1 for g, n in ready_by_group.items()
                                          if g in stss and n == stss[g]["spec"]["replicas"]))

    async def run(self) -> None:
        while not self.stop:
            await self.step()
            await asyncio.sleep(0.2)


def cond(status: dict, ctype: str) -> dict:
    return next(c for c in status.get("conditions", []) if c["type"] == ctype)


def idf(name: str = "demo", **spec) -> dict:
    return {
        "apiVersion": "shoal.dev/v1alpha1", "kind": "InferenceDeployment",
        "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}", "generation": 1, "resourceVersion": "1",
                     "creationTimestamp": "2026-01-01T00:00:00Z"},
        "spec": {"model": {"source": "builtin://smollm2-135m-instruct", "revision": "main"}, **spec},
    }


async def test_apply_rollout_delete(cluster):
    k = cluster
    player = ClusterPlayer(k)
    async with operator_running():
        async with k.post(IDF, json=idf(replicas=2, parallelism={"pipeline": 2})) as resp:
            assert resp.status in (200, 201)

        # Children appear, owned by the InferenceDeployment.
        async def two_groups():
            stss = await items(k, STS)
            return stss if len(stss) == 2 else None
        stss = await eventually(two_groups)
        for obj in stss + [await get(k, "/api/v1/namespaces/default/services/demo"),
                           await get(k, "/api/v1/namespaces/default/services/demo-headless"),
                           await get(k, "/apis/policy/v1/namespaces/default/poddisruptionbudgets/demo")]:
            assert obj is not None
            (ref,) = obj["metadata"]["ownerReferences"]
            assert ref["uid"] == "uid-demo" and ref["kind"] == "InferenceDeployment" and ref["controller"]
        rev1 = stss[0]["metadata"]["labels"][render.L_REVISION]
        nps = await items(k, NPS)
        assert sorted(n["metadata"]["name"] for n in nps) == sorted(s["metadata"]["name"] for s in stss)

        # The "StatefulSet controller" makes the pods ready; status and conditions follow.
        play = asyncio.create_task(player.run())
        try:
            async def available():
                obj = await get(k, f"{IDF}/demo")
                st = obj.get("status") or {}
                if st.get("readyReplicas") == 2 and cond(st, "Available")["status"] == "True" \
                        and cond(st, "Progressing")["reason"] == "RolloutComplete":
                    return obj
            obj = await eventually(available)
            st = obj["status"]
            assert st["observedGeneration"] == 1 and st["desiredReplicas"] == 2 and st["updatedReplicas"] == 2
            assert st["selector"] == "shoal.dev/deployment=demo,apps.kubernetes.io/pod-index=0"
            assert cond(st, "Degraded")["status"] == "False"
            assert cond(st, "Ready")["status"] == "True" and cond(st, "Ready")["reason"] == "AllGroupsReady"
            assert st["url"] == "http://demo.default.svc.cluster.local:8000"
            assert all(c["observedGeneration"] == 1 for c in st["conditions"])
            assert {g["name"] for g in st["groups"]} == {s["metadata"]["name"] for s in stss}
            # The operator labelled the roles (pod index 0 is the leader).
            pods = await items(k, PODS)
            assert {p["metadata"]["labels"].get(render.L_ROLE) for p in pods} == {"leader", "worker"}
            assert all((p["metadata"]["labels"][render.L_ROLE] == "leader")
                       == (p["metadata"]["labels"][render.L_POD_INDEX] == "0") for p in pods)

            # Issue 19, defect 2: a group scaled by hand is put back by the next resync.
            victim = stss[0]["metadata"]["name"]
            async with k.patch(f"{STS}/{victim}", json={"spec": {"replicas": 1}}) as resp:
                assert resp.status == 200

            async def repaired():
                sts = await get(k, f"{STS}/{victim}")
                return sts["spec"]["replicas"] == 2
            await eventually(repaired, timeout=20)

            # A new model revision: rolled out group by group (maxSurge 1, maxUnavailable 0).
            player.ready_groups_seen.clear()
            patch = {"metadata": {"generation": 2}, "spec": {"model": {"revision": "v2"}}}
            async with k.patch(f"{IDF}/demo", json=patch) as resp:
                assert resp.status == 200

            async def rolled_out():
                obj = await get(k, f"{IDF}/demo")
                st = obj.get("status") or {}
                stss = await items(k, STS)
                revs = {s["metadata"]["labels"][render.L_REVISION] for s in stss}
                if st.get("observedGeneration") == 2 and len(stss) == 2 and rev1 not in revs \
                        and st.get("readyReplicas") == 2 and cond(st, "Progressing")["reason"] == "RolloutComplete":
                    return obj, stss
            obj, stss = await eventually(rolled_out, timeout=90)
            # the old groups' NetworkPolicies went with them
            assert sorted(n["metadata"]["name"] for n in await items(k, NPS)) == \
                sorted(s["metadata"]["name"] for s in stss)
            assert min(player.ready_groups_seen) >= 2 - 0, player.ready_groups_seen   # replicas - maxUnavailable
            assert max(player.ready_groups_seen) <= 2 + 1, player.ready_groups_seen   # replicas + maxSurge
            assert obj["status"]["revision"] != rev1
            assert all(s["spec"]["template"]["metadata"]["annotations"][render.A_MODEL_REVISION] == "v2" for s in stss)
            # kopf posts events with generateName, which KMock 0.8 does not expand (every one after the
            # first is a 409 there), so the events are read from the requests KMock received.
            reasons = [r.data.get("reason") for r in list(k)
                       if r.method == "POST" and r.resource is not None and r.resource.plural == "events"]
            assert reasons.count("GroupCreated") >= 4 and reasons.count("GroupDeleted") >= 2, reasons

            # Autoscaling on: the timer scrapes the ready leaders (the in-test /metrics answers 25 + 5 each).
            FakeMetrics.depth = {"running": 25.0, "waiting": 5.0}
            patch = {"metadata": {"generation": 3}, "spec": {"autoscaling": {
                "enabled": True, "minReplicas": 1, "maxReplicas": 3, "targetQueueDepth": 10}}}
            async with k.patch(f"{IDF}/demo", json=patch) as resp:
                assert resp.status == 200

            async def scaled_up():
                obj = await get(k, f"{IDF}/demo")
                st = obj.get("status") or {}
                if st.get("desiredReplicas") == 3 and st.get("readyReplicas") == 3:
                    return obj
            obj = await eventually(scaled_up, timeout=60)
            assert obj["spec"]["replicas"] == 2              # the decision is in the status, never in the spec
            assert obj["status"]["queueDepth"] >= 60 and obj["status"]["autoscaler"]["recommendations"]
            assert len(await items(k, STS)) == 3
            reasons = [r.data.get("reason") for r in list(k)
                       if r.method == "POST" and r.resource is not None and r.resource.plural == "events"]
            assert "ScaledUp" in reasons

            # Issue 19, defect 6: a steady load writes no status (the resourceVersion stood still).
            async def settled():
                a = await get(k, f"{IDF}/demo")
                await asyncio.sleep(2.0)   # four resync rounds
                b = await get(k, f"{IDF}/demo")
                return a["status"] == b["status"] and b
            obj = await eventually(settled, timeout=30)
            assert all(isinstance(r["time"], str) for r in obj["status"]["autoscaler"]["recommendations"])
        finally:
            player.stop = True
            await play

        # Delete: kopf releases its finalizer, the object goes; the GC (played here) follows ownerReferences.
        async with k.delete(f"{IDF}/demo") as resp:
            assert resp.status == 200

        async def gone():
            return await get(k, f"{IDF}/demo") is None
        await eventually(gone)
        await asyncio.sleep(1.0)  # a timer round: nothing must be recreated after deletion
        collected = await garbage_collect(k, {"uid-demo"})
        assert collected, "the operator's objects must be collectable through ownerReferences"
        for path in (STS, PODS, SVCS, PDBS, NPS, DEPS):
            left = [o["metadata"]["name"] for o in await items(k, path)
                    if (o["metadata"].get("labels") or {}).get(render.L_DEPLOYMENT) == "demo"]
            assert left == [], (path, left)


async def garbage_collect(k: Any, dead_uids: set[str]) -> list[str]:
    """Plays the garbage collector: delete what an owner that is gone owned, transitively."""
    paths = [STS, PODS, SVCS, PDBS, NPS, DEPS, POOLS]
    collected: list[str] = []
    changed = True
    while changed:
        changed = False
        for path in paths:
            for obj in await items(k, path):
                owners = {r["uid"] for r in obj["metadata"].get("ownerReferences") or []}
                owner_names = {r["name"] for r in obj["metadata"].get("ownerReferences") or []}
                dead = owners & dead_uids or (path == PODS and not owner_names & {s["metadata"]["name"] for s in await items(k, STS)})
                if dead:
                    async with k.delete(f"{path}/{obj['metadata']['name']}"):
                        pass
                    collected.append(obj["metadata"]["name"])
                    dead_uids.add(obj["metadata"].get("uid", obj["metadata"]["name"]))
                    changed = True
    return collected


async def test_delete_while_the_resync_timer_runs(cluster, monkeypatch):
    """kopf holds its finalizer until the object's timer has exited; one caught mid-run must
    not keep a deletion waiting for kopf's default re-check a minute later."""
    from shoal.operator import controller

    in_timer = threading.Event()
    real_trigger = controller.Controller.trigger

    def slow_resync(self, namespace, name, scrape=False):
        if scrape:  # the timer's call: make it long enough to be caught running
            in_timer.set()
            time.sleep(2.0)
        return real_trigger(self, namespace, name, scrape=scrape)

    monkeypatch.setattr(controller.Controller, "trigger", slow_resync)
    k = cluster
    async with operator_running():
        async with k.post(IDF, json=idf(replicas=1)) as resp:
            assert resp.status in (200, 201)
        assert await asyncio.to_thread(in_timer.wait, 30), "the resync timer never ran"
        async with k.delete(f"{IDF}/demo") as resp:
            assert resp.status == 200

        async def gone():
            return await get(k, f"{IDF}/demo") is None
        started = time.monotonic()
        await eventually(gone, timeout=20)  # kopf's default re-check would come after 60 s
        assert time.monotonic() - started < 20


async def test_an_invalid_spec_is_reported_and_nothing_is_created(cluster):
    """Issue 19: KMock runs no CEL, like a cluster with an older CRD: the operator itself refuses
    the spec, says why in status, and touches no child."""
    k = cluster
    bad = idf(name="bad", parallelism={"tensor": 2}, resources={"limits": {"nvidia.com/gpu": 4}})
    async with operator_running():
        async with k.post(IDF, json=bad) as resp:
            assert resp.status in (200, 201)

        async def refused():
            obj = await get(k, f"{IDF}/bad")
            st = (obj or {}).get("status") or {}
            return st.get("conditions") and cond(st, "Degraded")["reason"] == "InvalidSpec" and st
        st = await eventually(refused, timeout=30)
        assert cond(st, "Ready")["status"] == "False" and "nvidia.com/gpu" in cond(st, "Ready")["message"]
        await asyncio.sleep(1.0)   # a couple of resync rounds
        for path in (STS, NPS, "/api/v1/namespaces/default/services"):
            assert [o for o in await items(k, path)
                    if (o["metadata"].get("labels") or {}).get(render.L_DEPLOYMENT) == "bad"] == [], path


async def test_the_router_follows_the_resource(cluster):
    """spec.routing through the real handlers: the router's objects are created with the resource,
    updated with its spec, replaced on a mode switch and collected with it."""
    k = cluster
    player = ClusterPlayer(k)
    async with operator_running():
        async with k.post(IDF, json=idf(replicas=1)) as resp:
            assert resp.status in (200, 201)

        async def router_up():
            dep = await get(k, f"{DEPS}/demo-router")
            svc, leaders = await get(k, f"{SVCS}/demo"), await get(k, f"{SVCS}/demo-leaders")
            pdb = await get(k, f"{PDBS}/demo-router")
            return dep and svc and leaders and pdb and (dep, svc, leaders, pdb)
        dep, svc, leaders, pdb = await eventually(router_up)
        for obj in (dep, svc, leaders, pdb):
            (ref,) = obj["metadata"]["ownerReferences"]
            assert ref["uid"] == "uid-demo" and ref["controller"]
        pod_labels = dep["spec"]["template"]["metadata"]["labels"]
        assert svc["spec"]["selector"].items() <= pod_labels.items()
        assert leaders["spec"]["selector"] == render.leader_selector_labels("demo")
        args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[:3] == ["router", "--backends-from-dns", "demo-leaders.default.svc.cluster.local:8000"]
        assert dep["spec"]["replicas"] == 2

        play = asyncio.create_task(player.run())
        try:
            async def ready():
                st = ((await get(k, f"{IDF}/demo")) or {}).get("status") or {}
                return st.get("conditions") and cond(st, "Ready")["status"] == "True" and st
            st = await eventually(ready, timeout=60)
            assert st["router"]["readyReplicas"] == 2 and st["url"] == "http://demo.default.svc.cluster.local:8000"

            # Updated with the spec: replicas and weights reach the Deployment.
            patch = {"metadata": {"generation": 2},
                     "spec": {"routing": {"router": {"replicas": 3, "prefixWeight": 0.25}}}}
            async with k.patch(f"{IDF}/demo", json=patch) as resp:
                assert resp.status == 200

            async def updated():
                dep = await get(k, f"{DEPS}/demo-router")
                args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
                return dep["spec"]["replicas"] == 3 and "--prefix-weight" in args and args
            args = await eventually(updated, timeout=30)
            assert args[args.index("--prefix-weight") + 1] == "0.25"

            # Switched to a plain Service: the router's objects go, `demo` selects the leaders.
            patch = {"metadata": {"generation": 3}, "spec": {"routing": {"mode": "service"}}}
            async with k.patch(f"{IDF}/demo", json=patch) as resp:
                assert resp.status == 200

            async def plain():
                gone = [await get(k, p) for p in (f"{DEPS}/demo-router", f"{SVCS}/demo-leaders", f"{PDBS}/demo-router")]
                # What the operator applied to `demo` last. (KMock merges an applied map where the API
                # server replaces one with mapType atomic, as Service.spec.selector is: its stored
                # selector keeps the router's key too, so the request is what tells.)
                applied = [r.data for r in list(k) if r.method == "PATCH" and r.resource is not None
                           and r.resource.plural == "services" and r.name == "demo" and isinstance(r.data, dict)]
                return gone == [None, None, None] and applied \
                    and applied[-1]["spec"]["selector"] == render.leader_selector_labels("demo")
            await eventually(plain, timeout=30)

            async def no_router_status():
                st = ((await get(k, f"{IDF}/demo")) or {}).get("status") or {}
                return st.get("observedGeneration") == 3 and "router" not in st
            await eventually(no_router_status, timeout=30)

            # Switched to an InferencePool: the pool over the leaders, no traffic Service.
            patch = {"metadata": {"generation": 4}, "spec": {"routing": {
                "mode": "inferencePool", "inferencePool": {"endpointPicker": {"name": "epp"}}}}}
            async with k.patch(f"{IDF}/demo", json=patch) as resp:
                assert resp.status == 200

            async def pooled():
                pool = await get(k, f"{POOLS}/demo")
                return pool and await get(k, f"{SVCS}/demo") is None and await get(k, f"{SVCS}/demo-leaders") \
                    and pool
            pool = await eventually(pooled, timeout=30)
            assert pool["spec"]["selector"]["matchLabels"] == render.leader_selector_labels("demo")
            assert pool["spec"]["endpointPickerRef"]["name"] == "epp"
        finally:
            player.stop = True
            await play

        async with k.delete(f"{IDF}/demo") as resp:
            assert resp.status == 200

        async def gone():
            return await get(k, f"{IDF}/demo") is None
        await eventually(gone)
        await asyncio.sleep(1.0)
        await garbage_collect(k, {"uid-demo"})
        for path in (STS, SVCS, PDBS, DEPS, POOLS):
            left = [o["metadata"]["name"] for o in await items(k, path)
                    if (o["metadata"].get("labels") or {}).get(render.L_DEPLOYMENT) == "demo"]
            assert left == [], (path, left)


async def test_a_scale_up_while_groups_drain_takes_new_names(cluster):
    """Issue 36: autoscaling 1..3 with a scale-down window; load to 3 groups, drop it (3 -> 1),
    and put it back while the two removed groups still drain. The new groups must take names
    no draining group holds, be created at once (the drain is held until the end here), and
    events and status must count only StatefulSets that exist."""
    k = cluster
    player = ClusterPlayer(k, hold_deletions=True)
    auto = {"enabled": True, "minReplicas": 1, "maxReplicas": 3, "targetQueueDepth": 10,
            "scaleDownStabilizationSeconds": 2}
    FakeMetrics.depth = {"running": 25.0, "waiting": 5.0}
    async with operator_running():
        play = asyncio.create_task(player.run())
        try:
            async with k.post(IDF, json=idf(replicas=1, autoscaling=auto)) as resp:
                assert resp.status in (200, 201)

            def live_and_draining() -> tuple[list[str], list[str]]:
                stss = stored(k, "statefulsets")
                return (sorted(s["metadata"]["name"] for s in stss if not s["metadata"].get("deletionTimestamp")),
                        sorted(s["metadata"]["name"] for s in stss if s["metadata"].get("deletionTimestamp")))

            async def ready(n: int, draining: int):
                st = ((await get(k, f"{IDF}/demo")) or {}).get("status") or {}
                live, gone = live_and_draining()
                return st.get("readyReplicas") == n and st.get("replicas") == n and len(live) == n \
                    and len(gone) == draining and len(st.get("groups") or []) == n + draining and st
            await eventually(lambda: ready(3, 0), timeout=60)

            FakeMetrics.depth = {"running": 0.0, "waiting": 0.0}
            st = await eventually(lambda: ready(1, 2), timeout=60)
            first, draining = live_and_draining()
            assert [g["name"] for g in st["groups"] if g["terminating"]] == draining

            # The load is back while both still drain: three groups serve without waiting for them.
            FakeMetrics.depth = {"running": 25.0, "waiting": 5.0}
            st = await eventually(lambda: ready(3, 2), timeout=60)
            live, still = live_and_draining()
            assert still == draining and first[0] in live and not set(live) & set(draining)
            names = [g["name"] for g in st["groups"]]
            assert len(names) == len(set(names)) == 5 and set(names) == set(live) | set(draining)
            assert {g["name"] for g in st["groups"] if not g["terminating"]} == set(live)

            await player.release()
            st = await eventually(lambda: ready(3, 0), timeout=30)
            assert sorted(g["name"] for g in st["groups"]) == live
        finally:
            player.stop = True
            await play
        # One GroupCreated event per StatefulSet that ever existed, each naming its own.
        created = [r.data.get("message", "") for r in list(k) if r.method == "POST" and r.resource is not None
                   and r.resource.plural == "events" and r.data.get("reason") == "GroupCreated"]
        named = sorted(m.split()[2] for m in created)   # "created group NAME (revision R)"
        assert named == sorted(player.statefulsets_seen), created


# ---------------------------------------------------------------- LoRA adapters (issue 31)

async def test_adapters_come_and_go_on_running_groups_without_a_rollout(cluster, monkeypatch, tmp_path):
    """Issue 31: an adapter added to and removed from a running deployment is loaded and
    unloaded on the groups' leaders over HTTP; no group is replaced, status says where each is."""
    from shoal.operator import scrape
    from shoal_op_helpers import FakeLeaders, make_adapter

    leaders = FakeLeaders()
    monkeypatch.setattr(scrape, "pod_url", leaders.url)
    sql, chat = make_adapter(tmp_path, "sql"), make_adapter(tmp_path, "chat")
    k = cluster
    player = ClusterPlayer(k)

    def adapters(*pairs):
        return {"source": "builtin://smollm2-135m-instruct", "revision": "main",
                "adapters": [{"name": n, "source": f"file://{p}"} for n, p in pairs]}

    def leader_state() -> dict[str, dict[str, str]]:
        out = {}
        for pod in stored(k, "pods"):
            if pod["metadata"]["labels"].get(render.L_POD_INDEX) == "0" and pod["metadata"]["uid"] in leaders.servers:
                out[pod["metadata"]["labels"][render.L_GROUP]] = dict(leaders.servers[pod["metadata"]["uid"]][1].adapters)
        return out

    def calls() -> list[tuple[str, str, str]]:
        return sorted((h.__name__, path, n) for _, h in leaders.servers.values() for path, n in h.calls)

    def group_events() -> list[str]:
        return [r.data.get("reason") for r in list(k) if r.method == "POST" and r.resource is not None
                and r.resource.plural == "events" and str(r.data.get("reason", "")).startswith("Group")]

    async def adapters_are(want: dict[str, str], generation: int):
        st = ((await get(k, f"{IDF}/demo")) or {}).get("status") or {}
        listed = {a["name"]: (a["loadedGroups"], {g["state"] for g in a["groups"]}) for a in st.get("adapters") or []}
        return st.get("observedGeneration") == generation and st.get("readyReplicas") == 2 \
            and listed == {n: (2 if s == "Loaded" else 0, {s}) for n, s in want.items()} and st

    try:
        async with operator_running():
            play = asyncio.create_task(player.run())
            try:
                async with k.post(IDF, json=idf(replicas=2, model=adapters(("sql", sql)))) as resp:
                    assert resp.status in (200, 201)
                # The groups start with it (--enable-lora --lora-modules sql=PATH): nothing to load.
                st = await eventually(lambda: adapters_are({"sql": "Loaded"}, 1), timeout=60)
                assert calls() == []
                groups = sorted(g["name"] for g in st["groups"])
                assert set(leader_state()) == set(groups) and all(a == {"sql": sql} for a in leader_state().values())

                def identity():
                    stss = stored(k, "statefulsets")
                    return (sorted((s["metadata"]["name"], s["metadata"]["uid"],
                                    s["metadata"]["labels"][render.L_REVISION]) for s in stss),
                            sorted((p["metadata"]["name"], p["metadata"]["uid"]) for p in stored(k, "pods")))
                before = identity()
                assert len(before[0]) == 2 and len(before[1]) == 2
                revision = st["revision"]
                created = group_events()
                assert created == ["GroupCreated", "GroupCreated"]

                # Added: loaded on each running leader, nothing replaced.
                patch = {"metadata": {"generation": 2}, "spec": {"model": adapters(("sql", sql), ("chat", chat))}}
                async with k.patch(f"{IDF}/demo", json=patch) as resp:
                    assert resp.status == 200
                st = await eventually(lambda: adapters_are({"sql": "Loaded", "chat": "Loaded"}, 2), timeout=60)
                assert all(a == {"sql": sql, "chat": chat} for a in leader_state().values())
                assert [c[1:] for c in calls()] == [("/v1/load_lora_adapter", "chat")] * 2
                assert st["revision"] == revision and identity() == before and group_events() == created

                # A bad one: the leader's refusal is that group's state, with its reason; the rest serve on.
                patch = {"metadata": {"generation": 3}, "spec": {"model": adapters(
                    ("sql", sql), ("chat", chat), ("gone", str(tmp_path / "nothing-here")))}}
                async with k.patch(f"{IDF}/demo", json=patch) as resp:
                    assert resp.status == 200
                st = await eventually(lambda: adapters_are({"sql": "Loaded", "chat": "Loaded", "gone": "Failed"}, 3),
                                      timeout=60)
                gone = next(a for a in st["adapters"] if a["name"] == "gone")
                assert all("404" in g["message"] and "no PEFT adapter" in g["message"] for g in gone["groups"])

                # Removed: unloaded from each leader, nothing replaced.
                patch = {"metadata": {"generation": 4}, "spec": {"model": adapters(("chat", chat))}}
                async with k.patch(f"{IDF}/demo", json=patch) as resp:
                    assert resp.status == 200
                st = await eventually(lambda: adapters_are({"chat": "Loaded"}, 4), timeout=60)
                assert all(a == {"chat": chat} for a in leader_state().values())
                assert [c[1:] for c in calls() if "unload" in c[1]] == [("/v1/unload_lora_adapter", "sql")] * 2
                assert st["revision"] == revision and identity() == before and group_events() == created
                assert sorted(g["name"] for g in st["groups"]) == groups

                # The groups' StatefulSets (OnDelete: their pods stay) follow the list on a resync,
                # so a group that restarts starts with what the spec says.
                async def templates_follow():
                    stss = stored(k, "statefulsets")
                    argss = [s["spec"]["template"]["spec"]["containers"][0]["args"] for s in stss]
                    return all(f"chat={chat}" in a for a in argss) and stss
                stss = await eventually(templates_follow, timeout=30)
                assert all(s["spec"]["updateStrategy"] == {"type": "OnDelete"} for s in stss)
                assert identity() == before and group_events() == created
            finally:
                player.stop = True
                await play
    finally:
        leaders.close()
