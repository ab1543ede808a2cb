"""The rollout planner driven through simulated cluster states.

The simulation plays the cluster: a created group becomes ready a few ticks later
(randomised), a deleted group disappears at once. After every planner step the
invariants are checked on the *ready* groups.
"""

from __future__ import annotations

import random

import pytest

from shoal.operator.rollout import Group, plan, removal_order


class Cluster:
    def __init__(self, revision: str, n: int, rng: random.Random):
        self.rng = rng
        self.groups: dict[str, dict] = {}
        for i in range(n):
            self.groups[f"{revision}-{i}"] = {"revision": revision, "index": i, "ready_in": 0}

    def view(self) -> list[Group]:
        return [Group(n, g["revision"], g["index"], ready=g["ready_in"] <= 0) for n, g in self.groups.items()]

    def ready(self) -> int:
        return sum(g["ready_in"] <= 0 for g in self.groups.values())

    def apply(self, p, revision: str) -> None:
        for name in p.delete:
            del self.groups[name]
        for index in p.create:
            self.groups[f"{revision}-{index}"] = {"revision": revision, "index": index,
                                                  "ready_in": self.rng.randint(1, 4)}

    def tick(self) -> None:
        for g in self.groups.values():
            g["ready_in"] -= 1


def run_rollout(replicas, surge, unavailable, seed, start_groups=None, new_replicas=None):
    rng = random.Random(seed)
    cluster = Cluster("old", replicas if start_groups is None else start_groups, rng)
    target = replicas if new_replicas is None else new_replicas
    floor, ceiling = min(replicas, target) - unavailable, max(replicas, target) + surge
    for step in range(200):
        p = plan(cluster.view(), "new", target, surge, unavailable)
        cluster.apply(p, "new")
        assert cluster.ready() >= floor, (step, cluster.groups)
        assert len(cluster.groups) <= ceiling, (step, cluster.groups)
        assert cluster.ready() <= ceiling
        if p.empty and all(g["revision"] == "new" and g["ready_in"] <= 0 for g in cluster.groups.values()) \
                and len(cluster.groups) == target:
            return step
        cluster.tick()
    raise AssertionError(f"rollout did not finish: {cluster.groups}")


@pytest.mark.parametrize("replicas,surge,unavailable", [
    (1, 1, 0), (2, 1, 0), (3, 1, 0), (4, 2, 0), (3, 0, 1), (4, 1, 1), (5, 0, 2), (8, 3, 2), (2, 2, 2),
])
@pytest.mark.parametrize("seed", range(5))
def test_rollout_keeps_capacity_and_finishes(replicas, surge, unavailable, seed):
    run_rollout(replicas, surge, unavailable, seed)


@pytest.mark.parametrize("start,target", [(2, 4), (4, 2), (3, 1)])
def test_rollout_while_scaling(start, target):
    for seed in range(5):
        run_rollout(start, 1, 0, seed, start_groups=start, new_replicas=target)


def test_one_group_at_a_time_with_surge_1():
    groups = [Group(f"old-{i}", "old", i, ready=True) for i in range(3)]
    p = plan(groups, "new", 3, 1, 0)
    assert p.create == [0] and p.delete == []
    groups.append(Group("new-0", "new", 0, ready=False))
    assert plan(groups, "new", 3, 1, 0).empty  # wait for the new group to be ready
    groups[-1] = Group("new-0", "new", 0, ready=True)
    p = plan(groups, "new", 3, 1, 0)
    assert len(p.delete) == 1 and p.delete[0].startswith("old")


def test_initial_creation_and_scale_down_picks_least_loaded():
    assert plan([], "r", 3, 1, 0).create == [0, 1, 2]
    groups = [Group("a", "r", 0, True, load=5), Group("b", "r", 1, True, load=1), Group("c", "r", 2, True, load=9)]
    assert plan(groups, "r", 2, 1, 0).delete == ["b"]
    groups.append(Group("d", "r", 3, False, load=0))
    assert plan(groups, "r", 3, 1, 0).delete == ["d"]  # a not-ready group goes before any ready one
    assert [g.name for g in removal_order(groups)] == ["d", "b", "a", "c"]


