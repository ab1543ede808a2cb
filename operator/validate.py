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
    out += adapter_problems(body)
    for arg in spec["engine"].get("extraArgs") or []:
        if re.match(crd.RESERVED_FLAG_PATTERN, arg):
            out.append(f"engine.extraArgs {arg!r}: " + crd.RULE_EXTRA_ARGS["message"])
    tpl = spec.get("podTemplate") or {}
    if tpl.get("serviceAccountName") and not allow_service_account:
        out.append("podTemplate.serviceAccountName: this operator chooses the pods' service account "
                   "(its admin can allow it with --allow-pod-service-account)")
    for v in tpl.get("volumes") or []:
        if v.get("name") in crd.RESERVED_VOLUMES or str(v.get("name", "")).startswith(crd.RESERVED_VOLUME_PREFIX):
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


def adapter_problems(body: dict[str, Any]) -> list[str]:
    """spec.model.adapters: known source schemes, no '..', each name once, not the base model's."""
    model = body["spec"]["model"]
    adapters = model.get("adapters")
    if adapters is None:
        return []
    if not isinstance(adapters, list):
        return ["model.adapters must be a list of {name, source}"]
    out = []
    names = [a.get("name") if isinstance(a, dict) else None for a in adapters]
    base = model.get("servedName") or body["metadata"].get("name")
    for a, name in zip(adapters, names):
        source = str((a or {}).get("source", "")) if isinstance(a, dict) else ""
        if not isinstance(name, str) or not re.match(crd.ADAPTER_NAME_PATTERN, name) or len(name) > 63:
            out.append(f"model.adapters: name {name!r} must match {crd.ADAPTER_NAME_PATTERN} (at most 63 characters)")
        if not re.match(crd.ADAPTER_SOURCE_PATTERN, source):
            out.append(f"model.adapters {name}: source {source!r} must be hf://ORG/NAME, pvc://CLAIM/PATH or file:///PATH")
        elif re.match(r"^(pvc|file)://(.*/)?[.][.](/.*)?$", source):
            out.append(f"model.adapters {name}: " + crd.RULE_ADAPTER_PATHS["message"])
        if name == base:
            out.append(f"model.adapters {name}: " + crd.RULE_ADAPTER_NOT_BASE["message"])
    if len(set(n for n in names if isinstance(n, str))) != len([n for n in names if isinstance(n, str)]):
        out.append(crd.RULE_ADAPTER_NAMES["message"])
    if len(adapters) > crd.MAX_ADAPTERS:
        out.append(f"model.adapters: at most {crd.MAX_ADAPTERS}")
    return out
