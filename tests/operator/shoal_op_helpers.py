"""Shared helpers of the operator tests (a module, not a package: tests/ has no __init__)."""

from __future__ import annotations

import http.server
import json
import os
import pathlib
import threading
from typing import Any

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


class FakeLeader(http.server.BaseHTTPRequestHandler):
    """One group leader's LoRA endpoints over HTTP, in vLLM's (and `shoal serve`'s) shapes:
    GET /v1/models (adapters with `parent` and their path as `root`), POST
    /v1/load_lora_adapter and /v1/unload_lora_adapter. It starts with the pod's own
    `--lora-modules`, and refuses a path with no adapter_config.json (404) and a name
    already loaded (400), as the runtime does."""
    adapters: dict[str, str]
    calls: list[tuple[str, str]]
    check_files = True

    def _reply(self, code: int, body: Any) -> None:
        data = (body if isinstance(body, str) else json.dumps(body)).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802
        if self.path != "/v1/models":
            return self._reply(404, {"error": {"message": "no such route"}})
        cards = [{"id": "demo", "object": "model", "root": "builtin://smollm2-135m-instruct", "parent": None}]
        cards += [{"id": n, "object": "model", "root": p, "parent": "demo"} for n, p in sorted(self.adapters.items())]
        self._reply(200, {"object": "list", "data": cards})

    def do_POST(self):  # noqa: N802
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        name = req["lora_name"]
        self.calls.append((self.path, name))
        if self.path == "/v1/load_lora_adapter":
            if name in self.adapters and not req.get("load_inplace"):
                return self._reply(400, {"error": {"message": f"an adapter named {name!r} is already loaded"}})
            if self.check_files and not os.path.exists(os.path.join(req["lora_path"], "adapter_config.json")):
                return self._reply(404, {"error": {"message": f"no PEFT adapter at {req['lora_path']!r}"}})
            self.adapters[name] = req["lora_path"]
            return self._reply(200, f"Success: LoRA adapter '{name}' added successfully.")
        if self.path == "/v1/unload_lora_adapter":
            if self.adapters.pop(name, None) is None:
                return self._reply(404, {"error": {"message": f"no adapter named {name!r} is loaded"}})
            return self._reply(200, f"Success: LoRA adapter '{name}' removed successfully.")
        self._reply(404, {"error": {"message": "no such route"}})

    def log_message(self, *args):
        pass


class FakeLeaders:
    """A FakeLeader server per leader pod (by pod uid: a recreated pod would be a new one)."""

    def __init__(self, check_files: bool = True):
        self.check_files = check_files
        self.servers: dict[str, tuple[http.server.ThreadingHTTPServer, type]] = {}

    def url(self, pod: dict) -> str | None:
        if not (pod.get("status") or {}).get("podIP"):
            return None
        uid = pod["metadata"].get("uid") or pod["metadata"]["name"]
        if uid not in self.servers:
            args = pod["spec"]["containers"][0]["args"]
            start = {}
            if "--lora-modules" in args:   # what `shoal serve --lora-modules NAME=PATH ...` starts with
                for a in args[args.index("--lora-modules") + 1:]:
                    if a.startswith("--"):
                        break
                    n, _, p = a.partition("=")
                    start[n] = p
            handler = type("Leader", (FakeLeader,), {"adapters": start, "calls": [], "check_files": self.check_files})
            server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            self.servers[uid] = (server, handler)
        return f"http://127.0.0.1:{self.servers[uid][0].server_address[1]}"

    def close(self):
        for server, _ in self.servers.values():
            server.shutdown()


def make_adapter(root, name: str) -> str:
    """A directory the fake leader accepts (it looks for adapter_config.json, as the runtime does)."""
    d = root / name
    d.mkdir()
    (d / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4, "lora_alpha": 8}')
    return str(d)
