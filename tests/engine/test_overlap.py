"""Two batches in flight on one device (--batches-in-flight 2): while the device runs one
lane's step the engine prepares the other's. The tokens are those of the serial engine."""

import pytest

from engine_helpers import make_tiny_model
from shoal import LLM, SamplingParams
from shoal.runtime.executor.model_runner import ModelRunner


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, builtin_dir):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), builtin_dir, vocab_size=512)


def test_two_lanes_on_one_device_give_the_serial_tokens(tiny, monkeypatch):
    prompts = [[5 + i, 6, 7, 8 + i] * (1 + i % 3) for i in range(9)]
    params = [SamplingParams(max_tokens=12, temperature=0.0 if i % 2 else 0.9, seed=i, logprobs=1 if i == 3 else None,
                             ignore_eos=True) for i in range(9)]
    serial = LLM(str(tiny), kv_cache_memory=2**24, cpu_decode_max_seqs=0)
    want = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in serial.generate(prompts, params)]
    monkeypatch.setattr(ModelRunner, "pipelined", property(lambda self: True))  # as on a GPU
    overlapped = LLM(str(tiny), kv_cache_memory=2**24, cpu_decode_max_seqs=0, batches_in_flight=2)
    assert overlapped.engine.num_lanes == 2
    got = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in overlapped.generate(prompts, params)]
    assert [g[0] for g in got] == [w[0] for w in want]
    for g, w in zip(got[3][1], want[3][1]):  # logprobs come back through the deferred read too
        assert g.keys() == w.keys() and list(g.values()) == pytest.approx(list(w.values()), abs=1e-5)
    assert overlapped.engine.pool.num_free == overlapped.engine.pool.num_blocks
