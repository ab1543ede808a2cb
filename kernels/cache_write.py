"""Cache write: new keys/values [T, kvh, d] into their slots of the paged cache, in place."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal.kernels._common import next_pow2


@triton.jit
def _round_e4m3(x):
    """x (float32, within +-448) rounded to its nearest float8 e4m3 value (ties to even), still
    float32: the cast that follows is then exact. (Triton's interpreter rounds a value just
    below a power of two down a whole binade, 124 -> 64; a GPU's cast does not.)"""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000  # 3 mantissa bits, carry into the exponent
    normal = bits.to(tl.float32, bitcast=True)
    magic = 24576.0  # 1.5 * 2**14: adding it rounds to a multiple of 2**-9, e4m3's subnormal step
    sub = (x + magic) - magic
    return tl.where(tl.abs(x) < 0.015625, sub, normal)


@triton.jit
def _write_kv_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, s_slot,
    s_kt, s_kh, s_kd, s_vt, s_vh, s_vd,
    s_kcn, s_kcb, s_kch, s_kcd, s_vcn, s_vcb, s_vch, s_vcd,
    k_inv, v_inv,  # float8 cache: 1 / its scales
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t * s_slot).to(tl.int64)
    if slot < 0:  # a padding token (vLLM's convention): nothing to store
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(key_ptr + t * s_kt + offs_h[:, None] * s_kh + offs_d[None, :] * s_kd, mask=mask)
    v = tl.load(value_ptr + t * s_vt + offs_h[:, None] * s_vh + offs_d[None, :] * s_vd, mask=mask)
    if FP8:  # stored divided by the scale, saturated
        k = _round_e4m3(tl.clamp(k.to(tl.float32) * k_inv, -448.0, 448.0))
        v = _round_e4m3(tl.clamp(v.to(tl.float32) * v_inv, -448.0, 448.0))
    kc = k_cache_ptr + blk * s_kcn + off * s_kcb + offs_h[:, None] * s_kch + offs_d[None, :] * s_kcd
    vc = v_cache_ptr + blk * s_vcn + off * s_vcb + offs_h[:, None] * s_vch + offs_d[None, :] * s_vcd
    tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(key, value, k_cache, v_cache, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Store new keys/values [T, kvh, d] into their cache slots, in place (negative slots are
    skipped); a float8 cache takes them divided by k_scale / v_scale."""
    T, kvh, d = key.shape
    if T == 0:
        return
    assert value.shape == key.shape and k_cache.shape == v_cache.shape
    assert k_cache.shape[2:] == (kvh, d), "cache is [num_blocks, block_size, kvh, d]"
    _write_kv_cache_kernel[(T,)](
        key, value, k_cache, v_cache, slot_mapping, slot_mapping.stride(0),  # a group's row of [G, T] may be strided
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        1.0 / k_scale, 1.0 / v_scale,
        NUM_KV_HEADS=kvh, HEAD_DIM=d, H_PAD=next_pow2(kvh), D_PAD=next_pow2(d),
        BLOCK_SIZE=k_cache.shape[1], FP8=k_cache.dtype == torch.float8_e4m3fn,
    )
