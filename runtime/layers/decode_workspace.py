"""A contiguous mirror of the decoding sequences' keys and values, for CPU attention.

Plain torch cannot read the paged cache in place: attending over it means gathering every
sequence's blocks into one tensor, each layer, each step — three passes over the whole
KV of the batch (read, write, read again) where one would do. So the torch backend keeps,
per layer, a workspace [rows, kvh, capacity, d] in which each decoding sequence owns a
row: each step appends just the new token, and a sequence is (re)loaded from the paged
cache only when it starts decoding, or moves. The paged cache stays the truth (prefix
sharing, preemption, n > 1); the workspace is a cache of it that the leader plans and
every rank applies identically.

Attention reads each run of rows (a chunk) only up to the longest context in it, so the
planner keeps rows roughly sorted by length (longest first): short sequences then cost
what they hold, not what the longest one holds. Finished sequences leave holes that later
arrivals fill; when holes or disorder make the layout much dearer than a sorted one, the
planner sorts again (moved rows reload).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_CHUNKS = 4  # one bmm pair per chunk per layer: more chunks cost more small ops
ROWS_PER_CHUNK = 8  # the fewest rows worth a chunk of their own
RESORT_AT = 1.25  # sort again when the layout reads this much more than a sorted one
GROWTH = 1.5  # capacity head-room on reallocation (chunks never read past their longest row)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def chunk_bounds(lens: list[int]) -> list[tuple[int, int, int]]:
    """Split rows into up to MAX_CHUNKS equal runs: (first row, end row, longest length).
    Runs of holes only (length 0) are dropped."""
    R = len(lens)
    k = max(1, min(MAX_CHUNKS, R // ROWS_PER_CHUNK))
    edges = [round(i * R / k) for i in range(k + 1)]
    chunks = [(a, b, max(lens[a:b])) for a, b in zip(edges, edges[1:]) if b > a]
    return [c for c in chunks if c[2] > 0]


def read_cost(lens: list[int]) -> int:
    """Token slots attention reads for this row layout."""
    return sum((b - a) * n for a, b, n in chunk_bounds(lens))


@dataclass
class DecodeChunk:
    start: int
    end: int
    length: int  # tokens read for every row of the chunk
    bias: torch.Tensor  # [(end - start) * kvh, 1, length]: 0 inside each row's context, -inf past it


@dataclass
class DecodePlan:
    rows: int  # workspace rows allocated
    capacity: int  # workspace tokens per row (>= every decoding context)
    reset: bool  # shapes changed: start from empty tensors
    used_rows: int  # rows [0, used_rows) hold the chunks
    decode_rows: torch.Tensor | None  # [Bd] row of each decode; None when decode i is row i
    positions: torch.Tensor  # [Bd] where each decode token goes (its context length - 1)
    chunks: list[DecodeChunk]
    fill_rows: torch.Tensor | None  # rows to load from the paged cache this step
    fill_block_tables: torch.Tensor | None


class DecodeRows:
    """Leader-side planner: which row each decoding sequence uses, and what to (re)load."""

    def __init__(self, max_bytes: int, bytes_per_token: int, num_kv_heads: int):
        self.max_bytes = max_bytes
        self.bytes_per_token = bytes_per_token  # K and V of one token, all layers of a rank
        self.num_kv_heads = num_kv_heads
        self.rows, self.capacity = 0, 0
        self.assigned: dict[int, tuple[int, int]] = {}  # seq_id -> (row, tokens held)

    def plan(self, batch, pad) -> DecodePlan | None:
        """Assign rows and put the batch's decodes in row order."""
        decodes = batch.seqs[: batch.num_decodes]
        if not decodes:
            self.assigned = {}
            return None
        lens = {s.seq_id: s.num_computed + 1 for s in decodes}
        need_len = max(lens.values())
        reset = len(decodes) > self.rows or need_len > self.capacity
        if reset:
            rows = max(_round_up(len(decodes), 16), self.rows)
            capacity = max(self.capacity, _round_up(int(need_len * GROWTH) + 1, 64))
            if rows * capacity * self.bytes_per_token > self.max_bytes:
                self.rows = self.capacity = 0
                self.assigned = {}
                return None  # too big: attend by gathering from the paged cache instead
            self.rows, self.capacity, self.assigned = rows, capacity, {}

        row_of = {}  # keep rows whose content is current
        for s in decodes:
            row, held = self.assigned.get(s.seq_id, (None, None))
            if row is not None and held == s.num_computed:
                row_of[s.seq_id] = row
        kept = dict(row_of)
        free = sorted(set(range(self.rows)) - set(row_of.values()), reverse=True)
        for s in sorted(decodes, key=lambda s: -lens[s.seq_id]):  # arrivals take the lowest free rows
            if s.seq_id not in row_of:
                row_of[s.seq_id] = free.pop()
        layout = self._layout(decodes, row_of, lens)
        by_length = sorted(lens.values(), reverse=True)
        if read_cost(layout) > RESORT_AT * read_cost(by_length):
            order = sorted(decodes, key=lambda s: -lens[s.seq_id])
            row_of = {s.seq_id: i for i, s in enumerate(order)}
            layout = by_length
        fill = [s for s in decodes if kept.get(s.seq_id) != row_of[s.seq_id]]

        decodes.sort(key=lambda s: row_of[s.seq_id])
        batch.seqs[: batch.num_decodes] = decodes
        self.assigned = {s.seq_id: (row_of[s.seq_id], s.num_computed + 1) for s in decodes}
        rows = [row_of[s.seq_id] for s in decodes]
        return DecodePlan(
            rows=self.rows,
            capacity=self.capacity,
            reset=reset,
            used_rows=len(layout),
            decode_rows=None if rows == list(range(len(layout))) else torch.tensor(rows, dtype=torch.long),
            positions=torch.tensor([s.num_computed for s in decodes], dtype=torch.long),
            chunks=[self._chunk(a, b, n, layout) for a, b, n in chunk_bounds(layout)],
            fill_rows=torch.tensor([row_of[s.seq_id] for s in fill], dtype=torch.long) if fill else None,
            fill_block_tables=pad([s.block_table for s in fill]) if fill else None,
        )

    @staticmethod
    def _layout(decodes, row_of, lens) -> list[int]:
        """Context length of each used row; 0 for a hole."""
        layout = [0] * (max(row_of.values()) + 1)
        for s in decodes:
            layout[row_of[s.seq_id]] = lens[s.seq_id]
        return layout

    def _chunk(self, start: int, end: int, length: int, layout: list[int]) -> DecodeChunk:
        # holes get one visible slot so that their (unused) rows stay finite
        row_lens = torch.tensor([max(n, 1) for n in layout[start:end]], dtype=torch.long)
        past = torch.arange(length)[None, :] >= row_lens[:, None]
        bias = torch.zeros(past.shape).masked_fill_(past, float("-inf"))
        return DecodeChunk(start, end, length, bias.repeat_interleave(self.num_kv_heads, 0)[:, None, :])


