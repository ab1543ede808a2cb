"""Tensor 2, pipeline 2 and tensor 2 x pipeline 2 give a single rank's greedy tokens, with
prefix caching on and a KV cache small enough that sequences get preempted."""

from __future__ import annotations

import pytest

from parallel_helpers import generate, mixed_prompts, single_rank

@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)], ids=["tp2", "pp2", "tp2xpp2"])
def test_tiny_model_matches_single_rank(tiny_dir, tp, pp):
    tokens, stats = generate(tiny_dir, tp, pp, mixed_prompts())
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0
    assert tokens == single_rank(tiny_dir)


def test_tp2_replicates_a_single_kv_head(tiny_mqa_dir):
    tokens, stats = generate(tiny_mqa_dir, 2, 1, mixed_prompts())
    assert stats.num_preemptions > 0
    assert tokens == single_rank(tiny_mqa_dir)


def test_uneven_pipeline_split(tiny_dir):
    tokens, _ = generate(tiny_dir, 1, 2, mixed_prompts(), pipeline_layer_split=[1, 3])  # the default is [3, 1]
    assert tokens == single_rank(tiny_dir)


@pytest.mark.parametrize("tp,pp", [(1, 2), (3, 1)], ids=["pp2", "tp3"])
def test_builtin_model_matches_single_rank(builtin_dir, tp, pp):
    """The built-in model has 9 query and 3 KV heads: tensor 2 cannot split it (refused,
    see test_launch.py), tensor 3 can; pipeline 2 splits its 30 layers 19 + 11 (the LM head weighs 8)."""
    tokens, stats = generate(builtin_dir, tp, pp, mixed_prompts())
    assert stats.num_preemptions > 0
    assert tokens == single_rank(builtin_dir)


def test_execute_async_keeps_two_batches_in_the_pipe(tiny_dir):
    """Two independent decode batches in flight at once give the logits of one at a time."""
    import torch

    from bench_pipeline import decode_step
    from shoal.runtime.config import EngineConfig
    from shoal.runtime.executor.distributed_executor import DistributedExecutor
    from shoal.runtime.models.loader import load_config

    cfg = load_config(tiny_dir)
    ex = DistributedExecutor(EngineConfig(model=str(tiny_dir), pipeline_parallel_size=2), cfg, tiny_dir, 256)
    try:
        ex.allocate_kv_cache(16)
        a, b = (decode_step(first, 4, 20, 16, cfg.vocab_size) for first in (0, 4))
        want_a, want_b = ex.execute(a), ex.execute(b)
        fa = ex.execute_async(a)
        fb = ex.execute_async(b)
        assert len(ex._in_flight) == 2
        got_a = fa.result()
        fa = ex.execute_async(a)
        got_b, got_a2 = fb.result(), fa.result()
        assert torch.equal(got_a, want_a) and torch.equal(got_b, want_b) and torch.equal(got_a2, want_a)
        assert not ex._in_flight and ex.group_ready()
    finally:
        ex.shutdown()
    assert all(c.poll() == 0 for c in ex.children)
