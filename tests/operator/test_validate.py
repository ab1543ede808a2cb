"""The operator refuses what the CRD's CEL rules refuse, before it touches any child
(a cluster may run an older CRD): status says InvalidSpec, nothing is rendered."""

from __future__ import annotations

import jsonschema
import pytest

from shoal.operator import controller as ctl
from shoal.operator import defaults, validate
from shoal_op_helpers import FakeKube, make_body
from test_crd import BAD, GOOD, validate_resource

# The issue-19 cases of test_crd.BAD (the others are plain schema checks: types, bounds).
ISSUE_19 = [k for k in BAD if k.startswith(("gpu", "mig", "extraArgs", "volume", "second", "SHOAL", "negative",
                                             "pvc", "interval", "min > max", "adapter")) or k == "negative replicas"]


@pytest.mark.parametrize("case", ISSUE_19)
def test_the_operator_refuses_what_the_crd_refuses(case):
    assert validate.problems(defaults.apply_defaults(make_body(**BAD[case])))


@pytest.mark.parametrize("name", ["llama.v2", "8b-llama", "x" * 39])
def test_bad_names(name):
    assert validate.problems(defaults.apply_defaults(make_body(name=name)))


@pytest.mark.parametrize("case", sorted(GOOD))
def test_good_specs_pass(case):
    assert validate.problems(defaults.apply_defaults(make_body(**GOOD[case]))) == []


def test_an_invalid_spec_is_reported_and_no_child_is_touched():
    kube = FakeKube()
    events = []
    c = ctl.Controller(kube, events=lambda b, t, r, m: events.append((t, r, m)), clock=lambda: 1000.0)
    body = make_body(parallelism={"tensor": 2}, resources={"limits": {"nvidia.com/gpu": 4}})
    body["metadata"]["generation"] = 2
    kube.put(body)
    c.trigger("default", "demo")
    assert [k for k, _, _ in kube.objects] == ["InferenceDeployment"]
    st = kube.objects[("InferenceDeployment", "default", "demo")]["status"]
    conds = {x["type"]: (x["status"], x["reason"]) for x in st["conditions"]}
    assert conds == {"Ready": ("False", "InvalidSpec"), "Progressing": ("False", "InvalidSpec"),
                     "Degraded": ("True", "InvalidSpec")}
    assert "nvidia.com/gpu" in st["conditions"][0]["message"] and st["observedGeneration"] == 2
    assert [r for _, r, _ in events] == ["InvalidSpec"]
    kube.calls.clear()
    c.trigger("default", "demo", scrape=True)            # unchanged: no second write, no second event
    assert [x for x in kube.calls if x[0] != "get"] == [] and len(events) == 1


def test_a_service_account_needs_the_admins_leave():
    body = defaults.apply_defaults(make_body(podTemplate={"serviceAccountName": "cluster-admin-ish"}))
    assert "serviceAccountName" in validate.problems(body)[0]
    assert validate.problems(body, allow_service_account=True) == []
    kube = FakeKube()
    kube.put(make_body(podTemplate={"serviceAccountName": "reader"}))
    ctl.Controller(kube, events=lambda *a: None, clock=lambda: 0.0, allow_service_account=True).trigger("default", "demo")
    (sts,) = kube.of_kind("StatefulSet").values()
    pod = sts["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "reader" and pod["automountServiceAccountToken"] is False


@pytest.mark.parametrize("spec", [
    {"replicas": -1}, {"replicas": 513}, {"replicas": "2"}, {"replicas": True},
    {"autoscaling": {"enabled": True, "minReplicas": -1}},
    {"autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 0}},
    {"autoscaling": {"enabled": True, "minReplicas": 4, "maxReplicas": 3}},
])
def test_group_counts_outside_the_crds_bounds_are_refused(spec):
    """Issue 36: the rollout planner trusts the count (a negative one would delete every group).
    The CRD (schema and CEL, as the API server runs them) is the reference: it refuses each too."""
    body = make_body(**spec)
    assert validate.problems(defaults.apply_defaults(body))
    with pytest.raises(jsonschema.ValidationError):
        validate_resource(body)


def test_a_negative_replica_count_deletes_no_group():
    kube = FakeKube()
    c = ctl.Controller(kube, events=lambda *a: None, clock=lambda: 1000.0)
    body = make_body(replicas=2)
    kube.put(body)
    c.trigger("default", "demo")
    assert len(kube.of_kind("StatefulSet")) == 2
    body["spec"]["replicas"] = -1
    c.trigger("default", "demo")
    assert len(kube.of_kind("StatefulSet")) == 2
    assert any(x["reason"] == "InvalidSpec" for x in body["status"]["conditions"])
