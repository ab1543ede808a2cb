"""LoRA shrink/expand: the Triton kernel (interpreter) and the torch reference against a float64
per-token loop, with base tokens (slot -1) left exactly as they were."""

from __future__ import annotations

import pytest
import torch

from shoal.kernels import lora, reference


def naive(x, a, b, token_slot, out, slots):
    want = out.double().clone()
    C = a.shape[0] // slots
    for t, s in enumerate(token_slot.tolist()):
        if s >= 0:
            want[t] += (x[t].double() @ a[s * C : (s + 1) * C].double().T) @ b[:, s * C : (s + 1) * C].double().T
    return want


@pytest.mark.parametrize("T,K,N,S,C", [(1, 64, 96, 1, 8), (7, 130, 200, 3, 24), (16, 64, 64, 4, 5)])
def test_lora_delta_matches_a_per_token_loop(T, K, N, S, C):
    x, a, b = torch.randn(T, K), torch.randn(S * C, K), torch.randn(N, S * C)
    token_slot = torch.randint(-1, S, (T,))
    token_slot[0] = -1  # at least one base token
    mask = torch.nn.functional.one_hot(token_slot + 1, S + 1)[:, 1:].float()
    base = torch.randn(T, N)
    want = naive(x, a, b, token_slot, base, S)
    for fn in (reference.lora_delta, lambda *args: lora.launch(*args, block_k=32, block_n=32)):
        got = fn(x, a, b, token_slot, mask, base.clone())
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
        base_rows = token_slot < 0
        assert torch.equal(got[base_rows], base[base_rows])
