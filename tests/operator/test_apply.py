"""operator/apply.py: drift comparison, quantities, the quiet reads and the applier."""

from __future__ import annotations

import pytest

from shoal.operator import apply, render
from shoal.operator.kube import ApiError
from shoal_op_helpers import FakeKube, make_body


def test_drift_ignores_what_the_server_adds():
    obj = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "a", "labels": {"x": "1"}},
           "spec": {"selector": {"a": "b"}, "ports": [{"port": 8000, "name": "http"}]}}
    live = {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "a", "uid": "u", "resourceVersion": "9", "labels": {"x": "1", "other": "y"}},
            "spec": {"selector": {"a": "b"}, "clusterIP": "10.0.0.1",
                     "ports": [{"port": 8000, "name": "http", "protocol": "TCP", "targetPort": 8000}]}}
    assert apply.drift(obj, live) == []
    # quantities as the server normalises them are not drift
    assert apply.drift({"limits": {"cpu": 0.5, "memory": "1024Mi", "nvidia.com/gpu": 2}},
                       {"limits": {"cpu": "500m", "memory": "1Gi", "nvidia.com/gpu": "2"}}) == []
    assert apply.drift({"limits": {"cpu": "1"}}, {"limits": {"cpu": "2"}}) == ["limits.cpu"]
    live["spec"]["selector"]["c"] = "d"
    live["spec"]["ports"][0]["port"] = 80
    assert apply.drift(obj, live) == ["spec.selector", "spec.ports[0].port"]


class Refusing(FakeKube):
    """Answers every read and delete with one API error (RBAC's 403, a missing CRD's 404, a 500)."""

    def __init__(self, status: int):
        super().__init__()
        self.status = status

    def get(self, *a):
        raise ApiError(self.status, "no")

    list = delete = get


@pytest.mark.parametrize("code", [403, 404])
def test_quiet_reads_take_a_refusal_as_nothing(code):
    kube = Refusing(code)
    assert apply.get_quietly(kube, "v1", "Service", "default", "a") is None
    assert apply.list_quietly(kube, "v1", "Service", "default", {}) == []
    apply.delete_quietly(kube, "v1", "Service", "default", "a")


def test_quiet_reads_raise_anything_else():
    kube = Refusing(500)
    for call in (lambda: apply.get_quietly(kube, "v1", "Service", "default", "a"),
                 lambda: apply.list_quietly(kube, "v1", "Service", "default", {}),
                 lambda: apply.delete_quietly(kube, "v1", "Service", "default", "a")):
        with pytest.raises(ApiError):
            call()


def test_the_applier_skips_what_it_applied_and_waits_for_a_name_being_deleted():
    kube = FakeKube()
    applier = apply.Applier()
    svc = render.headless_service(make_body())
    applier.apply(kube, svc, verify=False)
    applier.apply(kube, svc, verify=False)
    applier.apply(kube, svc, verify=True)   # reads it: same hash, no drift, so no write
    assert [c for c in kube.calls if c[0] == "apply"] == [("apply", "Service", "demo-headless")]
    kube.objects[("Service", "default", "demo-headless")]["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    kube.calls.clear()
    assert applier.apply_now(kube, svc) is False and ("apply", "Service", "demo-headless") not in kube.calls
    applier.forget("default", "demo")
    assert applier.applied == {}
