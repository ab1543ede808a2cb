"""The start-up warm-up (a spread of prompt lengths on a GPU, for Triton's kernel variants)
runs real requests through the engine and must leave nothing behind: no blocks held, no
prefix cache entries, no counted tokens, and the same tokens afterwards."""

import pytest

from engine_helpers import make_tiny_model
from shoal import LLM, SamplingParams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, builtin_dir):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), builtin_dir, vocab_size=512)


def test_full_warm_up_leaves_no_trace(tiny):
    opts = dict(kv_cache_memory=2**22, max_num_batched_tokens=64, max_model_len=512, cpu_decode_max_seqs=0)
    prompts = [[5 + i, 6, 7, 8 + i] * (3 + i) for i in range(6)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(tiny), **opts).generate(prompts, params)]

    llm = LLM(str(tiny), **opts)
    engine = llm.engine
    lengths = engine.warm_up_lengths(full=True)
    assert 1 in lengths and max(lengths) > 64  # a batch of one, and a prompt chunked over the budget
    engine._warm_up(full=True)
    s = engine.stats()
    assert (s.num_running, s.num_waiting, s.prompt_tokens, s.generation_tokens, s.num_preemptions) == (0, 0, 0, 0, 0)
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (0, 0)
    assert engine.pool.num_free == engine.pool.num_blocks and not engine.pool.cached
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
