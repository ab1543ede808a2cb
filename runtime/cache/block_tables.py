"""Every block table as a row of one array (vLLM's persistent block table).

A step's inputs take the rows of the sequences it runs in one numpy gather, a C copy,
instead of flattening each sequence's Python list again every step. Flattened, 256 tables
at 1,700 tokens of context cost 0.6 ms a step, growing with the context; gathered, tens of
microseconds. The KV-cache manager writes a row only when that sequence's blocks change:
a new block every block_size tokens, a prefix hit, a fork, a free.

Rows are handed out when a sequence first holds blocks and taken back when it frees them.
Both dimensions grow by doubling, so nothing is sized for the longest context up front.
Entries past a row's length are 0, as the padding of a ragged batch has always been.

A model with several KV-cache groups (models/kv_groups.py: full and sliding-window layers)
has one table per group per sequence, all of one length (a sliding group's table keeps its
dropped blocks as the null block): the array is [groups, rows, width] and a sequence's row
is the same in every group.
"""

from __future__ import annotations

import numpy as np


class BlockTables:
    def __init__(self, rows: int = 64, width: int = 64, num_groups: int = 1):
        self.table = np.zeros((num_groups, rows, width), dtype=np.int64)
        self.lengths = np.zeros(rows, dtype=np.int64)  # blocks in each row
        self.free_rows = list(range(rows - 1, -1, -1))  # popped from the end: lowest first

    def _grow(self, rows: int, width: int) -> None:
        groups, old_rows, old_width = self.table.shape
        table = np.zeros((groups, rows, width), dtype=np.int64)
        table[:, :old_rows, :old_width] = self.table
        self.table = table
        self.lengths = np.concatenate([self.lengths, np.zeros(rows - old_rows, dtype=np.int64)])
        self.free_rows[:0] = range(rows - 1, old_rows - 1, -1)

    def write(self, seq, start: int = 0) -> None:
        """Copy seq.block_table[start:] (and its other groups' tables) into its row (taking a row if it has none)."""
        row = seq.kv_row
        if row is None:
            if not self.free_rows:
                self._grow(2 * len(self.lengths), self.table.shape[2])
            row = seq.kv_row = self.free_rows.pop()
            start = 0
        ids = seq.block_table
        if len(ids) > self.table.shape[2]:
            self._grow(len(self.lengths), max(len(ids), 2 * self.table.shape[2]))
        self.table[0, row, start : len(ids)] = ids[start:]
        for g, group_ids in enumerate(seq.group_tables, 1):
            self.table[g, row, start : len(ids)] = group_ids[start:]
        self.lengths[row] = len(ids)

    def drop(self, seq, group: int, start: int, stop: int, null: int) -> None:
        """Entries [start, stop) of one group's table became the null block (out of the window)."""
        self.table[group, seq.kv_row, start:stop] = null

    def release(self, seq) -> None:
        row = seq.kv_row
        if row is not None:
            self.table[:, row, : self.lengths[row]] = 0
            self.lengths[row] = 0
            self.free_rows.append(row)
            seq.kv_row = None

    @property
    def rows(self) -> np.ndarray:
        """[rows, width] with one group (as before groups: 2-D indexing is the cheaper), else [groups, rows, width]."""
        return self.table[0] if len(self.table) == 1 else self.table

    def gather(self, seqs) -> np.ndarray:
        """[len(seqs), longest] int64 (one group; [groups, len(seqs), longest] with several):
        their block tables, zero-padded."""
        rows = np.fromiter([s.kv_row for s in seqs], dtype=np.int64, count=len(seqs))
        width = max(1, int(self.lengths[rows].max()))
        return self.rows[..., rows, :width]
