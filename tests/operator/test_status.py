"""Conditions follow Kubernetes conventions: observedGeneration, stable lastTransitionTime."""

from __future__ import annotations

from shoal.operator import defaults, status
from shoal.operator.rollout import Group
from shoal_op_helpers import make_body


def build(body, groups, desired=2, revision="new", **kw):
    return status.build(body=body, groups=groups, group_details={}, revision=revision, desired=desired,
                        selector="s", now=kw.pop("now", 1000.0), **kw)


def conds(st):
    return {c["type"]: (c["status"], c["reason"]) for c in st["conditions"]}


def body_with(generation=3, st=None):
    b = defaults.apply_defaults(make_body())
    b["metadata"]["generation"] = generation
    if st:
        b["status"] = st
    return b


def test_rollout_in_progress_then_complete():
    b = body_with()
    st = build(b, [Group("o", "old", 0, True), Group("o2", "old", 1, True), Group("n", "new", 0, False)])
    assert conds(st) == {"Ready": ("False", "RolloutInProgress"), "Available": ("True", "MinimumGroupsAvailable"),
                         "Progressing": ("True", "RolloutInProgress"), "Degraded": ("False", "AsExpected")}
    assert st["observedGeneration"] == 3 and all(c["observedGeneration"] == 3 for c in st["conditions"])
    assert st["replicas"] == 3 and st["readyReplicas"] == 2 and st["updatedReplicas"] == 1
    done = build(body_with(st=st), [Group("n", "new", 0, True), Group("n1", "new", 1, True)], now=2000.0)
    assert conds(done)["Progressing"] == ("False", "RolloutComplete")
    assert conds(done)["Ready"] == ("True", "AllGroupsReady")
    # Available did not change: its lastTransitionTime is kept; Progressing flipped: it is new.
    t = {c["type"]: c["lastTransitionTime"] for c in done["conditions"]}
    t0 = {c["type"]: c["lastTransitionTime"] for c in st["conditions"]}
    assert t["Available"] == t0["Available"] and t["Progressing"] != t0["Progressing"]


def test_unavailable_scaling_and_degraded():
    b = body_with()
    st = build(b, [Group("n", "new", 0, False)], failing=["n"])
    assert conds(st)["Available"] == ("False", "MinimumGroupsUnavailable")
    assert conds(st)["Progressing"] == ("True", "ScalingUp")
    assert conds(st)["Degraded"] == ("True", "GroupFailing")
    st = build(b, [Group("n", "new", 0, True)], desired=1, error="boom")
    assert conds(st)["Degraded"] == ("True", "ReconcileError")
    st = build(b, [Group("n", "new", 0, True), Group("m", "new", 1, True)], desired=1)
    assert conds(st)["Progressing"] == ("True", "ScalingDown")


def test_terminating_groups_are_shown_but_not_counted():
    st = build(body_with(), [Group("n", "new", 0, True), Group("n1", "new", 1, True),
                             Group("x", "old", 0, False, terminating=True)])
    assert st["replicas"] == 2 and conds(st)["Progressing"][1] == "RolloutComplete"
    assert [g["terminating"] for g in st["groups"]] == [True if g["name"] == "x" else False for g in st["groups"]]
    assert status.same(st, dict(st, conditions=[dict(c, lastTransitionTime="x") for c in st["conditions"]]))


def test_ready_condition_and_url():
    # Issue 19: `kubectl wait --for=condition=Ready` and kstatus need a Ready condition.
    b = body_with()
    st = build(b, [Group("n", "new", 0, False)], desired=1, url="http://demo.default.svc.cluster.local:8000")
    assert conds(st)["Ready"] == ("False", "MinimumGroupsUnavailable")
    assert st["url"] == "http://demo.default.svc.cluster.local:8000"
    st = build(b, [Group("n", "new", 0, True)], desired=1)
    assert conds(st)["Ready"] == ("True", "AllGroupsReady")


def test_degraded_holds_until_a_restarted_group_is_stable():
    b = body_with()
    details = {"n": {"restarts": 2, "recentRestarts": 2, "lastRestart": 1000.0}}

    def at(now, ready, prev=None):
        return status.build(body=body_with(st=prev) if prev else b, groups=[Group("n", "new", 0, ready)],
                            group_details=details, revision="new", desired=1, selector="s", now=now)
    st = at(1005, False)
    assert conds(st)["Degraded"] == ("True", "GroupRecovering")
    st = at(1100, True, st)
    assert st["groups"][0]["readySince"] == status.now_rfc3339(1100)
    assert conds(st)["Degraded"][0] == "True"
    st = at(1100 + status.STABLE_SECONDS - 1, True, st)
    assert conds(st)["Degraded"][0] == "True" and st["groups"][0]["readySince"] == status.now_rfc3339(1100)
    st = at(1100 + status.STABLE_SECONDS, True, st)
    assert conds(st)["Degraded"] == ("False", "AsExpected")
    assert st["groups"][0]["lastRestartTime"] == status.now_rfc3339(1000)


def test_documented_reasons_are_the_ones_the_code_writes():
    # Issue 19: docs/gitops.md showed MinimumGroupsReady and RollingUpdate, which no code writes.
    import re

    from shoal_op_helpers import ROOT

    code = (ROOT / "operator" / "status.py").read_text() + (ROOT / "operator" / "controller.py").read_text()
    written = set(re.findall(r'"([A-Z][A-Za-z]+)"', code))
    for doc in ("gitops.md", "operator.md"):
        text = (ROOT / "docs" / doc).read_text()
        documented = set(re.findall(r"reason:\s*([A-Z][A-Za-z]+)", text))
        assert documented <= written, (doc, documented - written)


# ---------------------------------------------------------------- LoRA adapters (issue 31)

def test_adapter_changes_load_the_missing_and_unload_the_removed():
    wanted = {"sql": "/a/sql", "chat": "/a/chat2"}
    loaded = {"chat": "/a/chat", "old": "/a/old", "later": "/a/later"}
    loads, unloads = status.adapter_changes(wanted, {"sql", "chat", "later"}, loaded)
    # a new path for a loaded name is loaded in place; one the group cannot load yet is kept
    assert loads == [("chat", "/a/chat2", True), ("sql", "/a/sql", False)]
    assert unloads == ["old"]
    assert status.adapter_changes(wanted, set(wanted), {"sql": "/a/sql", "chat": "/a/chat2"}) == ([], [])
    assert status.adapter_changes({}, set(), {"x": "/x"}) == ([], ["x"])


def test_adapter_status_lists_every_adapter_on_every_group():
    plans = [{"name": "sql", "source": "hf://o/sql"}, {"name": "chat", "source": "file:///c"}]
    states = {"g-1": {"sql": ("Loaded", ""), "chat": ("Failed", "400: rank 64 over --max-lora-rank 16")},
              "g-0": {"sql": ("Loaded", "")}}
    out = status.adapter_status(plans, states, cache={"sql": "Ready"})
    assert [a["name"] for a in out] == ["sql", "chat"]
    sql, chat = out
    assert sql == {"name": "sql", "source": "hf://o/sql", "loadedGroups": 2, "cache": "Ready",
                   "groups": [{"name": "g-0", "state": "Loaded"}, {"name": "g-1", "state": "Loaded"}]}
    assert chat["loadedGroups"] == 0 and "cache" not in chat
    assert chat["groups"] == [{"name": "g-0", "state": "Pending", "message": "not looked at yet"},
                              {"name": "g-1", "state": "Failed", "message": "400: rank 64 over --max-lora-rank 16"}]
