"""fused_moe: the torch reference (grouped GEMM and its padded-bmm fallback) and the Triton kernel
(interpreter) against the naive token-by-token float64 version."""

import pytest
import torch

import kernel_naive as naive
from kernel_naive import TOL
from shoal.kernels import reference as ref

# (T tokens, H hidden, I expert intermediate, E experts, k per token)
SHAPES = [(1, 32, 16, 4, 2), (7, 64, 48, 8, 2), (33, 48, 20, 6, 3), (5, 40, 24, 16, 4), (12, 32, 16, 3, 1)]
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _moe_inputs(T, H, I, E, k, dtype, skew=False):
    x = torch.randn(T, H).to(dtype)
    w13 = (torch.randn(E, 2 * I, H) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, I) / I**0.5).to(dtype)
    scores = torch.rand(T, E)
    if skew:  # every token prefers the same experts, most experts get nothing
        scores[:, : k] += 10
    weights, ids = scores.softmax(-1).topk(k, dim=-1)
    return x, w13, w2, weights / weights.sum(-1, keepdim=True), ids


def _check(got, x, w13, w2, weights, ids):
    dtype = x.dtype
    assert got.shape == x.shape and got.dtype == dtype and not got.isnan().any()
    torch.testing.assert_close(got.double(), naive.fused_moe(x, w13, w2, weights, ids), **TOL[dtype])


