"""Triton kernels of the quantized GEMMs; quant_reference.py holds their plain-torch
references (same arguments, same values) and the layouts.

fp8_scaled_mm: tiles of a float8 activation and weight, converted to float16 (exact for
e4m3) for the dot, scaled per row and per column at the end. On GPUs with FP8 units the
linear method calls torch._scaled_mm instead. int4_gemm: dequantize-in-GEMM (Marlin's idea:
the int4 tile is unpacked, shifted by its zero point and scaled in registers, never written
out), for small M; int4_dequantize writes W once for a large-M GEMM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal.kernels._common import cdiv, empty


@triton.jit
def _fp8_mm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, M, N, K,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        a = tl.load(a_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        w = tl.load(w_ptr + rn[None, :] * K + rk[:, None], mask=(rn[None, :] < N) & (rk[:, None] < K), other=0.0)
        acc += tl.dot(a.to(tl.float16), w.to(tl.float16))
    a_s = tl.load(as_ptr + rm, mask=rm < M, other=0.0)
    w_s = tl.load(ws_ptr + rn, mask=rn < N, other=0.0)
    acc = acc * a_s[:, None] * w_s[None, :]
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def fp8_scaled_mm(a, a_scale, w, w_scale, out_dtype):
    M, K = a.shape
    N = w.shape[0]
    out = empty((M, N), out_dtype, a.device)
    BM, BN, BK = 16, 64, 64
    a_s = a_scale.float().reshape(-1).expand(M).contiguous()
    _fp8_mm_kernel[(cdiv(M, BM), cdiv(N, BN))](a.contiguous(), a_s, w.contiguous(), w_scale.float().contiguous(), out,
                                              M, N, K, BM=BM, BN=BN, BK=BK)
    return out


@triton.jit
def _int4_tile(q_ptr, s_ptr, z_ptr, g_ptr, rk, rn, K, N):
    """W[rk, rn] float32, dequantized from the packed rows."""
    mask = (rk[:, None] < K) & (rn[None, :] < N)
    packed = tl.load(q_ptr + (rk // 8)[:, None] * N + rn[None, :], mask=mask, other=0)
    q = (packed >> ((rk % 8) * 4)[:, None]) & 0xF
    g = tl.load(g_ptr + rk, mask=rk < K, other=0)
    s = tl.load(s_ptr + g[:, None] * N + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + g[:, None] * N + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    return (q.to(tl.float32) - z) * s


@triton.jit
def _int4_gemm_kernel(x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, out_ptr, M, N, K,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        w = _int4_tile(q_ptr, s_ptr, z_ptr, g_ptr, rk, rn, K, N)
        acc += tl.dot(x.to(tl.float32), w)
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _int4_dequant_kernel(q_ptr, s_ptr, z_ptr, g_ptr, out_ptr, N, K, BN: tl.constexpr, BK: tl.constexpr):
    rk = tl.program_id(0) * BK + tl.arange(0, BK)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    w = _int4_tile(q_ptr, s_ptr, z_ptr, g_ptr, rk, rn, K, N)
    tl.store(out_ptr + rk[:, None] * N + rn[None, :], w.to(out_ptr.dtype.element_ty), mask=(rk[:, None] < K) & (rn[None, :] < N))


def int4_gemm(x, qweight, scales, zeros, g_idx):
    M, K = x.shape
    N = qweight.shape[1]
    out = empty((M, N), x.dtype, x.device)
    BM, BN, BK = 16, 64, 64
    _int4_gemm_kernel[(cdiv(M, BM), cdiv(N, BN))](x.contiguous(), qweight, scales, zeros, g_idx, out, M, N, K,
                                                  BM=BM, BN=BN, BK=BK)
    return out


def int4_dequantize(qweight, scales, zeros, g_idx, dtype=torch.float32):
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    out = empty((K, N), dtype, qweight.device)
    BN, BK = 64, 64
    _int4_dequant_kernel[(cdiv(K, BK), cdiv(N, BN))](qweight, scales, zeros, g_idx, out, N, K, BN=BN, BK=BK)
    return out
