"""A contiguous mirror of the decoding sequences' keys and values, for CPU attention.

Plain torch cannot read the paged cache in place: attending over it means gathering every
sequence's blocks into one tensor, each layer, each step — three passes over the whole
KV of the batch (read, write, read again) where one would do. So the torch backend keeps,
per layer, a workspace [rows, kvh, capacity, d] in which decoding sequence i owns row i:
each step appends just the new token, and a sequence is (re)loaded from the paged cache
only when it starts decoding, or moved. The paged cache stays the truth (prefix sharing,
preemption, n > 1); the workspace is a cache of it that the leader plans and every rank
applies identically.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclass
class DecodePlan:
    rows: int  # workspace rows (>= decoding sequences)
    capacity: int  # workspace tokens per row (>= every decoding context)
    reset: bool  # shapes changed: start from empty tensors
    positions: torch.Tensor  # [Bd] where each decode token goes (its context length - 1)
    fill_rows: torch.Tensor | None  # rows to load from the paged cache this step
    fill_block_tables: torch.Tensor | None


class DecodeRows:
    """Leader-side planner: which row each decoding sequence uses, and what to (re)load."""

    def __init__(self, max_bytes: int, bytes_per_token: int):
        self.max_bytes = max_bytes
        self.bytes_per_token = bytes_per_token  # K and V of one token, all layers of a rank
        self.rows, self.capacity = 0, 0
        self.assigned: dict[int, tuple[int, int]] = {}  # seq_id -> (row, tokens held)

    def plan(self, batch, pad) -> DecodePlan | None:
        """Assign rows and put the batch's decodes in row order (row i = decode i)."""
        decodes = batch.seqs[: batch.num_decodes]
        if not decodes:
            self.assigned = {}
            return None
        need_rows = _round_up(len(decodes), 16)
        need_len = max(s.num_computed + 1 for s in decodes)
        reset = need_rows > self.rows or need_len > self.capacity
        if reset:
            rows = max(need_rows, self.rows)
            capacity = max(self.capacity, _round_up(int(need_len * 1.25) + 1, 64))
            if rows * capacity * self.bytes_per_token > self.max_bytes:
                self.rows = self.capacity = 0
                self.assigned = {}
                return None  # too big: attend by gathering from the paged cache instead
            self.rows, self.capacity, self.assigned = rows, capacity, {}
        row_of, fill = {}, []
        for s in decodes:  # keep rows whose content is current and inside the batch's range
            row, held = self.assigned.get(s.seq_id, (None, None))
            if row is not None and row < len(decodes) and held == s.num_computed:
                row_of[s.seq_id] = row
        free = iter(sorted(set(range(len(decodes))) - set(row_of.values())))
        for s in decodes:
            if s.seq_id not in row_of:
                row_of[s.seq_id] = next(free)
                fill.append(s)
        decodes.sort(key=lambda s: row_of[s.seq_id])
        batch.seqs[: batch.num_decodes] = decodes
        self.assigned = {s.seq_id: (row_of[s.seq_id], s.num_computed + 1) for s in decodes}
        return DecodePlan(
            rows=self.rows,
            capacity=self.capacity,
            reset=reset,
            positions=torch.tensor([s.num_computed for s in decodes], dtype=torch.long),
            fill_rows=torch.tensor([row_of[s.seq_id] for s in fill], dtype=torch.long) if fill else None,
            fill_block_tables=pad([s.block_table for s in fill]) if fill else None,
        )


def new_workspace(plan: DecodePlan, num_kv_heads: int, head_dim: int, dtype, device):
    shape = (plan.rows, num_kv_heads, plan.capacity, head_dim)
    return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)


def _load(cache, block_tables) -> torch.Tensor:
    """Sequences' tokens from the paged cache: [F, kvh, tokens, d]."""
    B, nb = block_tables.shape
    _, bs, kvh, d = cache.shape
    return cache.permute(2, 0, 1, 3).index_select(1, block_tables.reshape(-1)).view(kvh, B, nb * bs, d).transpose(0, 1)


def decode_attention(q, k, v, k_cache, v_cache, workspace, plan: DecodePlan, context_lens, scale: float):
    """Like kernels.reference.paged_attention_decode, reading the workspace (after bringing
    it up to date with this step's tokens) instead of gathering the paged cache."""
    kw, vw = workspace
    B, h, d = q.shape
    kvh, cap = kw.shape[1], kw.shape[2]
    g = h // kvh
    if plan.fill_rows is not None:
        for w, cache in ((kw, k_cache), (vw, v_cache)):
            loaded = _load(cache, plan.fill_block_tables)
            n = min(loaded.shape[2], cap)
            w[plan.fill_rows, :, :n] = loaded[:, :, :n]
    rows = torch.arange(B, device=q.device)
    kw[rows, :, plan.positions] = k
    vw[rows, :, plan.positions] = v
    scores = torch.bmm(q.reshape(B * kvh, g, d), kw[:B].view(B * kvh, cap, d).transpose(1, 2)).mul_(scale)
    pad = torch.arange(cap, device=q.device)[None, :] >= context_lens[:, None]
    scores.view(B, kvh, g, cap).masked_fill_(pad[:, None, None, :], float("-inf"))
    return torch.bmm(scores.softmax(-1), vw[:B].view(B * kvh, cap, d)).view(B, h, d)
