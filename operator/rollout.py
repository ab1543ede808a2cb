"""The rollout planner: given the groups as they are, what to create and delete now.

Pure and stateless: call it again after anything changes. Group-granular, like a
Deployment's rolling update over ReplicaSets but with one group as the unit:

- total groups never exceed `replicas + maxSurge` (creations are capped by that);
- ready groups never drop below `replicas - maxUnavailable` because of a deletion:
  a ready group is removed only while there are more ready groups than that floor
  (not-ready old groups can always go: removing them costs no ready capacity);
- groups of the current revision are created until there are `replicas` of them;
- an old-revision group is removed once the new ready ones make it redundant;
- on scale-down the least-loaded groups go first (not-ready ones before any).

Terminating groups (being drained and deleted) count for nothing, except that a new
group never takes the index, so the name, of one still draining.

`partition` (a staged rollout, as LeaderWorkerSet's): up to `partition` ready groups of
older revisions are kept, and only `replicas - kept` groups move to the new revision;
lower it step by step to finish (0 rolls everything). It holds back an update only:
with no old groups (a new resource) every group is of the current revision.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Group:
    name: str
    revision: str
    index: int
    ready: bool
    load: float = 0.0
    terminating: bool = False


@dataclasses.dataclass
class Plan:
    create: list[int] = dataclasses.field(default_factory=list)   # indices of new groups (current revision)
    delete: list[str] = dataclasses.field(default_factory=list)   # names of groups to remove
    reasons: list[str] = dataclasses.field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.create and not self.delete


def removal_order(groups: Sequence[Group]) -> list[Group]:
    """Which groups to remove first: not ready, then least loaded, then newest index."""
    return sorted(groups, key=lambda g: (g.ready, g.load, -g.index, g.name))


def free_indices(used: set[int], count: int) -> list[int]:
    out, i = [], 0
    while len(out) < count:
        if i not in used:
            out.append(i)
        i += 1
    return out


def kept_by_partition(groups: Sequence[Group], revision: str, replicas: int, partition: int) -> list[Group]:
    """The old-revision groups a partition keeps: ready ones, the most useful first."""
    old_ready = [g for g in groups if not g.terminating and g.revision != revision and g.ready]
    return list(reversed(removal_order(old_ready)))[:max(0, min(partition, replicas))]


def plan(groups: Sequence[Group], revision: str, replicas: int, max_surge: int, max_unavailable: int,
         partition: int = 0) -> Plan:
    if max_surge <= 0 and max_unavailable <= 0:
        max_surge = 1  # the CRD forbids this; never deadlock if it slips through
    live = [g for g in groups if not g.terminating]
    kept = kept_by_partition(live, revision, replicas, partition)
    new = [g for g in live if g.revision == revision]
    old = [g for g in live if g.revision != revision and g not in kept]
    ready = sum(g.ready for g in live)
    floor = max(0, replicas - max_unavailable)
    ceiling = replicas + max_surge
    p = Plan()
    if kept:
        p.reasons.append(f"partition {partition}: keeping {len(kept)} old group(s)")
    replicas -= len(kept)   # what the current revision must provide

    # Too many groups of the current revision (scale-down): drop the least useful.
    excess_new = len(new) - replicas
    doomed: list[Group] = []
    if excess_new > 0:
        for g in removal_order(new)[:excess_new]:
            doomed.append(g)
            ready -= g.ready
        if doomed:
            p.reasons.append(f"scale down: {len(new)} groups of revision {revision} > {replicas}")

    # Old revisions: not-ready ones go right away, ready ones as the floor allows.
    # Keep as many old ready groups as still needed to fill `replicas` with ready capacity.
    new_ready = sum(g.ready for g in new if g not in doomed)
    for g in removal_order(old):
        if not g.ready:
            doomed.append(g)
            p.reasons.append(f"remove not-ready old group {g.name}")
        elif ready - 1 >= floor:
            doomed.append(g)
            ready -= 1
            p.reasons.append(f"replace old group {g.name} ({new_ready} new ready)")
    p.delete = [g.name for g in doomed]

    # New groups up to `replicas`, within the surge ceiling (counting what exists now).
    missing = replicas - len(new)
    room = ceiling - len(live)
    count = max(0, min(missing, room))
    if count:
        # Indices of every group of this revision, draining ones too: a draining group's
        # StatefulSet still exists under that name until its pods are gone.
        p.create = free_indices({g.index for g in groups if g.revision == revision}, count)
        p.reasons.append(f"create {count} group(s) of revision {revision}")
    return p