def new_workspace(plan: DecodePlan, num_kv_heads: int, head_dim: int, dtype, device):
    shape = (plan.rows, num_kv_heads, plan.capacity, head_dim)
    return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)


def _load(cache, block_tables) -> torch.Tensor:
    """Sequences' tokens from the paged cache: [F, kvh, tokens, d]."""
    B, nb = block_tables.shape
    _, bs, kvh, d = cache.shape
    return cache.permute(2, 0, 1, 3).index_select(1, block_tables.reshape(-1)).view(kvh, B, nb * bs, d).transpose(0, 1)


def decode_attention(q, k, v, k_cache, v_cache, workspace, plan: DecodePlan, scale: float):
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
    rows = plan.decode_rows if plan.decode_rows is not None else torch.arange(B, device=q.device)
    kw[rows, :, plan.positions] = k
    vw[rows, :, plan.positions] = v
    if plan.decode_rows is not None:  # scatter the queries to their rows
        q = q.new_zeros(plan.used_rows, h, d).index_copy_(0, rows, q)
    out = q.new_empty(plan.used_rows, h, d)
    for c in plan.chunks:  # a few runs of rows, not a loop over sequences
        n = c.end - c.start
        keys = kw[c.start : c.end, :, : c.length].reshape(n * kvh, c.length, d)  # views: no copy
        values = vw[c.start : c.end, :, : c.length].reshape(n * kvh, c.length, d)
        # the plan is built in float32; a bf16/fp16 model adds the bias in its own dtype
        scores = torch.baddbmm(c.bias.to(q.dtype), q[c.start : c.end].view(n * kvh, g, d), keys.transpose(1, 2), alpha=scale)
        torch.bmm(scores.softmax(-1), values, out=out[c.start : c.end].view(n * kvh, g, d))
    return out if plan.decode_rows is None else out.index_select(0, rows)
