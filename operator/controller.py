"""One reconcile of one InferenceDeployment: read the cluster, call the pure planners, write.

The kopf handlers (main.py) only decide *when* to call `Controller.trigger`; this file
decides *what* to do, with the pure functions below it (render, rollout, autoscale,
status) doing the thinking. Calls for the same resource are coalesced: while one runs,
further triggers only make it run once more, with a fresh read of the resource.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from shoal.operator import autoscale, crd, defaults, render, rollout, scrape, status, validate
from shoal.operator import operator_metrics as metrics
from shoal.operator.apply import Applier, delete_quietly, get_quietly, list_quietly, owned_by
from shoal.operator.kube import ApiError, Kube

log = logging.getLogger("shoal.operator")

RESTART_COOLDOWN_SECONDS = 30
MAX_RERUNS = 2
LONE_POD_SPREAD_SECONDS = 60
A_RESTARTS = "shoal.dev/restarts"
A_RESTARTED_AT = "shoal.dev/restarted-at"
OPTIONAL_STATUS = ("adapters", "autoscaler", "modelCache", "router", "url")  # present only while their feature is on
A_RESTART_TIMES = "shoal.dev/recent-restarts"   # epoch seconds within status.RESTART_WINDOW_SECONDS


# ---------------------------------------------------------------- observed state

def pod_ready(pod: dict[str, Any]) -> bool:
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


def pod_index(pod: dict[str, Any]) -> int:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    if render.L_POD_INDEX in labels:
        return int(labels[render.L_POD_INDEX])
    return int(pod["metadata"]["name"].rsplit("-", 1)[-1])


def _ts(value: str | None) -> float | None:
    if not value:
        return None
    import datetime

    return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def failure_reason(pods: list[dict[str, Any]]) -> str | None:
    """Why a group must be restarted as a whole, or None.

    A pod failed or one of its containers restarted (the runtime's ranks cannot rejoin a
    running group), or a pod was recreated alone (its creation is far later than its peers').
    """
    for pod in pods:
        st = pod.get("status") or {}
        if st.get("phase") == "Failed":
            return f"pod {pod['metadata']['name']} failed"
        for cs in (st.get("containerStatuses") or []) + (st.get("initContainerStatuses") or []):
            if int(cs.get("restartCount") or 0) > 0:
                return f"container {cs.get('name')} of pod {pod['metadata']['name']} restarted"
    times = [t for t in (_ts(p["metadata"].get("creationTimestamp")) for p in pods) if t is not None]
    if len(times) > 1 and max(times) - min(times) > LONE_POD_SPREAD_SECONDS:
        return "a pod was recreated alone"
    return None


def recent_restarts(annotations: dict[str, str], now: float) -> list[int]:
    """The group's restart times within the window (for the Degraded condition's count)."""
    times = [int(t) for t in (annotations.get(A_RESTART_TIMES) or "").split() if t.isdigit()]
    return [t for t in times if now - t < status.RESTART_WINDOW_SECONDS]


def group_size(sts: dict[str, Any]) -> int:
    """Pods a group must have: its pipeline size as rendered (SHOAL_PIPELINE_SIZE), not
    `spec.replicas`, which anyone may have scaled (a group of 1 of 2 pods is not ready)."""
    for c in ((sts.get("spec") or {}).get("template") or {}).get("spec", {}).get("containers") or []:
        for e in c.get("env") or []:
            if e.get("name") == "SHOAL_PIPELINE_SIZE" and str(e.get("value", "")).isdigit():
                return int(e["value"])
    return int((sts.get("spec") or {}).get("replicas") or 0)


def job_phase(job: dict[str, Any]) -> tuple[str, str]:
    """(Pending | Fetching | Ready | Failed, message) of a fetch Job."""
    st = job.get("status") or {}
    for c in st.get("conditions") or []:
        if c.get("type") == "Complete" and c.get("status") == "True":
            return "Ready", "downloaded"
        if c.get("type") == "Failed" and c.get("status") == "True":
            return "Failed", f"the fetch Job failed: {c.get('reason', '')} {c.get('message', '')}".strip()
    if int(st.get("succeeded") or 0) > 0:
        return "Ready", "downloaded"
    if int(st.get("active") or 0) > 0:
        tries = int(st.get("failed") or 0)
        return "Fetching", "downloading" + (f" (retry {tries})" if tries else "")
    return "Pending", "waiting for the fetch Job's pod"


def pod_failed(pod: Any) -> bool:
    """A pod whose own state calls for a group restart (failed, a container restarted): the
    kopf pod watch reacts to it at once, not at the next resync."""
    try:
        return failure_reason([pod]) is not None
    except (KeyError, TypeError, ValueError):
        return False


# ---------------------------------------------------------------- a leader's LoRA endpoints (plain HTTP)

ADAPTER_HTTP_TIMEOUT = 30.0   # a load reads the adapter's files on the engine thread


class AdapterCallError(Exception):
    """The leader answered a load or unload with an error status (its reason in the message)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def leader_adapters(base: str, timeout: float = ADAPTER_HTTP_TIMEOUT) -> dict[str, str]:
    """The adapters a leader serves, name -> path: vLLM's /v1/models, the cards with a parent."""
    with urllib.request.urlopen(base + "/v1/models", timeout=timeout) as resp:  # noqa: S310 (cluster-internal)
        cards = json.loads(resp.read()).get("data") or []
    return {c["id"]: str(c.get("root") or "") for c in cards if c.get("parent")}


