"""Reading a group leader's queue depth from its Prometheus metrics (docs/design.md: a
group's queue depth is shoal_num_requests_running + shoal_num_requests_waiting), and the
requests a Shoal router holds while no group is ready (shoal_router_pending_requests); a
pod's HTTP address (pod_url: the group leaders' LoRA endpoints are called there too)."""

from __future__ import annotations

import urllib.request
from typing import Any

from shoal.operator import render


def fetch_metrics(url: str, timeout: float = 2.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (cluster-internal http)
        return resp.read().decode()


def queue_depth(text: str) -> float:
    """Requests a leader holds: shoal_num_requests_running + shoal_num_requests_waiting (all models)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in ("shoal_num_requests_running", "shoal_num_requests_waiting"):
                total += float(sample.value)
    return total


ROUTER_PENDING = "shoal_router_pending_requests"


def pending_requests(text: str) -> float:
    """Requests a router holds, waiting for a group (shoal_router_pending_requests, all series)."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(float(sample.value) for family in text_string_to_metric_families(text)
               for sample in family.samples if sample.name == ROUTER_PENDING)


def metrics_url(pod: dict[str, Any]) -> str | None:
    base = pod_url(pod)
    return base + "/metrics" if base else None


def pod_url(pod: dict[str, Any]) -> str | None:
    """http://IP:PORT of a pod's `http` port (its runtime's API), None before it has an IP."""
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    port = render.HTTP_PORT
    for c in (pod.get("spec") or {}).get("containers") or []:
        for p in c.get("ports") or []:
            if p.get("name") == "http":
                port = p.get("containerPort", port)
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}"
