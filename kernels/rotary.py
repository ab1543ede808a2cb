"""Rotary embedding (neox halves or GPT-J interleaved pairs) from a cos/sin cache; one program per token."""

from __future__ import annotations

import triton
import triton.language as tl

from shoal.kernels import _common
from shoal.kernels._common import next_pow2


@triton.jit
def _rotate_heads(x_ptr, o_ptr, t, s_xt, s_xh, s_xd, s_ot, s_oh, s_od, cos, sin,
                  NUM_HEADS: tl.constexpr, H_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                  IS_NEOX: tl.constexpr):
    offs_h = tl.arange(0, H_PAD)
    offs_i = tl.arange(0, HALF_PAD)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_i[None, :] < HALF)
    if IS_NEOX:  # pairs (i, i + d/2)
        d1 = offs_i
        d2 = offs_i + HALF
    else:  # pairs (2i, 2i + 1)
        d1 = 2 * offs_i
        d2 = 2 * offs_i + 1
    base = x_ptr + t * s_xt + offs_h[:, None] * s_xh
    x1 = tl.load(base + d1[None, :] * s_xd, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + d2[None, :] * s_xd, mask=mask, other=0.0).to(tl.float32)
    obase = o_ptr + t * s_ot + offs_h[:, None] * s_oh
    ty = o_ptr.dtype.element_ty
    tl.store(obase + d1[None, :] * s_od, (x1 * cos[None, :] - x2 * sin[None, :]).to(ty), mask=mask)
    tl.store(obase + d2[None, :] * s_od, (x2 * cos[None, :] + x1 * sin[None, :]).to(ty), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, cs_ptr, qo_ptr, ko_ptr,
    s_qt, s_qh, s_qd, s_kt, s_kh, s_kd,
    s_qot, s_qoh, s_qod, s_kot, s_koh, s_kod, s_cs,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HQ_PAD: tl.constexpr, HK_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, IS_NEOX: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_i = tl.arange(0, HALF_PAD)
    cmask = offs_i < HALF
    cos = tl.load(cs_ptr + pos * s_cs + offs_i, mask=cmask, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * s_cs + HALF + offs_i, mask=cmask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, qo_ptr, t, s_qt, s_qh, s_qd, s_qot, s_qoh, s_qod, cos, sin,
                  NUM_Q_HEADS, HQ_PAD, HALF, HALF_PAD, IS_NEOX)
    _rotate_heads(k_ptr, ko_ptr, t, s_kt, s_kh, s_kd, s_kot, s_koh, s_kod, cos, sin,
                  NUM_K_HEADS, HK_PAD, HALF, HALF_PAD, IS_NEOX)


def rotary_embedding(positions, q, k, cos_sin_cache, is_neox: bool = True):
    """Rotate q [T, h, d] and k [T, kvh, d] by their positions; returns new (q, k).

    cos_sin_cache [max_pos, d] holds cos in its first half and sin in its second.
    Results keep q's and k's dtypes; the rotation runs in float32 whatever the cache's dtype.
    """
    T, h, d = q.shape
    kvh = k.shape[1]
    assert d % 2 == 0 and cos_sin_cache.shape[-1] == d and cos_sin_cache.stride(-1) == 1
    q_out = _common.empty(q.shape, q.dtype, q.device)
    k_out = _common.empty(k.shape, k.dtype, k.device)
    if T:
        half = d // 2
        _rotary_kernel[(T,)](
            positions, q, k, cos_sin_cache, q_out, k_out,
            *q.stride(), *k.stride(), *q_out.stride(), *k_out.stride(), cos_sin_cache.stride(0),
            NUM_Q_HEADS=h, NUM_K_HEADS=kvh, HQ_PAD=next_pow2(h), HK_PAD=next_pow2(kvh),
            HALF=half, HALF_PAD=next_pow2(half), IS_NEOX=is_neox,
        )
    return q_out, k_out
