"""Paged attention kernels (interpreter) against the torch reference and dense float64 attention."""

import pytest
import torch

import kernel_naive as naive
from kernel_naive import TOL, finite, paged_kv

pytest.importorskip("triton")

from shoal.kernels import paged_attention as pa  # noqa: E402  (after conftest set TRITON_INTERPRET)
from shoal.kernels import reference as ref  # noqa: E402


def _q(shape, dtype, strided):
    """Queries, optionally as a strided slice of a wider projection (as the model produces them)."""
    if not strided:
        return torch.randn(shape).to(dtype)
    wide = torch.randn(*shape[:-2], shape[-2] + 3, shape[-1]).to(dtype)
    return wide[..., 1 : 1 + shape[-2], :]


def _check(out, want_ref, want_naive, dtype):
    assert not out.isnan().any(), "an output element was never written"
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), want_naive, **TOL[dtype])
    torch.testing.assert_close(out.float(), want_ref.float(), **TOL[dtype])


# d, block_size, h, kvh, dtype, context lengths, split_size (None: the heuristic), block_n
DECODE = [
    (64, 16, 4, 4, torch.float32, [1, 16, 33], None, 64),  # MHA, length 1, ends on a block
    (80, 32, 6, 2, torch.float32, [64, 5, 47], 64, 64),  # GQA 3, split-K, ends on a block
    (96, 16, 8, 2, torch.float32, [1, 130, 77], 64, 32),  # GQA 4, three splits, one short
    (128, 32, 4, 1, torch.float16, [200, 96], 64, 64),  # GQA 4 fp16, split-K
    (128, 16, 3, 1, torch.bfloat16, [31, 32], None, 64),  # GQA 3 bf16
    (64, 32, 2, 1, torch.float32, [45, 64], 32, 16),  # tile smaller than a block
    (80, 16, 12, 4, torch.float16, [17, 3, 48, 1], 32, 32),  # GQA 3, ragged, many splits
]


@pytest.mark.parametrize("d,bs,h,kvh,dtype,lens,split,block_n", DECODE)
def test_decode(d, bs, h, kvh, dtype, lens, split, block_n):
    k_cache, v_cache, bt, ctx = paged_kv(lens, bs, kvh, d, dtype)
    q = _q((len(lens), h, d), dtype, strided=split == 64)
    scale = d**-0.5
    out = pa.decode(q, k_cache, v_cache, bt, ctx, scale, split_size=split, block_n=block_n)
    want_ref = ref.paged_attention_decode(q.float(), finite(k_cache).float(), finite(v_cache).float(), bt, ctx, scale)
    _check(out, want_ref, naive.decode(q, k_cache, v_cache, bt, ctx, scale), dtype)


def test_decode_heuristic_splits_long_context():
    """The public function, no knobs: one long sequence on a wide table engages split-K."""
    d, bs, h, kvh = 64, 16, 4, 2
    lens = [600]
    k_cache, v_cache, bt, ctx = paged_kv(lens, bs, kvh, d, pad_cols=2)
    split = pa.decode_split_size(1, kvh, bt.shape[1] * bs, 32, torch.device("cpu"))
    assert split < bt.shape[1] * bs, "split-K should engage for one long sequence"
    q = torch.randn(1, h, d)
    out = pa.paged_attention_decode(q, k_cache, v_cache, bt, ctx, 0.125)
    want_ref = ref.paged_attention_decode(q, finite(k_cache), finite(v_cache), bt, ctx, 0.125)
    _check(out, want_ref, naive.decode(q, k_cache, v_cache, bt, ctx, 0.125), torch.float32)


def test_decode_split_heuristic():
    cpu = torch.device("cpu")
    assert pa.decode_split_size(256, 8, 4096, 64, cpu) == 4096  # a full batch needs no split
    s = pa.decode_split_size(2, 8, 32768, 64, cpu)
    assert s % 64 == 0 and 32768 / s <= pa.MAX_SPLITS and s >= pa.MIN_SPLIT_TOKENS
    assert pa.decode_split_size(1, 1, 64, 64, cpu) == 64


# d, block_size, h, kvh, dtype, [(cached prefix, new tokens)], block_m, block_n
PREFILL = [
    (64, 16, 2, 2, torch.float32, [(0, 1), (0, 17), (16, 16)], 16, 16),  # first chunk, length 1, block end
    (80, 32, 6, 2, torch.float32, [(5, 9), (32, 1), (0, 40)], 16, 32),  # GQA 3, prefix hit, decode row
    (96, 16, 8, 2, torch.float32, [(33, 20), (0, 3)], 64, 64),  # GQA 4, default tiles
    (128, 32, 4, 1, torch.float16, [(64, 30), (10, 1)], 32, 16),  # fp16, chunked prefill
    (64, 16, 3, 1, torch.bfloat16, [(7, 12)], 16, 16),  # bf16, GQA 3
    (80, 16, 4, 4, torch.float32, [(3, 5), (20, 0), (0, 2)], 16, 16),  # a sequence with no new tokens
    # a long prefix and several query tiles: whole blocks before each tile's diagonal, unmasked
    (64, 16, 4, 2, torch.float32, [(100, 70), (48, 33)], 32, 16),
]


