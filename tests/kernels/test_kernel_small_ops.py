"""Cache write, RMSNorm, rotary and SiLU-and-mul kernels (interpreter) against reference and naive."""

import pytest
import torch

import kernel_naive as naive
from kernel_naive import TOL

pytest.importorskip("triton")

from shoal.kernels import activation, cache_write, norm, rotary  # noqa: E402
from shoal.kernels import reference as ref  # noqa: E402


def _strided(shape, dtype, extra=2):
    """A [T, n, d] view into a wider buffer (like q, k, v sliced out of one qkv projection)."""
    T, n, d = shape
    return torch.randn(T, n + extra, d).to(dtype)[:, extra:, :]


# ---------------------------------------------------------------- cache write


@pytest.mark.parametrize(
    "kvh,d,bs,T,dtype",
    [(1, 64, 16, 5, torch.float32), (2, 80, 32, 9, torch.float16), (3, 96, 16, 1, torch.bfloat16), (8, 128, 32, 7, torch.float32)],
)
def test_write_kv_cache(kvh, d, bs, T, dtype):
    num_blocks = 4
    slots = torch.randperm(num_blocks * bs)[:T]  # scattered over blocks, out of order
    key, value = _strided((T, kvh, d), dtype), _strided((T, kvh, d), dtype)
    caches = [torch.full((num_blocks, bs, kvh, d), float("nan"), dtype=dtype) for _ in range(6)]
    cache_write.write_kv_cache(key, value, caches[0], caches[1], slots)
    ref.write_kv_cache(key, value, caches[2], caches[3], slots)
    naive.write_kv_cache(key, value, caches[4], caches[5], slots)
    for tri, want in ((caches[0], caches[4]), (caches[1], caches[5]), (caches[2], caches[4]), (caches[3], caches[5])):
        torch.testing.assert_close(tri, want, rtol=0, atol=0, equal_nan=True)  # bit-exact, others untouched
    assert int((~caches[0].isnan()).all(-1).all(-1).sum()) == T  # exactly T slots written


def test_write_kv_cache_reads_strided_slots():
    """A KV-cache group's slots as a row of a [groups, T] array in Fortran order (what numpy's
    fancy indexing can hand the step builder): every stride honoured, as the reference does."""
    T, bs = 6, 16
    grouped = torch.randperm(4 * bs)[: 2 * T].view(T, 2).T  # [2, T], column-major
    key, value = torch.randn(T, 2, 64), torch.randn(T, 2, 64)
    for slots in grouped:
        assert slots.stride(0) == 2
        caches = [torch.zeros(4, bs, 2, 64) for _ in range(4)]
        cache_write.write_kv_cache(key, value, caches[0], caches[1], slots)
        ref.write_kv_cache(key, value, caches[2], caches[3], slots)
        torch.testing.assert_close(caches[0], caches[2], rtol=0, atol=0)
        torch.testing.assert_close(caches[1], caches[3], rtol=0, atol=0)


def test_write_kv_cache_skips_negative_slots():
    key = value = torch.randn(3, 2, 64)
    k_cache = torch.zeros(2, 16, 2, 64)
    v_cache = torch.zeros(2, 16, 2, 64)
    cache_write.write_kv_cache(key, value, k_cache, v_cache, torch.tensor([3, -1, 20]))
    torch.testing.assert_close(k_cache[0, 3], key[0])
    torch.testing.assert_close(k_cache[1, 4], key[2])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 2


# ---------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize(
    "shape,dtype,with_residual",
    [((5, 64), torch.float32, False), ((3, 80), torch.float32, True), ((2, 3, 96), torch.float16, True),
     ((1, 128), torch.bfloat16, False), ((4, 96), torch.bfloat16, True), ((7, 1000), torch.float32, True)],
)
def test_rms_norm(shape, dtype, with_residual):
    x = torch.randn(shape).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1])).to(dtype)
    residual = torch.randn(shape).to(dtype) if with_residual else None
    x0, r0 = x.clone(), None if residual is None else residual.clone()
    got = norm.rms_norm(x, w, 1e-6, residual)
    want = ref.rms_norm(x, w, 1e-6, residual)
    slow = naive.rms_norm(x, w, 1e-6, residual)
    assert torch.equal(x, x0) and (residual is None or torch.equal(residual, r0)), "inputs must stay untouched"
    if not with_residual:
        got, want, slow = (got,), (want,), (slow,)
    for g, wv, s in zip(got, want, slow):
        assert g.dtype == wv.dtype and g.shape == wv.shape and not g.isnan().any()
        torch.testing.assert_close(g.float(), wv.float(), **TOL[dtype])
        torch.testing.assert_close(g.double(), s, **TOL[dtype])


