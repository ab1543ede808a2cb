"""LoRA shrink/expand: the Triton kernel (interpreter) and the torch reference against a float64
per-token loop, with base tokens (slot -1) left exactly as they were."""

from __future__ import annotations

import pytest
import torch

from shoal.kernels import lora, reference
from shoal.runtime.layers.lora import LoraMapping


def naive(x, a, b, token_slot, out):
    want = out.double().clone()
    for t, s in enumerate(token_slot.tolist()):
        if s >= 0:
            want[t] += (x[t].double() @ a[s].double().T) @ b[s].double().T
    return want


@pytest.mark.parametrize("T,K,N,S,C", [(1, 64, 96, 1, 8), (7, 130, 200, 3, 24), (16, 64, 64, 4, 5)])
def test_lora_delta_matches_a_per_token_loop(T, K, N, S, C):
    x, a, b = torch.randn(T, K), torch.randn(S, C, K), torch.randn(S, N, C)
    token_slot = torch.randint(-1, S, (T,))
    token_slot[0] = -1  # at least one base token
    mapping = LoraMapping(S)
    mapping.set(token_slot)
    base = torch.randn(T, N)
    want = naive(x, a, b, token_slot, base)
    for fn in (reference.lora_delta, lambda *args: lora.launch(*args, block_k=32, block_n=32)):
        got = fn(x, a, b, token_slot, mapping.groups, base.clone())
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
        base_rows = token_slot < 0
        assert torch.equal(got[base_rows], base[base_rows])


def test_one_adapter_for_every_token_needs_no_gather():
    x, a, b = torch.randn(5, 32), torch.randn(2, 4, 32), torch.randn(2, 48, 4)
    token_slot = torch.full((5,), 1)
    mapping = LoraMapping(2)
    mapping.set(token_slot)
    assert [(s, idx) for s, idx in mapping.groups] == [(1, None)]
    got = reference.lora_delta(x, a, b, token_slot, mapping.groups, torch.zeros(5, 48))
    torch.testing.assert_close(got.double(), naive(x, a, b, token_slot, torch.zeros(5, 48)), rtol=1e-4, atol=1e-4)
