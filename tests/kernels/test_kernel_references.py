"""The torch references (what CPU inference runs) against the naive float64 versions, on a wide grid."""

import itertools
import random

import pytest
import torch

import kernel_naive as naive
from kernel_naive import TOL, finite, paged_kv
from shoal.kernels import reference as ref

HEAD_SIZES = (64, 80, 96, 128)
BLOCK_SIZES = (16, 32)
GQA = ((4, 4), (6, 2), (8, 2), (8, 1))  # ratios 1, 3, 4, 8
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
GRID = list(itertools.product(HEAD_SIZES, BLOCK_SIZES, GQA))


def _lengths(rng, bs, n):
    picks = [1, bs, 2 * bs, bs + 1, bs - 1]  # length 1 and block boundaries, always in the mix
    return picks[: n // 2] + [rng.randint(1, 300) for _ in range(n - n // 2)]


@pytest.mark.parametrize("d,bs,heads", GRID)
def test_decode_reference(d, bs, heads):
    h, kvh = heads
    rng = random.Random(d * 1000 + bs * 10 + h)
    dtype = DTYPES[rng.randrange(3)]
    lens = _lengths(rng, bs, 6)
    k_cache, v_cache, bt, ctx = paged_kv(lens, bs, kvh, d, dtype)
    q = torch.randn(len(lens), h, d).to(dtype)
    out = ref.paged_attention_decode(q, finite(k_cache), finite(v_cache), bt, ctx, d**-0.5)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out.double(), naive.decode(q, k_cache, v_cache, bt, ctx, d**-0.5), **TOL[dtype])


@pytest.mark.parametrize("path", ["paged_attention_prefill", "_prefill_causal", "_prefill_masked"])
@pytest.mark.parametrize("d,bs,heads", GRID)
def test_prefill_reference(d, bs, heads, path):
    h, kvh = heads
    rng = random.Random(d * 1000 + bs * 10 + h + 1)
    dtype = DTYPES[rng.randrange(3)]
    # (cached prefix, new tokens): a first chunk, a prefix hit on a block boundary, a one-token
    # step, a chunk ending on a block boundary, and a random one
    seqs = [(0, rng.randint(1, 70)), (bs, rng.randint(1, 40)), (rng.randint(1, 90), 1), (bs - 3, 3 + bs),
            (rng.randint(0, 100), rng.randint(1, 50))]
    lens = [p + n for p, n in seqs]
    k_cache, v_cache, bt, ctx = paged_kv(lens, bs, kvh, d, dtype)
    qsl = torch.tensor([0] + [n for _, n in seqs]).cumsum(0)
    q = torch.randn(int(qsl[-1]), h, d).to(dtype)
    out = getattr(ref, path)(q, finite(k_cache), finite(v_cache), bt, qsl, ctx, d**-0.5)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out.double(), naive.prefill(q, k_cache, v_cache, bt, qsl, ctx, d**-0.5), **TOL[dtype])


@pytest.mark.parametrize("path", ["_prefill_causal", "_prefill_masked"])
def test_prefill_reference_sequence_without_new_tokens(path):
    seqs = [(3, 5), (20, 0), (0, 2)]
    lens = [p + n for p, n in seqs]
    k_cache, v_cache, bt, ctx = paged_kv(lens, 16, 2, 64)
    qsl = torch.tensor([0, 5, 5, 7])
    q = torch.randn(7, 4, 64)
    out = getattr(ref, path)(q, finite(k_cache), finite(v_cache), bt, qsl, ctx, 0.125)
    torch.testing.assert_close(out.double(), naive.prefill(q, k_cache, v_cache, bt, qsl, ctx, 0.125), **TOL[torch.float32])


@pytest.mark.parametrize("kvh,d,bs", [(1, 64, 16), (2, 80, 32), (4, 96, 16), (8, 128, 32)])
def test_write_kv_cache_reference(kvh, d, bs):
    slots = torch.randperm(6 * bs)[:11]
    key, value = torch.randn(11, kvh, d), torch.randn(11, kvh, d)
    a = [torch.zeros(6, bs, kvh, d) for _ in range(4)]
    ref.write_kv_cache(key, value, a[0], a[1], slots)
    naive.write_kv_cache(key, value, a[2], a[3], slots)
    assert torch.equal(a[0], a[2]) and torch.equal(a[1], a[3])


@pytest.mark.parametrize("n", (64, 80, 96, 128, 576, 4096))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", (False, True))
def test_rms_norm_reference(n, dtype, with_residual):
    x = torch.randn(6, n).to(dtype)
    w = torch.randn(n).to(dtype)
    r = torch.randn(6, n).to(dtype) if with_residual else None
    got, want = ref.rms_norm(x, w, 1e-5, r), naive.rms_norm(x, w, 1e-5, r)
    for g, s in zip(got, want) if with_residual else ((got, want),):
        torch.testing.assert_close(g.double(), s, **TOL[dtype])


@pytest.mark.parametrize("d", HEAD_SIZES)
@pytest.mark.parametrize("is_neox", (True, False))
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_reference(d, is_neox, dtype):
    cache = naive.rope_cache(4096, d).to(dtype)
    positions = torch.randint(0, 4096, (9,))
    q, k = torch.randn(9, 6, d).to(dtype), torch.randn(9, 2, d).to(dtype)
    for g, s in zip(ref.rotary_embedding(positions, q, k, cache, is_neox), naive.rotary_embedding(positions, q, k, cache, is_neox)):
        torch.testing.assert_close(g.double(), s, **TOL[dtype])


def test_rotary_reference_is_a_rotation_by_position():
    """neox rotary with a real cache: dot products depend only on the distance between positions."""
    d = 64
    cache = naive.rope_cache(64, d, dtype=torch.float64)
    q, k = torch.randn(1, 1, d, dtype=torch.float64), torch.randn(1, 1, d, dtype=torch.float64)
    dots = []
    for p in (3, 10, 40):
        qr, _ = ref.rotary_embedding(torch.tensor([p + 5]), q, k, cache)
        _, kr = ref.rotary_embedding(torch.tensor([p]), q, k, cache)
        dots.append(float((qr * kr).sum()))
    assert max(dots) - min(dots) < 1e-9


@pytest.mark.parametrize("i", (64, 80, 1000, 11008))
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_reference(i, dtype):
    x = (3 * torch.randn(3, 2 * i)).to(dtype)
    torch.testing.assert_close(ref.silu_and_mul(x).double(), naive.silu_and_mul(x), **TOL[dtype])


@pytest.mark.parametrize("n", [1, 2, 7, 40, 300])
def test_length_buckets_partition_and_pay_off(n):
    rng = random.Random(n)
    lengths = [rng.randint(1, 600) for _ in range(n)]
    buckets = ref.length_buckets(lengths)
    assert sorted(i for b in buckets for i in b) == list(range(n)) and len(buckets) <= 3
    padded = sum(len(b) * max(lengths[i] for i in b) ** 2 for b in buckets)
    assert padded <= n * max(lengths) ** 2
    if n >= 7:  # varied lengths: bucketing must save real work
        assert padded < 0.8 * n * max(lengths) ** 2


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_and_mul_reference(dtype):
    x = (3 * torch.randn(3, 2 * 80)).to(dtype)
    torch.testing.assert_close(ref.gelu_tanh_and_mul(x).double(), naive.gelu_tanh_and_mul(x), **TOL[dtype])
