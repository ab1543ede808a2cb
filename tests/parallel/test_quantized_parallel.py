"""Quantized checkpoints over two tensor-parallel ranks (processes): act-order GPTQ (a
row-parallel layer keeps every group's scales), AWQ with groups split across ranks, and
compressed-tensors FP8 with static activation scales, each with transformers' greedy tokens
and first-step log-probs on the dequantized weights (W8A8: activations rounded through fp8)."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import make_tiny_model
from quant_checkpoints import fake_quant_activations, quantize_checkpoint
from shoal import LLM, SamplingParams

PROMPTS = [[1], [100, 2000, 3000, 4000, 5000], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]]
MAX_NEW = 6


@torch.inference_mode()
def _reference(model, prompts):
    tokens, first = [], []
    for ids in prompts:
        x = torch.tensor([ids])
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                             do_sample=False, pad_token_id=0)
        tokens.append(out[0, len(ids):].tolist())
        first.append(torch.log_softmax(model(x).logits[0, -1].double(), -1))
    return tokens, first


def check_two_ranks(model, path) -> None:
    """The checkpoint at `path` over two tensor-parallel ranks: greedy tokens equal to
    transformers' on `model` (its dequantized weights), first-step log-probs within 1e-4."""
    want, first = _reference(model, PROMPTS)
    llm = LLM(str(path), tensor_parallel_size=2, kv_cache_memory=2**22, attention_backend="torch")
    try:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0.0, logprobs=5))
    finally:
        llm.engine.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == want
    for o, ref in zip(outs, first):
        for token, lp in o.outputs[0].logprobs[0].items():
            assert abs(getattr(lp, "logprob", lp) - float(ref[token])) < 1e-4


@pytest.mark.parametrize("fmt,group", [("gptq-act-order", 128), ("awq", 32), ("ct-fp8-tensor-static", 128)])
def test_quantized_checkpoint_over_two_ranks(fmt, group, tmp_path, builtin_dir):
    from transformers import AutoModelForCausalLM

    make_tiny_model(tmp_path, builtin_dir, hidden_size=128, intermediate_size=256)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    quantize_checkpoint(model, tmp_path, fmt, PROMPTS, group=group)
    if "fp8" in fmt:
        fake_quant_activations(model, fmt, tmp_path)
    check_two_ranks(model, tmp_path)
