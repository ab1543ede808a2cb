"""Gated activations of a fused gate/up projection: SiLU-and-mul (SwiGLU), GeLU(tanh)-and-mul
(GeGLU, Gemma's MLP) and gpt-oss's clamped SwiGLU (its experts)."""

from __future__ import annotations

import triton
import triton.language as tl

from shoal.kernels import _common
from shoal.kernels._common import cdiv


@triton.jit
def _gated_kernel(x_ptr, out_ptr, s_x, s_o, I, alpha, limit, BLOCK: tl.constexpr, GELU: tl.constexpr,
                  OAI: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    gate = tl.load(x_ptr + row * s_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * s_x + I + offs, mask=mask, other=0.0).to(tl.float32)
    if OAI:  # gpt-oss: gate clamped above, up both sides, (up + 1) * gate * sigmoid(alpha * gate)
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        y = (up + 1.0) * gate * tl.sigmoid(alpha * gate)
    elif GELU:  # 0.5 x (1 + tanh(u)) = x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3)
        y = gate * tl.sigmoid(1.5957691216057308 * (gate + 0.044715 * gate * gate * gate)) * up
    else:
        y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * s_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x):
    """SwiGLU activation of a fused gate/up projection: x [T, 2I] -> silu(gate) * up [T, I]."""
    return launch(x)


def gelu_tanh_and_mul(x):
    """GeGLU (Gemma's MLP): x [T, 2I] -> gelu_tanh(gate) * up [T, I]."""
    return launch(x, gelu=True)


def swiglu_oai_and_mul(x, alpha: float = 1.702, limit: float = 7.0):
    """gpt-oss's clamped SwiGLU (see reference.swiglu_oai_and_mul)."""
    return launch(x, oai=(alpha, limit))


def launch(x, *, block=1024, gelu=False, oai=None):
    """The gated activation with its tile width exposed (tests shrink it to cover several tiles)."""
    I = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * I)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = _common.empty((*x.shape[:-1], I), x.dtype, x.device)
    out2 = out.view(-1, I)
    if x2.shape[0] and I:
        alpha, limit = oai or (1.0, 0.0)
        _gated_kernel[(x2.shape[0], cdiv(I, block))](x2, out2, x2.stride(0), out2.stride(0), I, float(alpha), float(limit),
                                                    BLOCK=block, GELU=gelu, OAI=oai is not None)
    return out
