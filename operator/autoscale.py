"""Queue-depth autoscaling, by the HorizontalPodAutoscaler's algorithm. Pure.

- metric: the total queue depth (requests in flight, running + waiting) over the ready
  groups that reported; per group it is compared with `targetQueueDepth`;
- raw recommendation: `ceil(reporting * (total/reporting) / target)` = `ceil(total/target)`,
  or the current count when the ratio is within the tolerance (10%) of 1;
- groups that should exist but do not report (still loading a model, restarting) are,
  as HPA does with pods missing metrics, assumed at the target on a scale-down and idle
  on a scale-up; if that flips the direction or lands within the tolerance, hold;
- stabilization (as HPA `behavior`): a scale-up goes to the *lowest* recommendation
  seen in the scale-up window, a scale-down to the *highest* one seen in the
  scale-down window, so brief spikes and dips do not flap the group count;
- the window is seeded with the current count the first time a resource is seen (as
  HPA does), so a fresh resource is not scaled down before its scale-down window;
- bounds: [minReplicas, maxReplicas];
- scale to zero (minReplicas 0, routing.mode shoal): `pending`, the requests the routers
  hold, wakes a resource at 0 groups to 1 at once (no stabilization: requests wait), and
  keeps the recommendation at 1 or more while any is held; 1 -> 0 is an ordinary
  scale-down of a queue depth of 0, so it happens after `scaleDownStabilizationSeconds`
  with no traffic.

The state (recent recommendations, last scale time) is a plain dict kept in the
resource's `status.autoscaler`, so it survives an operator restart.
"""

from __future__ import annotations

import dataclasses
import datetime
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


def raw_recommendation(current: int, loads: Sequence[float], target: float, tolerance: float = 0.1,
                       missing: int = 0) -> int | None:
    """HPA's formula over the reporting groups; None when nobody reported (no data, no change).

    `missing`: groups that exist (or should) but did not report; see the module docstring.
    """
    if not loads:
        return None
    total = float(sum(loads))
    ratio = total / len(loads) / target
    if abs(ratio - 1.0) <= tolerance:
        return current
    if missing <= 0:
        return max(0, math.ceil(len(loads) * ratio - 1e-9))
    scale_up = ratio > 1.0
    count = len(loads) + missing
    ratio = (total + (0.0 if scale_up else missing * target)) / count / target
    if abs(ratio - 1.0) <= tolerance or (ratio > 1.0) != scale_up:
        return current
    return max(0, math.ceil(count * ratio - 1e-9))