@pytest.mark.parametrize("d,bs,h,kvh,dtype,seqs,block_m,block_n", PREFILL)
def test_prefill(d, bs, h, kvh, dtype, seqs, block_m, block_n):
    lens = [p + n for p, n in seqs]
    k_cache, v_cache, bt, ctx = paged_kv(lens, bs, kvh, d, dtype)
    qsl = torch.tensor([0] + [n for _, n in seqs]).cumsum(0)
    q = _q((int(qsl[-1]), h, d), dtype, strided=block_m == 16)
    scale = d**-0.5
    out = pa.prefill(q, k_cache, v_cache, bt, qsl, ctx, scale, block_m=block_m, block_n=block_n)
    want_ref = ref.paged_attention_prefill(q.float(), finite(k_cache).float(), finite(v_cache).float(), bt, qsl, ctx, scale)
    _check(out, want_ref, naive.prefill(q, k_cache, v_cache, bt, qsl, ctx, scale), dtype)


def test_prefill_public_matches_decode_rows():
    """Through the public signature; a one-token 'prefill' per sequence is a decode step."""
    d, bs, h, kvh = 64, 16, 4, 2
    lens = [9, 33]
    k_cache, v_cache, bt, ctx = paged_kv(lens, bs, kvh, d)
    q = torch.randn(2, h, d)
    qsl = torch.tensor([0, 1, 2])
    out = pa.paged_attention_prefill(q, k_cache, v_cache, bt, qsl, ctx, 0.1)
    dec = pa.paged_attention_decode(q, k_cache, v_cache, bt, ctx, 0.1)
    torch.testing.assert_close(out, dec, **TOL[torch.float32])
    torch.testing.assert_close(out.double(), naive.decode(q, k_cache, v_cache, bt, ctx, 0.1), **TOL[torch.float32])


# Sliding windows (Mistral, Gemma's local layers) and score soft-capping (Gemma 2), both
# backends against the float64 naive attention: windows shorter than, equal to and longer
# than the contexts, across split-K boundaries and block edges.
# d, block_size, h, kvh, dtype, context lengths, split_size, block_n, window, softcap
DECODE_WINDOWED = [
    (64, 16, 4, 2, torch.float32, [1, 16, 33, 130], 64, 32, 20, 0.0),  # window inside split 2 of 3
    (80, 16, 6, 2, torch.float32, [100, 7], 32, 32, 64, 0.0),  # splits wholly before the window
    (64, 16, 4, 4, torch.float32, [40, 41], None, 64, 16, 50.0),  # window and cap together
    (128, 32, 4, 1, torch.float16, [200, 96], 64, 64, 0, 30.0),  # cap alone, fp16
    (64, 16, 2, 1, torch.bfloat16, [31, 300], 64, 64, 256, 0.0),  # window longer than a context
]


@pytest.mark.parametrize("d,bs,h,kvh,dtype,lens,split,block_n,window,softcap", DECODE_WINDOWED)
def test_decode_window_and_softcap(d, bs, h, kvh, dtype, lens, split, block_n, window, softcap):
    k_cache, v_cache, bt, ctx = paged_kv(lens, bs, kvh, d, dtype)
    q = torch.randn(len(lens), h, d).to(dtype) * 4  # large scores, so the cap bites
    scale = d**-0.5
    out = pa.decode(q, k_cache, v_cache, bt, ctx, scale, window, softcap, split_size=split, block_n=block_n)
    want_ref = ref.paged_attention_decode(q.float(), finite(k_cache).float(), finite(v_cache).float(), bt, ctx, scale,
                                          window, softcap)
    _check(out, want_ref, naive.decode(q, k_cache, v_cache, bt, ctx, scale, window, softcap), dtype)


# d, block_size, h, kvh, dtype, [(cached prefix, new tokens)], block_m, block_n, window, softcap
PREFILL_WINDOWED = [
    (64, 16, 2, 2, torch.float32, [(0, 40), (16, 16), (0, 1)], 16, 16, 8, 0.0),  # window < a tile
    (80, 32, 6, 2, torch.float32, [(50, 9), (0, 70)], 16, 32, 33, 0.0),  # a prefix partly outside
    (64, 16, 4, 1, torch.float32, [(5, 30)], 32, 16, 0, 20.0),  # cap alone
    (64, 16, 4, 2, torch.float16, [(20, 25), (0, 3)], 32, 32, 12, 50.0),  # both, fp16
]


