"""Each quantized format as a LinearMethod on the tensor-parallel layers: tensors written in
the published layout (tests/quant_checkpoints.py) load through the layers' one sharding path,
and two ranks together compute the dequantized layer's product (W8A8: with its activations
rounded through fp8 as the format defines)."""

from __future__ import annotations

import pytest
import torch

from quant_checkpoints import FP8, quantization_config, quantize_awq, quantize_fp8, quantize_gptq, quantize_w4a16
from shoal.runtime.distributed import ParallelState
from shoal.runtime.layers.linear import MergedColumnLinear, QKVLinear, RowLinear, cast_and_finish
from shoal.runtime.layers.quantization import methods_for

GROUP = 32
FORMATS = ["ct-fp8-tensor-static", "ct-fp8-channel-dynamic", "awq", "gptq", "gptq-act-order", "ct-w4a16", "ct-w4a16-asym"]


class Cfg:
    def __init__(self, qc):
        self.quantization_config = qc


def _quantize(fmt, name, w, perm, input_amax):
    if fmt.startswith("ct-fp8"):
        return quantize_fp8(name, w, per_channel="channel" in fmt, input_amax=input_amax)
    if fmt == "awq":
        return quantize_awq(name, w, GROUP)
    if fmt.startswith("gptq"):
        return quantize_gptq(name, w, GROUP, perm)
    return quantize_w4a16(name, w, GROUP, symmetric=fmt == "ct-w4a16")


def _fp8_round(x, fmt, amax):
    if fmt == "ct-fp8-tensor-static":
        s = torch.tensor(amax / 448.0)
    else:
        s = (x.abs().amax(-1, keepdim=True) / 448.0).clamp_min(1e-12)
    return (x / s).clamp(-448, 448).to(FP8).float() * s


def _checkpoint(fmt, weights, in_features):
    """Each projection quantized alone, as a checkpoint holds them: ({kind: tensor} per
    projection, the dequantized matrices)."""
    perm = torch.randperm(in_features) if fmt == "gptq-act-order" else None
    parts, deqs = [], []
    for w in weights:
        tensors, deq = _quantize(fmt, "p", w, perm, 4.0 if fmt == "ct-fp8-tensor-static" else None)
        parts.append({k.split(".", 1)[1]: v for k, v in tensors.items()})
        deqs.append(deq)
    return parts, deqs