# ---------------------------------------------------------------- rotary


@pytest.mark.parametrize(
    "d,h,kvh,dtype,is_neox",
    [(64, 4, 4, torch.float32, True), (80, 6, 2, torch.float32, False), (96, 8, 2, torch.float16, True),
     (128, 4, 1, torch.bfloat16, False), (128, 3, 1, torch.float32, True), (96, 2, 2, torch.float32, False)],
)
def test_rotary_embedding(d, h, kvh, dtype, is_neox):
    T, max_pos = 5, 64
    positions = torch.tensor([7, 0, 63, 7, 31])  # out of order, repeated, the last position
    cache = naive.rope_cache(max_pos, d, base=10000.0 if d != 128 else 500000.0).to(dtype)
    q, k = _strided((T, h, d), dtype), _strided((T, kvh, d), dtype, extra=1)
    q0, k0 = q.clone(), k.clone()
    got = rotary.rotary_embedding(positions, q, k, cache, is_neox)
    want = ref.rotary_embedding(positions, q, k, cache, is_neox)
    slow = naive.rotary_embedding(positions, q, k, cache, is_neox)
    assert torch.equal(q, q0) and torch.equal(k, k0)
    for g, wv, s in zip(got, want, slow):
        assert g.dtype == wv.dtype and g.shape == wv.shape and not g.isnan().any()
        torch.testing.assert_close(g.float(), wv.float(), **TOL[dtype])
        torch.testing.assert_close(g.double(), s, **TOL[dtype])


def test_rotary_position_zero_is_identity():
    cache = naive.rope_cache(4, 64)
    q, k = torch.randn(2, 2, 64), torch.randn(2, 1, 64)
    for neox in (True, False):
        qo, ko = rotary.rotary_embedding(torch.zeros(2, dtype=torch.long), q, k, cache, neox)
        torch.testing.assert_close(qo, q)
        torch.testing.assert_close(ko, k)


# ---------------------------------------------------------------- SiLU and mul


@pytest.mark.parametrize(
    "shape,dtype,block",
    [((4, 128), torch.float32, 1024), ((3, 160), torch.float16, 1024), ((2, 3, 192), torch.bfloat16, 1024),
     ((5, 2000), torch.float32, 256), ((1, 2), torch.float32, 1024)],
)
def test_silu_and_mul(shape, dtype, block):
    x = (3 * torch.randn(shape)).to(dtype)
    got = activation.launch(x, block=block)
    want = ref.silu_and_mul(x)
    assert got.dtype == want.dtype and got.shape == want.shape and not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    torch.testing.assert_close(got.double(), naive.silu_and_mul(x), **TOL[dtype])
    if block == 1024:
        torch.testing.assert_close(activation.silu_and_mul(x), got, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
def test_rotary_float32_cache_keeps_the_model_dtype(dtype):
    """The engine keeps cos/sin in float32 for a half-precision model: q and k must stay in their
    dtype (the cache write and attention need it), for both backends."""
    cache = naive.rope_cache(32, 64)
    positions = torch.tensor([3, 31, 0])
    q, k = torch.randn(3, 4, 64).to(dtype), torch.randn(3, 2, 64).to(dtype)
    got = rotary.rotary_embedding(positions, q, k, cache)
    want = ref.rotary_embedding(positions, q, k, cache)
    slow = naive.rotary_embedding(positions, q, k, cache)
    for g, wv, s in zip(got, want, slow):
        assert g.dtype == wv.dtype == dtype
        torch.testing.assert_close(g.float(), wv.float(), **TOL[dtype])
        torch.testing.assert_close(g.double(), s, **TOL[dtype])


@pytest.mark.parametrize("shape,dtype,block", [((4, 128), torch.float32, 1024), ((3, 160), torch.float16, 1024),
                                               ((5, 2000), torch.float32, 256), ((2, 3, 192), torch.bfloat16, 1024)])
def test_gelu_tanh_and_mul(shape, dtype, block):
    x = (3 * torch.randn(shape)).to(dtype)
    got = activation.launch(x, block=block, gelu=True)
    want = ref.gelu_tanh_and_mul(x)
    assert got.dtype == want.dtype and got.shape == want.shape and not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    torch.testing.assert_close(got.double(), naive.gelu_tanh_and_mul(x), **TOL[dtype])
