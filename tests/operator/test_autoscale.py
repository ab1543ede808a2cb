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

from shoal.operator.autoscale import decide, raw_recommendation

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
