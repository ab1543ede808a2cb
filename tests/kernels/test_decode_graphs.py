"""Decode steps through the CUDA-graph runner's static buffers give the eager tokens.

No GPU here: the graphs are stand-ins that rerun the captured forward over the same
static buffers (`replay`), with the Triton kernels in the interpreter. What this checks is
everything around the capture: copying a step into the buffers, padding rows that write no
cache slot, the size ladder, and which steps fit.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # engine_helpers

from engine_helpers import make_tiny_model  # noqa: E402


class Rerun:
    """A CUDA graph stand-in: replay() recomputes the captured function into the same output."""

    def __init__(self, graphs, size):
        self.graphs, self.size = graphs, size
        self.out = graphs._forward(size)

    def replay(self):
        self.out.copy_(self.graphs._forward(self.size))


def test_ladder():
    from shoal.runtime.executor.cuda_graphs import ladder

    assert ladder(256)[:6] == [1, 2, 4, 8, 16, 24] and ladder(256)[-1] == 256
    assert ladder(20) == [1, 2, 4, 8, 16, 20] and ladder(1) == [1]


def test_graph_runner_gives_the_eager_tokens(tmp_path, builtin_dir):
    pytest.importorskip("triton")
    import torch

    from shoal import LLM, SamplingParams
    from shoal.runtime.executor.cuda_graphs import DecodeGraphs

    path = make_tiny_model(tmp_path, builtin_dir, num_hidden_layers=2, hidden_size=64, vocab_size=512,
                           num_attention_heads=4, num_key_value_heads=2)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25], [30, 31], [40] * 7, [41, 42]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm = LLM(model=str(path), attention_backend="triton", kv_cache_memory=2**22, block_size=4, max_num_seqs=6,
              cpu_decode_max_seqs=0)
    eager = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    runner = llm.engine.executor
    graphs = DecodeGraphs(runner, max_batch=6, max_blocks=8)
    with torch.inference_mode():
        graphs.graphs = {size: (rerun := Rerun(graphs, size), rerun.out) for size in graphs.sizes}
    used = []
    run = graphs.run
    graphs.run = lambda step: used.append(step.input_ids.shape[0]) or run(step)
    runner.graphs = graphs
    replayed = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert replayed == eager
    assert used and 5 in used and all(b <= 6 for b in used)  # decode steps of 5 ran as a padded 6
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks
