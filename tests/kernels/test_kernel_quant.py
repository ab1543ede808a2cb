"""The quantized GEMMs' Triton kernels equal their torch references (kernels/quant_reference.py)
in the interpreter, on shapes that leave partial tiles in every dimension."""

from __future__ import annotations

import pytest
import torch

from shoal.kernels import quant_reference as ref


@pytest.fixture(scope="module")
def quant_gemm():
    pytest.importorskip("triton")
    from shoal.kernels import quant_gemm

    return quant_gemm


@pytest.mark.parametrize("M", [1, 5, 33])
@pytest.mark.parametrize("static", [False, True])
def test_fp8_scaled_mm_matches_reference(quant_gemm, M, static):
    N, K = 96, 200
    x = torch.randn(M, K) * 3
    w = torch.randn(N, K)
    w_scale = w.abs().amax(1) / ref.FP8_MAX
    w_q = (w / w_scale[:, None]).to(ref.FP8)
    a, a_scale = ref.quantize_fp8(x, torch.tensor(0.05) if static else None)
    want = ref.fp8_scaled_mm(a, a_scale, w_q, w_scale, torch.float32)
    got = quant_gemm.fp8_scaled_mm(a, a_scale, w_q, w_scale, torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # and the reference is W8A8's product: the rounded activations times the rounded weights
    deq = (x / a_scale).clamp(-448, 448).to(ref.FP8).float() * a_scale
    torch.testing.assert_close(want, deq @ (w_q.float() * w_scale[:, None]).t(), rtol=1e-5, atol=1e-4)


def _int4_operands(K, N, group, act_order):
    q = torch.randint(0, 16, (K, N))
    groups = K // group
    scales, zeros = torch.rand(groups, N) * 0.1 + 0.01, torch.randint(0, 16, (groups, N)).float()
    g_idx = torch.arange(K) // group
    if act_order:
        g_idx = g_idx[torch.randperm(K)]
    return q, ref.pack_int4_rows(q), scales, zeros, g_idx.to(torch.int32)


@pytest.mark.parametrize("M", [1, 7, 20])
@pytest.mark.parametrize("act_order", [False, True])
def test_int4_gemm_matches_reference(quant_gemm, M, act_order):
    K, N = 256, 96
    q, packed, scales, zeros, g_idx = _int4_operands(K, N, 32, act_order)
    x = torch.randn(M, K)
    want = ref.int4_gemm(x, packed, scales, zeros, g_idx)
    torch.testing.assert_close(quant_gemm.int4_gemm(x, packed, scales, zeros, g_idx), want, rtol=1e-4, atol=1e-4)
    w = quant_gemm.int4_dequantize(packed, scales, zeros, g_idx)
    torch.testing.assert_close(w, ref.int4_dequantize(packed, scales, zeros, g_idx))
    # the reference against the definition, element by element
    naive = torch.empty(K, N)
    for k in range(K):
        g = int(g_idx[k])
        naive[k] = (q[k].float() - zeros[g]) * scales[g]
    torch.testing.assert_close(w, naive)


def test_int4_packing_round_trips():
    q = torch.randint(0, 16, (64, 24))
    packed = ref.pack_int4_rows(q)
    assert packed.dtype == torch.int32 and packed.shape == (8, 24)
    assert torch.equal(ref.unpack_int4_rows(packed), q)
    assert int(packed[0, 0]) == sum(int(q[i, 0]) << (4 * i) for i in range(8)) - (2**32 if q[7, 0] >= 8 else 0)


@pytest.mark.parametrize("act_order", [False, True])
def test_int4_dequantize_experts_is_each_experts_dequantize(act_order):
    """MoE experts stacked in the int4 layout dequantize to each expert's W, as fused_moe takes it ([N, K])."""
    E, K, N, group = 3, 64, 24, 16
    experts = [_int4_operands(K, N, group, act_order) for _ in range(E)]
    stacked = [torch.stack([ops[i] for ops in experts]) for i in range(1, 5)]  # packed, scales, zeros, g_idx
    got = ref.int4_dequantize_experts(*stacked)
    for e, (q, *ops) in enumerate(experts):
        torch.testing.assert_close(got[e], ref.int4_dequantize(*ops).t(), rtol=0, atol=0)
        g = ops[3].long()
        torch.testing.assert_close(got[e], ((q.float() - ops[2][g]) * ops[1][g]).t(), rtol=0, atol=0)
