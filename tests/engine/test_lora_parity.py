"""LoRA adapters served unmerged: each adapter's greedy tokens equal transformers + PEFT's, and
a batch mixing the base model and several adapters gives each row what it gets alone."""

from __future__ import annotations

import random

import pytest

from shoal import LLM, SamplingParams
from engine_helpers import lora_prompts, lora_references, make_lora_models

MAX_NEW = 10
GREEDY = SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0.0)


@pytest.fixture(scope="module")
def lora_models(tmp_path_factory, builtin_dir):
    """A tiny random base model and five random adapters made with PEFT."""
    return make_lora_models(tmp_path_factory.mktemp("lora"), builtin_dir, count=5)


@pytest.fixture(scope="module")
def prompts():
    return lora_prompts()


@pytest.fixture(scope="module")
def references(lora_models, prompts):
    return lora_references(*lora_models, prompts, MAX_NEW)


@pytest.fixture(scope="module")
def llm(lora_models):
    base, adapters = lora_models
    engine = LLM(str(base), enable_lora=True, max_loras=3, max_lora_rank=16, kv_cache_memory=2**24,
                 lora_modules=[f"{name}={path}" for name, path in list(adapters.items())[:3]])
    yield engine
    engine.engine.shutdown()


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_each_adapter_matches_transformers_and_peft(llm, prompts, references):
    for name in (None, "a0", "a1", "a2"):
        assert tokens(llm.generate(prompts, GREEDY, lora=name)) == references[name], name
    # the adapters change the tokens: a test of them can fail
    assert all(references[name] != references[None] for name in ("a0", "a1", "a2"))


def test_mixed_batch_gives_each_row_what_it_gets_alone(llm, prompts, references):
    """Base rows, three adapters and two rows of one adapter in one batch (one step each)."""
    rows = [(None, 0), ("a0", 1), ("a1", 2), ("a2", 0), ("a2", 1), (None, 2), ("a1", 0)]
    outs = llm.generate([prompts[p] for _, p in rows], GREEDY, lora=[name for name, _ in rows])
    assert tokens(outs) == [references[name][p] for name, p in rows]


def test_adapters_never_share_prefix_cache_blocks(llm, references):
    """The same long prompt under the base model then an adapter: the adapter's request finds
    no cached block (its hashes start from its own root) and still gives its own tokens."""
    rng = random.Random(9)
    prompt = [rng.randrange(3, 49152) for _ in range(70)]
    engine = llm.engine
    base_tokens = tokens(llm.generate([prompt], GREEDY))
    hits = engine.kv.prefix_hits
    with_adapter = tokens(llm.generate([prompt], GREEDY, lora="a2"))
    assert engine.kv.prefix_hits == hits
    again = tokens(llm.generate([prompt], GREEDY, lora="a2"))
    assert engine.kv.prefix_hits > hits  # the adapter's own blocks are reused
    assert again == with_adapter != base_tokens


def test_two_slots_serve_five_adapters_under_concurrent_load(lora_models, prompts, references):
    """--max-loras 2, five adapters in rotation, all requests at once: every request waits for a
    slot rather than failing, and gets its own adapter's tokens; slots are swapped many times.
    --max-cpu-loras 3 drops host copies too (read again from disk)."""
    base, adapters = lora_models
    engine = LLM(str(base), enable_lora=True, max_loras=2, max_cpu_loras=3, max_lora_rank=16, kv_cache_memory=2**24,
                 lora_modules=[{"name": name, "path": str(path)} for name, path in adapters.items()])
    try:
        names = [None] + list(adapters)
        rows = [(names[i % len(names)], i % len(prompts)) for i in range(24)]
        llm_engine, lora = engine.engine, engine.engine.lora
        got, pending, waited = {}, list(enumerate(rows)), 0
        while pending or llm_engine.has_unfinished_requests():
            for _ in range(2 if pending else 0):  # two arrivals a step, joining the running batch
                i, (name, p) = pending.pop(0)
                llm_engine.add_request(f"r-{i}", prompts[p], GREEDY, lora=name)
            for out in llm_engine.step():
                if out.finished:
                    got[int(out.request_id.split("-")[1])] = out.outputs[0].token_ids
            # requests kept waiting because both slots hold other adapters
            waited += sum(s.request.lora is not None and s.request.lora not in lora.slots for s in llm_engine.scheduler.waiting)
        assert [got[i] for i in range(len(rows))] == [references[name][p] for name, p in rows]
        assert waited > 0
        assert lora.num_loads > len(adapters)  # each adapter loaded, some more than once
        assert sorted(a.num_requests for a in lora.adapters.values()) == [4] * len(adapters)
        assert lora.refs == [0, 0] and lora.max_loras == 2
        assert sum(a.weights is not None for a in lora.adapters.values()) <= 3
    finally:
        engine.engine.shutdown()


def test_unknown_adapter_is_refused(llm):
    from shoal.runtime.engine.lora_manager import LoraError

    with pytest.raises(LoraError, match="no adapter named 'nope'") as e:
        llm.generate([[5, 6, 7]], GREEDY, lora="nope")
    assert e.value.status == 404
