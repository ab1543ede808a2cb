"""Mixture-of-experts models at tensor 2 (each rank half of every expert, one all-reduce per
block) and pipeline 2 give transformers' greedy tokens and first-step log-probabilities (within
1e-4), with a KV cache small enough that sequences get preempted."""

from __future__ import annotations

import pytest

from engine_helpers import hf_greedy, make_tiny_model
from parallel_helpers import MAX_NEW, generate, mixed_prompts
from shoal import SamplingParams

MOE = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48, num_hidden_layers=4),
    "qwen2_moe": dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                      mlp_only_layers=[2], num_hidden_layers=4),
    "qwen3_moe": dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True,
                      num_hidden_layers=4, head_dim=32),
}


@pytest.fixture(scope="module", params=sorted(MOE))
def moe_model(request, tmp_path_factory, builtin_dir):
    import torch
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path_factory.mktemp(request.param), builtin_dir, arch=request.param, **MOE[request.param])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = mixed_prompts()
    with torch.inference_mode():
        first = [hf(torch.tensor([p])).logits[0, -1].double().log_softmax(-1) for p in prompts]
    return path, [hf_greedy(hf, p, MAX_NEW) for p in prompts], first


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_moe_model_matches_transformers(moe_model, tp, pp):
    path, expected, first = moe_model
    outs = []
    params = SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0.0, logprobs=3)
    tokens, stats = generate(path, tp, pp, mixed_prompts(), params=params, outputs=outs)
    assert stats.num_preemptions > 0
    assert tokens == expected
    for out, ref in zip(outs, first):
        for token, logprob in out.outputs[0].logprobs[0].items():
            value = logprob.logprob if hasattr(logprob, "logprob") else logprob
            assert abs(value - float(ref[token])) < 1e-4
