"""Queue-depth autoscaling, by the HorizontalPodAutoscaler's algorithm. Pure.

- metric: the total queue depth (requests in flight, running + waiting) over the ready
  groups that reported; per group it is compared with `targetQueueDepth`;
- raw recommendation: `ceil(reporting * (total/reporting) / target)` = `ceil(total/target)`,
  or the current count when the ratio is within the tolerance (10%) of 1;
- stabilization (as HPA `behavior`): a scale-up goes to the *lowest* recommendation
  seen in the scale-up window, a scale-down to the *highest* one seen in the
  scale-down window, so brief spikes and dips do not flap the group count;
- bounds: [minReplicas, maxReplicas].

The state (recent recommendations, last scale time) is a plain dict kept in the
resource's `status.autoscaler`, so it survives an operator restart.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class Decision:
    replicas: int          # the new desired group count
    raw: int               # this round's recommendation before stabilization and bounds
    direction: str         # "up" | "down" | "hold"
    reason: str
    state: dict[str, Any]  # the new status.autoscaler


def raw_recommendation(current: int, loads: Sequence[float], target: float, tolerance: float = 0.1) -> int | None:
    """HPA's formula over the reporting groups; None when nobody reported (no data, no change)."""
    if not loads:
        return None
    total = float(sum(loads))
    per_group = total / len(loads)
    ratio = per_group / target
    if abs(ratio - 1.0) <= tolerance:
        return current
    return max(0, math.ceil(len(loads) * ratio - 1e-9))


def decide(
    *,
    now: float,
    current: int,
    loads: Sequence[float],
    config: Mapping[str, Any],
    state: Mapping[str, Any] | None = None,
) -> Decision:
    """One autoscaler round. `current` is the desired count so far, `loads` one queue depth per ready group."""
    lo, hi = int(config["minReplicas"]), int(config["maxReplicas"])
    up_window = float(config.get("scaleUpStabilizationSeconds", 0))
    down_window = float(config.get("scaleDownStabilizationSeconds", 300))
    tolerance = float(config.get("tolerance", 0.1))
    state = dict(state or {})
    recs = [dict(r) for r in state.get("recommendations") or []]

    raw = raw_recommendation(current, loads, float(config["targetQueueDepth"]), tolerance)
    if raw is None:
        bounded = max(lo, min(hi, current))
        direction = "hold" if bounded == current else ("up" if bounded > current else "down")
        return Decision(bounded, current, direction, "no metrics from ready groups", {**state, "recommendations": recs})

    recs.append({"time": now, "replicas": int(raw)})
    horizon = max(up_window, down_window)
    recs = [r for r in recs if r["time"] >= now - horizon]

    up = min([r["replicas"] for r in recs if r["time"] >= now - up_window] or [raw])
    down = max([r["replicas"] for r in recs if r["time"] >= now - down_window] or [raw])
    stabilized = current
    if stabilized < up:
        stabilized = up
    if stabilized > down:
        stabilized = down
    desired = max(lo, min(hi, stabilized))

    if desired > current:
        direction, reason = "up", f"queue depth {sum(loads):g} over {len(loads)} group(s), target {config['targetQueueDepth']}"
    elif desired < current:
        direction, reason = "down", f"queue depth {sum(loads):g} over {len(loads)} group(s), target {config['targetQueueDepth']}"
    else:
        direction = "hold"
        reason = "within tolerance" if raw == current else f"stabilizing (recommendation {raw})"
    new_state = {**state, "recommendations": recs, "lastDirection": direction}
    if direction != "hold":
        new_state["lastScaleTime"] = now
    return Decision(desired, int(raw), direction, reason, new_state)
