"""`shoal bench throughput|latency --compare-gguf`: the C decode step on float32 panels and on a
GGUF file's quantized blocks, in one run. Checked on a tiny GGUF (K-quant and Q4_1 matrices)
against the engine's own greedy outputs with and without --quantization gguf."""

from __future__ import annotations

import argparse

import pytest

from gguf_files import tiny_llama, write_tiny_gguf
from shoal import LLM, SamplingParams
from shoal.runtime.bench import args as bench_args
from shoal.runtime.bench import offline, workloads
from shoal.runtime.models.cpu_llama import cpu_supported

pytestmark = pytest.mark.skipif(cpu_supported() is not None, reason=f"C decode step: {cpu_supported()}")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench-gguf") / "tiny.gguf"
    write_tiny_gguf(path, tiny_llama(hidden_size=256, intermediate_size=512, seed=5),
                    {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q4_K", "o_proj": "Q5_K", "gate_proj": "Q4_1",
                     "up_proj": "Q4_1", "down_proj": "Q6_K", "lm_head": "Q6_K"})
    return path


def parse(*argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_args.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_compare_gguf_throughput_runs_both_paths(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("SHOAL_CACHE", str(tmp_path / "cache"))
    args = parse("throughput", str(tiny_gguf), "--compare-gguf", "--dtype", "float32", "--kv-cache-memory", "16MiB")
    llm = offline._engine(args)
    llms = offline.gguf_engines(args, llm)
    assert llms["float32"] is llm and set(llms["float32"].engine.executor.cpu_decoder.quantized_types) == {0}
    assert set(llms["gguf"].engine.executor.cpu_decoder.quantized_types) == {3, 12, 13, 14}
    items = [workloads.Item([1] + [3 + (7 * i + j) % 250 for j in range(5 + 3 * i)], 6 + i) for i in range(6)]
    result = offline.gguf_cost(llms, items, rounds=1)
    assert [r["output_tokens"] for rs in result["runs"].values() for r in rs] == [sum(i.output_len for i in items)] * 2

    # the match rate is that of the two engines' own greedy outputs
    outs = {}
    for kind, engine_llm in llms.items():
        params = [SamplingParams(max_tokens=i.output_len, min_tokens=i.output_len, ignore_eos=True, temperature=0.0)
                  for i in items]
        outs[kind] = [o.outputs[0].token_ids for o in engine_llm.generate([i.prompt for i in items], params)]
        engine_llm.engine.shutdown()
    pairs = [(a, b) for x, y in zip(outs["float32"], outs["gguf"]) for a, b in zip(x, y)]
    assert result["greedy_match_rate"] == pytest.approx(sum(a == b for a, b in pairs) / len(pairs))
    assert result["identical_requests"] == sum(x == y for x, y in zip(outs["float32"], outs["gguf"]))


def test_compare_gguf_needs_a_gguf_model(tmp_path, builtin_dir):
    from engine_helpers import make_tiny_model

    path = make_tiny_model(tmp_path / "hf", builtin_dir)
    args = parse("latency", str(path), "--compare-gguf", "--kv-cache-memory", "16MiB")
    llm = LLM(str(path), kv_cache_memory=2**24)
    with pytest.raises(SystemExit, match="needs a GGUF model"):
        offline.gguf_engines(args, llm)
    llm.engine.shutdown()
