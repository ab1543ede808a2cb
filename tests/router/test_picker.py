"""The picker, pure: score = prefix_weight x matched fraction - load_weight x load."""

import pytest

from shoal.runtime.router import picker
from shoal.runtime.router.picker import View


def holding(*hashes):
    s = set(hashes)
    return s.__contains__


def test_load_is_the_queue_term_or_kv_usage_whichever_is_larger():
    assert picker.load(View("a")) == 0.0
    assert picker.load(View("a", running=4, waiting=2, in_flight=2)) == pytest.approx(8 / 16)
    assert picker.load(View("a", running=1, kv_usage=0.9)) == pytest.approx(0.9)
    assert picker.load(View("a", running=1000)) < 1.0


def test_matched_counts_the_leading_run_only():
    v = View("a", has=holding(1, 2, 4))
    assert picker.matched(v, [1, 2, 3, 4]) == 0.5  # block 4 without block 3 cannot be reused
    assert picker.matched(v, [9, 1, 2]) == 0.0
    assert picker.matched(v, []) == 0.0


def test_the_backend_holding_the_prefix_wins_against_modest_load():
    hashes = list(range(10))
    cold = View("cold", running=1)
    warm = View("warm", running=3, has=holding(*range(8)))
    ranked = picker.rank([cold, warm], hashes)
    assert [r.view.name for r in ranked] == ["warm", "cold"]
    assert ranked[0].matched == 0.8 and picker.reason(ranked) == "prefix"
    assert ranked[0].score == pytest.approx(0.8 - 3 / 11)


def test_load_outweighs_the_prefix_when_its_weight_says_so_and_ties_go_to_the_lighter():
    hashes = list(range(10))
    warm = View("warm", running=40, has=holding(*range(10)))
    cold = View("cold")
    assert [r.view.name for r in picker.rank([warm, cold], hashes, load_weight=2.0)] == ["cold", "warm"]
    # no prefix anywhere: the least loaded first; equal scores: the lower load breaks the tie
    a, b = View("a", running=2), View("b", running=5, kv_usage=0.0)
    ranked = picker.rank([b, a], [])
    assert [r.view.name for r in ranked] == ["a", "b"] and picker.reason(ranked) == "load"
    x, y = View("x", waiting=1, has=holding(0)), View("y", waiting=3)
    ranked = picker.rank([y, x], [0], prefix_weight=0.0)
    assert [r.view.name for r in ranked] == ["x", "y"]


def test_unready_backends_are_never_ranked():
    assert picker.rank([View("a", ready=False)], [1]) == []
    assert picker.reason([]) == "none"


def test_prefix_reason_only_when_the_cache_decided():
    # the winner holds the prefix but so does the least-loaded one: load decided
    both = holding(0, 1)
    ranked = picker.rank([View("a", has=both), View("b", running=1, has=both)], [0, 1])
    assert ranked[0].view.name == "a" and picker.reason(ranked) == "load"


def test_a_backend_holding_the_requests_lora_adapter_wins_against_modest_load():
    """LoRA affinity: the backend with the adapter in a slot goes first unless it is much busier;
    a base-model request (a name no backend holds as an adapter) is ranked by load alone."""
    holds = View("holds", running=3, adapters=frozenset({"sql"}))
    idle = View("idle")
    ranked = picker.rank([idle, holds], [], adapter="sql")
    assert [r.view.name for r in ranked] == ["holds", "idle"] and picker.reason(ranked) == "lora"
    assert ranked[0].score == pytest.approx(1 - 3 / 11)
    assert [r.view.name for r in picker.rank([idle, holds], [], adapter="base")] == ["idle", "holds"]
    busy = View("holds", running=400, kv_usage=1.0, adapters=frozenset({"sql"}))
    assert picker.rank([busy, idle], [], adapter="sql", lora_weight=0.5)[0].view.name == "idle"