def leader_call(base: str, path: str, payload: dict[str, Any], timeout: float = ADAPTER_HTTP_TIMEOUT) -> None:
    """POST /v1/load_lora_adapter or /v1/unload_lora_adapter; AdapterCallError on a refusal."""
    req = urllib.request.Request(base + path, data=json.dumps(payload).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 (cluster-internal)
            resp.read()
    except urllib.error.HTTPError as e:
        text = e.read().decode(errors="replace")
        try:   # OpenAI's error shape, as vLLM and Shoal answer
            err = json.loads(text)
            inner = err.get("error")
            text = inner.get("message", text) if isinstance(inner, dict) else err.get("message") or text
        except (ValueError, AttributeError):
            pass
        raise AdapterCallError(e.code, f"{e.code}: {str(text)[:300]}") from None


@dataclasses.dataclass
class Observed:
    statefulsets: dict[str, dict[str, Any]]
    pods: dict[str, list[dict[str, Any]]]          # by group name


# ---------------------------------------------------------------- the controller

Events = Callable[[dict[str, Any], str, str, str], None]   # (body, type, reason, message)


def log_event(body: dict[str, Any], type_: str, reason: str, message: str) -> None:
    log.info("%s/%s %s %s: %s", body["metadata"].get("namespace"), body["metadata"]["name"], type_, reason, message)


class Controller:
    def __init__(self, kube: Kube | Callable[[], Kube], *, events: Events = log_event,
                 clock: Callable[[], float] = time.time, cluster_domain: str = "cluster.local",
                 fetch: Callable[[str], str] | None = None, allow_service_account: bool = False):
        self._kube = kube
        self.events = events
        self.clock = clock
        self.cluster_domain = cluster_domain
        self.fetch = fetch or scrape.fetch_metrics
        self.allow_service_account = allow_service_account   # an admin's choice (--allow-pod-service-account)
        self._lock = threading.Lock()
        self._running: dict[tuple[str, str], dict[str, bool]] = {}
        self.loads: dict[tuple[str, str], dict[str, float]] = {}
        self.pending: dict[tuple[str, str], float] = {}   # requests the routers hold, last scrape
        self.no_pod_patch: set[str] = set()   # namespaces where RBAC refuses pods/patch
        self.applier = Applier()

    @property
    def kube(self) -> Kube:
        return self._kube() if callable(self._kube) else self._kube

    # -------------------------------------------------------------- coalescing

    def trigger(self, namespace: str, name: str, *, scrape: bool = False) -> None:
        """Reconcile now, or (if one is running for this resource) once more right after it.

        A caller reruns at most MAX_RERUNS times for triggers that arrived meanwhile, so no
        kopf handler is held for long; anything left over is picked up by the next trigger
        or timer round.
        """
        key = (namespace, name)
        with self._lock:
            if key in self._running:
                pending = self._running[key]
                pending["again"] = True
                pending["scrape"] = pending["scrape"] or scrape
                return
            self._running[key] = {"again": False, "scrape": False}
        try:
            for _ in range(1 + MAX_RERUNS):
                self.reconcile(namespace, name, scrape=scrape)
                with self._lock:
                    pending = self._running[key]
                    if not pending["again"]:
                        break
                    scrape = pending["scrape"]
                    self._running[key] = {"again": False, "scrape": False}
        finally:
            with self._lock:
                pending = self._running.pop(key, {})
            if pending.get("forgotten"):
                # Deleted while this round ran: it may have set the series again after forget().
                metrics.forget(namespace, name)

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            if (namespace, name) in self._running:
                self._running[(namespace, name)]["forgotten"] = True
        self.loads.pop((namespace, name), None)
        self.pending.pop((namespace, name), None)
        self.applier.forget(namespace, name)
        metrics.forget(namespace, name)

    # -------------------------------------------------------------- one reconcile

    def reconcile(self, namespace: str, name: str, *, scrape: bool = False) -> dict[str, Any] | None:
        kube = self.kube
        raw = kube.get(crd.API_VERSION, crd.KIND, namespace, name)
        if raw is None or raw["metadata"].get("deletionTimestamp"):
            metrics.forget(namespace, name)  # going or gone: its series must not linger
            return None
        body = defaults.apply_defaults(raw)
        body["metadata"].setdefault("namespace", namespace)
        bad = validate.problems(body, allow_service_account=self.allow_service_account)
        if bad:
            # Refused before any child is touched; the groups that run keep running.
            new = status.refused(body, bad, self.clock())
            if not status.same({k: (body.get("status") or {}).get(k) for k in new}, new):
                kube.merge_patch(crd.API_VERSION, crd.KIND, namespace, name, {"status": new}, subresource="status")
                self.events(body, "Warning", "InvalidSpec", "; ".join(bad)[:1000])
            return new
        with metrics.reconciling():
            try:
                return self._reconcile(kube, body, scrape)
            except Exception as e:
                self._report_error(kube, body, e)
                raise

    def _reconcile(self, kube: Kube, body: dict[str, Any], scrape: bool) -> dict[str, Any]:
        ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
        uid = body["metadata"].get("uid")
        spec = body["spec"]
        now = self.clock()
        want = render.desired(body, self.cluster_domain)
        revision = want.revision

        # 1. Objects shared by all groups.
        # Event-driven rounds trust what this process applied; timer rounds re-check the cluster.
        for obj in want.shared:
            self.applier.apply(kube, obj, verify=scrape)
        # Objects of a switched-off feature or another routing mode: timer rounds look in the
        # cluster; other rounds delete at once what this process applied (a mode switch).
        self.applier.delete_absent(kube, want.absent, ns, uid, name, look=scrape)
        router = None
        if want.router:
            router = self._router(kube, body, want.router, fresh=scrape)
        else:
            self.pending.pop((ns, name), None)   # no router: nothing held (a switch back starts afresh)

        # 1b. The shared model cache: groups of this revision wait until it holds the model.
        cache = self._model_cache(kube, body, want, now) if want.cache_key else None

        # 2. What the groups look like.
        obs = self._observe(kube, body, want.labels)
        if scrape:
            # Companions of groups that are gone (a delete that failed half-way, an operator restart).
            for api_version, kind in want.companion_kinds:
                for obj in list_quietly(kube, api_version, kind, ns, want.labels):
                    group = (obj["metadata"].get("labels") or {}).get(render.L_GROUP)
                    if group and group not in obs.statefulsets and owned_by(obj, uid):
                        delete_quietly(kube, api_version, kind, ns, obj["metadata"]["name"])
        groups, details, failing = self._groups(kube, body, want, obs, verify=scrape)

        # 3. Queue depth (timer rounds only) and the autoscaler.
        key = (ns, name)
        if scrape:
            self.loads[key] = self._scrape(obs, groups)
        loads = self.loads.get(key, {})
        groups = [dataclasses.replace(g, load=loads.get(g.name, 0.0)) for g in groups]
        desired = autoscale.desired_replicas(body)
        auto_state = None
        if spec["autoscaling"]["enabled"]:
            auto_state = (body.get("status") or {}).get("autoscaler") or {}
            if scrape:
                reporting = [loads[g.name] for g in groups if g.ready and not g.terminating and g.name in loads]
                decision = autoscale.decide(now=now, current=desired, loads=reporting,
                                            config=spec["autoscaling"], state=auto_state,
                                            pending=(router or {}).get("pendingRequests", 0.0))
                metrics.autoscaler_decision(ns, name, decision.direction)
                if decision.replicas != desired:
                    self.events(body, "Normal", "ScaledUp" if decision.direction == "up" else "ScaledDown",
                                f"desired groups {desired} -> {decision.replicas}: {decision.reason}")
                desired, auto_state = decision.replicas, decision.state

        # 4. The rollout step.
        plan = rollout.plan(groups, revision, desired, spec["rollout"]["maxSurge"], spec["rollout"]["maxUnavailable"],
                            partition=spec["rollout"]["partition"])
        if cache is not None and cache["phase"] != "Ready":
            plan.create = []   # nothing to load yet; the old groups keep serving (the floor holds)
        for index in plan.create:
            *companions, sts = want.group(index)
            for companion in companions:   # before its pods exist
                self.applier.apply_now(kube, companion)
            if not self.applier.apply_now(kube, sts):
                continue   # an object of that name is still going away: nothing was created, say nothing
            groups.append(rollout.Group(sts["metadata"]["name"], revision, index, ready=False))
            self.events(body, "Normal", "GroupCreated",
                        f"created group {sts['metadata']['name']} (revision {revision})")
        doomed = set(plan.delete)
        for gname in plan.delete:
            kube.delete("apps/v1", "StatefulSet", ns, gname, propagation="Foreground")
            # Its policy (and PodGroup) go with it; its pods still drain among themselves (their
            # connections exist already, and no new peer needs the rendezvous port).
            for api_version, kind in want.companion_kinds:
                delete_quietly(kube, api_version, kind, ns, gname)
            g = next(g for g in groups if g.name == gname)
            why = "old revision" if g.revision != revision else "scale down"
            self.events(body, "Normal", "GroupDeleted", f"deleted group {gname} ({why}); its pods drain")
        groups = [dataclasses.replace(g, terminating=True, ready=False) if g.name in doomed else g for g in groups]

        # 5. LoRA adapters: loaded and unloaded on the running groups (no rollout).
        adapters = self._adapters(kube, body, want, obs, groups, probe=scrape) if want.adapters is not None else None

        # 6. Status.
        new_status = status.build(body=body, groups=groups, group_details=details, revision=revision,
                                  desired=desired, selector=want.selector, failing=failing,
                                  autoscaler=auto_state, now=now, model_cache=cache, url=want.url,
                                  router=router, adapters=adapters)
        self._write_status(kube, body, new_status)
        metrics.set_groups(ns, name, desired, new_status["readyReplicas"])
        return new_status

    # -------------------------------------------------------------- helpers

    def _observe(self, kube: Kube, body: dict[str, Any], labels: dict[str, str]) -> Observed:
        ns, uid = body["metadata"]["namespace"], body["metadata"].get("uid")
        stss = {s["metadata"]["name"]: s for s in kube.list("apps/v1", "StatefulSet", ns, labels)
                if owned_by(s, uid) and render.L_GROUP in (s["metadata"].get("labels") or {})}
        pods: dict[str, list[dict[str, Any]]] = {g: [] for g in stss}
        for pod in kube.list("v1", "Pod", ns, labels):
            group = (pod["metadata"].get("labels") or {}).get(render.L_GROUP)
            if group in pods:
                pods[group].append(pod)
        return Observed(stss, pods)

    def _model_cache(self, kube: Kube, body: dict[str, Any], want: render.Desired, now: float) -> dict[str, Any]:
        """The fetch Job of the current (source, revision): create it, follow it, remember success.

        Once status says Ready for this key it is trusted (the Job may be gone); a new
        revision is a new key, so a new Job and a new directory in the cache."""
        ns = body["metadata"]["namespace"]
        key = want.cache_key
        prev = (body.get("status") or {}).get("modelCache") or {}
        if prev.get("key") == key and prev.get("phase") == "Ready":
            return prev
        job = want.fetch_job()
        jname = job["metadata"]["name"]
        live = get_quietly(kube, "batch/v1", "Job", ns, jname)
        if live is None:
            self.applier.apply_now(kube, job)
            return {"phase": "Pending", "key": key, "job": jname, "message": "fetch Job created"}
        phase, message = job_phase(live)
        st = live.get("status") or {}
        out = {"phase": phase, "key": key, "job": jname, "message": message,
               **({"startTime": st["startTime"]} if st.get("startTime") else {}),
               **({"completionTime": st["completionTime"]} if st.get("completionTime") else {})}
        if phase != prev.get("phase") or key != prev.get("key"):
            if phase == "Ready":
                self.events(body, "Normal", "ModelFetched", f"{body['spec']['model']['source']} is in the cache")
            elif phase == "Failed":
                self.events(body, "Warning", "ModelFetchFailed", message)
        return out

    def _adapters(self, kube: Kube, body: dict[str, Any], want: render.Desired, obs: Observed,
                  groups: list[rollout.Group], probe: bool) -> list[dict[str, Any]]:
        """status.adapters, after asking each ready group's leader what it serves and loading
        or unloading the difference. Timer rounds ask; other rounds ask only when the
        adapter list or the set of ready groups changed (else the last answers stand)."""
        plans = want.adapters or []
        prev = (body.get("status") or {}).get("adapters") or []
        cache = self._adapter_cache(kube, body, want, prev)
        live = [g for g in groups if not g.terminating]
        before = {(x.get("name"), a.get("name")): (x.get("state", "Pending"), x.get("message", ""))
                  for a in prev for x in a.get("groups") or []}
        listed = [(a.get("name"), a.get("source")) for a in prev]
        seen = {x.get("name") for a in prev for x in a.get("groups") or [] if x.get("state") != "Pending"}
        new_ready = {g.name for g in live if g.ready} - seen
        if not probe and listed == [(p["name"], p["source"]) for p in plans] and not (plans and new_ready):
            states = {g.name: {p["name"]: before.get((g.name, p["name"]), ("Pending", "not looked at yet"))
                               for p in plans} for g in live}
            return status.adapter_status(plans, states, cache)
        states = {}
        for g in live:
            leader = next((p for p in obs.pods.get(g.name, []) if pod_index(p) == 0), None)
            base = scrape.pod_url(leader) if leader and g.ready else None
            if base is None:
                states[g.name] = {p["name"]: ("Pending", "the group is not ready") for p in plans}
                continue
            states[g.name] = self._adapters_on(body, g.name, base, leader, plans, cache, before)
        return status.adapter_status(plans, states, cache)

    def _adapters_on(self, body: dict[str, Any], group: str, base: str, leader: dict[str, Any],
                     plans: list[dict[str, Any]], cache: dict[str, str],
                     before: dict[tuple[str, str], tuple[str, str]]) -> dict[str, tuple[str, str]]:
        """One group: read what its leader serves, load and unload the difference."""
        try:
            loaded = leader_adapters(base)
        except Exception as e:  # not answering: nothing changes there, the next round asks again
            return {p["name"]: ("Pending", f"the leader did not answer: {e}"[:300]) for p in plans}
        out: dict[str, tuple[str, str]] = {}
        wanted: dict[str, str] = {}
        for p in plans:
            if loaded.get(p["name"]) == p["path"]:
                out[p["name"]] = ("Loaded", "")
            elif p["cacheKey"] and cache.get(p["name"]) == "Failed":
                out[p["name"]] = ("Failed", "its download into the shared cache failed (see its Job; "
                                            "deleting the Job retries)")
            elif p["cacheKey"] and cache.get(p["name"]) != "Ready":
                out[p["name"]] = ("Fetching", f"the shared cache's Job is {cache.get(p['name'], 'Pending')}")
            elif not render.adapter_on_pod(p, leader):
                out[p["name"]] = ("Pending", "this group's pods cannot load it (started without --enable-lora, or "
                                             "without its files: a claim they do not mount, hf:// without "
                                             "model.cache); the group's next start has it")
            else:
                wanted[p["name"]] = p["path"]
        loads, unloads = status.adapter_changes(wanted, {p["name"] for p in plans}, loaded)
        for name in unloads:
            try:
                leader_call(base, "/v1/unload_lora_adapter", {"lora_name": name})
                self.events(body, "Normal", "AdapterUnloaded", f"unloaded adapter {name} from group {group}")
            except Exception as e:  # it stays; the next round tries again
                log.warning("unloading adapter %s from %s failed: %s", name, group, e)
        for name, path, in_place in loads:
            try:
                leader_call(base, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path,
                                                            "load_inplace": in_place})
                out[name] = ("Loaded", "")
                self.events(body, "Normal", "AdapterLoaded", f"loaded adapter {name} ({path}) on group {group}")
            except AdapterCallError as e:
                # 4xx: the leader refused it (a bad adapter): Failed, with its reason; else try again
                out[name] = ("Failed" if 400 <= e.status < 500 else "Pending", str(e))
                if out[name][0] == "Failed" and before.get((group, name)) != out[name]:
                    self.events(body, "Warning", "AdapterFailed", f"adapter {name} on group {group}: {e}")
            except Exception as e:
                out[name] = ("Pending", f"the leader did not answer: {e}"[:300])
        return out

    def _adapter_cache(self, kube: Kube, body: dict[str, Any], want: render.Desired,
                       prev: list[dict[str, Any]]) -> dict[str, str]:
        """hf:// adapters with the shared model cache: adapter name -> its fetch Job's phase
        (the Job created when missing; a Ready already in status is trusted, as the model's)."""
        ns = body["metadata"]["namespace"]
        out: dict[str, str] = {}
        done = {(a.get("name"), a.get("source")) for a in prev if a.get("cache") == "Ready"}
        for plan in want.adapters or []:
            if not plan["cacheKey"]:
                continue
            if (plan["name"], plan["source"]) in done:
                out[plan["name"]] = "Ready"
                continue
            job = want.adapter_fetch_job(plan)
            live = get_quietly(kube, "batch/v1", "Job", ns, job["metadata"]["name"])
            if live is None:
                self.applier.apply_now(kube, job)
                out[plan["name"]] = "Pending"
            else:
                out[plan["name"]] = job_phase(live)[0]
        return out

    def _groups(self, kube: Kube, body: dict[str, Any], want: render.Desired, obs: Observed, verify: bool = False):
        ns, revision = body["metadata"]["namespace"], want.revision
        now = self.clock()
        groups: list[rollout.Group] = []
        details: dict[str, dict[str, Any]] = {}
        failing: list[str] = []
        for gname, sts in sorted(obs.statefulsets.items()):
            meta = sts["metadata"]
            labels = meta.get("labels") or {}
            ann = meta.get("annotations") or {}
            size = group_size(sts)
            pods = [p for p in obs.pods.get(gname, []) if not p["metadata"].get("deletionTimestamp")]
            ready_pods = sum(pod_ready(p) for p in pods)
            ready = size > 0 and ready_pods == size and len(pods) == size
            restarts = int(ann.get(A_RESTARTS, "0"))
            terminating = bool(meta.get("deletionTimestamp"))
            g_rev = labels.get(render.L_REVISION, "")
            if not terminating and g_rev == revision and verify:
                # Drift (a group scaled by hand, a label removed, its policy deleted): put back what we own.
                for obj in want.group(int(labels.get(render.L_INDEX, "0"))):
                    self.applier.apply_now(kube, obj)
            if not terminating:
                self._label_roles(kube, ns, pods)
                reason = failure_reason(pods) if g_rev == revision else None
                if reason:
                    failing.append(gname)
                    ready = False
                    last = float(ann.get(A_RESTARTED_AT, "0") or 0)
                    if body["spec"]["restartPolicy"] == "None":
                        pass  # the user's choice: report it (Degraded), leave the pods alone
                    elif now - last >= RESTART_COOLDOWN_SECONDS:
                        restarts += 1
                        recent = recent_restarts(ann, now) + [int(now)]
                        self._restart_group(kube, body, sts, obs.pods.get(gname, []), reason, restarts, now, recent)
                        ann = {**ann, A_RESTARTED_AT: str(int(now)), A_RESTART_TIMES: " ".join(map(str, recent))}
            groups.append(rollout.Group(gname, g_rev, int(labels.get(render.L_INDEX, "0")), ready=ready,
                                        terminating=terminating))
            details[gname] = {"readyPods": ready_pods, "restarts": restarts,
                              "recentRestarts": len(recent_restarts(ann, now)),
                              "lastRestart": float(ann[A_RESTARTED_AT]) if ann.get(A_RESTARTED_AT) else None}
        return groups, details, failing

    def _label_roles(self, kube: Kube, ns: str, pods: list[dict[str, Any]]) -> None:
        for pod in pods:
            try:
                role = "leader" if pod_index(pod) == 0 else "worker"
            except (ValueError, KeyError):
                continue
            if (pod["metadata"].get("labels") or {}).get(render.L_ROLE) != role:
                if ns in self.no_pod_patch:
                    return
                try:
                    kube.merge_patch("v1", "Pod", ns, pod["metadata"]["name"],
                                     {"metadata": {"labels": {render.L_ROLE: role}}})
                except ApiError as e:
                    if e.status == 403:
                        # The cluster-wide role grants no pods/patch (least privilege): the label is
                        # a convenience (selectors use the pod index), so go without it here.
                        log.info("no pods/patch in namespace %s: pods get no %s label", ns, render.L_ROLE)
                        self.no_pod_patch.add(ns)
                        return
                    if e.status != 404:
                        raise

    def _restart_group(self, kube: Kube, body: dict[str, Any], sts: dict[str, Any], pods: list[dict[str, Any]],
                       reason: str, restarts: int, now: float, recent: list[int]) -> None:
        ns, gname = body["metadata"]["namespace"], sts["metadata"]["name"]
        kube.merge_patch("apps/v1", "StatefulSet", ns, gname, {"metadata": {"annotations": {
            A_RESTARTS: str(restarts), A_RESTARTED_AT: str(int(now)),
            A_RESTART_TIMES: " ".join(map(str, recent))}}})
        for pod in pods:
            kube.delete("v1", "Pod", ns, pod["metadata"]["name"])
        metrics.group_restarted(ns, body["metadata"]["name"])
        self.events(body, "Warning", "GroupRestarted",
                    f"restarting group {gname} as a whole ({reason}); restart #{restarts}")

    def _scrape(self, obs: Observed, groups: list[rollout.Group]) -> dict[str, float]:
        out: dict[str, float] = {}
        for g in groups:
            if not g.ready or g.terminating:
                continue
            leader = next((p for p in obs.pods.get(g.name, []) if pod_index(p) == 0), None)
            url = scrape.metrics_url(leader) if leader else None
            if not url:
                continue
            try:
                out[g.name] = scrape.queue_depth(self.fetch(url))
            except Exception as e:  # a leader that does not answer simply does not report
                log.debug("scrape %s failed: %s", url, e)
        return out

    def _router(self, kube: Kube, body: dict[str, Any], router: tuple[str, dict[str, str]],
                fresh: bool) -> dict[str, Any]:
        """The router Deployment's ready pods and (timer rounds) the requests its pods hold."""
        ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
        dep_name, pod_labels = router
        dep = get_quietly(kube, "apps/v1", "Deployment", ns, dep_name) or {}
        key = (ns, name)
        if fresh:
            total = 0.0
            for pod in list_quietly(kube, "v1", "Pod", ns, pod_labels):
                url = scrape.metrics_url(pod) if pod_ready(pod) else None
                if not url:
                    continue
                try:
                    total += scrape.pending_requests(self.fetch(url))
                except Exception as e:  # a router that does not answer holds nothing we can see
                    log.debug("scrape %s failed: %s", url, e)
            self.pending[key] = total
        return {"readyReplicas": int((dep.get("status") or {}).get("readyReplicas") or 0),
                "replicas": int(body["spec"]["routing"]["router"]["replicas"]),
                "pendingRequests": self.pending.get(key, 0.0)}

    def _write_status(self, kube: Kube, body: dict[str, Any], new: dict[str, Any]) -> None:
        old = body.get("status") or {}
        dropped = [k for k in OPTIONAL_STATUS if k in old and k not in new]   # switched off: remove
        if status.same({k: old.get(k) for k in new}, new) and not dropped:
            return
        patch = {**new, **{k: None for k in dropped}}
        ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
        kube.merge_patch(crd.API_VERSION, crd.KIND, ns, name, {"status": patch}, subresource="status")

    def _report_error(self, kube: Kube, body: dict[str, Any], exc: Exception) -> None:
        """Best effort: say Degraded/ReconcileError in the status, keep the rest."""
        try:
            now = self.clock()
            prev = (body.get("status") or {}).get("conditions") or []
            gen = body["metadata"].get("generation")
            deg = status.condition("Degraded", True, "ReconcileError", str(exc)[:500], gen, prev, now)
            conds = [c for c in prev if c.get("type") != "Degraded"] + [deg]
            kube.merge_patch(crd.API_VERSION, crd.KIND, body["metadata"]["namespace"], body["metadata"]["name"],
                             {"status": {"conditions": conds}}, subresource="status")
            self.events(body, "Warning", "ReconcileError", str(exc)[:500])
        except Exception:  # pragma: no cover - reporting must never mask the error
            log.exception("could not report the reconcile error")
