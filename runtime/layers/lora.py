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
        self.groups: list = []  # [(slot, token indices or None: all)], the torch kernel's form

    def set(self, token_slot: torch.Tensor | None, host_slots: torch.Tensor | None = None, grouped: bool = True) -> None:
        """`host_slots`: the same mapping on the host, grouped here once for every layer
        (`grouped`: the torch kernel reads the groups; Triton reads token_slot alone)."""
        self.token_slot, self.groups = token_slot, []
        if token_slot is None or not grouped:
            return
        host = (token_slot if host_slots is None else host_slots).cpu()
        for slot in torch.unique(host).tolist():
            if slot < 0:
                continue
            mask = host == slot
            self.groups.append((slot, None if bool(mask.all()) else mask.nonzero().flatten().to(token_slot.device)))


class LoraLayer:
    """One layer's slots: a [S, C, in] and b [S, out, C], C = projections x max rank."""

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
        self.a = torch.zeros(S, self.cols, layer.input_size, dtype=dtype, device=device)
        self.b = torch.zeros(S, out_features, self.cols, dtype=dtype, device=device)

    def __call__(self, layer, x, out):
        m = self.mapping
        if m.token_slot is None:
            return out
        return self.delta(x, self.a, self.b, m.token_slot, m.groups, out)

    def set_slot(self, layer, slot: int, weights) -> None:
        """Put one adapter in `slot`: `weights` is, per projection, None or its full (A [r, in],
        B [out, r]) with the scaling in B; this rank keeps its shard. None empties the slot."""
        a, b = self.a[slot], self.b[slot]
        a.zero_()
        b.zero_()
        for p, pair in enumerate(weights or [None] * self.num_proj):
            if pair is None:
                continue
            A, B = pair
            r, c = A.shape[0], p * self.max_rank
            if isinstance(layer, RowLinear):
                a[c : c + r].copy_(A[:, layer.start : layer.start + layer.input_size])
                b[:, c : c + r].copy_(B)
            else:
                offset, start, count = layer._rows(p)
                a[c : c + r].copy_(A)
                b[offset : offset + count, c : c + r].copy_(B[start : start + count])