@pytest.mark.parametrize("d,bs,h,kvh,dtype,seqs,block_m,block_n,window,softcap", PREFILL_WINDOWED)
def test_prefill_window_and_softcap(d, bs, h, kvh, dtype, seqs, block_m, block_n, window, softcap):
    lens = [p + n for p, n in seqs]
    k_cache, v_cache, bt, ctx = paged_kv(lens, bs, kvh, d, dtype)
    qsl = torch.tensor([0] + [n for _, n in seqs]).cumsum(0)
    q = torch.randn(int(qsl[-1]), h, d).to(dtype) * 4
    scale = d**-0.5
    out = pa.prefill(q, k_cache, v_cache, bt, qsl, ctx, scale, window, softcap, block_m=block_m, block_n=block_n)
    want_ref = ref.paged_attention_prefill(q.float(), finite(k_cache).float(), finite(v_cache).float(), bt, qsl, ctx,
                                           scale, window, softcap)
    _check(out, want_ref, naive.prefill(q, k_cache, v_cache, bt, qsl, ctx, scale, window, softcap), dtype)


# Attention sinks (gpt-oss): a per-head logit in each softmax's denominator, alone and with a
# window, across split-K (the sink joins once, in the reduce pass) and prefill tiles; both
# backends against the float64 naive attention. Sinks of both signs and large enough to matter.
# d, block_size, h, kvh, dtype, context lengths, split_size, block_n, window
DECODE_SINKS = [
    (64, 16, 4, 2, torch.float32, [1, 16, 33], None, 64, 0),  # one split (direct)
    (64, 16, 4, 2, torch.float32, [1, 16, 33, 130], 64, 32, 20),  # split-K, window inside a later split
    (80, 16, 6, 2, torch.float32, [100, 7], 32, 32, 64),  # splits wholly before the window
    (64, 16, 8, 1, torch.float16, [45, 64], 32, 16, 0),  # fp16, GQA 8, split-K
]


def _sinks(h):
    return torch.randn(h) * 3


@pytest.mark.parametrize("d,bs,h,kvh,dtype,lens,split,block_n,window", DECODE_SINKS)
def test_decode_sinks(d, bs, h, kvh, dtype, lens, split, block_n, window):
    k_cache, v_cache, bt, ctx = paged_kv(lens, bs, kvh, d, dtype)
    q = torch.randn(len(lens), h, d).to(dtype) * 2
    sinks, scale = _sinks(h), d**-0.5
    out = pa.decode(q, k_cache, v_cache, bt, ctx, scale, window, sinks=sinks, split_size=split, block_n=block_n)
    want_ref = ref.paged_attention_decode(q.float(), finite(k_cache).float(), finite(v_cache).float(), bt, ctx, scale,
                                          window, sinks=sinks)
    want = naive.decode(q, k_cache, v_cache, bt, ctx, scale, window, sinks=sinks)
    _check(out, want_ref, want, dtype)
    torch.testing.assert_close(want_ref.double(), want, **TOL[torch.float32])
    plain = naive.decode(q, k_cache, v_cache, bt, ctx, scale, window)
    assert not torch.allclose(want, plain, atol=1e-3), "the sinks changed nothing: the test cannot tell"


# d, block_size, h, kvh, dtype, [(cached prefix, new tokens)], block_m, block_n, window
PREFILL_SINKS = [
    (64, 16, 4, 2, torch.float32, [(0, 40), (16, 16), (0, 1)], 16, 16, 0),  # no window
    (64, 16, 2, 2, torch.float32, [(0, 40), (16, 16), (0, 1)], 16, 16, 8),  # window < a tile
    (80, 32, 6, 2, torch.float32, [(50, 9), (0, 70)], 16, 32, 33),  # a prefix partly outside
    (64, 16, 4, 1, torch.float16, [(20, 25), (0, 3)], 32, 32, 12),  # fp16
]


@pytest.mark.parametrize("d,bs,h,kvh,dtype,seqs,block_m,block_n,window", PREFILL_SINKS)
def test_prefill_sinks(d, bs, h, kvh, dtype, seqs, block_m, block_n, window):
    lens = [p + n for p, n in seqs]
    k_cache, v_cache, bt, ctx = paged_kv(lens, bs, kvh, d, dtype)
    qsl = torch.tensor([0] + [n for _, n in seqs]).cumsum(0)
    q = torch.randn(int(qsl[-1]), h, d).to(dtype) * 2
    sinks, scale = _sinks(h), d**-0.5
    out = pa.prefill(q, k_cache, v_cache, bt, qsl, ctx, scale, window, sinks=sinks, block_m=block_m, block_n=block_n)
    want_ref = ref.paged_attention_prefill(q.float(), finite(k_cache).float(), finite(v_cache).float(), bt, qsl, ctx,
                                           scale, window, sinks=sinks)
    want = naive.prefill(q, k_cache, v_cache, bt, qsl, ctx, scale, window, sinks=sinks)
    _check(out, want_ref, want, dtype)
    torch.testing.assert_close(want_ref.double(), want, **TOL[torch.float32])
