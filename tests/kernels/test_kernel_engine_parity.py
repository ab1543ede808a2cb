"""The engine's greedy output with the Triton backend (interpreter, tiny random model) equals the torch backend's.

Chunked prefill (a 16-token step budget), a shared prefix served from the prefix cache, GQA 3.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # engine_helpers

from engine_helpers import make_tiny_model  # noqa: E402


def test_greedy_triton_equals_torch(tmp_path, builtin_dir):
    pytest.importorskip("triton")
    from shoal import LLM, SamplingParams

    path = make_tiny_model(tmp_path, builtin_dir, num_hidden_layers=2, hidden_size=96,
                           num_attention_heads=6, num_key_value_heads=2)
    prompts = ["The quick brown fox jumps over the lazy dog", "Hello",
               "The quick brown fox jumps over the lazy cat"]
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(model=str(path), attention_backend=backend, kv_cache_memory=2**22, max_num_batched_tokens=16,
                  block_size=16, enable_prefix_caching=True)
        outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0))
        tokens[backend] = [o.outputs[0].token_ids for o in outs]
    assert all(len(t) == 4 for t in tokens["torch"])
    assert tokens["triton"] == tokens["torch"]


@pytest.mark.parametrize("model_type", ["gemma2", "phi3"])
def test_families_on_triton_equal_transformers(tmp_path, builtin_dir, model_type):
    """Gemma 2 through the Triton kernels (windowed and soft-capped attention, GeGLU, the sandwich
    norms), Phi-3 (partial rotary through the Triton rotary kernel): transformers' greedy tokens."""
    pytest.importorskip("triton")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from family_models import hf_reference, make_family_model, mixed_prompts

    from shoal import LLM, SamplingParams

    path, model = make_family_model(tmp_path, builtin_dir, model_type)
    prompts = mixed_prompts(4, seed=5)  # 1 to 17 tokens: past Gemma's window of 8
    want, _ = hf_reference(model, prompts, 4)
    llm = LLM(model=str(path), attention_backend="triton", kv_cache_memory=2**22, max_num_batched_tokens=16, block_size=16)
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, min_tokens=4, temperature=0.0))
    assert [o.outputs[0].token_ids for o in outs] == want


def test_deepseek_on_triton_equals_transformers(tmp_path, builtin_dir):
    """DeepSeek-V3's latent attention through the Triton kernels: a one-plane cache read as K and V
    (width 40, padded in the kernels), 4 query heads on one latent head; transformers' greedy tokens."""
    pytest.importorskip("triton")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from family_models import hf_reference, make_deepseek_model, mixed_prompts

    from shoal import LLM, SamplingParams

    path, model = make_deepseek_model(tmp_path, builtin_dir, "deepseek_v3")
    prompts = mixed_prompts(4, seed=5)
    want, _ = hf_reference(model, prompts, 4)
    llm = LLM(model=str(path), attention_backend="triton", kv_cache_memory=2**22, max_num_batched_tokens=16, block_size=16)
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, min_tokens=4, temperature=0.0))
    assert [o.outputs[0].token_ids for o in outs] == want


def test_moe_model_greedy_triton_equals_torch(tmp_path, builtin_dir):
    """A Qwen2-MoE model (routed experts through fused_moe's grouped GEMMs, a gated shared expert)."""
    pytest.importorskip("triton")
    from shoal import LLM, SamplingParams

    path = make_tiny_model(tmp_path, builtin_dir, arch="qwen2_moe", num_hidden_layers=2, hidden_size=64,
                           num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                           shared_expert_intermediate_size=48)
    prompts = ["The quick brown fox jumps over the lazy dog", "Hello", "A longer prompt, chunked over two steps or more"]
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(model=str(path), attention_backend=backend, kv_cache_memory=2**22, max_num_batched_tokens=16)
        outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0))
        tokens[backend] = [o.outputs[0].token_ids for o in outs]
    assert all(len(t) == 6 for t in tokens["torch"])
    assert tokens["triton"] == tokens["torch"]


def test_gpt_oss_on_triton_equals_transformers(tmp_path, builtin_dir):
    """gpt-oss through the Triton kernels: sinks in the decode and prefill attention (windowed
    and full layers), fused_moe with expert biases and the clamped SwiGLU."""
    pytest.importorskip("triton")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from family_models import hf_reference, make_gpt_oss_model, mixed_prompts

    from shoal import LLM, SamplingParams

    path, model = make_gpt_oss_model(tmp_path, builtin_dir)
    prompts = mixed_prompts(4, seed=5)  # 1 to 17 tokens: past the window of 8
    want, _ = hf_reference(model, prompts, 4)
    llm = LLM(model=str(path), attention_backend="triton", kv_cache_memory=2**22, max_num_batched_tokens=16, block_size=16)
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, min_tokens=4, temperature=0.0))
    assert [o.outputs[0].token_ids for o in outs] == want


@pytest.mark.parametrize("fmt", ["ct-fp8-tensor-static", "awq"])
def test_quantized_moe_model_triton_equals_torch(tmp_path, builtin_dir, fmt):
    """Qwen2-MoE with quantized experts (FP8 W8A8 or AWQ int4) and shared expert (the dense
    methods): fused_moe's fp8 and int4 paths in the Triton kernel, wired through the engine,
    give the torch backend's greedy tokens and first-step log-probs."""
    pytest.importorskip("triton")
    import torch
    from transformers import AutoModelForCausalLM

    from quant_checkpoints import quantize_moe_checkpoint
    from shoal import LLM, SamplingParams

    path = make_tiny_model(tmp_path, builtin_dir, arch="qwen2_moe", num_hidden_layers=2, hidden_size=64,
                           num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                           shared_expert_intermediate_size=64)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [[100, 2000, 3000, 4000, 5000], [7], list(range(300, 321))]
    quantize_moe_checkpoint(model, path, fmt, prompts)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(model=str(path), attention_backend=backend, kv_cache_memory=2**22, max_num_batched_tokens=16)
        try:
            block = next(m for m in llm.engine.executor.model.modules() if type(m).__name__ == "SparseMoeBlock")
            assert block.experts.quant is not None
            assert type(block.shared_expert.down_proj.method).__name__ == ("AwqLinear" if fmt == "awq" else "Fp8Linear")
            outs[backend] = llm.generate(prompts,
                                         SamplingParams(max_tokens=6, temperature=0.0, logprobs=3))
        finally:
            llm.engine.shutdown()
    assert [o.outputs[0].token_ids for o in outs["triton"]] == [o.outputs[0].token_ids for o in outs["torch"]]
    for a, b in zip(outs["triton"], outs["torch"]):
        for token, lp in b.outputs[0].logprobs[0].items():
            got = a.outputs[0].logprobs[0][token]
            assert abs(getattr(got, "logprob", got) - getattr(lp, "logprob", lp)) < 1e-3
