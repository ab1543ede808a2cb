"""Greedy decoding must give transformers' tokens exactly (float32, the built-in model),
however requests are batched, chunked, cached or preempted."""

from __future__ import annotations

import random

import pytest

from shoal import LLM, SamplingParams
from engine_helpers import hf_greedy

MAX_NEW = 16


def mixed_prompts(tokenizer, seed: int) -> list[list[int]]:
    """Text prompts and random-id prompts of very different lengths."""
    rng = random.Random(seed)
    texts = [
        "The quick brown fox",
        "Explain in one paragraph why the sky is blue, for a ten year old.",
        "def fibonacci(n):\n    ",
        "Les pommes de terre sont",
    ]
    prompts = [tokenizer(t).input_ids for t in texts]
    prompts += [[rng.randrange(1000, 40000) for _ in range(n)] for n in (1, 17, 70, 150)]
    return prompts


@pytest.fixture(scope="module")
def references(hf_model, tokenizer):
    prompts = mixed_prompts(tokenizer, seed=7)
    return prompts, [hf_greedy(hf_model, p, MAX_NEW) for p in prompts]


# min_tokens bans EOS as transformers' min_new_tokens does, so both run the full length
GREEDY = SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0.0)


def test_batch_submitted_together_matches_transformers(llm, references):
    prompts, expected = references
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_staggered_arrivals_match_transformers(llm, references):
    prompts, expected = references
    engine = llm.engine
    got, pending = {}, list(enumerate(prompts))
    while pending or engine.has_unfinished_requests():
        if pending:  # one new request every step, joining a running batch
            i, p = pending.pop(0)
            engine.add_request(f"stagger-{i}", p, GREEDY)
        for out in engine.step():
            if out.finished:
                got[int(out.request_id.split("-")[1])] = out.outputs[0].token_ids
    assert [got[i] for i in range(len(prompts))] == expected


def test_torch_decode_path_matches_transformers(builtin_dir, references):
    """With the C decode step off, decodes run the torch model over the workspace mirror."""
    prompts, expected = references
    llm = LLM(str(builtin_dir), kv_cache_memory=2**26, cpu_decode_max_seqs=0)
    assert llm.engine.executor.cpu_decoder is None
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_prefix_caching_on_and_off(builtin_dir, hf_model, tokenizer, prefix_caching):
    system = tokenizer("You are a helpful assistant who answers briefly and precisely. " * 4).input_ids
    prompts = [system + tokenizer(q).input_ids for q in ("What is 2+2?", "Name a colour.", "Say hi.")]
    expected = [hf_greedy(hf_model, p, MAX_NEW) for p in prompts]
    llm = LLM(str(builtin_dir), enable_prefix_caching=prefix_caching, kv_cache_memory=2**26)
    first = llm.generate(prompts[:1], GREEDY)  # fills the cache with the shared prefix
    rest = llm.generate(prompts[1:], GREEDY)
    assert [o.outputs[0].token_ids for o in first + rest] == expected
    stats = llm.engine.stats()
    if prefix_caching:
        assert stats.prefix_cache_hits >= (len(system) // 16) * 16 * 2
    else:
        assert stats.prefix_cache_hits == 0


def test_preemption_keeps_outputs_exact(builtin_dir, references):
    prompts, expected = references
    # 24 blocks of 16 tokens: far less than the batch needs at once, so sequences get preempted
    llm = LLM(str(builtin_dir), kv_cache_memory=24 * 16 * 46080, max_num_batched_tokens=256)
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks


def test_chunked_prefill_of_a_long_prompt(builtin_dir, hf_model):
    rng = random.Random(3)
    prompt = [rng.randrange(1000, 40000) for _ in range(300)]
    llm = LLM(str(builtin_dir), max_num_batched_tokens=64, kv_cache_memory=2**26)
    out = llm.generate([prompt], GREEDY)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, MAX_NEW)
