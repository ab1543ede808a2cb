"""The CRD's issue-19 rules, in Python: what the operator refuses to render. Pure.

The API server enforces them through the CRD's CEL rules (crd.py). The operator checks
again before it touches any child, so a cluster still running an older CRD (or a file
given to `shoal operator render`) gets a status with the reason, not broken children.
"""

from __future__ import annotations

import re
from typing import Any

from shoal.operator import crd, defaults

_NEGATIVE = re.compile(r"^\s*-")


def problems(body: dict[str, Any], allow_service_account: bool = False) -> list[str]:
    """Why this (defaulted) resource cannot be rendered; [] when it can.

    `allow_service_account`: whether the operator's admin lets users pick their pods'
    service account (`shoal operator run --allow-pod-service-account`); a cluster-wide
    choice, so the operator checks it, not the CRD."""
    out: list[str] = []
    name = body["metadata"].get("name") or ""
    if len(name) > crd.MAX_NAME_LENGTH:
        out.append(crd.RULE_NAME["message"])
    if not re.match(crd.NAME_PATTERN, name):
        out.append(crd.RULE_NAME_FORMAT["message"])
    spec = body["spec"]
    out += replica_problems(spec)
    tensor = spec["parallelism"]["tensor"]
    res = spec.get("resources") or {}
    for part in ("limits", "requests"):
        for key, value in (res.get(part) or {}).items():
            if defaults.is_accelerator(key) and str(value) != str(tensor):
                out.append(f"resources.{part}[{key}] = {value}: " + crd.RULE_ACCELERATORS["message"])
            if _NEGATIVE.match(str(value)):
                out.append(f"resources.{part}[{key}] is negative")
    if _NEGATIVE.match(str(spec["model"].get("cacheSize", ""))):
        out.append("model.cacheSize is negative")
    if re.match(r"^(pvc|file)://(.*/)?[.][.](/.*)?$", spec["model"]["source"]):
        out.append(crd.RULE_SOURCE_PATH["message"])
    if (spec["model"].get("cache") or {}).get("enabled") and not spec["model"]["source"].startswith("hf://"):
        out.append(crd.RULE_CACHE_SOURCE["message"])
    if _NEGATIVE.match(str((spec["model"].get("cache") or {}).get("size", ""))):
        out.append("model.cache.size is negative")
    for arg in spec["engine"].get("extraArgs") or []:
        if re.match(crd.RESERVED_FLAG_PATTERN, arg):
            out.append(f"engine.extraArgs {arg!r}: " + crd.RULE_EXTRA_ARGS["message"])
    tpl = spec.get("podTemplate") or {}
    if tpl.get("serviceAccountName") and not allow_service_account:
        out.append("podTemplate.serviceAccountName: this operator chooses the pods' service account "
                   "(its admin can allow it with --allow-pod-service-account)")
    for v in tpl.get("volumes") or []:
        if v.get("name") in crd.RESERVED_VOLUMES:
            out.append(f"podTemplate.volumes {v.get('name')!r}: " + crd.RULE_VOLUMES["message"])
    for m in tpl.get("volumeMounts") or []:
        path = str(m.get("mountPath", "")).rstrip("/")
        if path == "/dev/shm" or path.startswith("/dev/shm/"):
            out.append(crd.RULE_SHM_MOUNT["message"])
        if path in crd.RESERVED_MOUNTS:
            out.append(crd.RULE_MOUNTS["message"])
    for e in tpl.get("env") or []:
        if str(e.get("name", "")).startswith(crd.RESERVED_ENV_PREFIX):
            out.append(f"podTemplate.env {e.get('name')}: " + crd.RULE_ENV["message"])
    routing = spec.get("routing") or {}
    mode = routing.get("mode", "shoal")
    if (spec.get("autoscaling") or {}).get("minReplicas", 1) == 0 and mode != "shoal":
        out.append(crd.RULE_SCALE_TO_ZERO["message"])
    if mode == "inferencePool" and not (routing.get("inferencePool") or {}).get("endpointPicker"):
        out.append(crd.RULE_ENDPOINT_PICKER["message"])
    router_res = (routing.get("router") or {}).get("resources") or {}
    for part in ("limits", "requests"):
        for key, value in (router_res.get(part) or {}).items():
            if _NEGATIVE.match(str(value)):
                out.append(f"routing.router.resources.{part}[{key}] is negative")
    interval = spec["monitoring"].get("interval", "15s")
    if not re.match(r"^0*[1-9][0-9]*(ms|s|m|h)$", str(interval)):
        out.append(f"monitoring.interval {interval!r} must be a duration > 0")
    return out


def replica_problems(spec: dict[str, Any]) -> list[str]:
    """The group counts, within the CRD's bounds: the rollout planner trusts them (a negative
    count would have it delete every group)."""
    out = []
    auto = spec.get("autoscaling") or {}
    counts = {"replicas": (spec.get("replicas"), 0), "autoscaling.minReplicas": (auto.get("minReplicas"), 0),
              "autoscaling.maxReplicas": (auto.get("maxReplicas"), 1)}
    for field, (value, least) in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= crd.MAX_REPLICAS:
            out.append(f"{field} {value!r} must be an integer from {least} to {crd.MAX_REPLICAS}")
    lo, hi = auto.get("minReplicas"), auto.get("maxReplicas")
    if isinstance(lo, int) and isinstance(hi, int) and lo > hi:
        out.append(crd.RULE_MIN_MAX["message"])
    return out
