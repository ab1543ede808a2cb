"""The scheduler on its own: no model, no KV cache, a fake manager that answers yes or no.

The scheduler's contract with the KV-cache manager is a yes/no question per sequence
(`allocate(seq, tokens)`); here the manager is a token-slot counter, so each test states
exactly how much room there is and checks what the scheduler did with it."""

from __future__ import annotations

import pytest

from shoal.runtime.engine.request import Request, Status
from shoal.runtime.engine.scheduler import Scheduler
from shoal.runtime.sampling_params import SamplingParams


class FakeKV:
    """Room for `capacity` token slots, counted per sequence; no prefix cache, no sliding windows."""

    sliding: list = []

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.held: dict[int, int] = {}

    def allocate(self, seq, num_tokens: int) -> bool:
        more = num_tokens - self.held.get(seq.seq_id, 0)
        if more > self.capacity - sum(self.held.values()):
            return False
        self.held[seq.seq_id] = max(num_tokens, self.held.get(seq.seq_id, 0))
        return True

    def free(self, seq) -> None:
        """As the real manager: the sequence's KV is gone, so it computes again from the start."""
        self.held.pop(seq.seq_id, None)
        seq.num_computed = 0

    def reuse_prefix(self, seq) -> None:
        pass

    def cache_full_blocks(self, seqs) -> None:
        pass


def request(n_prompt: int, priority: int = 0, arrival: float = 0.0):
    req = Request(f"r{arrival}", None, list(range(n_prompt)), SamplingParams(max_tokens=8, priority=priority), arrival_time=arrival)
    return req.seqs[0]


def run_step(sched: Scheduler):
    """Schedule, pretend the model ran, and give each sequence whose prompt is done a token."""
    batch = sched.schedule()
    sched.after_step(batch)
    for seq in batch.seqs:
        if seq.num_computed == len(seq.token_ids):
            seq.token_ids.append(7)
    return batch


def test_prefill_is_chunked_to_the_token_budget_and_decodes_go_first():
    sched = Scheduler(FakeKV(10_000), max_num_seqs=8, max_num_batched_tokens=64)
    a, b = request(40, arrival=0), request(100, arrival=1)
    sched.add(a)
    sched.add(b)
    first = run_step(sched)
    assert [s.seq_id for s in first.seqs] == [a.seq_id, b.seq_id] and first.num_new_tokens == [40, 24]
    second = run_step(sched)  # a decodes (1 token, first), b's prefill continues with the rest of the budget
    assert [s.seq_id for s in second.seqs] == [a.seq_id, b.seq_id]
    assert second.num_new_tokens == [1, 63] and second.num_decodes == 1
    assert sum(second.num_new_tokens) <= 64


def test_no_room_means_no_admission_and_nothing_held():
    kv = FakeKV(50)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=512)
    big = request(80)
    sched.add(big)
    assert not sched.schedule()  # the manager said no: nothing scheduled, nothing taken
    assert kv.held == {} and big.status is Status.WAITING and sched.waiting == [big]


def test_max_num_seqs_caps_the_running_set():
    sched = Scheduler(FakeKV(10_000), max_num_seqs=2, max_num_batched_tokens=512)
    seqs = [request(4, arrival=i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    batch = run_step(sched)
    assert len(batch.seqs) == 2 and len(sched.running) == 2 and sched.waiting == [seqs[2]]


def test_out_of_room_preempts_the_latest_and_it_comes_back():
    kv = FakeKV(20)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=512)
    early, late = request(10, arrival=0), request(9, arrival=1)
    sched.add(early)
    sched.add(late)
    run_step(sched)  # both prefill: 19 of 20 slots
    run_step(sched)  # early decodes into slot 20; late needs one more: no room, late is preempted
    assert sched.num_preemptions == 1
    assert late.status is Status.WAITING and late.seq_id not in kv.held and early.status is Status.RUNNING
    sched.remove(early)  # early finishes: its room lets late back in, recomputed from scratch
    known = len(late.token_ids)
    batch = run_step(sched)
    assert batch.seqs == [late] and batch.num_new_tokens == [known]


def test_priority_policy_orders_admission():
    sched = Scheduler(FakeKV(10_000), max_num_seqs=1, max_num_batched_tokens=512, policy="priority")
    low, high = request(4, priority=5, arrival=0), request(4, priority=-1, arrival=1)
    sched.add(low)
    sched.add(high)
    assert run_step(sched).seqs == [high]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_budget_is_never_exceeded(policy):
    sched = Scheduler(FakeKV(4_000), max_num_seqs=16, max_num_batched_tokens=96, policy=policy)
    for i in range(12):
        sched.add(request(13 + 17 * i, priority=i % 3, arrival=i))
    for _ in range(40):
        batch = run_step(sched)
        assert batch.num_tokens <= 96
        assert len(sched.running) <= 16


def test_a_lora_request_without_a_slot_waits_and_gets_the_next_free_one():
    """One slot: A runs; B waits (passed over, not refused); a base request behind B is admitted,
    a second A request is not (the slot must drain for B); when A's requests end, B loads."""
    from shoal.runtime.engine.lora_manager import LoraAdapter, LoraManager

    lora = LoraManager(None, max_loras=1, max_rank=8)
    adapter_a, adapter_b = (LoraAdapter(name, "", i, 8, weights={}) for i, name in enumerate("ab"))
    sched = Scheduler(FakeKV(10_000), max_num_seqs=8, max_num_batched_tokens=256, lora=lora)
    seqs = [request(4, arrival=t) for t in range(4)]
    for seq, adapter in zip(seqs, (adapter_a, adapter_b, None, adapter_a)):
        seq.request.lora = adapter
        sched.add(seq)
    a, b, base, a2 = seqs
    assert run_step(sched).seqs == [a, base]
    assert sched.waiting == [b, a2] and lora.slots == [adapter_a] and lora.refs == [1]
    sched.remove(a)
    sched.remove(base)
    assert lora.refs == [0]
    assert run_step(sched).seqs == [b]  # the oldest waiting adapter takes the freed slot
    assert lora.slots == [adapter_b] and lora.num_loads == 2 and [w for _, w in lora.take_loads()] == [{}, {}]
    assert b.lora_slot == 0 and sched.waiting == [a2]


def test_a_sliding_window_prompt_no_budget_chunk_fits_is_prefilled_in_shorter_chunks():
    """Sliding-window groups take a chunk's blocks in every group before the window lets the old
    ones go. With a full group and two sliding ones (window 8) over 20 blocks of 16, a 120-token
    chunk needs 24 blocks, more than the pool holds, though the prompt is well within what the
    manager says one sequence can hold: the real manager, and the prompt still runs, in halves."""
    from shoal.runtime.cache.kv_cache_manager import KVCacheManager

    kv = KVCacheManager(20, 16, True, [0, 8, 8])
    seq = request(120)
    assert len(seq.token_ids) + 8 <= kv.max_tokens()
    assert not kv.allocate(seq, 120)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=128)
    sched.add(seq)
    chunks = []
    while len(seq.token_ids) < 128:
        batch = run_step(sched)
        assert batch.seqs == [seq]  # progress every step
        chunks.append(batch.num_new_tokens[0])
    assert chunks == [60, 60] + [1] * 7 and sched.num_preemptions == 0
    sched.remove(seq)
    assert kv.pool.num_free == 20 - 1  # all but the null block