@pytest.mark.parametrize("grouped_mm", [True, False], ids=["grouped_mm", "padded_bmm"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_reference(shape, dtype, grouped_mm, monkeypatch):
    if not grouped_mm:
        monkeypatch.setattr(ref, "_grouped_mm_fits", lambda rows, w: False)
    inputs = _moe_inputs(*shape, dtype)
    _check(ref.fused_moe(*inputs), *inputs)


def test_reference_takes_the_grouped_gemm_when_it_fits(monkeypatch):
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    ref.fused_moe(*_moe_inputs(6, 32, 16, 4, 2, torch.float32))
    assert len(calls) == 2  # gate/up and down: one grouped GEMM each, over every expert
    ref.fused_moe(*_moe_inputs(6, 30, 16, 4, 2, torch.float32))  # 120-byte rows: not 16-byte aligned
    assert len(calls) == 2


@pytest.mark.parametrize("skew", [False, True], ids=["spread", "skewed"])
def test_reference_routing_edges(skew):
    inputs = _moe_inputs(9, 32, 16, 8, 2, torch.float32, skew=skew)
    _check(ref.fused_moe(*inputs), *inputs)
    x, w13, w2, weights, ids = inputs
    assert torch.equal(ref.fused_moe(x, w13, w2, weights, ids.int()), ref.fused_moe(*inputs))  # int32 ids too
    x, w13, w2, weights, ids = _moe_inputs(0, 32, 16, 8, 2, torch.float32)
    assert ref.fused_moe(x, w13, w2, weights, ids).shape == (0, 32)


# ---------------------------------------------------------------- Triton (interpreter)

triton_cases = pytest.mark.parametrize(
    "shape,dtype,blocks",
    [((1, 32, 16, 4, 2), torch.float32, (16, 16, 16)), ((7, 64, 48, 8, 2), torch.float32, (16, 32, 16)),
     ((33, 48, 20, 6, 3), torch.float32, (16, 16, 32)), ((5, 40, 24, 16, 4), torch.float16, (16, 32, 16)),
     ((12, 32, 16, 3, 1), torch.bfloat16, (32, 16, 16)), ((20, 64, 32, 4, 2), torch.float32, (16, 64, 64))],
    ids=str,
)


@triton_cases
def test_triton_matches_reference_and_naive(shape, dtype, blocks):
    pytest.importorskip("triton")
    from shoal.kernels import fused_moe

    inputs = _moe_inputs(*shape, dtype)
    bm, bn, bk = blocks
    got = fused_moe.launch(*inputs, block_m=bm, block_n=bn, block_k=bk)
    _check(got, *inputs)
    torch.testing.assert_close(got.float(), ref.fused_moe(*inputs).float(), **TOL[dtype])


def test_triton_skewed_routing_and_no_tokens():
    pytest.importorskip("triton")
    from shoal.kernels import fused_moe

    inputs = _moe_inputs(21, 32, 16, 8, 2, torch.float32, skew=True)  # two experts take every token
    _check(fused_moe.launch(*inputs, block_m=16, block_n=16, block_k=16), *inputs)
    x, w13, w2, weights, ids = inputs
    _check(fused_moe.launch(x, w13, w2, weights, ids.int(), block_m=16, block_n=16, block_k=16), *inputs)
    assert fused_moe.fused_moe(*_moe_inputs(0, 32, 16, 8, 2, torch.float32)).shape == (0, 32)


@pytest.mark.parametrize("T,E,k,bm", [(1, 8, 2, 16), (9, 4, 3, 16), (40, 6, 2, 32), (3, 64, 4, 16)])
def test_align_block_size_gives_each_block_one_expert(T, E, k, bm):
    pytest.importorskip("triton")
    from shoal.kernels.fused_moe import align_block_size

    ids = torch.rand(T, E).topk(k, dim=-1).indices
    sorted_ids, block_expert, num_padded = align_block_size(ids, E, bm)
    P = T * k
    total = int(num_padded)
    assert total % bm == 0 and total <= sorted_ids.numel()
    assert (sorted_ids[total:] == P).all()  # beyond the padded total: only padding
    used = sorted_ids[:total]
    real = used[used < P].long()
    assert sorted(real.tolist()) == list(range(P))  # every pair exactly once
    flat = ids.reshape(-1)
    for b in range(total // bm):  # each block's real pairs all go to the block's expert
        block = sorted_ids[b * bm : (b + 1) * bm].long()
        block = block[block < P]
        assert len(block) and (flat[block] == int(block_expert[b])).all()


# ---------------------------------------------------------------- expert parallelism


def _split_routing(T, H, I, E, k, dtype):
    """Routing over 3E experts of which this rank holds the middle E: ids below 0 or from E on
    name other ranks' experts (as a layer shifts global ids by its first expert)."""
    x, w13, w2, _, _ = _moe_inputs(T, H, I, E, k, dtype)
    weights, ids = torch.rand(T, 3 * E).softmax(-1).topk(k, dim=-1)
    return x, w13, w2, weights, ids - E


@pytest.mark.parametrize("grouped_mm", [True, False], ids=["grouped_mm", "padded_bmm"])
def test_reference_skips_other_ranks_experts(grouped_mm, monkeypatch):
    if not grouped_mm:
        monkeypatch.setattr(ref, "_grouped_mm_fits", lambda rows, w: False)
    inputs = _split_routing(17, 32, 16, 4, 3, torch.float32)
    assert ((inputs[4] < 0) | (inputs[4] >= 4)).any() and ((inputs[4] >= 0) & (inputs[4] < 4)).any()
    _check(ref.fused_moe(*inputs), *inputs)
    x, w13, w2, weights, ids = inputs
    none_here = ref.fused_moe(x, w13, w2, weights, ids.clamp(max=-1))
    assert torch.equal(none_here, torch.zeros_like(x))


def test_triton_skips_other_ranks_experts():
    pytest.importorskip("triton")
    from shoal.kernels import fused_moe

    inputs = _split_routing(17, 32, 16, 4, 3, torch.float32)
    got = fused_moe.launch(*inputs, block_m=16, block_n=16, block_k=16)
    _check(got, *inputs)
    torch.testing.assert_close(got, ref.fused_moe(*inputs), **TOL[torch.float32])


def test_triton_prefill_sized_routing_takes_tall_tiles(monkeypatch):
    """Many rows per expert switch fused_moe to 64-row tiles; the result is the same."""
    pytest.importorskip("triton")
    from shoal.kernels import fused_moe

    seen = []
    launch = fused_moe.launch
    monkeypatch.setattr(fused_moe, "launch", lambda *a, **k: seen.append(k.get("block_m", 16)) or launch(*a, **k))
    inputs = _moe_inputs(70, 48, 24, 4, 2, torch.float32)
    _check(fused_moe.fused_moe(*inputs), *inputs)
    small = _moe_inputs(3, 48, 24, 4, 2, torch.float32)
    _check(fused_moe.fused_moe(*small), *small)
    assert seen == [64, 16]


# ---------------------------------------------------------------- gpt-oss experts: biases, clamped SwiGLU


def _oai_inputs(T, H, I, E, k, dtype):
    """gpt-oss's experts: biased projections, activations past the clamp (|x| > 7) on purpose."""
    x, w13, w2, weights, ids = _moe_inputs(T, H, I, E, k, dtype)
    w13 = (w13.float() * 6).to(dtype)  # gate/up values of several units: the clamp at 7 bites
    b13, b2 = torch.randn(E, 2 * I).to(dtype), torch.randn(E, H).to(dtype)
    return (x, w13, w2, weights, ids), dict(w13_bias=b13, w2_bias=b2, activation="swiglu_oai", alpha=1.702, limit=7.0)


@pytest.mark.parametrize("grouped_mm", [True, False], ids=["grouped_mm", "padded_bmm"])
@pytest.mark.parametrize("shape,dtype", [((7, 64, 48, 8, 2), torch.float32), ((33, 48, 20, 6, 3), torch.float32),
                                         ((5, 40, 24, 16, 4), torch.bfloat16)], ids=str)
def test_reference_biased_clamped_swiglu(shape, dtype, grouped_mm, monkeypatch):
    if not grouped_mm:
        monkeypatch.setattr(ref, "_grouped_mm_fits", lambda rows, w: False)
    inputs, extra = _oai_inputs(*shape, dtype)
    gate_up = inputs[1].double()[0] @ inputs[0].double().T
    assert (gate_up.abs() > 7).any(), "no activation past the clamp: the test cannot tell"
    got = ref.fused_moe(*inputs, **extra)
    torch.testing.assert_close(got.double(), naive.fused_moe(*inputs, **extra), **TOL[dtype])
    assert not torch.allclose(got.double(), naive.fused_moe(*inputs), atol=1e-2)  # not plain SwiGLU


def test_reference_biased_experts_of_other_ranks():
    (x, w13, w2, weights, _), extra = _oai_inputs(17, 32, 16, 4, 3, torch.float32)
    _, _, _, weights, ids = _split_routing(17, 32, 16, 4, 3, torch.float32)
    got = ref.fused_moe(x, w13, w2, weights, ids, **extra)
    torch.testing.assert_close(got.double(), naive.fused_moe(x, w13, w2, weights, ids, **extra), **TOL[torch.float32])


@pytest.mark.parametrize("shape,dtype,blocks", [((7, 64, 48, 8, 2), torch.float32, (16, 32, 16)),
                                                ((33, 48, 20, 6, 3), torch.float32, (16, 16, 32)),
                                                ((5, 40, 24, 16, 4), torch.float16, (16, 32, 16))], ids=str)
def test_triton_biased_clamped_swiglu(shape, dtype, blocks):
    pytest.importorskip("triton")
    from shoal.kernels import fused_moe

    inputs, extra = _oai_inputs(*shape, dtype)
    bm, bn, bk = blocks
    got = fused_moe.launch(*inputs, block_m=bm, block_n=bn, block_k=bk, **extra)
    want = naive.fused_moe(*inputs, **extra)
    tol = dict(TOL[dtype], atol=TOL[dtype]["atol"] * float(want.abs().max()))  # outputs of tens: half rounding scales
    torch.testing.assert_close(got.double(), want, **tol)
    torch.testing.assert_close(got.float(), ref.fused_moe(*inputs, **extra).float(), **tol)


# ---------------------------------------------------------------- FP8 W8A8 experts


def _fp8_inputs(T, H, I, E, k, per_tensor=False):
    """Float8 experts with a scale per output row (per_tensor: one per expert projection,
    repeated over its rows, as the MoE block expands a per-tensor checkpoint's)."""
    x, w13, w2, weights, ids = _moe_inputs(T, H, I, E, k, torch.float32)

    def quantize(w, parts):
        rows = w.abs().amax(-1)  # [E, N]
        if per_tensor:
            rows = rows.view(E, parts, -1).amax(-1, keepdim=True).expand(E, parts, w.shape[1] // parts).reshape(E, -1)
        scale = rows / 448.0
        return (w / scale[..., None]).to(torch.float8_e4m3fn), scale

    w13_q, s13 = quantize(w13, 2)
    w2_q, s2 = quantize(w2, 1)
    return (x, w13_q, w2_q, weights, ids), dict(w13_scale=s13, w2_scale=s2)


def _naive_fp8(x, w13, w2, weights, ids, w13_scale, w2_scale, a13_scale=None, a2_scale=None):
    """Token by token in float64 on the dequantized weights, each GEMM's input rounded to
    float8 as W8A8 defines (per token from its amax, or by the static scale)."""
    def rounded(v, static):
        s = torch.tensor(float(static)) if static is not None else (v.abs().amax() / 448.0).clamp_min(1e-12)
        return ((v.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn).double() * s.double())

    T, k = ids.shape
    out = torch.zeros(T, x.shape[1], dtype=torch.float64)
    for t in range(T):
        xt = rounded(x[t], a13_scale)
        for j in range(k):
            e = int(ids[t, j])
            gate_up = (w13[e].double() * w13_scale[e].double()[:, None]) @ xt
            h = naive.silu_and_mul(gate_up.float()[None])[0]  # the model's dtype between the GEMMs
            h = rounded(h.float(), a2_scale)
            out[t] += float(weights[t, j]) * ((w2[e].double() * w2_scale[e].double()[:, None]) @ h)
    return out


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("per_tensor", [False, True], ids=["channel", "tensor"])
@pytest.mark.parametrize("grouped_mm", [True, False], ids=["grouped_mm", "padded_bmm"])
def test_reference_fp8_experts(per_tensor, static, grouped_mm, monkeypatch):
    if not grouped_mm:
        monkeypatch.setattr(ref, "_grouped_mm_fits", lambda rows, w: False)
    inputs, scales = _fp8_inputs(13, 64, 32, 6, 2, per_tensor)
    if static:
        scales.update(a13_scale=torch.tensor(4.0 / 448), a2_scale=torch.tensor(0.5 / 448))
    got = ref.fused_moe(*inputs, **scales)
    torch.testing.assert_close(got.double(), _naive_fp8(*inputs, **scales), atol=1e-4, rtol=1e-4)
    # the rounding is there: the float product on the same dequantized weights differs
    x, w13, w2, weights, ids = inputs
    deq = (x, w13.float() * scales["w13_scale"][..., None], w2.float() * scales["w2_scale"][..., None], weights, ids)
    assert not torch.allclose(got, ref.fused_moe(*deq), atol=1e-4)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("shape,blocks", [((1, 32, 16, 4, 2), (16, 16, 16)), ((33, 48, 20, 6, 3), (16, 16, 32)),
                                          ((9, 64, 48, 8, 2), (16, 32, 16))], ids=str)
def test_triton_fp8_experts_match_reference(shape, blocks, static):
    pytest.importorskip("triton")
    from shoal.kernels import fused_moe

    inputs, scales = _fp8_inputs(*shape)
    if static:
        scales.update(a13_scale=torch.tensor(4.0 / 448), a2_scale=torch.tensor(0.5 / 448))
    bm, bn, bk = blocks
    got = fused_moe.launch(*inputs, block_m=bm, block_n=bn, block_k=bk, **scales)
    assert not got.isnan().any()
    torch.testing.assert_close(got, ref.fused_moe(*inputs, **scales), atol=1e-4, rtol=1e-4)
    # other ranks' experts (ids outside the local range) add nothing here either
    _, _, _, w, ids = _split_routing(shape[0], *shape[1:4], shape[4], torch.float32)
    split = (inputs[0], inputs[1], inputs[2], w, ids)
    torch.testing.assert_close(fused_moe.launch(*split, block_m=bm, block_n=bn, block_k=bk, **scales),
                               ref.fused_moe(*split, **scales), atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- int4 experts


def _int4_experts(E, N, K, group, act_order=False):
    """Random experts in quant_reference's int4 layout: (packed [E, K/8, N], (scales, zeros, g_idx))."""
    from shoal.kernels import quant_reference as qref

    q = torch.randint(0, 16, (E, K, N))
    scales = torch.rand(E, K // group, N) * 0.05 + 0.01
    zeros = torch.randint(0, 16, (E, K // group, N)).float()
    g_idx = torch.stack([(torch.randperm(K) if act_order else torch.arange(K)) // group for _ in range(E)])
    packed = torch.stack([qref.pack_int4_rows(q[e]) for e in range(E)])
    return packed, (scales, zeros, g_idx.to(torch.int32))


def _int4_inputs(T, H, I, E, k, act_order=False):
    x, _, _, weights, ids = _moe_inputs(T, H, I, E, k, torch.float32)
    q13, m13 = _int4_experts(E, 2 * I, H, 16, act_order)
    q2, m2 = _int4_experts(E, H, I, 8, act_order)
    return (x, q13, q2, weights, ids), dict(w13_int4=m13, w2_int4=m2)


@pytest.mark.parametrize("act_order", [False, True])
def test_reference_int4_experts_are_the_dequantized_experts(act_order):
    from shoal.kernels import quant_reference as qref

    (x, q13, q2, weights, ids), extra = _int4_inputs(11, 64, 32, 6, 2, act_order)
    w13 = qref.int4_dequantize_experts(q13, *extra["w13_int4"])
    w2 = qref.int4_dequantize_experts(q2, *extra["w2_int4"])
    got = ref.fused_moe(x, q13, q2, weights, ids, **extra)
    _check(got, x, w13, w2, weights, ids)


@pytest.mark.parametrize("pick", ["few", "other_ranks", "none_here"])
def test_reference_int4_experts_dequantize_only_those_chosen_and_equal_all_dequantized(pick, monkeypatch):
    """On the CPU the reference dequantizes only the experts the tokens chose (and counts the
    experts it dequantizes): the same output as the float experts, with ids of other ranks mixed
    in or every pair elsewhere."""
    from shoal.kernels import quant_reference as qref

    (x, q13, q2, weights, ids), extra = _int4_inputs(3, 64, 32, 16, 2)
    ids = torch.tensor([[3, 9], [9, 14], [3, 3]])
    if pick == "other_ranks":
        ids = torch.tensor([[3, -1], [16, 14], [40, 3]])
    elif pick == "none_here":
        ids = ids.clamp(max=-1)
    w13 = qref.int4_dequantize_experts(q13, *extra["w13_int4"])
    w2 = qref.int4_dequantize_experts(q2, *extra["w2_int4"])
    seen = []
    real = ref.int4_dequantize_experts
    monkeypatch.setattr(ref, "int4_dequantize_experts", lambda q, *m: seen.append(q.shape[0]) or real(q, *m))
    got = ref.fused_moe(x, q13, q2, weights, ids, **extra)
    _check(got, x, w13, w2, weights, ids)
    assert seen == [{"few": 3, "other_ranks": 2, "none_here": 1}[pick]] * 2


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("shape,blocks", [((1, 32, 16, 4, 2), (16, 16, 16)), ((33, 48, 24, 6, 3), (16, 16, 32)),
                                          ((9, 64, 48, 8, 2), (16, 32, 16))], ids=str)
def test_triton_int4_experts_match_reference(shape, blocks, act_order):
    pytest.importorskip("triton")
    from shoal.kernels import fused_moe

    inputs, extra = _int4_inputs(*shape, act_order)
    bm, bn, bk = blocks
    got = fused_moe.launch(*inputs, block_m=bm, block_n=bn, block_k=bk, **extra)
    assert not got.isnan().any()
    torch.testing.assert_close(got, ref.fused_moe(*inputs, **extra), **TOL[torch.float32])
