"""Quantized experts over two tensor-parallel ranks: each rank holds every expert's half of the
intermediate dimension. FP8: w13's per-channel scales sliced with its rows and w2's whole (its
outputs are not split), the static input scales the largest over every expert on both ranks;
static activations round the same on one rank or two, so the result is transformers' on the
dequantized weights with the same rounding (tests/models/test_quantized_moe_models.py). Int4
(AWQ, asymmetric W4A16, group 32): gate/up's columns and down's rows split, down keeping every
group's scales and zero points."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import make_tiny_model
from quant_checkpoints import fake_quant_activations, fake_quant_experts, quantize_moe_checkpoint
from test_quantized_parallel import PROMPTS, check_two_ranks

QWEN3_MOE = dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True,
                 num_hidden_layers=2, head_dim=32, initializer_range=0.2)


@pytest.mark.parametrize("fmt", ["ct-fp8-channel-static", "ct-fp8-tensor-static", "awq", "ct-w4a16-asym"])
def test_quantized_experts_over_two_ranks(fmt, tmp_path, builtin_dir):
    from transformers import AutoModelForCausalLM

    make_tiny_model(tmp_path, builtin_dir, arch="qwen3_moe", **QWEN3_MOE)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    quantize_moe_checkpoint(model, tmp_path, fmt, PROMPTS)
    if "fp8" in fmt:
        fake_quant_activations(model, fmt, tmp_path)
        fake_quant_experts(model, fmt, tmp_path)
    check_two_ranks(model, tmp_path)
