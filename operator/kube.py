"""A small, generic Kubernetes REST client over the `kubernetes` package's ApiClient.

Generic (paths by apiVersion/kind) so that one code path serves core objects,
StatefulSets, PDBs and prometheus-operator monitors alike, with server-side apply.
"""

from __future__ import annotations

import json
import os
import logging
import threading
from typing import Any
from urllib.parse import quote

from kubernetes import client as k8s_client
from kubernetes import config as k8s_config


log = logging.getLogger(__name__)

FIELD_MANAGER = "shoal-operator"  # server-side apply: the fields this operator owns

PLURALS = {
    "Service": "services",
    "Pod": "pods",
    "Event": "events",
    "StatefulSet": "statefulsets",
    "Deployment": "deployments",
    "InferencePool": "inferencepools",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "NetworkPolicy": "networkpolicies",
    "PersistentVolumeClaim": "persistentvolumeclaims",
    "Job": "jobs",
    "PodGroup": "podgroups",
    "ServiceMonitor": "servicemonitors",
    "PodMonitor": "podmonitors",
    "InferenceDeployment": "inferencedeployments",
}


class ApiError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status


def collection_path(api_version: str, kind: str, namespace: str) -> str:
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    return f"{base}/namespaces/{quote(namespace)}/{PLURALS[kind]}"


def object_path(api_version: str, kind: str, namespace: str, name: str) -> str:
    return f"{collection_path(api_version, kind, namespace)}/{quote(name)}"


_lock = threading.Lock()
_default: Kube | None = None


def default() -> Kube:
    """One client per process, configured in-cluster or from KUBECONFIG."""
    global _default
    with _lock:
        if _default is None:
            try:
                k8s_config.load_incluster_config()
            except k8s_config.ConfigException:
                # KUBECONFIG is read now (the library reads it once, at import).
                k8s_config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
            _default = Kube(k8s_client.ApiClient())
        return _default


def reset_default() -> None:
    global _default
    with _lock:
        _default = None


class Kube:
    def __init__(self, api: k8s_client.ApiClient):
        self.api = api

    def request(self, method: str, path: str, *, body: Any = None, query: list[tuple[str, str]] | None = None,
                content_type: str = "application/json", timeout: float = 30) -> Any:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        method_, url, headers, _, _ = self.api.param_serialize(
            method, path, query_params=query or [], header_params=headers, auth_settings=["BearerToken"])
        # The REST layer serialises dict bodies itself for JSON and structured-YAML content types.
        resp = self.api.call_api(method_, url, header_params=headers, body=body, _request_timeout=timeout)
        raw = resp.read()
        if not 200 <= resp.status < 300:
            try:
                message = json.loads(raw).get("message", "")
            except (ValueError, AttributeError):
                message = raw[:200].decode(errors="replace") if raw else ""
            raise ApiError(resp.status, f"{method} {path}: {message}")
        return json.loads(raw) if raw else None

    # -------------------------------------------------------------- reads

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.request("GET", object_path(api_version, kind, namespace, name))
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def list(self, api_version: str, kind: str, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        selector = ",".join(f"{k}={v}" for k, v in labels.items())
        data = self.request("GET", collection_path(api_version, kind, namespace),
                            query=[("labelSelector", selector)] if selector else None)
        items = (data or {}).get("items") or []
        # Filter here too: a server (or a mock) that ignores the selector must not leak other objects.
        return [i for i in items if all((i.get("metadata", {}).get("labels") or {}).get(k) == v
                                        for k, v in labels.items())]

    # -------------------------------------------------------------- writes

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply (our field manager, forced on our fields only); create if the server cannot."""
        meta = obj["metadata"]
        path = object_path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        try:
            return self.request("PATCH", path, body=obj, content_type="application/apply-patch+yaml",
                                query=[("fieldManager", FIELD_MANAGER), ("force", "true")])
        except ApiError as e:
            if e.status != 404:
                raise
        # A real API server creates on apply; simpler servers need a POST.
        return self.request("POST", collection_path(obj["apiVersion"], obj["kind"], meta["namespace"]), body=obj,
                            query=[("fieldManager", FIELD_MANAGER)])

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        return self.request("POST", collection_path(obj["apiVersion"], obj["kind"], meta["namespace"]), body=obj,
                            query=[("fieldManager", FIELD_MANAGER)])

    def merge_patch(self, api_version: str, kind: str, namespace: str, name: str, patch: dict[str, Any],
                    subresource: str | None = None) -> dict[str, Any]:
        path = object_path(api_version, kind, namespace, name) + (f"/{subresource}" if subresource else "")
        return self.request("PATCH", path, body=patch, content_type="application/merge-patch+json",
                            query=[("fieldManager", FIELD_MANAGER)])

    def delete(self, api_version: str, kind: str, namespace: str, name: str,
               propagation: str = "Background") -> bool:
        try:
            self.request("DELETE", object_path(api_version, kind, namespace, name),
                         body={"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": propagation})
            return True
        except ApiError as e:
            if e.status == 404:
                return False
            raise
