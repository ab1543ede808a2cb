"""Status and conditions (Kubernetes conventions, so Argo CD and Flux can judge health). Pure.

- `Available`: True when ready groups >= desired - maxUnavailable (and at least one
  ready group when any is desired); reasons MinimumGroupsAvailable / MinimumGroupsUnavailable.
- `Progressing`: True while a rollout or a scale is under way (reasons RolloutInProgress,
  ScalingUp, ScalingDown, WaitingForGroups); False with reason RolloutComplete when every
  group is ready on the current revision and the count matches, or PartitionReached
  when `rollout.partition` keeps older groups and the rest is done.
- `Ready`: True when the resource is done: Available and the rollout complete (every
  desired group ready on the current revision), so `kubectl wait --for=condition=Ready`
  and kstatus-based tools (Flux `wait: true`) wait for the rollout; reasons AllGroupsReady,
  else Progressing's reason, or MinimumGroupsUnavailable.
- with a Shoal router in front (routing.mode shoal), `Ready` also needs a ready router
  pod (reason RouterUnavailable otherwise): it is what clients call; `status.router`
  says how many are ready and how many requests they hold.
- a spec the operator refuses (validate.py): `Ready`, `Degraded` and `Progressing` say
  InvalidSpec with the problems, `Available` and the rest stay as they were (no child
  is touched, so groups that serve keep serving).
- `Degraded`: True when a group is failing (being restarted), when a restarted group has
  not yet been ready for STABLE_SECONDS since (so a crash-looping group stays Degraded
  between its restarts, for Argo CD and Flux to see), or the last reconcile failed
  (reasons GroupFailing, GroupRecovering, ReconcileError); else False/AsExpected.

Every condition carries `observedGeneration`; `lastTransitionTime` changes only when
the condition's status changes.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from shoal.operator.rollout import Group, kept_by_partition

STABLE_SECONDS = 120            # a restarted group must be ready this long before Degraded clears
RESTART_WINDOW_SECONDS = 3600   # restarts counted in the message and status.groups[].recentRestarts


def now_rfc3339(now: float) -> str:
    return datetime.datetime.fromtimestamp(now, tz=datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_rfc3339(value: str | None) -> float | None:
    if not value:
        return None
    return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def ready_since(g: Group, previous: Mapping[str, Any] | None, now: float) -> str | None:
    """When the group last turned ready (kept from the previous status while it stays ready)."""
    if not g.ready:
        return None
    if previous and previous.get("ready") and previous.get("readySince"):
        return previous["readySince"]
    return now_rfc3339(now)


def recovering(last_restart: float | None, since: str | None, now: float) -> bool:
    """Restarted, and not yet ready for STABLE_SECONDS since (within the restart window)."""
    if last_restart is None or now - last_restart >= RESTART_WINDOW_SECONDS:
        return False
    t = parse_rfc3339(since)
    return t is None or t < last_restart or now - t < STABLE_SECONDS


def condition(ctype: str, ok: bool, reason: str, message: str, generation: int | None,
              previous: Sequence[Mapping[str, Any]], now: float) -> dict[str, Any]:
    status = "True" if ok else "False"
    old = next((c for c in previous if c.get("type") == ctype), None)
    changed = old is None or old.get("status") != status
    cond = {
        "type": ctype,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": now_rfc3339(now) if changed else old.get("lastTransitionTime", now_rfc3339(now)),
    }
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond


def build(
    *,
    body: Mapping[str, Any],
    groups: Sequence[Group],
    group_details: Mapping[str, Mapping[str, Any]],
    revision: str,
    desired: int,
    selector: str,
    failing: Sequence[str] = (),
    error: str | None = None,
    autoscaler: Mapping[str, Any] | None = None,
    now: float,
    url: str | None = None,
    model_cache: Mapping[str, Any] | None = None,
    router: Mapping[str, Any] | None = None,
    adapters: Sequence[Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """`router`: mode shoal only, {readyReplicas, replicas, pendingRequests} of the router pods.
    `adapters`: with `model.adapters`, status.adapters (adapter_status)."""
    spec = body["spec"]
    prev = body.get("status") or {}
    generation = body["metadata"].get("generation")
    max_unavailable = spec["rollout"]["maxUnavailable"]

    live = [g for g in groups if not g.terminating]
    ready = [g for g in live if g.ready]
    updated = [g for g in live if g.revision == revision]
    updated_ready = [g for g in updated if g.ready]
    old = [g for g in live if g.revision != revision]
    floor = max(desired - max_unavailable, 1 if desired > 0 else 0)
    queue = int(round(sum(g.load for g in ready)))

    kept = kept_by_partition(live, revision, desired, spec["rollout"].get("partition", 0))
    old = [g for g in old if g not in kept]
    want = desired - len(kept)
    available = len(ready) >= floor
    complete = not old and len(updated) == want and len(updated_ready) == want
    if complete and kept:
        prog = (False, "PartitionReached", f"{want} group(s) ready on revision {revision}, "
                f"{len(kept)} older group(s) kept by rollout.partition")
    elif complete:
        prog = (False, "RolloutComplete", f"{desired} group(s) ready on revision {revision}")
    elif model_cache and model_cache.get("phase") != "Ready" and len(updated) < want:
        prog = (True, "FetchingModel", f"the model cache is {model_cache.get('phase')}: "
                f"{model_cache.get('message', '')} (Job {model_cache.get('job')})")
    elif old:
        prog = (True, "RolloutInProgress",
                f"{len(updated_ready)}/{desired} group(s) ready on revision {revision}, {len(old)} old group(s) left")
    elif len(updated) < want:
        prog = (True, "ScalingUp", f"{len(updated)}/{want} group(s) exist, {len(updated_ready)} ready")
    elif len(updated) > want:
        prog = (True, "ScalingDown", f"{len(updated)} group(s) exist, {desired} desired")
    else:
        prog = (True, "WaitingForGroups", f"{len(updated_ready)}/{desired} group(s) ready")

    prev_groups = {g.get("name"): g for g in prev.get("groups") or []}
    since = {g.name: ready_since(g, prev_groups.get(g.name), now) for g in groups}
    restarted = {g.name: group_details.get(g.name, {}) for g in live}
    healing = sorted(n for n, d in restarted.items() if recovering(d.get("lastRestart"), since[n], now))
    if error:
        deg = (True, "ReconcileError", error)
    elif model_cache and model_cache.get("phase") == "Failed":
        deg = (True, "ModelFetchFailed", str(model_cache.get("message", "")))
    elif failing and spec.get("restartPolicy") == "None":
        deg = (True, "GroupFailing", "failing group(s), not restarted (restartPolicy None): "
               + ", ".join(sorted(failing)))
    elif failing:
        deg = (True, "GroupFailing", "restarting group(s): " + ", ".join(sorted(failing)))
    elif healing:
        counts = ", ".join(f"{n} ({int(restarted[n].get('recentRestarts', 0))} in "
                           f"{RESTART_WINDOW_SECONDS // 60}m)" for n in healing)
        deg = (True, "GroupRecovering",
               f"restarted group(s) not yet ready for {STABLE_SECONDS}s: {counts}")
    else:
        deg = (False, "AsExpected", "no failing groups")

    previous = prev.get("conditions") or []
    conditions = [
        condition("Available", available,
                  "MinimumGroupsAvailable" if available else "MinimumGroupsUnavailable",
                  f"{len(ready)} of {desired} group(s) ready (at least {floor} needed)", generation, previous, now),
        condition("Progressing", prog[0], prog[1], prog[2], generation, previous, now),
        condition("Degraded", deg[0], deg[1], deg[2], generation, previous, now),
    ]
    router_down = router is not None and int(router.get("readyReplicas") or 0) < 1
    if router_down:
        rdy = (False, "RouterUnavailable", f"0 of {int(router.get('replicas') or 0)} router pod(s) ready")
    elif available and complete:
        rdy = (True, "AllGroupsReady", f"{desired} group(s) ready on revision {revision}")
    elif not available:
        rdy = (False, "MinimumGroupsUnavailable", conditions[0]["message"])
    else:
        rdy = (False, prog[1], prog[2])
    conditions.insert(0, condition("Ready", rdy[0], rdy[1], rdy[2], generation, previous, now))

    status: dict[str, Any] = {
        "replicas": len(live),
        "readyReplicas": len(ready),
        "updatedReplicas": len(updated),
        "desiredReplicas": desired,
        "selector": selector,
        "queueDepth": queue,
        "revision": revision,
        "model": spec["model"]["source"],
        **({"url": url} if url else {}),
        "groups": [
            {
                "name": g.name,
                "revision": g.revision,
                "ready": g.ready,
                "pods": int(group_details.get(g.name, {}).get("readyPods", 0)),
                "queueDepth": int(round(g.load)),
                "restarts": int(group_details.get(g.name, {}).get("restarts", 0)),
                "recentRestarts": int(group_details.get(g.name, {}).get("recentRestarts", 0)),
                "terminating": g.terminating,
                **({"readySince": since[g.name]} if since[g.name] else {}),
                **({"lastRestartTime": now_rfc3339(group_details[g.name]["lastRestart"])}
                   if group_details.get(g.name, {}).get("lastRestart") else {}),
            }
            for g in sorted(groups, key=lambda g: g.name)
        ],
        "conditions": conditions,
    }
    if generation is not None:
        status["observedGeneration"] = generation
    if autoscaler is not None:
        status["autoscaler"] = dict(autoscaler)
    if model_cache is not None:
        status["modelCache"] = dict(model_cache)
    if adapters is not None:
        status["adapters"] = [dict(a) for a in adapters]
    if router is not None:
        status["router"] = {"readyReplicas": int(router.get("readyReplicas") or 0),
                            "pendingRequests": int(round(float(router.get("pendingRequests") or 0)))}
    return status


# ---------------------------------------------------------------- LoRA adapters

def adapter_changes(wanted: Mapping[str, str], known: set[str] | frozenset[str],
                    loaded: Mapping[str, str]) -> tuple[list[tuple[str, str, bool]], list[str]]:
    """What to ask a group's leader: (loads as (name, path, in place), unloads).

    `wanted`: name -> path of the adapters this group can load now; `known`: every adapter
    name in the spec (one the group cannot load yet is kept if loaded, never unloaded);
    `loaded`: name -> path of the adapters the leader serves (its /v1/models)."""
    loads = [(n, path, n in loaded) for n, path in sorted(wanted.items()) if loaded.get(n) != path]
    unloads = sorted(n for n in loaded if n not in known)
    return loads, unloads


def adapter_status(plans: Sequence[Mapping[str, Any]], states: Mapping[str, Mapping[str, tuple[str, str]]],
                   cache: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """status.adapters: per adapter of the spec, its state on each live group.

    `states`: group -> adapter name -> (state, message); `cache`: adapter name -> the
    shared cache's phase for it (hf:// with model.cache)."""
    out = []
    for plan in plans:
        groups = []
        for group in sorted(states):
            state, message = states[group].get(plan["name"], ("Pending", "not looked at yet"))
            groups.append({"name": group, "state": state, **({"message": message} if message else {})})
        entry: dict[str, Any] = {"name": plan["name"], "source": plan["source"],
                                 "loadedGroups": sum(g["state"] == "Loaded" for g in groups), "groups": groups}
        if cache and plan["name"] in cache:
            entry["cache"] = cache[plan["name"]]
        out.append(entry)
    return out


def same(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Equal but for lastTransitionTime (so an unchanged status is not re-written)."""
    def strip(s: Mapping[str, Any]) -> dict[str, Any]:
        d = dict(s)
        d["conditions"] = [{k: v for k, v in c.items() if k != "lastTransitionTime"} for c in d.get("conditions") or []]
        return d
    return strip(a) == strip(b)


def refused(body: Mapping[str, Any], problems: Sequence[str], now: float) -> dict[str, Any]:
    """The status of a spec that cannot be rendered: the reasons, nothing else changed."""
    prev = body.get("status") or {}
    generation = body["metadata"].get("generation")
    previous = prev.get("conditions") or []
    message = "; ".join(problems)[:1000]
    changed = [
        condition("Ready", False, "InvalidSpec", message, generation, previous, now),
        condition("Progressing", False, "InvalidSpec", message, generation, previous, now),
        condition("Degraded", True, "InvalidSpec", message, generation, previous, now),
    ]
    kept = [c for c in previous if c.get("type") not in {c["type"] for c in changed}]
    out: dict[str, Any] = {"conditions": changed + kept}
    if generation is not None:
        out["observedGeneration"] = generation
    return out
