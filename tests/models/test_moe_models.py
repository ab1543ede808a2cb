"""Mixtral, Qwen2-MoE and Qwen3-MoE: a tiny random-weight model of each family, saved by
transformers, gives transformers' greedy tokens for a batch of prompts of mixed lengths and its
first-step log-probabilities within 1e-4 (float32, CPU, torch backend; the Triton backend's
MoE model is checked against this one in tests/kernels/test_kernel_engine_parity.py)."""

from __future__ import annotations

import pytest

from family_models import BASE, check_against_reference, hf_reference, make_family_model, mixed_prompts
from shoal import LLM

MAX_NEW = 16

# Each family with what it varies: Mixtral renormalises its top-2 and slides a window; Qwen2-MoE
# has a gated shared expert, qkv bias, no renormalisation and a dense layer among sparse ones;
# Qwen3-MoE has q/k norms and every other layer sparse.
MOE_FAMILIES = {
    "mixtral": dict(num_local_experts=6, num_experts_per_tok=2, intermediate_size=48, sliding_window=16),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                      norm_topk_prob=False, mlp_only_layers=[1], num_hidden_layers=3),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                      decoder_sparse_step=2, num_hidden_layers=4, head_dim=32),
}


def make_moe_model(path, builtin_dir, model_type: str, **overrides):
    return make_family_model(path, builtin_dir, model_type, **{**MOE_FAMILIES[model_type], **overrides})


@pytest.fixture(scope="module", params=sorted(MOE_FAMILIES))
def family(request, tmp_path_factory, builtin_dir):
    model_type = request.param
    path, model = make_moe_model(tmp_path_factory.mktemp(model_type), builtin_dir, model_type)
    prompts = mixed_prompts()
    tokens, first = hf_reference(model, prompts, MAX_NEW)
    return model_type, path, prompts, tokens, first


def test_greedy_tokens_and_first_logprobs_match_transformers(family):
    model_type, path = family[:2]
    llm = LLM(str(path), kv_cache_memory=2**24, max_num_batched_tokens=32, attention_backend="torch")
    experts = [m for m in llm.engine.executor.model.modules() if type(m).__name__ == "SparseMoeBlock"]
    assert len(experts) == {"mixtral": 2, "qwen2_moe": 2, "qwen3_moe": 2}[model_type]
    check_against_reference(llm, family, MAX_NEW)


def test_checkpoint_holds_per_expert_weights(family):
    """save_pretrained writes one tensor per expert and projection (the layout published
    checkpoints use), which is what the engine loads above."""
    from shoal.runtime.models.loader import iter_weights

    model_type, path = family[:2]
    names = {n for n, _ in iter_weights(path)}
    leaf = "block_sparse_moe.experts.5.w3.weight" if model_type == "mixtral" else "mlp.experts.7.up_proj.weight"
    sparse = {"mixtral": 1, "qwen2_moe": 2, "qwen3_moe": 3}[model_type]
    assert f"model.layers.{sparse}.{leaf}" in names
    assert not any("gate_up_proj" in n for n in names)


def test_spec_marks_the_sparse_layers():
    from transformers import AutoConfig

    from shoal.runtime.models.families import spec_of

    def spec(t, **kw):
        return spec_of(AutoConfig.for_model(t, **{**BASE, **MOE_FAMILIES[t], **kw}))

    assert spec("mixtral").moe_layers == [True, True] and not spec("mixtral").plain
    q2 = spec("qwen2_moe")
    assert q2.moe_layers == [True, False, True] and q2.qkv_bias
    q3 = spec("qwen3_moe")
    assert q3.moe_layers == [False, True, False, True] and q3.qk_norm == "head" and not q3.qkv_bias


# ---------------------------------------------------------------- gpt-oss


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory, builtin_dir):
    from family_models import make_gpt_oss_model

    path, model = make_gpt_oss_model(tmp_path_factory.mktemp("gpt_oss"), builtin_dir)
    prompts = mixed_prompts()  # most longer than the window of 8
    tokens, first = hf_reference(model, prompts, MAX_NEW)
    return "gpt_oss", path, prompts, tokens, first


