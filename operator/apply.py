"""Writing children: server-side apply behind a spec hash, drift comparison, quiet reads.

Each rendered child carries `shoal.dev/spec-hash` (render._stamp). `Applier.apply` skips a
child this process already applied with that hash (event-driven rounds), or, when asked to
verify (timer rounds), reads the live object and applies again only where a field the
operator sets has drifted. An object still being deleted is never written over: its name
is free only once it is gone.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from shoal.operator import render
from shoal.operator.kube import ApiError, Kube

log = logging.getLogger("shoal.operator")

# (kind, namespace, name, owner uid, owner name): the applied object
Key = tuple[str, str, str, str, str]


# ---------------------------------------------------------------- quiet reads and deletes

def get_quietly(kube: Kube, api_version: str, kind: str, ns: str, name: str) -> dict[str, Any] | None:
    """The object, or None when it is absent or RBAC hides it (an optional feature's kind)."""
    try:
        return kube.get(api_version, kind, ns, name)
    except ApiError as e:
        if e.status in (403, 404):
            return None
        raise


def list_quietly(kube: Kube, api_version: str, kind: str, ns: str, labels: dict[str, str]) -> list[dict[str, Any]]:
    try:
        return kube.list(api_version, kind, ns, labels)
    except ApiError as e:
        if e.status in (403, 404):
            return []
        raise


def delete_quietly(kube: Kube, api_version: str, kind: str, ns: str, name: str) -> None:
    try:
        kube.delete(api_version, kind, ns, name)
    except ApiError as e:
        if e.status not in (403, 404):
            raise


def owned_by(obj: dict[str, Any], uid: str | None) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return uid is None or any(r.get("uid") == uid for r in refs)


# ---------------------------------------------------------------- applying

class Applier:
    """Applies children and remembers, per child, the spec hash this process applied."""

    def __init__(self) -> None:
        self.applied: dict[Key, str] = {}

    @staticmethod
    def key(obj: dict[str, Any]) -> Key:
        meta = obj["metadata"]
        ref = (meta.get("ownerReferences") or [{}])[0]
        return (obj["kind"], meta["namespace"], meta["name"], ref.get("uid", ""),
                meta["labels"].get(render.L_DEPLOYMENT, ""))

    def apply(self, kube: Kube, obj: dict[str, Any], verify: bool = True) -> None:
        """Apply unless this process applied the same hash (and `verify` is off)."""
        key, want = self.key(obj), obj["metadata"]["annotations"][render.A_SPEC_HASH]
        if not verify and self.applied.get(key) == want:
            return
        if self.apply_now(kube, obj):
            self.applied[key] = want

    def apply_now(self, kube: Kube, obj: dict[str, Any]) -> bool:
        """Apply unless unchanged; False when an object of that name is still being deleted
        (nothing is written: the next round creates it once it is gone)."""
        meta = obj["metadata"]
        existing = get_quietly(kube, obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        if existing is not None:
            if existing["metadata"].get("deletionTimestamp"):
                return False
            have = ((existing.get("metadata") or {}).get("annotations") or {}).get(render.A_SPEC_HASH)
            if have == meta["annotations"][render.A_SPEC_HASH]:
                # Our annotation says unchanged, but someone may have changed what we own:
                # compare the live fields we set (applying again when nothing drifted would
                # only churn resourceVersions).
                paths = drift({k: v for k, v in obj.items() if k != "status"}, existing)
                if not paths:
                    return True
                log.warning("%s %s/%s drifted (%s): re-applying", obj["kind"], meta["namespace"], meta["name"],
                            ", ".join(paths[:5]))
        kube.apply(obj)
        return True

    def delete_absent(self, kube: Kube, absent: list[tuple[str, str, str]], ns: str, uid: str | None,
                      owner: str, look: bool) -> None:
        """Delete owned objects that must not exist (a switched-off feature, another routing
        mode): those this process applied, or (`look`, timer rounds) any found in the cluster."""
        for api_version, kind, name in absent:
            key = (kind, ns, name, uid or "", owner)
            if not look and key not in self.applied:
                continue
            existing = get_quietly(kube, api_version, kind, ns, name)
            if existing is not None and owned_by(existing, uid) and not existing["metadata"].get("deletionTimestamp"):
                kube.delete(api_version, kind, ns, name)
            self.applied.pop(key, None)

    def forget(self, ns: str, owner: str) -> None:
        """Drop the hashes of one resource's children (by owner name: a name prefix would also
        hit `NAME2`'s)."""
        self.applied = {k: v for k, v in self.applied.items() if (k[1], k[4]) != (ns, owner)}


# ---------------------------------------------------------------- drift

# Maps the API server replaces whole on apply (mapType atomic), so a key someone else
# added there is drift we can repair: compare them exactly, not as a subset.
ATOMIC_MAPS = ("selector", "matchLabels")
_META_KEYS = ("labels", "annotations", "ownerReferences")


def drift(desired: Any, live: Any, path: str = "") -> list[str]:
    """Where a live object no longer holds what the operator set (paths), [] if it does.

    The desired object is compared as a subset of the live one: fields the API server
    defaults or other tools add are not drift, a changed or missing field we set is
    (a StatefulSet scaled by hand, a Service selector given an extra label). Scalars are
    compared as strings: the server returns quantities such as `2` as "2".
    """
    if isinstance(desired, dict):
        if not isinstance(live, dict):
            return [path or "/"]
        if path.rsplit(".", 1)[-1] in ATOMIC_MAPS and all(not isinstance(v, (dict, list)) for v in desired.values()):
            same = {k: str(v) for k, v in desired.items()} == {k: str(v) for k, v in live.items()}
            return [] if same else [path]
        out: list[str] = []
        for key, want in desired.items():
            if path == "metadata" and key not in _META_KEYS:
                continue  # name/namespace address the object; the rest is the server's
            if key not in live:
                out.append(f"{path}.{key}".lstrip("."))
            else:
                out += drift(want, live[key], f"{path}.{key}".lstrip("."))
        return out
    if isinstance(desired, list):
        if not isinstance(live, list) or len(live) != len(desired):
            return [path]
        return [p for i, (a, b) in enumerate(zip(desired, live)) for p in drift(a, b, f"{path}[{i}]")]
    if str(desired) == str(live):
        return []
    a, b = quantity(desired), quantity(live)
    return [] if a is not None and a == b else [path]


_SUFFIX = {"n": 1e-9, "u": 1e-6, "m": 1e-3, "": 1.0, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
           "E": 1e18, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_QUANTITY_RE = re.compile(r"^([+-]?[0-9.]+)(n|u|m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")


def quantity(value: Any) -> float | None:
    """A Kubernetes quantity's value (the server returns `0.5` as "500m", `1024Mi` as "1Gi"),
    or None for anything else."""
    if isinstance(value, bool):
        return None
    m = _QUANTITY_RE.match(str(value))
    if not m:
        return None
    try:
        return float(m.group(1)) * _SUFFIX[m.group(2) or ""]
    except ValueError:
        return None
