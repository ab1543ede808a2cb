"""Status and conditions (Kubernetes conventions, so Argo CD and Flux can judge health). Pure.

- `Available`: True when ready groups >= desired - maxUnavailable (and at least one
  ready group when any is desired); reasons MinimumGroupsAvailable / MinimumGroupsUnavailable.
- `Progressing`: True while a rollout or a scale is under way (reasons RolloutInProgress,
  ScalingUp, ScalingDown, WaitingForGroups); False with reason RolloutComplete when every
  group is ready on the current revision and the count matches.
- `Degraded`: True when a group is failing (being restarted) or the last reconcile failed
  (reasons GroupFailing, ReconcileError); else False/AsExpected.

Every condition carries `observedGeneration`; `lastTransitionTime` changes only when
the condition's status changes.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from shoal.operator.rollout import Group


def now_rfc3339(now: float) -> str:
    return datetime.datetime.fromtimestamp(now, tz=datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


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
) -> dict[str, Any]:
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

    available = len(ready) >= floor
    complete = not old and len(updated) == desired and len(updated_ready) == desired
    if complete:
        prog = (False, "RolloutComplete", f"{desired} group(s) ready on revision {revision}")
    elif old:
        prog = (True, "RolloutInProgress",
                f"{len(updated_ready)}/{desired} group(s) ready on revision {revision}, {len(old)} old group(s) left")
    elif len(updated) < desired:
        prog = (True, "ScalingUp", f"{len(updated)}/{desired} group(s) exist, {len(updated_ready)} ready")
    elif len(updated) > desired:
        prog = (True, "ScalingDown", f"{len(updated)} group(s) exist, {desired} desired")
    else:
        prog = (True, "WaitingForGroups", f"{len(updated_ready)}/{desired} group(s) ready")

    if error:
        deg = (True, "ReconcileError", error)
    elif failing:
        deg = (True, "GroupFailing", "restarting group(s): " + ", ".join(sorted(failing)))
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

    status: dict[str, Any] = {
        "replicas": len(live),
        "readyReplicas": len(ready),
        "updatedReplicas": len(updated),
        "desiredReplicas": desired,
        "selector": selector,
        "queueDepth": queue,
        "revision": revision,
        "model": spec["model"]["source"],
        "groups": [
            {
                "name": g.name,
                "revision": g.revision,
                "ready": g.ready,
                "pods": int(group_details.get(g.name, {}).get("readyPods", 0)),
                "queueDepth": int(round(g.load)),
                "restarts": int(group_details.get(g.name, {}).get("restarts", 0)),
                "terminating": g.terminating,
            }
            for g in sorted(groups, key=lambda g: g.name)
        ],
        "conditions": conditions,
    }
    if generation is not None:
        status["observedGeneration"] = generation
    if autoscaler is not None:
        status["autoscaler"] = dict(autoscaler)
    return status


def same(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Equal but for lastTransitionTime (so an unchanged status is not re-written)."""
    def strip(s: Mapping[str, Any]) -> dict[str, Any]:
        d = dict(s)
        d["conditions"] = [{k: v for k, v in c.items() if k != "lastTransitionTime"} for c in d.get("conditions") or []]
        return d
    return strip(a) == strip(b)