def test_gpt_oss_matches_transformers(gpt_oss):
    """Sinks, alternating windows, qkv/o biases, YaRN, the biased router's top-k softmax and the
    biased clamped-SwiGLU experts (loaded from the fused [E, H, 2I] interleaved tensors)."""
    llm = LLM(str(gpt_oss[1]), kv_cache_memory=2**24, max_num_batched_tokens=32, attention_backend="torch")
    model = llm.engine.executor.model
    assert [layer.self_attn.window for layer in model.layers] == [8, 0, 8]
    assert all(type(layer.mlp).__name__ == "SparseMoeBlock" and layer.mlp.experts.oai for layer in model.layers)
    check_against_reference(llm, gpt_oss, MAX_NEW)


def test_gpt_oss_spec():
    from transformers import AutoConfig

    from family_models import GPT_OSS
    from shoal.runtime.models.families import model_type_of, spec_of

    spec = spec_of(AutoConfig.for_model("gpt_oss", **{**BASE, **GPT_OSS}))
    assert spec.attn_sinks and spec.o_bias and spec.qkv_bias and not spec.plain
    assert spec.moe_layers == [True] * 3 and spec.windows == [8, 0, 8]
    assert model_type_of({"architectures": ["GptOssForCausalLM"]}) == "gpt_oss"


def _quantize_mxfp4(w):
    """w [..., K] -> (blocks [..., K/32, 16] uint8, scales [..., K/32] uint8): the OCP MX layout of
    gpt-oss's checkpoints (e2m1 codes two to a byte, low nibble first; e8m0 scales, bias 127)."""
    import torch

    magnitudes = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    groups = w.reshape(*w.shape[:-1], -1, 32)
    exp = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=2.0**-100) / 6.0))
    x = groups / torch.exp2(exp)[..., None]
    code = (x.abs()[..., None] - magnitudes).abs().argmin(-1) | ((x < 0).long() << 3)
    return (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8), (exp + 127).to(torch.uint8)


def test_gpt_oss_mxfp4_checkpoint(tmp_path, builtin_dir):
    """A checkpoint in gpt-oss's published MXFP4 form (experts as *_blocks and *_scales,
    quantization_config mxfp4) loads dequantized: transformers' tokens on the dequantized weights
    (dequantized by transformers' own convert_moe_packed_tensors)."""
    import json

    import torch
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from family_models import make_gpt_oss_model

    path, model = make_gpt_oss_model(tmp_path, builtin_dir)
    state = {}
    with torch.no_grad():
        for name, p in model.state_dict().items():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                blocks, scales = _quantize_mxfp4(p.transpose(1, 2))  # stored (out, in), grouped along the inputs
                state[name + "_blocks"], state[name + "_scales"] = blocks, scales
                p.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))  # transformers' [E, in, out]
            elif name != "lm_head.weight" or not model.config.tie_word_embeddings:
                state[name] = p.contiguous()
    (path / "model.safetensors").unlink()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(cfg))
    prompts = mixed_prompts(5)
    tokens, first = hf_reference(model, prompts, 8)
    llm = LLM(str(path), kv_cache_memory=2**24, max_num_batched_tokens=32, attention_backend="torch")
    check_against_reference(llm, ("gpt_oss-mxfp4", path, prompts, tokens, first), 8)


def test_gpt_oss_yarn_table_matches_transformers():
    """gpt-oss's YaRN RoPE (scaled frequencies and the attention factor folded into cos/sin)."""
    import torch
    from transformers import AutoConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    from family_models import GPT_OSS
    from shoal.runtime.models.decoder import rope_cache

    cfg = AutoConfig.for_model("gpt_oss", **{**BASE, **GPT_OSS})
    table = rope_cache(cfg, 256)
    positions = torch.tensor([[0, 5, 63, 64, 200, 255]])
    cos, sin = GptOssRotaryEmbedding(cfg)(torch.zeros(1, 1, 16), positions)
    half = table.shape[-1] // 2
    assert half == cos.shape[-1] == GPT_OSS["head_dim"] // 2
    torch.testing.assert_close(table[positions[0], :half], cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(table[positions[0], half:], sin[0], rtol=0, atol=1e-6)
    assert not torch.allclose(cos[0, -1], torch.cos(255 * 150000.0 ** (-torch.arange(0, 16, 2) / 16)))  # YaRN moved it
