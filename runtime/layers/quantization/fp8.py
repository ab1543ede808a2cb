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


class Fp8Experts:
    """FP8 W8A8 experts of a FusedMoE (layers/moe.py), as Fp8Linear holds a dense layer: w13
    [E, 2n, H] and w2 [E, H, n] float8, a scale per output row ([E, 2n] and [E, H] float32;
    a per-tensor checkpoint's one scale per expert projection is repeated over its rows),
    activations per token or by one static scale per GEMM: the largest input_scale over the
    experts' gate/up projections for the first (every expert sees the same token), over their
    down projections for the second, as vLLM does. --quantization fp8: the float experts are
    quantized in finish, a scale per output channel of this rank's slice, dynamic activations.

    Checkpoint tensors per expert and projection: weight, weight_scale (one value, or [out, 1]),
    input_scale (static)."""

    def __init__(self, method: Fp8Linear, moe):
        if method.activations is None:
            raise ValueError("fp8 weight-only (W8A16) experts are not supported (W8A8 only)")
        self.per_channel, self.serialized = method.per_channel, method.serialized
        self.static = method.activations == "static"
        E, n, H = moe.w13.shape[0], moe.local, moe.hidden
        if not self.serialized:  # a float checkpoint: quantized in finish, from float32
            moe.w13, moe.w2 = kept(moe.w13), kept(moe.w2)
            return
        moe.w13 = kept(nn.Parameter(torch.empty(E, 2 * n, H, dtype=ref.FP8), requires_grad=False))
        moe.w2 = kept(nn.Parameter(torch.empty(E, H, n, dtype=ref.FP8), requires_grad=False))
        moe.w13_weight_scale = kept(_param(E, 2 * n) if self.per_channel else _param(E, 2))
        moe.w2_weight_scale = kept(_param(E, H) if self.per_channel else _param(E, 1))
        if self.static:  # every expert's, on every rank: the static scale is their largest
            moe.w13_input_scale = kept(_param(moe.num_experts, 2))
            moe.w2_input_scale = kept(_param(moe.num_experts))

    def load(self, moe, expert: int, local: int | None, which: int, kind: str, tensor) -> None:
        """A scale of `expert` (`local`: its index on this rank, None if another rank's);
        which: 0 gate, 1 up, 2 down."""
        s, n = moe.start, moe.local
        if kind == "input_scale" and self.static:
            if tensor.numel() != 1:
                raise ValueError(f"expert {expert}: input_scale must be one value, got {tuple(tensor.shape)}")
            target = moe.w2_input_scale.data[expert] if which == 2 else moe.w13_input_scale.data[expert, which]
            target.copy_(tensor.reshape(()))
        elif kind == "weight_scale" and self.serialized:
            if local is None:
                return
            t = tensor.float().reshape(-1)
            if not self.per_channel:
                if t.numel() != 1:
                    raise ValueError(f"expert {expert}: a per-tensor weight_scale must be one value, got {tuple(tensor.shape)}")
                target = moe.w2_weight_scale.data[local, 0] if which == 2 else moe.w13_weight_scale.data[local, which]
                target.copy_(t[0])
            elif which == 2:
                moe.w2_weight_scale.data[local].copy_(t)  # the down projection's outputs are not split
            else:
                moe.w13_weight_scale.data[local, which * n : (which + 1) * n].copy_(t[s : s + n])
        else:
            raise ValueError(f"unexpected fp8 expert tensor {kind!r}")

    def finish(self, moe, dtype) -> None:
        if not self.serialized:
            for name in ("w13", "w2"):
                w = getattr(moe, name).data.float()
                scale = (w.abs().amax(-1) / ref.FP8_MAX).clamp_min(1e-12)
                setattr(moe, name, kept(nn.Parameter((w / scale[..., None]).to(ref.FP8), requires_grad=False)))
                setattr(moe, f"{name}_scale", scale)
        elif self.per_channel:
            moe.w13_scale, moe.w2_scale = moe.w13_weight_scale.data.float(), moe.w2_weight_scale.data.float()
        else:
            moe.w13_scale = moe.w13_weight_scale.data.float().repeat_interleave(moe.local, dim=1)
            moe.w2_scale = moe.w2_weight_scale.data.float().expand(-1, moe.hidden).contiguous()
        moe.a13_scale = moe.w13_input_scale.data.float().max() if self.static else None
        moe.a2_scale = moe.w2_input_scale.data.float().max() if self.static else None
