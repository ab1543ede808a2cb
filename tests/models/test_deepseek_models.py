"""DeepSeek-V2 and DeepSeek-V3: a tiny random-weight model of each, saved by transformers, gives
transformers' greedy tokens for a batch of prompts of mixed lengths and its first-step
log-probabilities within 1e-4 (float32, CPU, torch backend), with the paged KV cache holding only
the compressed latent (kv_lora_rank + qk_rope_head_dim per token and layer, one plane).

V2-shaped: no q_lora_rank (V2-Lite's plain q_proj), attention biases (kv_a_proj_with_mqa,
o_proj), softmax routing limited to the best groups (group_limited_greedy), a routed scaling
factor, complex (interleaved) RoPE, v_head_dim unlike the nope dim. V3-shaped: q_lora_rank, sigmoid routing with a random e_score_correction_bias, grouped
top-k over the sum of each group's best two, norm_topk_prob, rope_interleave, YaRN with both
mscales (RoPE's attention factor and the softmax scale). Both: dense layers first
(first_k_dense_replace), shared experts.
"""

from __future__ import annotations

import pytest
import torch

from family_models import BASE, DEEPSEEK, check_against_reference, hf_reference, make_deepseek_model, mixed_prompts
from shoal import LLM

MAX_NEW = 16


@pytest.fixture(scope="module", params=sorted(DEEPSEEK))
def family(request, tmp_path_factory, builtin_dir):
    model_type = request.param
    path, model = make_deepseek_model(tmp_path_factory.mktemp(model_type), builtin_dir, model_type)
    prompts = mixed_prompts()
    tokens, first = hf_reference(model, prompts, MAX_NEW)
    return model_type, path, prompts, tokens, first


def test_greedy_tokens_and_first_logprobs_match_transformers(family):
    model_type, path = family[:2]
    cfg = DEEPSEEK[model_type]
    llm = LLM(str(path), kv_cache_memory=2**22, max_num_batched_tokens=32, attention_backend="torch")
    runner = llm.engine.executor
    # the cache holds one latent plane per layer: [c, k_pe] of kv_lora_rank + qk_rope_head_dim per token
    width = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    for cache in runner.kv_caches:
        assert cache.shape[0] == 1 and cache.shape[-2:] == (1, width)
    assert runner.kv_bytes_per_block() == cfg["num_hidden_layers"] * runner.config.block_size * width * 4
    moe = [m for m in runner.model.modules() if type(m).__name__ == "SparseMoeBlock"]
    assert len(moe) == cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]
    check_against_reference(llm, family, MAX_NEW)


def test_latent_cache_is_smaller_than_the_expanded_one(family):
    """For the same memory, blocks in proportion to the per-token size: the latent against the K
    and V of every head that transformers' expanded attention would hold."""
    model_type, path = family[:2]
    cfg = DEEPSEEK[model_type]
    llm = LLM(str(path), kv_cache_memory=2**22, attention_backend="torch")
    try:
        runner = llm.engine.executor
        expanded = cfg["num_attention_heads"] * (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"] + cfg["v_head_dim"])
        latent = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
        per_block = cfg["num_hidden_layers"] * runner.config.block_size * 4
        assert runner.num_blocks_for(2**22) == 2**22 // (per_block * latent) > 2**22 // (per_block * expanded)
    finally:
        llm.engine.shutdown()


def test_grouped_topk_routing_matches_transformers_router():
    """The router alone against transformers' V2 and V3 routers, on many tokens: the same experts
    with the same weights."""
    from transformers import AutoConfig
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from shoal.runtime.layers.moe import SparseMoeBlock

    torch.manual_seed(0)
    x = torch.randn(200, BASE["hidden_size"])
    for model_type, ref_cls in (("deepseek_v2", DeepseekV2TopkRouter), ("deepseek_v3", DeepseekV3TopkRouter)):
        for greedy in (False, True) if model_type == "deepseek_v2" else (False,):
            extra = {"topk_method": "greedy"} if greedy else {}
            cfg = AutoConfig.for_model(model_type, **{**BASE, **DEEPSEEK[model_type], **extra})
            ref = ref_cls(cfg)
            with torch.no_grad():
                ref.weight.normal_()
                if model_type == "deepseek_v3":
                    ref.e_score_correction_bias.normal_(std=0.3)
            block = SparseMoeBlock.from_config(cfg)
            block.load("gate.weight", ref.weight.detach())
            if model_type == "deepseek_v3":
                block.load("gate.e_score_correction_bias", ref.e_score_correction_bias)
            _, want_w, want_ids = ref(x)
            got_w, got_ids = block.route(x)
            want_ids, order = want_ids.sort(-1)
            got_ids, got_order = got_ids.sort(-1)
            assert torch.equal(got_ids, want_ids), (model_type, greedy)
            torch.testing.assert_close(got_w.gather(1, got_order), want_w.gather(1, order))


def test_spec_marks_latent_attention_and_sparse_layers():
    from transformers import AutoConfig

    from shoal.runtime.models.families import spec_of

    for model_type, fields in DEEPSEEK.items():
        spec = spec_of(AutoConfig.for_model(model_type, **{**BASE, **fields}))
        assert spec.mla and not spec.plain and spec.moe_layers == [False, True, True]
