"""Mixture-of-experts gated layer as two grouped GEMMs (vLLM's fused_moe idea).

The T*k (token, expert) pairs are sorted by expert and each expert's run padded to a multiple
of BLOCK_M, so every block of BLOCK_M sorted pairs belongs to one expert: one launch per
projection covers every expert, each program reading its block's rows and its expert's weight.
The grid is sized from shapes alone (no host sync): blocks past the padded total exit at once.
gpt-oss's expert biases are added in the GEMM (before the routing weight), its clamped SwiGLU
runs between the two. FP8 W8A8 experts: each GEMM's input is rounded to float8 per row (or by a
static scale) before the launch, the kernel reads the float8 tiles of both, multiplies them in
the model's dtype (float8 values are exact there) and scales the float32 sums per row and per
output channel. Int4 experts (int4.py's layout stacked over the experts): each weight tile is
unpacked, shifted by its zero point and scaled in registers (quant_gemm's _int4_tile), then
cast to the model's dtype for the dot, as the reference dequantizes into it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal.kernels import _common
from shoal.kernels._common import cdiv
from shoal.kernels.activation import silu_and_mul, swiglu_oai_and_mul
from shoal.kernels.paged_attention import _dot_precision, _dot_type
from shoal.kernels.quant_gemm import _int4_tile
from shoal.kernels.quant_reference import quantize_fp8


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, bias_ptr,
    a_scale_ptr, b_scale_ptr, q4_s_ptr, q4_z_ptr, q4_g_ptr,
    N, K, num_pairs, a_rows_per_pair,
    s_am, s_ak, s_be, s_bn, s_bk, s_cm, s_cn, s_bias_e, s_bscale_e, s_q4_e,
    MUL_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, INT4: tl.constexpr, PRECISION: tl.constexpr, DOT_TY: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """c[pair] = (a[pair // a_rows_per_pair] @ b[expert].T + bias[expert]) (times the pair's weight),
    one block of BLOCK_M sorted pairs (all of one expert) by BLOCK_N output columns."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    real = pairs < num_pairs  # padding slots hold num_pairs
    rows = tl.where(real, pairs, 0) // a_rows_per_pair
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * s_am + offs_k[None, :] * s_ak
    b_ptrs = b_ptr + expert * s_be + offs_n[None, :] * s_bn + offs_k[:, None] * s_bk  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k + k0 < K
        a = tl.load(a_ptrs, mask=real[:, None] & k_ok[None, :], other=0.0).to(DOT_TY)
        if INT4:  # b_ptr: the packed [E, K / 8, N]; scales and zeros [E, G, N], g_idx [E, K]
            b = _int4_tile(b_ptr + expert * s_be, q4_s_ptr + expert * s_q4_e, q4_z_ptr + expert * s_q4_e,
                           q4_g_ptr + expert * K, offs_k + k0, offs_n, K, N).to(DOT_TY)
        else:
            b = tl.load(b_ptrs, mask=k_ok[:, None] & (offs_n[None, :] < N), other=0.0).to(DOT_TY)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * s_ak
        b_ptrs += BLOCK_K * s_bk
    if HAS_SCALE:  # fp8: a's scale per row [M], b's per output channel [E, N]
        acc *= tl.load(a_scale_ptr + rows, mask=real, other=0.0)[:, None]
        acc *= tl.load(b_scale_ptr + expert * s_bscale_e + offs_n, mask=offs_n < N, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * s_bias_e + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + pairs, mask=real, other=0.0).to(tl.float32)[:, None]
    c_ptrs = c_ptr + pairs[:, None] * s_cm + offs_n[None, :] * s_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=real[:, None] & (offs_n[None, :] < N))


def align_block_size(topk_ids, num_experts: int, block_m: int):
    """Pairs sorted by expert, each expert's run padded to a multiple of block_m (pairs whose
    expert is outside [0, num_experts), another rank's, get no slot).

    Returns (sorted_ids [capacity] with num_pairs in padding slots, block_expert [capacity //
    block_m], num_padded [1]); capacity bounds the padded total from shapes alone.
    """
    flat = topk_ids.reshape(-1).long()
    P, E = flat.numel(), num_experts
    flat = torch.where((flat >= 0) & (flat < E), flat, E)  # experts of other ranks: no slot
    # bincount reads its input's max on the host (a sync, no CUDA graph); a scatter does not
    counts = torch.zeros(E + 1, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))[:E]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = flat.argsort(stable=True)
    experts = flat[order]
    mine = experts.clamp(max=E - 1)
    rank = torch.arange(P, device=flat.device) - (counts.cumsum(0) - counts)[mine]
    capacity = P + min(E, P) * (block_m - 1)
    capacity = cdiv(max(capacity, 1), block_m) * block_m
    dest = torch.where(experts < E, (padded_end - padded)[mine] + rank, capacity)  # the last slot: dropped
    sorted_ids = torch.full((capacity + 1,), P, dtype=torch.int32, device=flat.device)
    sorted_ids[dest] = order.to(torch.int32)
    sorted_ids = sorted_ids[:capacity]
    block_starts = torch.arange(0, capacity, block_m, device=flat.device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, block_expert, padded_end[-1:].to(torch.int32)


def fused_moe(x, w13, w2, topk_weights, topk_ids, w13_bias=None, w2_bias=None, activation: str = "silu",
              alpha: float = 1.702, limit: float = 7.0, w13_scale=None, w2_scale=None, a13_scale=None, a2_scale=None,
              w13_int4=None, w2_int4=None):
    """Gated experts, each token through its top-k (see reference.fused_moe for shapes and options)."""
    extra = dict(w13_bias=w13_bias, w2_bias=w2_bias, activation=activation, alpha=alpha, limit=limit,
                 w13_scale=w13_scale, w2_scale=w2_scale, a13_scale=a13_scale, a2_scale=a2_scale,
                 w13_int4=w13_int4, w2_int4=w2_int4)
    if topk_ids.numel() >= 32 * w13.shape[0]:  # many rows per expert (prefill): taller tiles, as vLLM's defaults
        return launch(x, w13, w2, topk_weights, topk_ids, block_m=64, block_n=64, block_k=32, **extra)
    return launch(x, w13, w2, topk_weights, topk_ids, **extra)


def launch(x, w13, w2, topk_weights, topk_ids, *, block_m=16, block_n=64, block_k=64, w13_bias=None, w2_bias=None,
           activation="silu", alpha=1.702, limit=7.0, w13_scale=None, w2_scale=None, a13_scale=None, a2_scale=None,
           w13_int4=None, w2_int4=None):
    """fused_moe with its tile sizes exposed (tests shrink them to cover several tiles)."""
    T, H = x.shape
    k = topk_ids.shape[1]
    E, I2 = w13.shape[0], (w13.shape[2] if w13_int4 is not None else w13.shape[1])
    P = T * k
    out = _common.empty((T, H), x.dtype, x.device)
    if T == 0:
        return out
    sorted_ids, block_expert, num_padded = align_block_size(topk_ids, E, block_m)
    weights = topk_weights.reshape(-1).contiguous()
    gate_up = _common.empty((P, I2), x.dtype, x.device)
    a, a_s = (x, None) if w13_scale is None else quantize_fp8(x, a13_scale)
    _gemm(a, w13, gate_up, weights, sorted_ids, block_expert, num_padded, k, False, block_m, block_n, block_k, w13_bias,
          a_s, w13_scale, w13_int4)
    if activation == "silu":
        h = silu_and_mul(gate_up)
    elif activation == "swiglu_oai":
        h = swiglu_oai_and_mul(gate_up, alpha, limit)
    else:
        raise ValueError(f"unknown expert activation {activation!r}")
    down = _common.empty((P, H), x.dtype, x.device)
    a, a_s = (h, None) if w2_scale is None else quantize_fp8(h, a2_scale)
    _gemm(a, w2, down, weights, sorted_ids, block_expert, num_padded, 1, True, block_m, block_n, block_k, w2_bias,
          a_s, w2_scale, w2_int4)
    here = ((topk_ids >= 0) & (topk_ids < E))[..., None]  # rows of other ranks' experts: never written
    out.copy_(torch.where(here, down.view(T, k, H).float(), 0.0).sum(1))
    return out


def _gemm(a, b, c, weights, sorted_ids, block_expert, num_padded, a_rows_per_pair, mul_weight, bm, bn, bk, bias=None,
          a_scale=None, b_scale=None, int4=None):
    N, K = (b.shape[2], b.shape[1] * 8) if int4 is not None else (b.shape[1], b.shape[2])
    q4_s, q4_z, q4_g = (t.contiguous() for t in int4) if int4 is not None else (weights,) * 3
    grid = (sorted_ids.numel() // bm, cdiv(N, bn))
    if bias is not None:
        bias = bias.contiguous()
    if b_scale is not None:
        a_scale, b_scale = a_scale.float().reshape(-1).contiguous(), b_scale.float().contiguous()
    _grouped_gemm_kernel[grid](
        a, b, c, weights, sorted_ids, block_expert, num_padded, bias if bias is not None else weights,
        a_scale if b_scale is not None else weights, b_scale if b_scale is not None else weights, q4_s, q4_z, q4_g,
        N, K, c.shape[0], a_rows_per_pair,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        bias.stride(0) if bias is not None else 0, b_scale.stride(0) if b_scale is not None else 0,
        q4_s.stride(0) if int4 is not None else 0,
        MUL_WEIGHT=mul_weight, HAS_BIAS=bias is not None, HAS_SCALE=b_scale is not None, INT4=int4 is not None,
        PRECISION=_dot_precision(c.dtype), DOT_TY=_dot_type(c.dtype), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
    )
