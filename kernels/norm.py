"""RMSNorm, optionally with the residual add fused in front: one program per row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal.kernels import _common
from shoal.kernels._common import next_pow2


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    s_x, s_r, s_o, s_ro, eps,
    N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    xf = tl.load(x_ptr + row * s_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        # the sum is rounded to the input dtype, as torch's add does, and normalized as rounded
        xf = xf + tl.load(res_ptr + row * s_r + offs, mask=mask, other=0.0).to(tl.float32)
        x = xf.to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * s_ro + offs, x, mask=mask)
        xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * s_o + offs, (xf * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t, n):
    t = t.reshape(-1, n)
    return t if t.stride(-1) == 1 else t.contiguous()


def rms_norm(x, weight, eps: float, residual=None):
    """RMSNorm; with `residual`, first adds it (fused residual add) and returns (out, x + residual).

    Normalizes in float32; outputs keep torch's promotion of the reference's dtypes.
    """
    shape, N = x.shape, x.shape[-1]
    in_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    x2 = _rows(x, N).to(in_dtype)
    r2 = x2 if residual is None else _rows(residual, N).to(in_dtype)
    out = _common.empty(shape, torch.promote_types(in_dtype, weight.dtype), x.device)
    res_out = out if residual is None else _common.empty(shape, in_dtype, x.device)
    out2, ro2 = out.view(-1, N), res_out.view(-1, N)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, out2, ro2,
            x2.stride(0), r2.stride(0), out2.stride(0), ro2.stride(0), eps,
            N=N, BLOCK=next_pow2(N), HAS_RESIDUAL=residual is not None,
            num_warps=min(max(next_pow2(N) // 256, 1), 16),
        )
    return out if residual is None else (out, res_out)
