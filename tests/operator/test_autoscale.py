"""The autoscaler driven through a simulated load trace.

Each round (15 s apart, as the timer would) the simulated groups report their share of
the offered load; the decision is carried into the next round exactly as the
controller does (state through `status.autoscaler`, serialised to JSON and back, as a
restart would).
"""

from __future__ import annotations

import json
import math
import random

from shoal.operator.autoscale import decide, desired_replicas, raw_recommendation

CONFIG = {"minReplicas": 1, "maxReplicas": 8, "targetQueueDepth": 32,
          "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 300, "tolerance": 0.1}
STEP = 15.0


def simulate(trace, config=CONFIG, start=1):
    """trace: total in-flight requests per round. Returns the desired count after each round."""
    replicas, state, out = start, {}, []
    for i, load in enumerate(trace):
        loads = [load / replicas] * replicas  # each ready group holds its share
        d = decide(now=i * STEP, current=replicas, loads=loads, config=config, state=state)
        state = json.loads(json.dumps(d.state))  # through the resource's status
        replicas = d.replicas
        out.append(replicas)
    return out


def test_formula_and_tolerance():
    assert raw_recommendation(2, [32, 32], 32) == 2
    assert raw_recommendation(2, [34, 34], 32) == 2       # 6% over: within tolerance
    assert raw_recommendation(2, [40, 40], 32) == 3       # ceil(2 * 1.25)
    assert raw_recommendation(4, [1, 1, 1, 1], 32) == 1
    assert raw_recommendation(3, [], 32) is None


def test_ramp_follows_the_load_within_bounds():
    trace = [32 * k for k in range(1, 11)]  # 32 .. 320 requests
    out = simulate(trace)
    for load, replicas in zip(trace, out):
        assert replicas == min(8, max(1, math.ceil(load / 32)))


def test_spike_scales_up_at_once_and_stays_up_through_the_window():
    trace = [20] * 4 + [250] * 2 + [20] * 30
    out = simulate(trace)
    assert out[3] == 1
    assert out[4] == 8  # 250/32 -> 8 (the max)
    # After the spike the count holds for the whole 300 s scale-down window ...
    spike_end = 5
    window_rounds = int(CONFIG["scaleDownStabilizationSeconds"] / STEP)
    assert all(r == 8 for r in out[spike_end: spike_end + window_rounds])
    # ... and only then goes down to what the load needs.
    assert out[-1] == 1
    assert min(out[: spike_end + window_rounds]) >= 1


def test_idle_scales_down_to_min_only_after_the_window():
    trace = [200] * 3 + [0] * 40
    out = simulate(trace, start=7)
    first_down = next(i for i, r in enumerate(out) if r < out[2])
    assert (first_down - 2) * STEP >= CONFIG["scaleDownStabilizationSeconds"]
    assert out[-1] == CONFIG["minReplicas"]


def test_noise_does_not_flap():
    rng = random.Random(7)
    trace = [4 * 32 * (1 + rng.uniform(-0.25, 0.25)) for _ in range(200)]
    out = simulate(trace, start=4)
    changes = sum(1 for a, b in zip(out, out[1:]) if a != b)
    # Up-moves follow peaks at once, down-moves need 300 s of calm: a handful of changes, not a flip per round.
    assert changes <= 6, out
    assert all(4 <= r <= 5 for r in out[5:]), out


def test_scale_up_stabilization_window():
    config = dict(CONFIG, scaleUpStabilizationSeconds=60)
    out = simulate([20] * 3 + [200] * 10, config=config)
    assert out[3] == 1 and out[4] == 1 and out[6] == 1   # within 60 s the lowest recommendation wins
    assert out[7] == 7                                     # sustained for 60 s: scale up


def test_bounds_and_no_metrics():
    config = dict(CONFIG, minReplicas=2, maxReplicas=3)
    assert simulate([1000] * 3, config=config, start=2)[-1] == 3
    assert simulate([0] * 40, config=config, start=3)[-1] == 2
    d = decide(now=0, current=5, loads=[], config=CONFIG, state={})
    assert d.replicas == 5 and d.direction == "hold"   # no data: no change
    d = decide(now=0, current=12, loads=[], config=CONFIG, state={})
    assert d.replicas == 8                              # but bounds always hold


def test_state_survives_a_restart():
    d1 = decide(now=0, current=1, loads=[300], config=CONFIG, state={})
    assert d1.replicas == 8 and d1.direction == "up"
    restored = json.loads(json.dumps(d1.state))
    d2 = decide(now=60, current=8, loads=[0] * 8, config=CONFIG, state=restored)
    assert d2.replicas == 8 and d2.direction == "hold"  # the window remembers the high recommendation
    d3 = decide(now=400, current=8, loads=[0] * 8, config=CONFIG, state=d2.state)
    assert d3.replicas == 1 and d3.direction == "down"


# ---------------------------------------------------------------- issue 19, defects 1 and 6

IDLE_CONFIG = {"minReplicas": 1, "maxReplicas": 4, "targetQueueDepth": 16, "scaleDownStabilizationSeconds": 300}


def test_a_fresh_resource_is_not_scaled_down_within_its_window():
    # Seeded with the current count (as HPA does): idle at creation holds for the whole window.
    d = decide(now=1000, current=2, loads=[0, 0], config=IDLE_CONFIG, state={})
    assert d.replicas == 2 and d.direction == "hold"
    state = json.loads(json.dumps(d.state))
    for t in range(1015, 1300, 15):
        d = decide(now=t, current=2, loads=[0, 0], config=IDLE_CONFIG, state=state)
        assert d.replicas == 2, t
        state = json.loads(json.dumps(d.state))
    d = decide(now=1301, current=2, loads=[0, 0], config=IDLE_CONFIG, state=state)
    assert d.replicas == 1 and d.direction == "down"


def test_a_fresh_resource_still_scales_up_at_once():
    d = decide(now=0, current=1, loads=[300], config=CONFIG, state={})
    assert d.replicas == 8


def test_a_group_still_loading_is_not_idle():
    # Two groups desired, one reports 3 requests, the other is still loading its model:
    # assumed at the target for a scale-down, as HPA does with pods missing metrics.
    state = {"recommendations": []}
    d = decide(now=1000, current=2, loads=[3], config=IDLE_CONFIG, state=state)
    assert d.replicas == 2, d
    assert raw_recommendation(2, [3], 16, missing=1) == 2
    assert raw_recommendation(2, [40], 16, missing=1) == 3   # a scale-up still counts it idle: ceil(40/16)
    assert raw_recommendation(2, [20], 16, missing=1) == 2   # 20 + 0 over 2 groups: down, flipped -> hold


def test_the_window_in_status_stays_short_and_times_are_rfc3339():
    state = {}
    for i in range(200):
        d = decide(now=1_800_000_000 + 15 * i, current=4, loads=[64] * 4, config=CONFIG, state=state)
        state = json.loads(json.dumps(d.state))
    recs = state["recommendations"]
    assert len(recs) <= 2, recs   # the same recommendation every tick: one entry, not one per tick
    assert all(isinstance(r["time"], str) and r["time"].endswith("Z") for r in recs)
    assert "e+" not in json.dumps(state)


def test_state_from_an_older_operator_with_float_times_is_read():
    d = decide(now=1000, current=4, loads=[0] * 4, config=CONFIG,
               state={"recommendations": [{"time": 900.0, "replicas": 4}], "lastScaleTime": 900.0})
    assert d.replicas == 4 and d.state["recommendations"][0] == {"time": "1970-01-01T00:16:40Z", "replicas": 4}
    assert d.state["lastScaleTime"] == "1970-01-01T00:15:00Z"


def test_a_steady_recommendation_leaves_the_state_unchanged():
    # Status is written only on change: the same load tick after tick must not change the state.
    d = decide(now=0, current=2, loads=[40, 40], config=CONFIG, state={})
    states = []
    for i in range(1, 30):
        d = decide(now=15 * i, current=d.replicas, loads=[80 / d.replicas] * d.replicas, config=CONFIG,
                   state=d.state)
        states.append(json.dumps(d.state, sort_keys=True))
    # 29 rounds, three states: after the scale-up, steady, and once the creation seed left the window
    assert len(set(states)) <= 3, states


def test_desired_replicas_is_the_spec_or_the_last_decision_within_bounds():
    auto = {"enabled": True, "minReplicas": 2, "maxReplicas": 4}
    assert desired_replicas({"spec": {"replicas": 3, "autoscaling": {**auto, "enabled": False}},
                             "status": {"desiredReplicas": 1}}) == 3
    assert desired_replicas({"spec": {"replicas": 3, "autoscaling": auto}}) == 3           # first sight
    assert desired_replicas({"spec": {"replicas": 3, "autoscaling": auto}, "status": {"desiredReplicas": 9}}) == 4
    assert desired_replicas({"spec": {"replicas": 1, "autoscaling": auto}}) == 2
    assert desired_replicas({"spec": {"replicas": 3, "autoscaling": auto}, "status": {"desiredReplicas": 2}}) == 2
