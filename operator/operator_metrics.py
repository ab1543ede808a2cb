"""The operator's own Prometheus metrics (names are a contract with manifests/monitoring/).

- shoal_operator_reconcile_total{result}            result: success | error
- shoal_operator_reconcile_errors_total
- shoal_operator_reconcile_duration_seconds          histogram
- shoal_operator_desired_groups{namespace,name}
- shoal_operator_ready_groups{namespace,name}
- shoal_operator_autoscaler_decisions_total{namespace,name,direction}   direction: up | down | hold
- shoal_operator_group_restarts_total{namespace,name}
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

REGISTRY = CollectorRegistry(auto_describe=True)

RECONCILE_TOTAL = Counter("shoal_operator_reconcile_total", "Reconciliations by result",
                          ["result"], registry=REGISTRY)
RECONCILE_ERRORS = Counter("shoal_operator_reconcile_errors_total", "Failed reconciliations",
                           registry=REGISTRY)
RECONCILE_DURATION = Histogram("shoal_operator_reconcile_duration_seconds", "Time to reconcile one resource",
                               buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
                               registry=REGISTRY)
DESIRED_GROUPS = Gauge("shoal_operator_desired_groups", "Desired pod groups",
                       ["namespace", "name"], registry=REGISTRY)
READY_GROUPS = Gauge("shoal_operator_ready_groups", "Ready pod groups",
                     ["namespace", "name"], registry=REGISTRY)
AUTOSCALER_DECISIONS = Counter("shoal_operator_autoscaler_decisions_total", "Autoscaler decisions by direction",
                               ["namespace", "name", "direction"], registry=REGISTRY)
GROUP_RESTARTS = Counter("shoal_operator_group_restarts_total", "Groups restarted as a whole after a pod failed",
                         ["namespace", "name"], registry=REGISTRY)

# Pre-create the label-less children so the series exist (at 0) from the start.
for _result in ("success", "error"):
    RECONCILE_TOTAL.labels(_result)


@contextlib.contextmanager
def reconciling() -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    except BaseException:
        RECONCILE_TOTAL.labels("error").inc()
        RECONCILE_ERRORS.inc()
        raise
    else:
        RECONCILE_TOTAL.labels("success").inc()
    finally:
        RECONCILE_DURATION.observe(time.perf_counter() - start)


def set_groups(namespace: str, name: str, desired: int, ready: int) -> None:
    DESIRED_GROUPS.labels(namespace, name).set(desired)
    READY_GROUPS.labels(namespace, name).set(ready)


def autoscaler_decision(namespace: str, name: str, direction: str) -> None:
    AUTOSCALER_DECISIONS.labels(namespace, name, direction).inc()


def group_restarted(namespace: str, name: str) -> None:
    GROUP_RESTARTS.labels(namespace, name).inc()


def forget(namespace: str, name: str) -> None:
    """Drop every per-resource series of a deleted InferenceDeployment (gauges and counters)."""
    for gauge in (DESIRED_GROUPS, READY_GROUPS, GROUP_RESTARTS):
        with contextlib.suppress(KeyError):
            gauge.remove(namespace, name)
    for direction in ("up", "down", "hold"):
        with contextlib.suppress(KeyError):
            AUTOSCALER_DECISIONS.remove(namespace, name, direction)


def serve(port: int, addr: str = "0.0.0.0") -> None:
    start_http_server(port, addr=addr, registry=REGISTRY)
