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


class Int4Experts:
    """Int4 experts of a FusedMoE (layers/moe.py): each expert projection's checkpoint tensors
    (its format's, one set per expert, as a dense layer of the format holds them) are kept as
    loaded and, in finish, turned by the format's own `canonical` into int4.py's one layout,
    stacked over the experts: q4_13 [E, H/8, 2n] (gate then up columns), q4_2 [E, n/8, H] int32
    packed along the inputs, scales and zero points [E, G, N] float32, g_idx [E, K]. Tensor
    parallel: gate/up keep this rank's n output columns, down its n input rows with every
    group's scales (their g_idx picks them), as a dense row-parallel act-order layer does.

    fused_moe takes them as they are (w13_int4 / w2_int4): the torch reference dequantizes the
    experts into the model's dtype each step, then the float grouped GEMM; the Triton kernel
    dequantizes each weight tile in registers."""

    serialized = True  # one tensor set per expert, never transformers' fused in-memory layout

    def __init__(self, method: Int4Linear, moe):
        self.method, self.pending = method, {}
        moe.w13, moe.w2 = _param(0), _param(0)  # the experts are q4_13 / q4_2 (finish)

    def load(self, moe, expert: int, local: int | None, which: int, kind: str, tensor) -> None:
        if kind not in self.method.checkpoint_names():
            raise ValueError(f"{type(self.method).__name__} experts hold no tensor {kind!r}")
        if local is not None:
            self.pending.setdefault((local, which), {})[kind] = tensor

    def finish(self, moe, dtype) -> None:
        from types import SimpleNamespace

        E, s, n = moe.num_local, moe.start, moe.local
        if len(self.pending) != 3 * E:
            raise ValueError(f"int4 experts: {3 * E - len(self.pending)} expert projections missing from the checkpoint")
        parts = {}
        for (e, which), tensors in sorted(self.pending.items()):
            q, scales, zeros, g_idx = self.method.canonical(SimpleNamespace(**tensors))  # [K, N]: W = (q - z) * s
            if which == 2:
                q, g_idx = q[s : s + n], g_idx[s : s + n]
            else:
                q, scales, zeros = q[:, s : s + n], scales[:, s : s + n], zeros[:, s : s + n]
            parts[e, which] = (q, scales.float(), zeros.float(), g_idx)
        self.pending = {}
        for name, whiches in (("13", (0, 1)), ("2", (2,))):
            q, scales, zeros = (torch.stack([torch.cat([parts[e, w][i] for w in whiches], dim=1) for e in range(E)])
                                for i in range(3))
            moe.register_buffer(f"q4_{name}", torch.stack([ref.pack_int4_rows(x) for x in q]), persistent=False)
            moe.register_buffer(f"q4_{name}_scales", scales.contiguous(), persistent=False)
            moe.register_buffer(f"q4_{name}_zeros", zeros.contiguous(), persistent=False)
            # gate and up see the same inputs: one g_idx per expert (act-order GPTQ gives them one)
            g = torch.stack([parts[e, whiches[0]][3] for e in range(E)])
            if len(whiches) == 2 and not torch.equal(g, torch.stack([parts[e, 1][3] for e in range(E)])):
                raise ValueError("int4 experts: gate and up projections with different g_idx")
            moe.register_buffer(f"q4_{name}_g_idx", g.to(torch.int32).contiguous(), persistent=False)

    def fused_moe_args(self, moe) -> tuple:
        """(w13, w2, their int4 (scales, zeros, g_idx)) as fused_moe takes int4 experts."""
        return (moe.q4_13, moe.q4_2, (moe.q4_13_scales, moe.q4_13_zeros, moe.q4_13_g_idx),
                (moe.q4_2_scales, moe.q4_2_zeros, moe.q4_2_g_idx))
