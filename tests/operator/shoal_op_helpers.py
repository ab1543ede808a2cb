"""Shared helpers of the operator tests (a module, not a package: tests/ has no __init__)."""

from __future__ import annotations

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def make_body(name: str = "demo", namespace: str = "default", uid: str | None = "uid-1", **spec) -> dict:
    body = {
        "apiVersion": "shoal.dev/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"model": {"source": "builtin://smollm2-135m-instruct"}, **spec},
    }
    if uid:
        body["metadata"]["uid"] = uid
    return body


class FakeKube:
    """An in-memory stand-in for operator/kube.Kube (same methods), for fast controller tests."""

    def __init__(self):
        self.objects: dict[tuple[str, str, str], dict] = {}   # (kind, namespace, name) -> object
        self.calls: list[tuple[str, str, str]] = []

    def _key(self, kind, namespace, name):
        return (kind, namespace, name)

    def get(self, api_version, kind, namespace, name):
        self.calls.append(("get", kind, name))
        import copy
        obj = self.objects.get(self._key(kind, namespace, name))
        return copy.deepcopy(obj) if obj is not None else None

    def list(self, api_version, kind, namespace, labels):
        import copy
        self.calls.append(("list", kind, ""))
        return [copy.deepcopy(o) for (k, ns, _), o in sorted(self.objects.items())
                if k == kind and ns == namespace
                and all((o["metadata"].get("labels") or {}).get(a) == b for a, b in labels.items())]

    def apply(self, obj):
        import copy
        m = obj["metadata"]
        self.calls.append(("apply", obj["kind"], m["name"]))
        self.objects[self._key(obj["kind"], m["namespace"], m["name"])] = copy.deepcopy(obj)
        return obj

    create = apply

    def merge_patch(self, api_version, kind, namespace, name, patch, subresource=None):
        self.calls.append(("patch", kind, name))
        obj = self.objects[self._key(kind, namespace, name)]
        merge(obj, patch)
        return obj

    def delete(self, api_version, kind, namespace, name, propagation="Background"):
        self.calls.append(("delete", kind, name))
        return self.objects.pop(self._key(kind, namespace, name), None) is not None

    # -- what a cluster would do, played by the tests
    def put(self, obj):
        m = obj["metadata"]
        self.objects[self._key(obj["kind"], m.get("namespace", "default"), m["name"])] = obj

    def of_kind(self, kind):
        return {n: o for (k, _, n), o in self.objects.items() if k == kind}

    def run_statefulsets(self, ready=True, ip="10.0.0.1", router_pods=False):
        """Play the StatefulSet controller + kubelet: pods for every StatefulSet; drop orphaned pods.
        Routers: the Deployments' status, and their pods too with router_pods."""
        stss = self.of_kind("StatefulSet")
        for name, sts in stss.items():
            for i in range(sts["spec"]["replicas"]):
                pname = f"{name}-{i}"
                if ("Pod", "default", pname) in self.objects:
                    continue
                tpl = sts["spec"]["template"]
                self.put({"apiVersion": "v1", "kind": "Pod",
                          "metadata": {"name": pname, "namespace": "default",
                                       "labels": {**tpl["metadata"]["labels"], "apps.kubernetes.io/pod-index": str(i)}},
                          "spec": tpl["spec"],
                          "status": {"phase": "Running", "podIP": ip,
                                     "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                                     "containerStatuses": [{"name": "shoal", "restartCount": 0}]}})
        # The Deployment controller, for the routers: ready pods `<deployment>-<i>` and its status.
        deps = self.of_kind("Deployment")
        for name, dep in deps.items():
            tpl = dep["spec"]["template"]
            for i in range(dep["spec"]["replicas"] if router_pods else 0):
                self.put({"apiVersion": "v1", "kind": "Pod",
                          "metadata": {"name": f"{name}-{i}", "namespace": "default",
                                       "labels": dict(tpl["metadata"]["labels"])},
                          "spec": tpl["spec"],
                          "status": {"phase": "Running", "podIP": ip,
                                     "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}})
            dep["status"] = {"replicas": dep["spec"]["replicas"], "readyReplicas": dep["spec"]["replicas"] if ready else 0}
        for name, pod in list(self.of_kind("Pod").items()):
            labels = pod["metadata"]["labels"]
            if "shoal.dev/router" in labels:
                gone = not any(d["spec"]["selector"]["matchLabels"].items() <= labels.items() for d in deps.values())
            else:
                gone = labels.get("shoal.dev/group") not in stss
            if gone:
                del self.objects[("Pod", "default", name)]


def merge(dst: dict, patch: dict) -> dict:
    for k, v in patch.items():
        if v is None:
            dst.pop(k, None)
        elif isinstance(v, dict) and isinstance(dst.get(k), dict):
            merge(dst[k], v)
        else:
            dst[k] = v
    return dst