def decide(
    *,
    now: float,
    current: int,
    loads: Sequence[float],
    config: Mapping[str, Any],
    state: Mapping[str, Any] | None = None,
    pending: float = 0.0,
) -> Decision:
    """One autoscaler round. `current` is the desired count so far, `loads` one queue depth per ready group
    that reported; the `current - len(loads)` others count as missing (see raw_recommendation).
    `pending`: requests the routers hold for want of a ready group (scale from zero)."""
    lo, hi = int(config["minReplicas"]), int(config["maxReplicas"])
    up_window = float(config.get("scaleUpStabilizationSeconds", 0))
    down_window = float(config.get("scaleDownStabilizationSeconds", 300))
    tolerance = float(config.get("tolerance", 0.1))
    state = dict(state or {})
    if isinstance(state.get("lastScaleTime"), (int, float)):  # written by an older operator
        state["lastScaleTime"] = rfc3339(state["lastScaleTime"])
    horizon = max(up_window, down_window)
    recs = [{**r, "time": _seconds(r["time"]), "replicas": int(r["replicas"])}
            for r in state.get("recommendations") or []]
    if "recommendations" not in state:
        # First sight: seed the window with the current count (HPA does), so a resource is
        # not scaled down within its scale-down window of being created.
        recs.append({"time": now, "replicas": int(current), "seed": True})
    # The newest recommendation is an open run: it held until now (see _advance).
    open_run = recs[-1] if recs and not recs[-1].get("seed") else None

    def seen(r: dict[str, Any], window: float) -> bool:
        # a closed run's time is when it was replaced: it held until just before then
        return window > 0 and (r is open_run or r["time"] > now - window)

    if current <= 0 and pending > 0 and hi > 0:
        # Wake from zero now: the requests are waiting (the scale-up window is for load changes).
        desired = max(1, lo)
        recs = _advance(recs, open_run, desired, now)
        return Decision(desired, desired, "up", f"{pending:g} request(s) held by the router, no group running",
                        {**state, "recommendations": _encode(_expire(recs, recs[-1], now, horizon)),
                         "lastDirection": "up", "lastScaleTime": rfc3339(now)})
    raw = raw_recommendation(current, loads, float(config["targetQueueDepth"]), tolerance,
                             missing=max(0, current - len(loads)))
    if raw is not None and pending > 0:
        raw = max(raw, 1)   # held requests need a group: never recommend zero under them
    if raw is None:
        bounded = max(lo, min(hi, current))
        direction = "hold" if bounded == current else ("up" if bounded > current else "down")
        return Decision(bounded, current, direction, "no metrics from ready groups",
                        {**state, "recommendations": _encode(_expire(recs, open_run, now, horizon))})

    # The seed holds scale-downs only; a scale-up may follow the first round's load at once.
    up = min([r["replicas"] for r in recs if not r.get("seed") and seen(r, up_window)] + [raw])
    down = max([r["replicas"] for r in recs if seen(r, down_window)] + [raw])
    recs = _advance(recs, open_run, int(raw), now)
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
    new_state = {**state, "recommendations": _encode(_expire(recs, recs[-1], now, horizon)),
                 "lastDirection": direction}
    if direction != "hold":
        new_state["lastScaleTime"] = rfc3339(now)
    return Decision(desired, int(raw), direction, reason, new_state)


def desired_replicas(body: Mapping[str, Any]) -> int:
    """The group count so far: `spec.replicas`, or with autoscaling the last decision
    (`status.desiredReplicas`) within the current bounds."""
    spec, status = body["spec"], body.get("status") or {}
    if spec["autoscaling"]["enabled"]:
        lo, hi = spec["autoscaling"]["minReplicas"], spec["autoscaling"]["maxReplicas"]
        current = status.get("desiredReplicas")
        if current is None:
            current = spec.get("replicas", lo)
        return max(lo, min(hi, int(current)))
    return int(spec["replicas"])


def rfc3339(t: float) -> str:
    return datetime.datetime.fromtimestamp(int(t), tz=datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _seconds(value: Any) -> float:
    """A stored time: RFC 3339 (now) or epoch seconds (status written by an older operator)."""
    if isinstance(value, (int, float)):
        return float(value)
    return datetime.datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()


def _advance(recs: list[dict[str, Any]], open_run: dict[str, Any] | None, raw: int,
             now: float) -> list[dict[str, Any]]:
    """Add this round's recommendation to the window, as runs of equal recommendations.

    The newest run is open: stored with the time it *started*, it counts as current until
    another value replaces it; then it is closed with the time `now` (at most one round
    later than it was last seen: it is held that much longer, never shorter). So a round that
    repeats the recommendation changes nothing in status (no write per tick), and the list
    is as long as the changes within the window, not the ticks.
    """
    if open_run is not None and open_run["replicas"] == raw:
        return recs
    if open_run is not None:
        open_run["time"] = now
    return recs + [{"time": now, "replicas": raw}]


def _expire(recs: list[dict[str, Any]], open_run: dict[str, Any] | None, now: float,
            horizon: float) -> list[dict[str, Any]]:
    return [r for r in recs if r is open_run or r["time"] > now - horizon]


def _encode(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"time": rfc3339(r["time"]), "replicas": r["replicas"], **({"seed": True} if r.get("seed") else {})}
            for r in recs]
