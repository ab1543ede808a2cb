"""A Gemma 3-shaped model (five sliding layers to one global) generating far past its window:
its sliding layers' KV-cache groups hold no more blocks than the window needs, read from the
KV-cache manager at every allocation, and the greedy tokens still equal transformers' (with a
prefix hit on a shared prompt and an n = 2 fork on the same engine)."""

from __future__ import annotations

import pytest

from family_models import hf_reference, make_family_model
from shoal import LLM, SamplingParams

WINDOW, BS, CHUNK, MAX_NEW = 8, 4, 16, 72
LAYERS = ["sliding_attention"] * 5 + ["full_attention"]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory, builtin_dir):
    path, model = make_family_model(
        tmp_path_factory.mktemp("gemma3"), builtin_dir, "gemma3_text", head_dim=16, query_pre_attn_scalar=16,
        sliding_window=WINDOW, num_hidden_layers=6, layer_types=LAYERS, tie_word_embeddings=True,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}})
    return path, model


def test_sliding_groups_hold_a_window_and_tokens_match_transformers(gemma3):
    import random

    path, model = gemma3
    rng = random.Random(5)
    shared = [rng.randrange(100, 40000) for _ in range(40)]
    prompts = [shared + [rng.randrange(100, 40000) for _ in range(3)], [rng.randrange(100, 40000) for _ in range(21)]]
    later = shared + [rng.randrange(100, 40000) for _ in range(5)]  # its first 40 tokens' blocks are cached by then
    want, _ = hf_reference(model, prompts + [later], MAX_NEW)

    llm = LLM(str(path), kv_cache_memory=2**22, block_size=BS, max_num_batched_tokens=CHUNK, attention_backend="torch")
    kv = llm.engine.kv
    try:
        assert kv.windows == [0] + [WINDOW] * 5  # one global group, five sliding ones of a layer each
        seen = []  # (tokens the sequence holds, live blocks per group) after every allocation
        allocate = kv.allocate

        def spy(seq, num_tokens):
            ok = allocate(seq, num_tokens)
            if ok:
                tables = [seq.block_table, *seq.group_tables]
                seen.append((seq.num_computed, num_tokens, [sum(b != kv.null_block for b in t) for t in tables]))
            return ok

        kv.allocate = spy
        greedy = SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0.0)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        hits_before = kv.prefix_hits
        got.append(llm.generate([later], greedy)[0].outputs[0].token_ids)
        assert kv.prefix_hits - hits_before >= 32  # the shared prefix came from the cache
        forked = llm.generate([prompts[1]], SamplingParams(n=2, max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0.0))
    finally:
        llm.engine.shutdown()
    assert got == want
    assert [c.token_ids for c in forked[0].outputs] == [want[1]] * 2

    bound = -(-WINDOW // BS) + 1  # the window's blocks, plus the one being filled
    decoding = [(n, live) for computed, n, live in seen if n == computed + 1]
    longest = max(n for n, _ in decoding)
    assert longest >= 10 * WINDOW
    for n, live in decoding:
        assert live[0] == -(-n // BS)  # the global layers keep every token
        assert max(live[1:]) <= bound, (n, live)
    for computed, n, live in seen:  # a prefill chunk: the window before it, and the chunk
        assert max(live[1:]) <= -(-(WINDOW + n - computed) // BS) + 1
    # everything went back: only the null block is still taken
    assert kv.pool.num_used == 1
    print(f"\n{longest} tokens: global group {-(-longest // BS)} blocks, each sliding group <= {bound}; "
          f"{6 * -(-longest // BS)} pages without groups, {-(-longest // BS) + 5 * bound} with")
