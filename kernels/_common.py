"""Helpers shared by the Triton wrappers; plain torch, so importing it never loads triton."""

from __future__ import annotations

import torch


def empty(shape, dtype, device) -> torch.Tensor:
    """Every output a kernel wrapper allocates comes from here (tests swap in a NaN-filled one)."""
    return torch.empty(shape, dtype=dtype, device=device)


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
