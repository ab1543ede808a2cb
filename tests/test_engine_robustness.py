"""Bad input is refused with a clear ValueError and nothing is lost; no KV block leaks."""

from __future__ import annotations

import random

import pytest

from shoal import SamplingParams


def all_blocks_free(engine) -> bool:
    # prefix-cached blocks nobody references sit on the free list: they count as free
    return engine.pool.num_free == engine.pool.num_blocks and all(r == 0 for r in engine.pool.ref_count)


@pytest.mark.parametrize(
    "prompt, make_params, message",
    [
        ("", lambda: SamplingParams(), "empty"),
        ([], lambda: SamplingParams(), "empty"),
        ([5, 10**9], lambda: SamplingParams(), "vocabulary"),
        ([5, -1], lambda: SamplingParams(), "vocabulary"),
        ("hi", lambda: SamplingParams(max_tokens=0), "max_tokens"),
        ("hi", lambda: SamplingParams(top_p=0.0), "top_p"),
        ("hi", lambda: SamplingParams(top_p=1.5), "top_p"),
        ([7] * 100_000, lambda: SamplingParams(), "max_model_len"),
    ],
)
def test_bad_input_is_a_clear_value_error_and_serving_goes_on(llm, prompt, make_params, message):
    engine = llm.engine
    engine.add_request("bystander", [100, 200, 300], SamplingParams(max_tokens=4, temperature=0.0))
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, make_params())
    assert "bad" not in engine.requests
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == ["bystander"] and len(done[0].outputs[0].token_ids) == 4
    assert all_blocks_free(engine)


def test_random_aborts_leak_no_blocks(llm):
    engine = llm.engine
    rng = random.Random(0)
    live = set()
    for i in range(40):
        prompt = [rng.randrange(1000, 40000) for _ in range(rng.randrange(1, 120))]
        engine.add_request(f"leak-{i}", prompt, SamplingParams(n=rng.choice([1, 1, 2]), max_tokens=rng.randrange(1, 20), temperature=1.0))
        live.add(f"leak-{i}")
        for out in engine.step():
            if out.finished:
                live.discard(out.request_id)
        if live and rng.random() < 0.3:
            victim = rng.choice(sorted(live))
            engine.abort_request(victim)
            live.discard(victim)
    while engine.has_unfinished_requests():
        for out in engine.step():
            live.discard(out.request_id)
    assert not engine.requests
    assert all_blocks_free(engine)


def test_abort_frees_blocks_at_once(llm):
    engine = llm.engine
    engine.add_request("long", list(range(1000, 1300)), SamplingParams(max_tokens=200, temperature=0.0))
    engine.step()
    assert engine.pool.num_free < engine.pool.num_blocks
    engine.abort_request("long")
    assert all_blocks_free(engine) and not engine.has_unfinished_requests()


def test_priority_policy_runs_lower_values_first(builtin_dir):
    from shoal import LLM

    llm = LLM(str(builtin_dir), scheduling_policy="priority", max_num_seqs=1, kv_cache_memory=2**26)
    engine = llm.engine
    for name, prio in (("late", 5), ("urgent", -1), ("normal", 0)):
        engine.add_request(name, [1000, 2000, 3000], SamplingParams(max_tokens=2, temperature=0.0, priority=prio))
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["urgent", "normal", "late"]
