"""Iteration-level scheduling under one token budget (vLLM V1 style).

Every step, running sequences go first (decode is just a 1-token catch-up), then waiting
ones are admitted — prefill chunked to whatever budget is left, starting after any
prefix-cache hit. When KV blocks run out, the lowest-priority, latest-arrived running
sequence is preempted: its blocks are freed and it is recomputed later.

Lanes (vLLM V0's "virtual engines") let a pipeline keep several batches in flight: each
running sequence belongs to one lane, a step schedules one lane, and the engine schedules
a lane again only once its previous batch is back. So no sequence is ever in two batches
at once, and preemption picks its victims inside the lane being scheduled (the others'
sequences are in the pipe). Waiting sequences join whichever lane admits them, up to a
fair share of the work, so the lanes stay about equally full. One lane is plain V1.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from shoal.runtime.cache.block_pool import BlockPool, block_hashes
from shoal.runtime.engine.request import Sequence, Status


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)  # decodes (1 new token) first, then prefills
    num_new_tokens: list[int] = field(default_factory=list)
    num_decodes: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)

    def samples(self, seq: Sequence, num_new: int) -> bool:
        """Whether this step computes the sequence's last known token (so it samples)."""
        return seq.num_computed + num_new == len(seq.token_ids)


class Scheduler:
    def __init__(self, pool: BlockPool, block_size: int, max_num_seqs: int, max_num_batched_tokens: int, policy: str = "fcfs",
                 num_lanes: int = 1):
        self.pool = pool
        self.num_lanes = num_lanes
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.waiting: list[Sequence] = []  # sorted by order_key
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found

    def order_key(self, seq: Sequence):
        # lower priority value runs first (as in vLLM); then arrival; then creation order
        return (seq.priority if self.policy == "priority" else 0, seq.arrival_time, seq.seq_id)

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        bisect.insort(self.waiting, seq, key=self.order_key)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def _release(self, seq: Sequence) -> None:
        self.pool.release(seq.block_table)
        seq.block_table = []
        seq.num_computed = 0
        seq.num_registered = 0

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        self.num_preemptions += 1
        self.add(seq)

    def remove(self, seq: Sequence) -> None:
        """Finished or aborted: free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = Status.FINISHED

    def schedule(self, lane: int = 0) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        chosen: list[tuple[Sequence, int]] = []
        preempted = False
        self.running.sort(key=self.order_key)
        running = [s for s in self.running if s.lane == lane]
        share = -(-min(self.max_num_seqs, len(self.running) + len(self.waiting)) // self.num_lanes)
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            num_new = min(len(seq.token_ids) - seq.num_computed, budget)
            need = self._blocks_needed(seq, seq.num_computed + num_new)
            while need > self.pool.num_free and running[-1] is not seq:
                self._preempt(running.pop())
                preempted = True
            if need > self.pool.num_free:
                self._preempt(running.pop())
                preempted = True
                break
            seq.block_table += self.pool.allocate(need)
            chosen.append((seq, num_new))
            budget -= num_new
            i += 1

        # Admit waiting sequences, unless this step already had to preempt (no room).
        while (not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
               and len(running) < share):
            seq = self.waiting[0]
            if not seq.block_table:
                self._reuse_prefix(seq)
            num_new = min(len(seq.token_ids) - seq.num_computed, budget)
            need = self._blocks_needed(seq, seq.num_computed + num_new)
            if need > self.pool.num_free:
                self._release(seq)  # give back the prefix hits; try again next step
                break
            seq.block_table += self.pool.allocate(need)
            self.waiting.pop(0)
            seq.status = Status.RUNNING
            seq.lane = lane
            self.running.append(seq)
            running.append(seq)
            if seq.request.metrics.first_scheduled_time is None:
                seq.request.metrics.first_scheduled_time = time.time()
            chosen.append((seq, num_new))
            budget -= num_new

        chosen.sort(key=lambda c: c[1] != 1)  # decodes first (stable)
        batch = ScheduledBatch([s for s, _ in chosen], [n for _, n in chosen])
        batch.num_decodes = sum(1 for n in batch.num_new_tokens if n == 1)
        return batch

    def _reuse_prefix(self, seq: Sequence) -> None:
        """Start a sequence on the cached blocks of its longest cached prefix."""
        seq.block_hashes = block_hashes(seq.token_ids, self.block_size, seq.block_hashes)
        # at least one token must be computed to have something to sample from
        usable = seq.block_hashes[: (len(seq.token_ids) - 1) // self.block_size]
        hits = self.pool.lookup(usable)
        seq.block_table = hits
        seq.num_computed = len(hits) * self.block_size
        seq.num_registered = len(hits)
        if self.pool.enable_prefix_caching:
            self.prefix_queries += len(seq.token_ids)
            self.prefix_hits += seq.num_computed

    def after_step(self, batch: ScheduledBatch) -> None:
        """Advance computed counts and offer newly filled blocks to the prefix cache."""
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed += num_new
            full = seq.num_computed // self.block_size
            if self.pool.enable_prefix_caching and full > seq.num_registered:
                seq.block_hashes = block_hashes(seq.token_ids[: full * self.block_size], self.block_size, seq.block_hashes[:full])
                for b in range(seq.num_registered, full):
                    self.pool.register(seq.block_table[b], seq.block_hashes[b])
                seq.num_registered = full

    def fragmentation(self) -> tuple[int, int]:
        """(slots allocated to running sequences, slots of them holding no token)."""
        allocated = sum(len(s.block_table) for s in self.running) * self.block_size
        used = sum(min(len(s.token_ids), len(s.block_table) * self.block_size) for s in self.running)
        return allocated, allocated - used
