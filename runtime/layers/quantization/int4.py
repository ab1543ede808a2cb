"""What every int4 format (AWQ, GPTQ, compressed-tensors W4A16) becomes once loaded: one
layout (kernels/quant_reference.py) that one kernel reads. Each format's method says which
tensors its checkpoint holds and how to turn them into (q [K, N] in 0..15, scales [G, N],
zero points [G, N], g_idx [K]); this base repacks them and multiplies."""

from __future__ import annotations

import torch
from torch import nn

from shoal.kernels import quant_reference as ref
from shoal.runtime.layers.linear import LinearMethod, RowLinear, _param, kept

SMALL_M = 32  # up to this many rows the fused dequantize-in-GEMM kernel; above, dequantize then GEMM


def int_param(*shape) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=torch.int32), requires_grad=False)


def float_param(*shape) -> nn.Parameter:
    """Scales kept in float32 whatever the model's dtype."""
    return kept(_param(*shape))


def group_count(in_features: int, group_size: int) -> int:
    if in_features % group_size:
        raise ValueError(f"{in_features} input features do not split into groups of {group_size}")
    return in_features // group_size


def is_row(layer) -> bool:
    return isinstance(layer, RowLinear)


class Int4Linear(LinearMethod):
    def __init__(self, group_size: int):
        self.group_size = group_size

    def group(self, in_features: int) -> int:
        return in_features if self.group_size in (-1, 0, None) else self.group_size

    def canonical(self, layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def checkpoint_names(self) -> tuple[str, ...]:
        raise NotImplementedError

    def finish(self, layer):
        q, scales, zeros, g_idx = self.canonical(layer)
        for name in self.checkpoint_names():
            if hasattr(layer, name):
                delattr(layer, name)
        layer.q4 = ref.pack_int4_rows(q)
        layer.q4_scales, layer.q4_zeros = scales.float().contiguous(), zeros.float().contiguous()
        layer.q4_g_idx = g_idx.to(torch.int32).contiguous()

    def apply(self, layer, x, bias):
        x2 = x.reshape(-1, x.shape[-1])
        args = (layer.q4, layer.q4_scales, layer.q4_zeros, layer.q4_g_idx)
        if not x.is_cuda:
            out = ref.int4_gemm(x2, *args)
        else:
            from shoal.kernels import quant_gemm

            if x2.shape[0] <= SMALL_M:
                out = quant_gemm.int4_gemm(x2, *args)
            else:
                out = x2 @ quant_gemm.int4_dequantize(*args, dtype=x.dtype)
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], -1)


def unpack_columns(packed: torch.Tensor) -> torch.Tensor:
    """[R, C / 8] int32 packed along the last dim (column 8c + i in bits 4i..) -> [R, C]."""
    return ref.unpack_int4_rows(packed.t().contiguous()).t()
