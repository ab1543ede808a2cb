"""Mixtral, Qwen2-MoE and Qwen3-MoE: a tiny random-weight model of each family, saved by
transformers, gives transformers' greedy tokens for a batch of prompts of mixed lengths and its
first-step log-probabilities within 1e-4 (float32)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # engine_helpers

from engine_helpers import hf_greedy, make_tiny_model  # noqa: E402
from shoal import LLM, SamplingParams  # noqa: E402

MAX_NEW = 12

# Each family with what it varies: Qwen2-MoE a shared expert, qkv bias, no renormalisation
# and a dense layer among sparse ones; Qwen3-MoE q/k norms and every other layer sparse.
FAMILIES = {
    "mixtral": dict(num_local_experts=6, num_experts_per_tok=2, intermediate_size=48),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                      intermediate_size=96, norm_topk_prob=False, mlp_only_layers=[1], num_hidden_layers=3),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                      decoder_sparse_step=2, intermediate_size=96, num_hidden_layers=4, head_dim=32),
}


def moe_prompts(seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(n)] for n in (1, 5, 17, 40, 90)]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory, builtin_dir):
    path = make_tiny_model(tmp_path_factory.mktemp(request.param), builtin_dir, arch=request.param,
                           **FAMILIES[request.param])
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, path, hf


def test_checkpoint_holds_per_expert_weights(family):
    """save_pretrained writes one tensor per expert and projection (the layout published
    checkpoints use), which is what the engine then loads."""
    from shoal.runtime.models.loader import iter_weights

    name, path, _ = family
    names = [n for n, _ in iter_weights(path)]
    leaf = "block_sparse_moe.experts.0.w1.weight" if name == "mixtral" else "mlp.experts.0.gate_proj.weight"
    assert f"model.layers.{1 if name == 'qwen3_moe' else 0}.{leaf}" in names


def test_greedy_tokens_match_transformers(family):
    name, path, hf = family
    prompts = moe_prompts()
    expected = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    llm = LLM(str(path), kv_cache_memory=2**24, max_num_batched_tokens=64)  # prefills split into chunks
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0.0))]
    finally:
        llm.engine.shutdown()
    assert got == expected


def test_first_step_logprobs_match_transformers(family):
    name, path, hf = family
    prompts = moe_prompts(seed=5)
    llm = LLM(str(path), kv_cache_memory=2**24)
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, logprobs=5))
    finally:
        llm.engine.shutdown()
    for prompt, out in zip(prompts, outs):
        with torch.inference_mode():
            row = hf(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
        entry = out.outputs[0].logprobs[0]
        assert set(entry) >= set(row.topk(5).indices.tolist())
        for tid, lp in entry.items():
            assert abs(lp - row[tid].item()) < 1e-4
