"""The shape of a decode step's host work: one host-to-device copy for all of the step's
inputs and sampling parameters, one device-to-host read of the sampled tokens, and a
fixed number of scatter ops, whatever the batch size. On a GPU each of those is a
transfer or a synchronization (the issue measured ~200 of each a step, growing with the
batch), so counting them on the CPU proves the structure the GPU relies on."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine_helpers import make_tiny_model
from shoal import LLM, SamplingParams
from shoal.runtime.executor.staging import Staging


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module", params=[False, True], ids=["serial", "async-scheduling"])
def engine(request, tmp_path_factory, builtin_dir):
    path = make_tiny_model(tmp_path_factory.mktemp("tiny"), builtin_dir, vocab_size=512)
    llm = LLM(str(path), kv_cache_memory=2**24, attention_backend="torch", cpu_decode_max_seqs=0, max_num_seqs=64,
              async_scheduling=request.param)
    runner = llm.engine.executor
    runner.staging = Staging(torch.device("cpu"))  # pack and "send" exactly as on a GPU
    return llm.engine


def decode_step_counts(engine, batch: int, monkeypatch) -> tuple[int, int, dict]:
    # mixed sampling parameters on purpose: greedy and sampled rows, penalties (with async
    # scheduling, their histories get the token in flight on the device), min_tokens, a seed
    for i in range(batch):
        params = SamplingParams(max_tokens=40, min_tokens=20, temperature=0.0 if i % 3 == 0 else 0.8, top_k=50,
                                top_p=0.9, repetition_penalty=1.1, presence_penalty=0.2,
                                seed=7 if i == 1 else None, logprobs=2 if i % 4 == 0 else None)
        engine.add_request(f"b{batch}-{i}", [5 + i, 6, 7, 8, 9], params)
    while engine.scheduler.waiting or any(s.num_computed < len(s.token_ids) - 1 for s in engine.scheduler.running):
        engine.step()  # through the prefills: what follows are decode-only steps
    assert len(engine.scheduler.running) == batch
    reads = []
    original = torch.Tensor.tolist

    def counting_tolist(self):
        reads.append(self.shape)
        return original(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    copies_before = engine.executor.staging.copies
    with CountOps() as ops:
        engine.step()
    monkeypatch.undo()
    copies = engine.executor.staging.copies - copies_before
    for i in range(batch):
        engine.abort_request(f"b{batch}-{i}")
    return copies, len(reads), ops.counts


def test_a_decode_step_does_not_grow_its_transfers_with_the_batch(engine, monkeypatch):
    small = decode_step_counts(engine, 3, monkeypatch)
    large = decode_step_counts(engine, 24, monkeypatch)
    assert small[0] == large[0] == 1, "one packed host-to-device copy a step"
    assert small[1] == large[1] <= 4, "a fixed number of device-to-host reads (tokens, logprobs)"
    for op in ("index_put_", "copy_", "_to_copy", "scatter", "scatter_add_", "index", "rand"):
        assert small[2].get(op, 0) == large[2].get(op, 0), (op, small[2].get(op), large[2].get(op))
