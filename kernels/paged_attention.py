"""Paged attention over the block-table KV cache: decode (split-K, flash-decoding) and prefill.

Both read K/V straight from the cache [num_blocks, block_size, kvh, d] through the block
table, one token tile at a time; nothing is gathered into contiguous memory. The query heads
that share a KV head (grouped-query attention, any ratio) are packed into the rows of one
tile, so each K/V tile is loaded once per group. Head sizes that are not powers of two (80,
96) are padded to the next power of two with masks. Softmax runs online in float32 (base 2);
gpt-oss's attention sinks join its denominator once, at the end (the reduce pass under split-K).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from shoal.kernels import _common
from shoal.kernels._common import cdiv, next_pow2

LOG2E = 1.4426950408889634
MAX_SPLITS = 64  # the reduce pass holds every split of one head in one tile
MIN_SPLIT_TOKENS = 256  # splitting shorter stretches costs more in the reduce than it gains


def _dot_precision(dtype) -> str:
    # float32 inputs: exact products (tf32 would cost ~1e-3 relative); half types: tensor cores.
    return "ieee" if dtype == torch.float32 else "tf32"


def _dot_type(dtype):
    """The dtype tl.dot sees. Triton's interpreter keeps bfloat16 as raw uint16 and multiplies
    those bits, so there bfloat16 operands go through float32; on a GPU this is the input dtype."""
    if dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return tl.float32
    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dtype]


def _qk_scale(scale, softcap, k_cache, k_scale) -> float:
    """The score scale the kernels take: a float8 cache's keys are read as stored (exact in
    the dot's dtype) and their scale folded in here; base 2 unless soft-capped."""
    if k_cache.dtype == torch.float8_e4m3fn:
        scale = scale * k_scale
    return scale if softcap else scale * LOG2E


def _v_scale(v_cache, v_scale) -> float:
    return float(v_scale) if v_cache.dtype == torch.float8_e4m3fn else 1.0


