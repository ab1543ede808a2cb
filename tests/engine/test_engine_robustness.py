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


def test_a_request_whose_sampling_raises_fails_alone(llm, monkeypatch):
    """An error inside one request's sampling fails that request (finish_reason 'error'),
    not the batch and not the engine: its neighbours in the batch finish normally."""
    from shoal.runtime.layers import sampler

    real = sampler.sample_tokens

    def sample_tokens(logits, m, native=None):  # the sampler sees parameters, not requests: "bad" is the one at 0.7
        if ((m.temperature - 0.7).abs() < 1e-6).any():
            raise OverflowError("injected: a value no tensor can hold")
        return real(logits, m)

    monkeypatch.setattr(sampler, "sample_tokens", sample_tokens)
    engine = llm.engine
    engine.add_request("ok-1", [100, 200, 300], SamplingParams(max_tokens=4, temperature=0.0))
    engine.add_request("bad", [100, 200, 301], SamplingParams(max_tokens=4, n=2, temperature=0.7, extra={"boom": True}))
    engine.add_request("ok-2", [100, 200, 302], SamplingParams(max_tokens=4, temperature=0.8, seed=3, logprobs=2))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert sorted(done) == ["bad", "ok-1", "ok-2"]
    assert [c.finish_reason for c in done["bad"].outputs] == ["error", "error"]
    assert "OverflowError" in done["bad"].outputs[0].stop_reason
    for rid in ("ok-1", "ok-2"):
        assert done[rid].outputs[0].finish_reason == "length" and len(done[rid].outputs[0].token_ids) == 4
    assert len(done["ok-2"].outputs[0].logprobs) == 4
    assert all_blocks_free(engine)
    engine.add_request("after", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0))  # the engine goes on
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("kw, message", [
    ({"top_k": 10**30}, "top_k"), ({"seed": 2**64}, "seed"), ({"n": 10**6}, "n must"), ({"logprobs": 10**9}, "logprobs"),
    ({"temperature": float("nan")}, "temperature"), ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"priority": 2**70}, "priority"),
    ({"max_tokens": True}, "max_tokens"), ({"presence_penalty": float("inf")}, "presence_penalty"),
])
def test_sampling_params_bound_every_value_that_reaches_a_tensor(kw, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kw)
