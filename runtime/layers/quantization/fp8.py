"""FP8 W8A8 (float8 e4m3 weights, activations quantized per token or by a static scale), as
compressed-tensors and vLLM's fp8 checkpoints store it, or quantized at load from a float
checkpoint (`--quantization fp8`: a scale per output channel, dynamic per-token activations).

Tensors: weight [out, in] float8; weight_scale one per projection ([out, 1] per channel);
input_scale one per projection (static activations; a fused layer takes the largest)."""

from __future__ import annotations

import torch
from torch import nn

from shoal.kernels import quant_reference as ref
from shoal.runtime.layers.linear import Layout, LinearMethod, _param, kept


def projections(layer) -> list[int]:
    """The output sizes of the projections a layer fuses (one for a row-parallel layer)."""
    return list(getattr(layer, "local_sizes", None) or [layer.weight_rows])


class Fp8Linear(LinearMethod):
    def __init__(self, per_channel: bool = False, activations: str | None = "dynamic", serialized: bool = True):
        if activations not in (None, "dynamic", "static"):
            raise ValueError(f"fp8 activations must be dynamic, static or none; got {activations!r}")
        self.per_channel, self.activations, self.serialized = per_channel or not serialized, activations, serialized

    def create_weights(self, layer, out_features, in_features):
        layer.weight_rows = out_features
        shards = len(projections(layer))
        if not self.serialized:  # a float checkpoint: quantized in finish, from float32 (not the model's dtype)
            layer.weight = kept(_param(out_features, in_features))
            return
        layer.weight = kept(nn.Parameter(torch.empty(out_features, in_features, dtype=ref.FP8), requires_grad=False))
        layer.weight_scale = kept(_param(out_features, 1) if self.per_channel else _param(shards))
        if self.activations == "static":
            layer.input_scale = kept(_param(shards))

    def layout(self, name):
        if name == "weight":
            return Layout(0, 1)
        if name == "bias" or (name == "weight_scale" and self.per_channel):
            return Layout(0, None)
        if name == "weight_scale" or (name == "input_scale" and self.activations == "static"):
            return Layout(None, None)
        raise ValueError(f"an fp8 layer holds no tensor {name!r}")

    def finish(self, layer):
        if not self.serialized:
            w = layer.weight.data.float()
            scale = (w.abs().amax(1) / ref.FP8_MAX).clamp_min(1e-12)
            layer.weight = kept(nn.Parameter((w / scale[:, None]).to(ref.FP8), requires_grad=False))
            layer.w_scale = scale
        elif self.per_channel:
            layer.w_scale = layer.weight_scale.data.float().reshape(-1)
        else:  # per tensor: one scale per fused projection, repeated over its rows
            sizes = torch.tensor(projections(layer), device=layer.weight.device)
            layer.w_scale = layer.weight_scale.data.float().repeat_interleave(sizes)
        layer.a_scale = layer.input_scale.data.float().max() if self.activations == "static" else None

    def apply(self, layer, x, bias):
        x2 = x.reshape(-1, x.shape[-1])
        if self.activations is None:  # weight-only (W8A16): dequantize
            w = layer.weight.float() * layer.w_scale[:, None]
            out = (x2.float() @ w.t()).to(x.dtype)
        else:
            a, a_scale = ref.quantize_fp8(x2, layer.a_scale)
            out = _scaled_mm(a, a_scale, layer.weight, layer.w_scale, x.dtype)
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], -1)


def _scaled_mm(a, a_scale, w, w_scale, out_dtype):
    """FP8 units (compute capability 8.9 and up): torch._scaled_mm; other GPUs: the Triton
    kernel; CPU: the torch reference."""
    if not a.is_cuda:
        return ref.fp8_scaled_mm(a, a_scale, w, w_scale, out_dtype)
    if torch.cuda.get_device_capability(a.device) >= (8, 9) and out_dtype == torch.bfloat16:
        return torch._scaled_mm(a, w.t(), scale_a=a_scale.float(), scale_b=w_scale.float()[None, :], out_dtype=out_dtype)
    from shoal.kernels import quant_gemm

    return quant_gemm.fp8_scaled_mm(a, a_scale, w, w_scale, out_dtype)
