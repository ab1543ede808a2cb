"""A float8 e4m3 KV cache (--kv-cache-dtype fp8): the Triton cache write and paged attention
(decode with and without split-K, prefill) equal the torch reference in the interpreter, and
both equal dense float64 attention over the cache dequantized (stored value times its scale)."""

import pytest
import torch

import kernel_naive as naive
from kernel_naive import TOL, finite, paged_kv

pytest.importorskip("triton")

from shoal.kernels import cache_write as cw  # noqa: E402
from shoal.kernels import paged_attention as pa  # noqa: E402
from shoal.kernels import reference as ref  # noqa: E402

FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 0.02, 0.05


def _fp8(cache, scale):
    return (cache / scale).clamp(-448, 448).to(FP8)  # NaN stays NaN: unwritten slots still poison a bad read


def _fp8_caches(lens, bs, kvh, d):
    k, v, bt, ctx = paged_kv(lens, bs, kvh, d)
    k8, v8 = _fp8(k * 3, K_SCALE), _fp8(v * 3, V_SCALE)
    k8f, v8f = _fp8(finite(k) * 3, K_SCALE), _fp8(finite(v) * 3, V_SCALE)  # the reference multiplies masked slots by 0
    deq = (k8.double() * K_SCALE, v8.double() * V_SCALE)
    return (k8, v8), (k8f, v8f), deq, bt, ctx


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_cache_write_saturates_and_matches_reference(dtype):
    T, kvh, d, bs, blocks = 7, 2, 32, 4, 5
    key, value = (torch.randn(T, kvh, d) * 10).to(dtype), (torch.randn(T, kvh, d) * 30).to(dtype)  # some past 448 * scale
    slots = torch.randperm(blocks * bs)[:T]
    caches = [torch.zeros(blocks, bs, kvh, d, dtype=FP8) for _ in range(4)]
    cw.write_kv_cache(key, value, caches[0], caches[1], slots, K_SCALE, V_SCALE)
    ref.write_kv_cache(key, value, caches[2], caches[3], slots, K_SCALE, V_SCALE)
    assert torch.equal(caches[0].float(), caches[2].float()) and torch.equal(caches[1].float(), caches[3].float())
    stored = caches[1].view(-1, kvh, d)[slots].float() * V_SCALE
    want = value.float().clamp(-448 * V_SCALE, 448 * V_SCALE)
    assert (stored - want).abs().max() <= 448 * V_SCALE / 16  # e4m3: 3 mantissa bits
    assert stored.abs().max() == pytest.approx(448 * V_SCALE)


@pytest.mark.parametrize("split", [None, 32])
def test_fp8_decode(split):
    d, bs, h, kvh, lens = 64, 16, 6, 2, [1, 40, 77]
    (k8, v8), (k8f, v8f), (kd, vd), bt, ctx = _fp8_caches(lens, bs, kvh, d)
    q = torch.randn(len(lens), h, d)
    scale = d**-0.5
    out = pa.decode(q, k8, v8, bt, ctx, scale, 0, 0.0, K_SCALE, V_SCALE, split_size=split, block_n=32)
    want_ref = ref.paged_attention_decode(q, k8f, v8f, bt, ctx, scale, k_scale=K_SCALE, v_scale=V_SCALE)
    want = naive.decode(q, kd, vd, bt, ctx, scale)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), want, **TOL[torch.float32])
    torch.testing.assert_close(want_ref.double(), want, **TOL[torch.float32])


@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_fp8_prefill(softcap):
    d, bs, h, kvh, lens, q_lens = 64, 16, 4, 2, [20, 37], [20, 5]
    (k8, v8), (k8f, v8f), (kd, vd), bt, ctx = _fp8_caches(lens, bs, kvh, d)
    qsl = torch.tensor([0, q_lens[0], sum(q_lens)])
    q = torch.randn(sum(q_lens), h, d)
    scale = d**-0.5
    out = pa.prefill(q, k8, v8, bt, qsl, ctx, scale, 0, softcap, K_SCALE, V_SCALE, block_m=16, block_n=16)
    want_ref = ref.paged_attention_prefill(q, k8f, v8f, bt, qsl, ctx, scale, 0, softcap, K_SCALE, V_SCALE)
    want = naive.prefill(q, kd, vd, bt, qsl, ctx, scale, softcap=softcap)
    torch.testing.assert_close(out.double(), want, **TOL[torch.float32])
    torch.testing.assert_close(want_ref.double(), want, **TOL[torch.float32])


def test_fp8_rounding_equals_torch_on_every_binade():
    """Values across e4m3's range, subnormals and ties included, round as torch's cast does."""
    grid = torch.cat([torch.linspace(-460, 460, 8191), torch.linspace(-0.03, 0.03, 4095),
                      torch.tensor([124.0, 120.0, 248.0, 0.0009765625 * 3, 0.015625, 0.0155, 449.0, -500.0])])
    n = grid.numel() - grid.numel() % 64
    key = grid[:n].view(-1, 1, 64)
    slots = torch.arange(key.shape[0])
    caches = [torch.zeros(key.shape[0], 1, 1, 64, dtype=FP8) for _ in range(4)]
    cw.write_kv_cache(key, key, caches[0], caches[1], slots)
    ref.write_kv_cache(key, key, caches[2], caches[3], slots)
    assert torch.equal(caches[0].float(), caches[2].float())