# ---------------------------------------------------------------------------------------
# decode


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, ctx_ptr, out_ptr, mid_o_ptr, mid_lse_ptr, sinks_ptr,
    qk_scale,  # softmax scale * log2(e); with SOFTCAP, the softmax scale alone (times a float8 cache's k_scale)
    softcap, window,  # softcap: Gemma 2's cap (SOFTCAP); window: 0 or the sliding window
    v_scale,  # a float8 cache's value scale (1.0 otherwise), applied to the output
    s_qb, s_qh, s_qd,
    s_kn, s_kb, s_kh, s_kd,
    s_vn, s_vb, s_vh, s_vd,
    s_btb, s_btn,
    s_ob, s_oh, s_od,
    NUM_SPLITS, SPLIT_SIZE,  # runtime values: a growing block table must not trigger a recompile
    G: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr, PRECISION: tl.constexpr, DOT_TY: tl.constexpr, SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b).to(tl.int32)
    start = split * SPLIT_SIZE
    if start >= ctx:  # this split lies past the sequence; the reduce pass skips it
        return
    end = tl.minimum(start + SPLIT_SIZE, ctx)
    lowest = 0  # the first key the query sees
    if window > 0:
        lowest = tl.maximum(ctx - window, 0)
    first = tl.maximum(start, (lowest // BLOCK_N) * BLOCK_N)  # whole tiles: the mask trims the first

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    head = kvh * G + offs_g
    g_mask = offs_g < G
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + b * s_qb + head[:, None] * s_qh + offs_d[None, :] * s_qd,
        mask=g_mask[:, None] & d_mask[None, :], other=0.0,
    ).to(DOT_TY)

    m_i = tl.full([G_PAD], -1e30, dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
    bt_row = bt_ptr + b * s_btb
    for n0 in range(first, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = (offs_n < end) & (offs_n >= lowest)
        blk = tl.load(bt_row + (offs_n // BLOCK_SIZE) * s_btn, mask=n_mask, other=0).to(tl.int64)
        slot_off = (offs_n % BLOCK_SIZE).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(
            k_cache_ptr + blk[:, None] * s_kn + slot_off[:, None] * s_kb + kvh * s_kh + offs_d[None, :] * s_kd,
            mask=kv_mask, other=0.0,
        ).to(DOT_TY)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [G_PAD, BLOCK_N]
        if SOFTCAP:  # softcap * tanh(s / softcap), tanh(x) = 2 sigmoid(2x) - 1; then base 2
            qk = softcap * (2.0 * tl.sigmoid(2.0 * qk / softcap) - 1.0) * 1.4426950408889634
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + blk[:, None] * s_vn + slot_off[:, None] * s_vb + kvh * s_vh + offs_d[None, :] * s_vd,
            mask=kv_mask, other=0.0,
        ).to(DOT_TY)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_TY), v, input_precision=PRECISION)
        m_i = m_new

    out_mask = g_mask[:, None] & d_mask[None, :]
    if window > 0:  # a split wholly before the window saw nothing: weight 0 in the reduce
        acc = tl.where(l_i[:, None] > 0, acc, 0.0)
        m_i = tl.where(l_i > 0, m_i, float("-inf"))
        l_i = tl.where(l_i > 0, l_i, 1.0)
    acc = acc * v_scale
    if DIRECT:
        if SINKS:  # the head's sink logit joins the denominator (base 2, as the scores)
            sink = tl.load(sinks_ptr + head, mask=g_mask, other=0.0).to(tl.float32) * 1.4426950408889634
            m_f = tl.maximum(m_i, sink)
            acc = acc * tl.exp2(m_i - m_f)[:, None]
            l_i = l_i * tl.exp2(m_i - m_f) + tl.exp2(sink - m_f)
        o = acc / l_i[:, None]
        tl.store(out_ptr + b * s_ob + head[:, None] * s_oh + offs_d[None, :] * s_od,
                 o.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # partial result of this split: normalized output and its log2-sum-exp
        h_total = tl.num_programs(1) * G
        row = (b * h_total + head) * NUM_SPLITS + split  # mid_o [B, h, S, D_PAD], mid_lse [B, h, S]
        tl.store(mid_o_ptr + row[:, None] * D_PAD + offs_d[None, :], acc / l_i[:, None], mask=out_mask)
        tl.store(mid_lse_ptr + row, m_i + tl.log2(l_i), mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    mid_o_ptr, mid_lse_ptr, ctx_ptr, out_ptr, sinks_ptr,
    s_ob, s_oh, s_od,
    NUM_SPLITS, SPLIT_SIZE,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr, SINKS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    ctx = tl.load(ctx_ptr + b).to(tl.int32)
    n_splits = tl.cdiv(ctx, SPLIT_SIZE)  # only these were written
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_mask = offs_s < n_splits
    d_mask = offs_d < HEAD_DIM
    row = (b * tl.num_programs(1) + h) * NUM_SPLITS + offs_s
    lse = tl.load(mid_lse_ptr + row, mask=s_mask, other=float("-inf"))
    top = tl.max(lse, 0)
    if SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
        top = tl.maximum(top, sink)
    w = tl.exp2(lse - top)
    w = tl.where(s_mask & (lse > float("-inf")), w, 0.0)
    o = tl.load(mid_o_ptr + row[:, None] * D_PAD + offs_d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    denom = tl.sum(w, 0)
    if SINKS:  # the sink joins the denominator once, over all splits
        denom += tl.exp2(sink - top)
    o = tl.sum(o * w[:, None], 0) / denom
    tl.store(out_ptr + b * s_ob + h * s_oh + offs_d * s_od, o.to(out_ptr.dtype.element_ty), mask=d_mask)


@functools.lru_cache(maxsize=16)
def _num_sms(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # the interpreter: pretend to be a large GPU so the same heuristic runs


def decode_split_size(B: int, kvh: int, max_len: int, block_n: int, device) -> int:
    """Tokens per split. One split (no reduce pass) when the batch alone fills the device.

    max_len comes from the block table's width, so choosing never waits on the device.
    """
    programs = B * kvh
    want = cdiv(2 * _num_sms(device), programs)  # splits per (sequence, KV head) to fill the device twice
    splits = max(1, min(want, max_len // MIN_SPLIT_TOKENS, MAX_SPLITS))
    return cdiv(cdiv(max_len, splits), block_n) * block_n


def decode(q, k_cache, v_cache, block_tables, context_lens, scale, window=0, softcap=0.0, k_scale=1.0, v_scale=1.0,
           sinks=None, *, split_size=None, block_n=None, num_warps=4):
    """paged_attention_decode with its tuning knobs exposed (tests force split-K with them)."""
    B, h, d = q.shape
    if block_n is None:
        block_n = 32 if q.dtype == torch.float32 else 64  # float32 tiles need twice the shared memory
    _, bs, kvh, dk = k_cache.shape
    assert dk == d and h % kvh == 0, "q [B, h, d] and cache [num_blocks, block_size, kvh, d] with kvh | h"
    g = h // kvh
    max_len = block_tables.shape[1] * bs
    if split_size is None:
        split_size = decode_split_size(B, kvh, max_len, block_n, q.device)
    assert split_size % block_n == 0
    num_splits = cdiv(max_len, split_size)
    out = _common.empty((B, h, d), q.dtype, q.device)
    if B == 0:
        return out
    d_pad = next_pow2(d)
    direct = num_splits == 1
    if direct:
        mid_o = mid_lse = out  # unused
    else:
        mid_o = torch.empty((B, h, num_splits, d_pad), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((B, h, num_splits), dtype=torch.float32, device=q.device)
    sinks_arg = q if sinks is None else sinks.contiguous()  # unread without SINKS
    _decode_kernel[(B, kvh, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, mid_o, mid_lse, sinks_arg,
        _qk_scale(scale, softcap, k_cache, k_scale), float(softcap), int(window), _v_scale(v_cache, v_scale),
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
        num_splits, split_size,
        G=g, G_PAD=max(16, next_pow2(g)), HEAD_DIM=d, D_PAD=d_pad,
        BLOCK_SIZE=bs, BLOCK_N=block_n,
        DIRECT=direct, PRECISION=_dot_precision(q.dtype), DOT_TY=_dot_type(q.dtype), SOFTCAP=bool(softcap),
        SINKS=sinks is not None, num_warps=num_warps,
    )
    if not direct:
        _decode_reduce_kernel[(B, h)](
            mid_o, mid_lse, context_lens, out, sinks_arg, *out.stride(), num_splits, split_size,
            HEAD_DIM=d, D_PAD=d_pad, S_PAD=next_pow2(num_splits), SINKS=sinks is not None,
        )
    return out


def paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale: float, window: int = 0,
                           softcap: float = 0.0, k_scale: float = 1.0, v_scale: float = 1.0, sinks=None):
    """One query token per sequence: q [B, h, d] -> [B, h, d]."""
    return decode(q, k_cache, v_cache, block_tables, context_lens, scale, window, softcap, k_scale, v_scale, sinks)


# ---------------------------------------------------------------------------------------
# prefill / extend


@triton.jit
def _prefill_block(acc, l_i, m_i, q, n0, kv_end, pos, window, bt_row, s_btn, k_cache_ptr, s_kn, s_kb, s_kh, s_kd,
                   v_cache_ptr, s_vn, s_vb, s_vh, s_vd, kvh, offs_d, d_mask, qk_scale, softcap,
                   BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, DOT_TY: tl.constexpr,
                   SOFTCAP: tl.constexpr, MASKED: tl.constexpr):
    """One K/V block of the online softmax. MASKED: the block may hold keys some rows must not
    see (past the context, after a row's position, outside its window); else all see all."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    if MASKED:
        n_mask = offs_n < kv_end
    else:
        n_mask = offs_n >= 0  # every key of the block exists and is seen
    blk = tl.load(bt_row + (offs_n // BLOCK_SIZE) * s_btn, mask=n_mask, other=0).to(tl.int64)
    slot_off = (offs_n % BLOCK_SIZE).to(tl.int64)
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(
        k_cache_ptr + blk[:, None] * s_kn + slot_off[:, None] * s_kb + kvh * s_kh + offs_d[None, :] * s_kd,
        mask=kv_mask, other=0.0,
    ).to(DOT_TY)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
    if SOFTCAP:
        qk = softcap * (2.0 * tl.sigmoid(2.0 * qk / softcap) - 1.0) * 1.4426950408889634
    if MASKED:
        visible = n_mask[None, :] & (offs_n[None, :] <= pos[:, None])
        if window > 0:
            visible = visible & (offs_n[None, :] > pos[:, None] - window)
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.exp2(qk - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(
        v_cache_ptr + blk[:, None] * s_vn + slot_off[:, None] * s_vb + kvh * s_vh + offs_d[None, :] * s_vd,
        mask=kv_mask, other=0.0,
    ).to(DOT_TY)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_TY), v, input_precision=PRECISION)
    return acc, l_i, m_new


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, qsl_ptr, ctx_ptr, out_ptr, sinks_ptr,
    qk_scale, num_seqs, softcap, window, v_scale,
    s_qt, s_qh, s_qd,
    s_kn, s_kb, s_kh, s_kd,
    s_vn, s_vb, s_vh, s_vd,
    s_btb, s_btn,
    s_ot, s_oh, s_od,
    G: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, DOT_TY: tl.constexpr,
    SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    # Tile -> sequence without a host-side table: sequence b owns tiles from
    # query_start_loc[b] // BLOCK_Q + b on (at least cdiv(q_len, BLOCK_Q) of them); binary search.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(qsl_ptr + mid).to(tl.int32) // BLOCK_Q + mid
        if first <= tile:
            lo = mid + 1
        else:
            hi = mid
    b = lo - 1
    q_start = tl.load(qsl_ptr + b).to(tl.int32)
    q_len = tl.load(qsl_ptr + b + 1).to(tl.int32) - q_start
    q_tile = tile - (q_start // BLOCK_Q + b)
    if q_tile * BLOCK_Q >= q_len:
        return
    ctx = tl.load(ctx_ptr + b).to(tl.int32)
    prefix = ctx - q_len  # cached tokens before this step's new ones

    BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
    offs_m = tl.arange(0, BLOCK_M)
    tok = q_tile * BLOCK_Q + offs_m // G_PAD  # row -> (token, query head of the group)
    hg = offs_m % G_PAD
    head = kvh * G + hg
    row_mask = (tok < q_len) & (hg < G)
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_DIM
    qo_mask = row_mask[:, None] & d_mask[None, :]
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * s_qt + head[:, None] * s_qh + offs_d[None, :] * s_qd, mask=qo_mask, other=0.0).to(DOT_TY)
    pos = prefix + tok  # absolute position of each row's query

    m_i = tl.full([BLOCK_M], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    kv_end = tl.minimum(ctx, prefix + (q_tile + 1) * BLOCK_Q)  # the last query of the tile sees this far
    kv_start = 0
    # blocks before full_end are seen whole by every row of the tile (its first query sees them):
    # no causal mask there; only the blocks on the diagonal pay for it (FlashAttention-2's split)
    full_end = ((prefix + q_tile * BLOCK_Q + 1) // BLOCK_N) * BLOCK_N
    if window > 0:  # the tile's first query sees nothing before this (whole tiles; the mask trims)
        kv_start = (tl.maximum(prefix + q_tile * BLOCK_Q - window + 1, 0) // BLOCK_N) * BLOCK_N
        full_end = kv_start  # every block masked: the window's edge moves row by row
    bt_row = bt_ptr + b.to(tl.int64) * s_btb
    for n0 in range(kv_start, full_end, BLOCK_N):
        acc, l_i, m_i = _prefill_block(
            acc, l_i, m_i, q, n0, kv_end, pos, window, bt_row, s_btn, k_cache_ptr, s_kn, s_kb, s_kh, s_kd,
            v_cache_ptr, s_vn, s_vb, s_vh, s_vd, kvh, offs_d, d_mask, qk_scale, softcap,
            BLOCK_SIZE, BLOCK_N, PRECISION, DOT_TY, SOFTCAP, False)
    for n0 in range(full_end, kv_end, BLOCK_N):
        acc, l_i, m_i = _prefill_block(
            acc, l_i, m_i, q, n0, kv_end, pos, window, bt_row, s_btn, k_cache_ptr, s_kn, s_kb, s_kh, s_kd,
            v_cache_ptr, s_vn, s_vb, s_vh, s_vd, kvh, offs_d, d_mask, qk_scale, softcap,
            BLOCK_SIZE, BLOCK_N, PRECISION, DOT_TY, SOFTCAP, True)

    if SINKS:  # each row's head sink joins the denominator (base 2, as the scores)
        sink = tl.load(sinks_ptr + head, mask=row_mask, other=0.0).to(tl.float32) * 1.4426950408889634
        m_f = tl.maximum(m_i, sink)
        acc = acc * tl.exp2(m_i - m_f)[:, None]
        l_i = l_i * tl.exp2(m_i - m_f) + tl.exp2(sink - m_f)
    l_i = tl.where(l_i > 0, l_i, 1.0)  # rows past q_len saw nothing; they are not stored
    o = acc * v_scale / l_i[:, None]
    tl.store(out_ptr + q_rows[:, None] * s_ot + head[:, None] * s_oh + offs_d[None, :] * s_od,
             o.to(out_ptr.dtype.element_ty), mask=qo_mask)


def prefill(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, window=0, softcap=0.0, k_scale=1.0,
            v_scale=1.0, sinks=None, *, block_m=None, block_n=None, num_warps=4, num_stages=None):
    """paged_attention_prefill with its tile sizes exposed (tests shrink them to cover tiling;
    `shoal bench kernels` times a few on a GPU)."""
    Tq, h, d = q.shape
    small = q.dtype == torch.float32  # float32 tiles: 4x smaller, to fit the shared memory of every GPU
    block_m = block_m or (32 if small else 64)
    block_n = block_n or (32 if small else 64)
    _, bs, kvh, dk = k_cache.shape
    assert dk == d and h % kvh == 0, "q [Tq, h, d] and cache [num_blocks, block_size, kvh, d] with kvh | h"
    g = h // kvh
    g_pad = next_pow2(g)
    block_q = max(1, block_m // g_pad)
    if block_q * g_pad < 16:  # tl.dot needs at least 16 rows
        block_q = cdiv(16, g_pad)
    B = query_start_loc.shape[0] - 1
    out = _common.empty((Tq, h, d), q.dtype, q.device)
    if Tq == 0 or B == 0:
        return out
    grid = (Tq // block_q + B, kvh)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, context_lens, out, q if sinks is None else sinks.contiguous(),
        _qk_scale(scale, softcap, k_cache, k_scale), B, float(softcap), int(window), _v_scale(v_cache, v_scale),
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
        G=g, G_PAD=g_pad, HEAD_DIM=d, D_PAD=next_pow2(d), BLOCK_SIZE=bs,
        BLOCK_Q=block_q, BLOCK_N=block_n, PRECISION=_dot_precision(q.dtype), DOT_TY=_dot_type(q.dtype),
        SOFTCAP=bool(softcap), SINKS=sinks is not None, num_warps=num_warps,
        **({} if num_stages is None else {"num_stages": num_stages}),
    )
    return out


def paged_attention_prefill(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale: float,
                            window: int = 0, softcap: float = 0.0, k_scale: float = 1.0, v_scale: float = 1.0,
                            sinks=None):
    """A ragged batch of new tokens, causal over each sequence's cached prefix + new tokens.

    q [Tq, h, d] holds sequence b's tokens at rows query_start_loc[b]:query_start_loc[b+1];
    they sit at the last positions of its context_lens[b] tokens. Returns [Tq, h, d].
    """
    return prefill(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, window, softcap, k_scale, v_scale,
                   sinks)

