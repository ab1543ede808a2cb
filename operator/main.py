"""The kopf handlers: thin. Each one only says *when* to reconcile (controller.py says what).

- create / update (of the spec) / resume of an InferenceDeployment: reconcile now;
- a timer per InferenceDeployment (every SHOAL_OPERATOR_RESYNC_SECONDS, default 10):
  scrape the ready leaders' queue depth, autoscale, reconcile (this also re-asserts
  the children and advances a rollout even if a watch event was missed);
- any change of a StatefulSet labelled `shoal.dev/deployment` (its status follows its
  pods' readiness): reconcile its owner, so a rollout advances as soon as a group is ready;
- a change of a pod labelled `shoal.dev/deployment` that failed or whose container
  restarted: reconcile its owner, so the group is restarted at once;
- delete: forget the in-memory state (children go by ownerReferences; optional, so
  this adds no finalizer of its own; the timer makes kopf add one so the timer stops first).

Run it with `shoal operator run` (or `kopf run -m shoal.operator.main`).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import kopf

from shoal.operator import controller as controller_mod
from shoal.operator import crd, kube, render

RESYNC_SECONDS = float(os.environ.get("SHOAL_OPERATOR_RESYNC_SECONDS", "10"))
CLUSTER_DOMAIN = os.environ.get("SHOAL_CLUSTER_DOMAIN", "cluster.local")
ALLOW_POD_SERVICE_ACCOUNT = os.environ.get("SHOAL_OPERATOR_ALLOW_POD_SERVICE_ACCOUNT", "0") == "1"

_controller: controller_mod.Controller | None = None


def _event(body: dict[str, Any], type_: str, reason: str, message: str) -> None:
    controller_mod.log_event(body, type_, reason, message)
    try:
        kopf.event(body, type=type_, reason=reason, message=message)
    except LookupError:  # outside kopf's context (no poster): the log line is all
        pass


def get_controller() -> controller_mod.Controller:
    global _controller
    if _controller is None:
        _controller = controller_mod.Controller(kube.default, events=_event, cluster_domain=CLUSTER_DOMAIN,
                                                allow_service_account=ALLOW_POD_SERVICE_ACCOUNT)
    return _controller


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """In-cluster service account, else KUBECONFIG (read at login time, not at import)."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.finalizer = "shoal.dev/operator"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="shoal.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="shoal.dev", key="last-handled-configuration")
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 300
    settings.execution.max_workers = 8
    # A resync timer still running when its object is deleted holds kopf's finalizer, and kopf
    # looks again only every cancellation_polling seconds (60 by default): a `kubectl delete`
    # could hang a minute. The timer's work is short, so look every second.
    settings.background.cancellation_polling = 1.0
    # Scanning notices CRDs and namespaces appearing later; off only where the API cannot list
    # namespaces (e.g. the KMock emulator in tests/operator).
    settings.scanning.disabled = os.environ.get("SHOAL_OPERATOR_SCANNING", "1") == "0"
    # kopf filters handler labels client-side: without these the pod and StatefulSet watches
    # would stream every pod and StatefulSet of the watched namespaces. Only ours, server-side.
    settings.watching.label_selectors["v1", "pods"] = render.L_DEPLOYMENT
    settings.watching.label_selectors["apps", "statefulsets"] = render.L_DEPLOYMENT
    get_controller()


@kopf.on.create(crd.GROUP, crd.VERSION, crd.PLURAL)
@kopf.on.resume(crd.GROUP, crd.VERSION, crd.PLURAL)
@kopf.on.update(crd.GROUP, crd.VERSION, crd.PLURAL, field="spec")
def apply(namespace: str, name: str, **_: Any) -> None:
    try:
        get_controller().trigger(namespace, name)
    except Exception as e:
        raise kopf.TemporaryError(str(e), delay=5) from e


@kopf.timer(crd.GROUP, crd.VERSION, crd.PLURAL, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS / 2)
def resync(namespace: str, name: str, **_: Any) -> None:
    get_controller().trigger(namespace, name, scrape=True)


# StatefulSets only, not pods: their status (readyReplicas) changes whenever a group's pod
# turns ready or unready, and watching every pod of a cluster would cost far more.
@kopf.on.event("apps", "v1", "statefulsets", labels={render.L_DEPLOYMENT: kopf.PRESENT})
def child_changed(namespace: str, labels: dict[str, str], type: str | None, **_: Any) -> None:
    _reconcile_owner(namespace, labels, type, "a child change")


# Pods of our groups (server-side label selector, see configure), only those that failed or whose
# container restarted: a group failure is acted on at once, not at the next resync.
@kopf.on.event("", "v1", "pods", labels={render.L_DEPLOYMENT: kopf.PRESENT},
               when=lambda body, **_: controller_mod.pod_failed(body))
def pod_failed(namespace: str, labels: dict[str, str], type: str | None, **_: Any) -> None:
    _reconcile_owner(namespace, labels, type, "a pod failure")


def _reconcile_owner(namespace: str, labels: dict[str, str], type: str | None, what: str) -> None:
    """A watched child's event: reconcile the InferenceDeployment that owns it."""
    if type is None:
        return  # the initial listing: resume/timers cover it
    try:
        get_controller().trigger(namespace, labels[render.L_DEPLOYMENT])
    except Exception as e:  # the next event or the timer retries
        logging.getLogger("shoal.operator").warning("reconcile after %s failed: %s", what, e)


@kopf.on.delete(crd.GROUP, crd.VERSION, crd.PLURAL, optional=True)
def deleted(namespace: str, name: str, **_: Any) -> None:
    get_controller().forget(namespace, name)
