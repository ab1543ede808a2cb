"""A tiny random Llama quantized in each format by the reference quantizers
(tests/quant_checkpoints.py, written in the published layouts) runs in Shoal with
transformers' greedy tokens and first-step log-probabilities, transformers running the
dequantized weights in float32 (W8A8: its linear inputs rounded through fp8 as the format
defines). Measured on this model: every prompt's tokens equal, log-probs within 2e-5
(docs/quantization.md); asserted: 7 of 8 prompts and 1e-4."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import make_tiny_model
from family_models import hf_reference, mixed_prompts
from quant_checkpoints import fake_quant_activations, quantize_checkpoint
from shoal import LLM, SamplingParams

MAX_NEW = 8
FORMATS = ["ct-fp8-tensor-static", "ct-fp8-channel-dynamic", "fp8-at-load", "awq", "gptq", "gptq-act-order", "ct-w4a16",
           "ct-w4a16-asym"]
METHODS = {"ct-fp8-tensor-static": "Fp8Linear", "ct-fp8-channel-dynamic": "Fp8Linear", "fp8-at-load": "Fp8Linear",
           "awq": "AwqLinear", "gptq": "GptqLinear", "gptq-act-order": "GptqLinear", "ct-w4a16": "PackedInt4Linear",
           "ct-w4a16-asym": "PackedInt4Linear"}


def quantized_model(path, builtin_dir, fmt):
    """(checkpoint dir, transformers on the dequantized weights, prompts)."""
    from transformers import AutoModelForCausalLM

    make_tiny_model(path, builtin_dir, hidden_size=128, intermediate_size=256)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = mixed_prompts()
    quantize_checkpoint(model, path, fmt, prompts)
    if "fp8" in fmt:
        fake_quant_activations(model, fmt, path)
    return path, model, prompts


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_checkpoint_matches_transformers_on_its_dequantized_weights(fmt, tmp_path, builtin_dir):
    path, model, prompts = quantized_model(tmp_path, builtin_dir, fmt)
    want, first = hf_reference(model, prompts, MAX_NEW)
    extra = {"quantization": "fp8"} if fmt == "fp8-at-load" else {}
    llm = LLM(str(path), kv_cache_memory=2**24, max_num_batched_tokens=32, attention_backend="torch", **extra)
    try:
        layer = llm.engine.executor.model.layers[0]
        assert type(layer.mlp.down_proj.method).__name__ == METHODS[fmt]
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0.0, logprobs=5))
    finally:
        llm.engine.shutdown()
    same = sum(o.outputs[0].token_ids == w for o, w in zip(outs, want))
    assert same >= len(prompts) - 1, f"{fmt}: {same} of {len(prompts)} prompts gave transformers' tokens"
    for o, ref in zip(outs, first):
        for token, logprob in o.outputs[0].logprobs[0].items():
            value = logprob.logprob if hasattr(logprob, "logprob") else logprob
            assert abs(value - float(ref[token])) < 1e-4, (fmt, token, value, float(ref[token]))
