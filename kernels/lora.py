"""LoRA shrink and expand for a batch whose tokens use different adapters (Punica's BGMV):
each token reads its own slot's A and B rows, so base rows and every adapter share one launch.
Layouts as kernels/reference.py's lora_delta (which these equal): a [S, C, K], b [S, N, C]."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal.kernels import _common
from shoal.kernels._common import cdiv, next_pow2


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slot_ptr, xa_ptr, K, C, s_x, s_as, s_a, s_xa, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    cols = tl.arange(0, BLOCK_C)
    cmask = (cols < C) & ((cols * 0 + slot) >= 0)  # a base token (slot -1) reads nothing
    base = a_ptr + tl.maximum(slot, 0) * s_as
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        xv = tl.load(x_ptr + t * s_x + ks, mask=kmask, other=0.0).to(tl.float32)
        av = tl.load(base + cols[:, None] * s_a + ks[None, :], mask=cmask[:, None] & kmask[None, :], other=0.0)
        acc += tl.sum(av.to(tl.float32) * xv[None, :], axis=1)
    tl.store(xa_ptr + t * s_xa + cols, acc, mask=cols < C)


@triton.jit
def _expand_kernel(xa_ptr, b_ptr, slot_ptr, out_ptr, N, C, s_xa, s_bs, s_b, s_o, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = (ns < N) & ((ns * 0 + slot) >= 0)  # a base token's row is not touched
    cols = tl.arange(0, BLOCK_C)
    cmask = cols < C
    xa = tl.load(xa_ptr + t * s_xa + cols, mask=cmask, other=0.0)
    bv = tl.load(b_ptr + tl.maximum(slot, 0) * s_bs + ns[:, None] * s_b + cols[None, :], mask=nmask[:, None] & cmask[None, :],
                 other=0.0)
    delta = tl.sum(bv.to(tl.float32) * xa[None, :], axis=1)
    o = tl.load(out_ptr + t * s_o + ns, mask=nmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * s_o + ns, (o + delta).to(out_ptr.dtype.element_ty), mask=nmask)


def lora_delta(x, a, b, token_slot, groups, out):
    """out += each token's slot's (x A^T) B^T in place; tokens with slot -1 are left alone.
    `groups` is the torch reference's; here token_slot says it all."""
    return launch(x, a, b, token_slot, groups, out)


def launch(x, a, b, token_slot, groups, out, *, block_k=128, block_n=128):
    """lora_delta with its tile sizes exposed (tests shrink them to cover several tiles)."""
    T, K = x.shape
    C, N = a.shape[1], out.shape[1]
    if T == 0 or C == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    xa = _common.empty((T, C), torch.float32, x.device)  # the shrink kept in float32
    bc = next_pow2(C)
    _shrink_kernel[(T,)](x, a, token_slot, xa, K, C, x.stride(0), a.stride(0), a.stride(1), xa.stride(0), BLOCK_C=bc,
                         BLOCK_K=min(block_k, next_pow2(K)))
    _expand_kernel[(T, cdiv(N, block_n))](xa, b, token_slot, out, N, C, xa.stride(0), b.stride(0), b.stride(1), out.stride(0),
                                          BLOCK_C=bc, BLOCK_N=min(block_n, next_pow2(N)))
    return out