@pytest.mark.parametrize("fmt", FORMATS)
def test_column_layers_shard_and_multiply(fmt):
    torch.manual_seed(0)
    hidden, d, heads, kv = 128, 16, 4, 2
    weights = [torch.randn(n * d, hidden) * 0.1 for n in (heads, kv, kv)]
    parts, deqs = _checkpoint(fmt, weights, hidden)
    x = torch.randn(5, hidden)
    xq = _fp8_round(x, fmt, 4.0) if "fp8" in fmt else x
    method_for = methods_for(Cfg(quantization_config(fmt, GROUP)))
    outs = []
    for rank in range(2):
        layer = QKVLinear(hidden, d, heads, kv, ParallelState(tp_rank=rank, tp_size=2), method=method_for("l.qkv_proj"))
        for shard, tensors in enumerate(parts):
            for kind, t in tensors.items():
                layer.load(t, shard, kind)
        cast_and_finish(layer, torch.float32)
        outs.append(layer(x).split(layer.local_sizes, dim=-1))
    got = torch.cat([torch.cat([outs[r][s] for r in range(2)], -1) for s in range(3)], -1)
    torch.testing.assert_close(got, xq @ torch.cat(deqs).t(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", FORMATS)
def test_merged_and_row_layers_in_one_process(fmt):
    """gate/up on one rank, down_proj's input features split over two (partial sums added:
    no all-reduce runs in one process); act-order GPTQ keeps every group's scales there."""
    torch.manual_seed(1)
    hidden, inter = 64, 128
    gate_up = [torch.randn(inter, hidden) * 0.1 for _ in range(2)]
    down = torch.randn(hidden, inter) * 0.1
    method_for = methods_for(Cfg(quantization_config(fmt, GROUP)))
    parts, deqs = _checkpoint(fmt, gate_up, hidden)
    merged = MergedColumnLinear(hidden, [inter, inter], method=method_for("l.gate_up_proj"))
    for shard, tensors in enumerate(parts):
        for kind, t in tensors.items():
            merged.load(t, shard, kind)
    cast_and_finish(merged, torch.float32)
    x = torch.randn(3, hidden)
    xq = _fp8_round(x, fmt, 4.0) if "fp8" in fmt else x
    torch.testing.assert_close(merged(x), xq @ torch.cat(deqs).t(), rtol=1e-4, atol=1e-4)

    (down_tensors,), (down_deq,) = _checkpoint(fmt, [down], inter)
    h = torch.randn(3, inter)
    partial = []
    for rank in range(2):
        layer = RowLinear(inter, hidden, ParallelState(tp_rank=rank, tp_size=2), method=method_for("l.down_proj"))
        for kind, t in down_tensors.items():
            layer.load(t, kind)
        cast_and_finish(layer, torch.float32)
        part = h[:, rank * 64 : rank * 64 + 64]
        partial.append(layer.method.apply(layer, part, None))
        want = (_fp8_round(part, fmt, 4.0) if "fp8" in fmt else part) @ down_deq[:, rank * 64 : rank * 64 + 64].t()
        torch.testing.assert_close(partial[-1], want, rtol=1e-4, atol=1e-4)


def test_fp8_at_load_quantizes_a_float_layer_per_channel():
    torch.manual_seed(2)
    w = torch.randn(48, 64)
    layer = RowLinear(64, 48, method=methods_for(Cfg(None), "fp8")("l.o_proj"))
    layer.load(w)
    cast_and_finish(layer, torch.bfloat16)
    assert layer.weight.dtype == FP8
    scale = w.abs().amax(1, keepdim=True) / 448.0
    torch.testing.assert_close(layer.weight.float() * layer.w_scale[:, None], (w / scale).to(FP8).float() * scale)
    x = torch.randn(2, 64)
    torch.testing.assert_close(layer(x), _fp8_round(x, "dynamic", 0) @ ((w / scale).to(FP8).float() * scale).t())


def test_vllm_fp8_checkpoint_layout_loads_per_tensor_scales():
    """vLLM's own fp8 checkpoints (quant_method fp8): a scalar weight_scale and input_scale per projection."""
    torch.manual_seed(3)
    weights = [torch.randn(32, 64) * 0.1 for _ in range(2)]
    method = methods_for(Cfg({"quant_method": "fp8", "activation_scheme": "static"}))("l.gate_up_proj")
    layer = MergedColumnLinear(64, [32, 32], method=method)
    deqs = []
    for shard, w in enumerate(weights):
        tensors, deq = quantize_fp8("p", w, input_amax=2.0 + shard)
        for kind, t in tensors.items():
            layer.load(t.reshape(()) if t.numel() == 1 else t, shard, kind.split(".", 1)[1])
        deqs.append(deq)
    cast_and_finish(layer, torch.float32)
    x = torch.randn(4, 64)
    torch.testing.assert_close(layer(x), _fp8_round(x, "ct-fp8-tensor-static", 3.0) @ torch.cat(deqs).t(),
                               rtol=1e-4, atol=1e-4)  # a fused layer takes the larger input scale


def test_the_registry_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="block-wise"):
        methods_for(Cfg({"quant_method": "fp8", "weight_block_size": [128, 128]}))
    with pytest.raises(ValueError, match="4-bit"):
        methods_for(Cfg({"quant_method": "gptq", "bits": 8}))
    with pytest.raises(ValueError, match="not supported"):
        methods_for(Cfg({"quant_method": "bitsandbytes"}))
    with pytest.raises(ValueError, match="quantized as 'awq'"):
        methods_for(Cfg(quantization_config("awq")), "gptq")
    qc = quantization_config("ct-w4a16")
    qc["ignore"] = ["re:.*\\.layers\\.0\\.mlp\\..*"]
    method_for = methods_for(Cfg(qc))
    assert type(method_for("model.layers.0.mlp.gate_up_proj")).__name__ == "PlainLinear"
    assert type(method_for("model.layers.1.mlp.gate_up_proj")).__name__ == "PackedInt4Linear"
    qc["ignore"] = ["model.layers.0.self_attn.q_proj"]  # q quantized, k and v not: no fused layer holds that
    with pytest.raises(ValueError, match="some of its fused projections"):
        methods_for(Cfg(qc))("model.layers.0.self_attn.qkv_proj")
    for fmt, name in (("gptq", "weight"), ("ct-w4a16", "qweight"), ("ct-fp8-channel-dynamic", "input_scale")):
        layer = RowLinear(64, 48, method=methods_for(Cfg(quantization_config(fmt, GROUP)))("model.layers.0.self_attn.o_proj"))
        with pytest.raises(ValueError, match="holds no tensor"):
            layer.load(torch.zeros(1), name)
