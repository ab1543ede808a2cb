"""Mixture-of-experts layers in the C decode step (runtime/models/cpu_llama.c, moe_block): tiny
random Qwen3-MoE (with a dense layer among the sparse ones; top-k renormalised or not),
Qwen2-MoE (a sigmoid-gated shared expert, QKV biases) and Mixtral models, against the torch model step by step and, in the engine, against transformers'
greedy tokens and first-step log-probabilities, at batches of 1-4 sequences and of 24 (where
nearly every expert gets rows, some several). Families the C step does not route stay on the
torch model."""

from __future__ import annotations

import random

import pytest
import torch

from family_models import check_against_reference, hf_reference, make_family_model, make_gpt_oss_model
from shoal import LLM
from shoal.runtime.models.cpu_llama import CpuDecoder, cpu_supported, unsupported_reason
from test_cpu_llama import check_steps_against_torch, load

pytestmark = pytest.mark.skipif(cpu_supported() is not None, reason=f"C decode step: {cpu_supported()}")

MAX_NEW = 12

# 16 experts of which each token takes 4 (Mixtral: 8, 2); Qwen2/3-MoE's layer 1 is a dense MLP
MODELS = {
    "qwen3_moe": ("qwen3_moe", dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, norm_topk_prob=True,
                                    decoder_sparse_step=1, mlp_only_layers=[1], num_hidden_layers=3, head_dim=32,
                                    intermediate_size=96)),
    "qwen3_moe_unnormalized": ("qwen3_moe", dict(num_experts=16, num_experts_per_tok=3, moe_intermediate_size=24,
                                                 norm_topk_prob=False, num_hidden_layers=2, head_dim=16)),
    "qwen2_moe": ("qwen2_moe", dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=48, norm_topk_prob=False, mlp_only_layers=[1],
                                    num_hidden_layers=3, intermediate_size=64)),
    "mixtral": ("mixtral", dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=40, sliding_window=None,
                                num_hidden_layers=2)),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def made(request, tmp_path_factory, builtin_dir):
    model_type, fields = MODELS[request.param]
    path, hf = make_family_model(tmp_path_factory.mktemp(request.param), builtin_dir, model_type, **fields)
    return request.param, path, hf


def prompts_of(n: int, seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randrange(1, 30))] for _ in range(n)]


@pytest.mark.parametrize("batch", [1, 3, 24])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_decode_steps_match_the_torch_model(made, batch, threads):
    """Each of 3 steps from identical caches: the same logits and cache contents as the torch
    model's MoE blocks (ops.fused_moe)."""
    name, path, _ = made
    model = load(path)
    decoder = CpuDecoder.create(model, num_threads=threads)
    assert decoder is not None and decoder._model.router, name
    block = 16
    check_steps_against_torch(model, decoder, batch, block, max_context=200, steps=3)


@pytest.mark.parametrize("num_prompts", [3, 24])
def test_engine_decodes_moe_in_c_and_matches_transformers(made, num_prompts):
    """The engine's decode steps go through the C step (spied), and its greedy tokens and
    first-step log-probabilities are transformers' own (each prompt alone in generate)."""
    name, path, hf = made
    prompts = prompts_of(num_prompts)
    tokens, first = hf_reference(hf, prompts, MAX_NEW)
    llm = LLM(str(path), kv_cache_memory=2**24, max_num_batched_tokens=512)
    decoder = llm.engine.executor.cpu_decoder
    assert decoder is not None
    calls = []
    step = decoder.step
    decoder.step = lambda *args: calls.append(args[0].shape[0]) or step(*args)
    check_against_reference(llm, (name, path, prompts, tokens, first), MAX_NEW)
    assert calls and max(calls) == num_prompts


def test_routing_the_c_step_does_not_do_stays_in_torch(tmp_path, builtin_dir):
    """gpt-oss (top-k of biased logits, then softmax; sinks) runs on the torch model, and still
    gives transformers' tokens; DeepSeek (grouped routing, latent attention) is not taken either."""
    from transformers import AutoConfig

    from family_models import BASE, DEEPSEEK
    from shoal.runtime.models.families import spec_of

    for t in DEEPSEEK:
        assert not spec_of(AutoConfig.for_model(t, **{**BASE, **DEEPSEEK[t]})).c_step
    path, hf = make_gpt_oss_model(tmp_path / "gpt_oss", builtin_dir)
    assert "shape" in unsupported_reason(load(path))
    prompts = prompts_of(3)
    tokens, first = hf_reference(hf, prompts, MAX_NEW)
    llm = LLM(str(path), kv_cache_memory=2**24)
    assert llm.engine.executor.cpu_decoder is None
    check_against_reference(llm, ("gpt_oss", path, prompts, tokens, first), MAX_NEW)
