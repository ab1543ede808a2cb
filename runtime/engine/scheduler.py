"""Iteration-level scheduling under one token budget (vLLM V1 style).

Every step, running sequences go first (decode is just a 1-token catch-up), then waiting
ones are admitted — prefill chunked to whatever budget is left, starting after any
prefix-cache hit. When KV blocks run out, the lowest-priority, latest-arrived running
sequence is preempted: its blocks are freed and it is recomputed later.

With async scheduling (one lane) a step is scheduled while the previous one runs: a
sequence's tokens in flight (`num_pending`) count as known, so it decodes the token the
device is still sampling, which the model runner fills in on the device.

Lanes (vLLM V0's "virtual engines") let a pipeline keep several batches in flight: each
running sequence belongs to one lane, a step schedules one lane, and the engine schedules
a lane again only once its previous batch is back. So no sequence is ever in two batches
at once, and preemption picks its victims inside the lane being scheduled (the others'
sequences are in the pipe). Waiting sequences join whichever lane admits them, up to a
fair share of the work, so the lanes stay about equally full. One lane is plain V1.

LoRA: a sequence holds its adapter's device slot while it runs (lora_manager.py). A waiting
sequence whose adapter finds no free slot is passed over, not refused: base-model sequences
behind it may be admitted, adapter ones not (the slots drain, and it gets the next free one);
it is asked again next step.
"""

from __future__ import annotations

import bisect
import operator
import time
from dataclasses import dataclass, field

from shoal.runtime.cache.kv_cache_manager import KVCacheManager
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
        """Whether this step computes the sequence's last token, known or still in flight (so it samples)."""
        return seq.num_computed + num_new == len(seq.token_ids) + seq.num_pending


_order = operator.attrgetter("order")  # the key Scheduler.add gave each sequence


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, policy: str = "fcfs",
                 num_lanes: int = 1, lora=None):
        self.kv = kv
        self.lora = lora  # the LoraManager, when adapters are served
        self.num_lanes = num_lanes
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.waiting: list[Sequence] = []  # sorted by order_key (kept as seq.order)
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def order_key(self, seq: Sequence):
        # lower priority value runs first (as in vLLM); then arrival; then creation order
        return (seq.priority if self.policy == "priority" else 0, seq.arrival_time, seq.seq_id)

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        seq.order = self.order_key(seq)  # fixed while it is here; sorting reads it each step
        bisect.insort(self.waiting, seq, key=_order)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add_running(self, seq: Sequence, lane: int) -> None:
        """A sequence that starts running with its blocks already in place (an n > 1 sibling)."""
        seq.status = Status.RUNNING
        seq.lane = lane
        seq.order = self.order_key(seq)
        if seq.request.lora is not None:  # its parent holds the slot: found at once
            seq.lora_slot = self.lora.acquire(seq.request.lora)
        self.running.append(seq)

    def _release_slot(self, seq: Sequence) -> None:
        if seq.lora_slot is not None:
            self.lora.release(seq.lora_slot)
            seq.lora_slot = None

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release_slot(seq)
        self.kv.free(seq)
        self.num_preemptions += 1
        self.add(seq)

    def remove(self, seq: Sequence) -> None:
        """Finished or aborted: free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
            self._release_slot(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = Status.FINISHED

    def _shorter_chunk(self, seq: Sequence, num_new: int) -> int:
        """The longest halving of a prefill chunk the KV cache takes now (0: none), for a sequence
        nobody else holds blocks from. Sliding-window groups take a chunk's blocks in every group
        before the window lets the old ones go, so a budget-long chunk may never fit where shorter
        ones do (the engine caps prompts at what a sequence alone can hold, KVCacheManager.max_tokens)."""
        while num_new > 1:
            num_new //= 2
            if self.kv.allocate(seq, seq.num_computed + num_new):
                return num_new
        return 0

    def schedule(self, lane: int = 0) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        chosen: list[tuple[Sequence, int]] = []
        preempted = False
        self.running.sort(key=_order)
        running = [s for s in self.running if s.lane == lane]
        share = -(-min(self.max_num_seqs, len(self.running) + len(self.waiting)) // self.num_lanes)
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            if seq.num_pending and len(seq.token_ids) + seq.num_pending >= seq.request.max_len:
                i += 1  # its tokens in flight end it (max_tokens, the context): nothing left to compute
                continue
            num_new = min(len(seq.token_ids) + seq.num_pending - seq.num_computed, budget)
            allocated = self.kv.allocate(seq, seq.num_computed + num_new)
            while not allocated and running[-1] is not seq:
                self._preempt(running.pop())
                preempted = True
                allocated = self.kv.allocate(seq, seq.num_computed + num_new)
            if not allocated and num_new > 1 and self.kv.sliding:  # alone: a shorter chunk before its own blocks go
                num_new = self._shorter_chunk(seq, num_new)
                allocated = num_new > 0
            if not allocated:
                self._preempt(running.pop())  # the sequence itself: nobody left to take blocks from
                preempted = True
                break
            chosen.append((seq, num_new))
            budget -= num_new
            i += 1

        # Admit waiting sequences, unless this step already had to preempt (no room).
        w = 0  # the first waiting sequence not passed over (its adapter had no slot)
        passed_over = False
        while (not preempted and w < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs
               and len(running) < share):
            seq = self.waiting[w]
            if seq.num_pending:  # preempted with a token in flight: it is recomputed once the token lands
                break
            if seq.request.lora is not None:
                # once one waits for a slot, later adapter requests take none either, so that
                # the slots drain and it gets the next free one (no adapter starves another)
                seq.lora_slot = self.lora.acquire(seq.request.lora) if not passed_over else None
                if seq.lora_slot is None:  # every slot busy with other adapters: it waits for one
                    passed_over = True
                    w += 1
                    continue
            if not seq.block_table and not seq.scores_prompt:  # prompt_logprobs: every position is computed
                self.kv.reuse_prefix(seq)
            num_new = min(len(seq.token_ids) - seq.num_computed, budget)
            allocated = self.kv.allocate(seq, seq.num_computed + num_new)
            if not allocated and not self.running and num_new > 1 and self.kv.sliding:  # nobody holds blocks
                num_new = self._shorter_chunk(seq, num_new)
                allocated = num_new > 0
            if not allocated:
                self.kv.free(seq)  # give back the prefix hits; try again next step
                self._release_slot(seq)
                break
            self.waiting.pop(w)
            seq.status = Status.RUNNING
            seq.lane = lane
            self.running.append(seq)
            running.append(seq)
            if seq.request.metrics.first_scheduled_time is None:
                seq.request.metrics.first_scheduled_time = time.time()
            chosen.append((seq, num_new))
            budget -= num_new

        num_new_tokens = [n for _, n in chosen]
        num_decodes = num_new_tokens.count(1)
        if num_decodes < len(chosen):
            chosen.sort(key=lambda c: c[1] != 1)  # decodes first (stable)
            num_new_tokens = [n for _, n in chosen]
        batch = ScheduledBatch([s for s, _ in chosen], num_new_tokens)
        batch.num_decodes = num_decodes
        return batch

    def after_step(self, batch: ScheduledBatch) -> None:
        """Advance computed counts and offer newly filled blocks to the prefix cache."""
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed += num_new
        self.kv.cache_full_blocks(batch.seqs)

    def fragmentation(self) -> tuple[int, int]:
        """(slots allocated to running sequences, slots of them holding no token)."""
        return self.kv.fragmentation(self.running)
