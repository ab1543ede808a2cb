"""The engine keeps one batch per pipeline stage in flight (scheduler lanes) and still gives
a single rank's greedy tokens; aborting a request whose batch is in the pipe loses nothing."""

from __future__ import annotations

import pytest

from parallel_helpers import generate, greedy, mixed_prompts, single_rank, small_cache_llm
from shoal.runtime.executor.distributed_executor import DistributedExecutor


@pytest.fixture
def pipe_depths(monkeypatch):
    """How many batches were in the pipe right after each execute_async."""
    depths = []
    start = DistributedExecutor.execute_async

    def spy(self, step):
        pending = start(self, step)
        depths.append(len(self._in_flight))
        return pending

    monkeypatch.setattr(DistributedExecutor, "execute_async", spy)
    return depths


@pytest.mark.parametrize("in_flight", [2, 1], ids=["pipelined", "serial"])
def test_pp2_engine_keeps_batches_in_flight_and_matches_single_rank(tiny_dir, pipe_depths, in_flight):
    tokens, stats = generate(tiny_dir, 1, 2, mixed_prompts(), batches_in_flight=in_flight)
    assert (max(pipe_depths) == 2) if in_flight == 2 else not pipe_depths  # serial: plain execute()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert tokens == single_rank(tiny_dir)


def test_abort_while_in_the_pipe_frees_blocks_and_spares_the_rest(tiny_dir):
    prompts = mixed_prompts()
    engine = small_cache_llm(tiny_dir, 1, 2).engine
    try:
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, greedy())
        done = {}
        for _ in range(4):
            done.update({o.request_id: o for o in engine.step() if o.finished})
        assert len(engine._in_flight) == 2
        victim = next(iter(engine._in_flight.values())).targets[0].request.request_id
        engine.abort_request(victim)
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        assert victim not in done and not engine._in_flight
        assert engine.pool.num_free == engine.pool.num_blocks
        want = single_rank(tiny_dir)
        spared = [i for i in range(len(prompts)) if str(i) != victim]
        assert [done[str(i)].outputs[0].token_ids for i in spared] == [want[i] for i in spared]
    finally:
        engine.shutdown()