def test_not_ready_old_groups_go_and_terminating_are_ignored():
    groups = [Group("o1", "old", 0, ready=False), Group("o2", "old", 1, ready=True),
              Group("x", "new", 0, ready=False, terminating=True)]
    p = plan(groups, "new", 2, 1, 0)
    assert "o1" in p.delete and "o2" not in p.delete
    # 2 live + 1 surge; index 0 is still the draining group's name (issue 36), so the new one takes 1
    assert p.create == [1]


def test_indices_are_reused_lowest_first():
    groups = [Group("r-0", "r", 0, True), Group("r-2", "r", 2, True)]
    assert plan(groups, "r", 4, 2, 0).create == [1, 3]


def test_new_groups_never_take_a_draining_groups_index():
    # Issue 36: a draining group's StatefulSet still exists under its name until its pods are gone.
    groups = [Group("x-r-0", "r", 0, ready=True), Group("x-r-1", "r", 1, ready=False, terminating=True),
              Group("x-r-2", "r", 2, ready=False, terminating=True)]
    assert plan(groups, "r", 3, 1, 0).create == [3, 4]
    # another revision's draining group has another name: its index is free for this one
    assert plan([Group("x-old-0", "old", 0, ready=False, terminating=True)], "r", 1, 1, 0).create == [0]


@pytest.mark.parametrize("seed", range(5))
def test_scaling_while_groups_drain_never_reuses_a_name(seed):
    """Deleted groups drain for a few ticks (their names still taken) while the count swings."""
    rng = random.Random(seed)
    live: dict[str, Group] = {}
    draining: dict[str, int] = {}   # name -> ticks left
    for step in range(60):
        replicas = rng.choice([1, 3, 5])
        view = list(live.values()) + [Group(n, "r", int(n.rsplit("-", 1)[1]), ready=False, terminating=True)
                                      for n in draining]
        p = plan(view, "r", replicas, 2, 1)
        for name in p.delete:
            live.pop(name)
            draining[name] = rng.randint(1, 6)
        for index in p.create:
            name = f"x-r-{index}"
            assert name not in live and name not in draining, (step, name)
            live[name] = Group(name, "r", index, ready=True)
        draining = {n: t - 1 for n, t in draining.items() if t > 1}


def converge(cluster, revision, replicas, surge, unavailable, partition, floor):
    for step in range(200):
        p = plan(cluster.view(), revision, replicas, surge, unavailable, partition=partition)
        cluster.apply(p, revision)
        assert cluster.ready() >= floor, (step, cluster.groups)
        assert len(cluster.groups) <= replicas + surge, (step, cluster.groups)
        if p.empty and all(g["ready_in"] <= 0 for g in cluster.groups.values()):
            return
        cluster.tick()
    raise AssertionError(f"did not settle: {cluster.groups}")


@pytest.mark.parametrize("seed", range(5))
def test_partition_stages_a_rollout(seed):
    # Issue 19: a canary: partition 3 of 4 keeps three old groups; lowering it finishes the rollout.
    cluster = Cluster("old", 4, random.Random(seed))
    converge(cluster, "new", 4, 1, 0, partition=3, floor=4)
    revs = sorted(g["revision"] for g in cluster.groups.values())
    assert revs == ["new", "old", "old", "old"]
    converge(cluster, "new", 4, 1, 0, partition=1, floor=4)
    assert sorted(g["revision"] for g in cluster.groups.values()) == ["new", "new", "new", "old"]
    converge(cluster, "new", 4, 1, 0, partition=0, floor=4)
    assert {g["revision"] for g in cluster.groups.values()} == {"new"} and len(cluster.groups) == 4


def test_partition_does_not_hold_back_a_new_resource():
    assert plan([], "new", 3, 1, 0, partition=2).create == [0, 1, 2]
