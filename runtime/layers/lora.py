"""LoRA adapters on the linear layers, unmerged: each layer's `lora` hook adds the delta of
whichever adapter each token of the step uses, every adapter of the batch in one op
(kernels: lora_delta), base tokens untouched.

A hook holds `max_loras` slots of stacked A and B for its layer. A fused layer (q/k/v,
gate/up) stacks one A per projection and a block-diagonal B, so one shrink and one expand
cover all of its projections. Tensor parallel: A and B are sharded like the layer they
modify; a column layer keeps A whole and its own output rows of B, a row layer its input
columns of A and B whole (its delta is a partial sum, reduced with the base one).
"""

from __future__ import annotations

import torch

from shoal.runtime.layers.linear import MergedColumnLinear, RowLinear


class LoraMapping:
    """Which slot each token of the step uses (-1: none); the model runner sets it before a
    forward, every hook of the model reads it."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.token_slot: torch.Tensor | None = None  # [T] long; None: no token uses an adapter
        self.slot_mask: torch.Tensor | None = None  # [T, S] one-hot, the torch kernel's form

    def set(self, token_slot: torch.Tensor | None, dtype: torch.dtype) -> None:
        self.token_slot = token_slot
        self.slot_mask = None if token_slot is None else \
            torch.nn.functional.one_hot(token_slot + 1, self.num_slots + 1)[:, 1:].to(dtype)


class LoraLayer:
    """One layer's slots: a [S*C, in] and b [out, S*C], C = projections x max rank."""

    def __init__(self, layer, mapping: LoraMapping, max_rank: int, delta, dtype, device):
        self.mapping, self.max_rank, self.delta = mapping, max_rank, delta
        if isinstance(layer, MergedColumnLinear):
            self.num_proj, out_features = len(layer.local_sizes), sum(layer.local_sizes)
        elif isinstance(layer, RowLinear):
            self.num_proj, out_features = 1, layer.output_size
        else:
            raise TypeError(f"no LoRA for a {type(layer).__name__}")
        self.cols = self.num_proj * max_rank
        S = mapping.num_slots
        self.a = torch.zeros(S * self.cols, layer.input_size, dtype=dtype, device=device)
        self.b = torch.zeros(out_features, S * self.cols, dtype=dtype, device=device)

    def __call__(self, layer, x, out):
        m = self.mapping
        if m.token_slot is None:
            return out
        return self.delta(x, self.a, self.b, m.token_slot, m.slot_mask, out)

    def set_slot(self, layer, slot: int, weights) -> None:
        """Put one adapter in `slot`: `weights` is, per projection, None or its full (A [r, in],
        B [out, r]) with the scaling in B; this rank keeps its shard. None empties the slot."""
        first = slot * self.cols
        self.a[first : first + self.cols].zero_()
        self.b[:, first : first + self.cols].zero_()
        for p, pair in enumerate(weights or [None] * self.num_proj):
            if pair is None:
                continue
            A, B = pair
            r, c = A.shape[0], first + p * self.max_rank
            if isinstance(layer, RowLinear):
                self.a[c : c + r].copy_(A[:, layer.start : layer.start + layer.input_size])
                self.b[:, c : c + r].copy_(B)
            else:
                offset, start, count = layer._rows(p)
                self.a[c : c + r].copy_(A)
                self.b[offset : offset + count, c : c + r].copy_(B[start : start + count])
