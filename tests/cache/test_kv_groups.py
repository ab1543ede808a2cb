"""The KV-cache manager with a full and a sliding-window group (vLLM's hybrid manager): a
long sequence's sliding table keeps only its window live, the rest goes back to the pool;
prefix reuse, fork and free stay consistent."""

import random

from shoal.runtime.cache.block_tables import BlockTables
from shoal.runtime.cache.kv_cache_manager import KVCacheManager, group_key
from shoal.runtime.engine.request import Request
from shoal.runtime.models.kv_groups import KVGroup, kv_cache_groups, layer_places
from shoal.runtime.sampling_params import SamplingParams

BS, W = 4, 10
BOUND = -(-W // BS) + 1  # a window's blocks plus the one being filled


def seq_of(ids, n=1):
    return Request("r", None, list(ids), SamplingParams(n=n)).seqs[0]


def decode_to(kv, seq, length):
    """Compute the sequence one token at a time up to `length` tokens, as the scheduler does."""
    while seq.num_computed < length:
        assert kv.allocate(seq, seq.num_computed + 1)
        seq.num_computed += 1
        kv.cache_full_blocks([seq])


def held(kv, seqs) -> int:
    """Distinct blocks the sequences hold (not the null block)."""
    return len({b for s in seqs for t in (s.block_table, *s.group_tables) for b in t} - {kv.null_block})


def test_groups_of_equal_size_full_first():
    gemma3 = [W] * 5 + [0] + [W] * 5 + [0]
    assert kv_cache_groups(gemma3) == [KVGroup(0, (5, 11)), KVGroup(W, (0, 1)), KVGroup(W, (2, 3)), KVGroup(W, (4, 6)),
                                       KVGroup(W, (7, 8)), KVGroup(W, (9, 10))]
    assert layer_places(gemma3)[4:7] == [(3, 0), (0, 0), (3, 1)]
    assert kv_cache_groups([0] * 3) == [KVGroup(0, (0, 1, 2))]  # no window: one group, a slot per layer
    assert layer_places([0] * 3) == [(0, 0), (0, 1), (0, 2)]
    assert kv_cache_groups([W] * 3) == [KVGroup(W, (0, 1, 2))]  # Mistral: one sliding group
    assert layer_places([W, 0, W, 0]) == [(1, 0), (0, 0), (1, 1), (0, 1)]


def test_a_long_sequence_holds_a_window_in_the_sliding_group():
    kv = KVCacheManager(num_blocks=200, block_size=BS, windows=[0, W])
    seq = seq_of(range(1, 9))
    kv.reuse_prefix(seq)
    for length in range(1, 301):
        decode_to(kv, seq, length)
        full, sliding = seq.block_table, seq.group_tables[0]
        assert len(full) == len(sliding) == -(-length // BS) and kv.null_block not in full
        live = [i for i, b in enumerate(sliding) if b != kv.null_block]
        assert len(live) <= BOUND
        # every key a query at the next position sees is still live
        nxt = seq.num_computed
        assert all(sliding[k // BS] != kv.null_block for k in range(max(0, nxt - W + 1), nxt))
        # what was dropped went back: the pool holds exactly the live blocks and the null block
        assert kv.pool.num_used == len(full) + len(live) + 1
        assert (kv.tables.gather([seq])[:, 0, : len(full)].tolist() == [full, sliding])
    kv.free(seq)
    assert kv.pool.num_free == 200 - 1


def test_allocate_counts_blocks_in_every_group():
    kv = KVCacheManager(num_blocks=7, block_size=BS, windows=[0, W])  # 6 usable beside the null block
    a = seq_of(range(1, 13))
    assert kv.allocate(a, 12)  # 3 blocks in each group
    assert kv.pool.num_free == 0 and not kv.allocate(seq_of(range(1, 5)), 4)
    a.num_computed = 12
    assert not kv.allocate(a, 13)  # a fourth in each: 2 blocks, but the window frees one only
    assert a.num_computed == 12 and len(a.block_table) == 3


def test_a_sliding_only_model_fits_any_length_in_a_window():
    kv = KVCacheManager(num_blocks=BOUND + 1, block_size=BS, windows=[W])  # Mistral: one sliding group
    seq = seq_of([1])
    kv.reuse_prefix(seq)
    decode_to(kv, seq, 500)
    assert kv.max_tokens() is None and len(seq.block_table) == 125


def test_prefix_hits_need_the_window_only_and_every_group():
    kv = KVCacheManager(num_blocks=60, block_size=BS, windows=[0, W])
    tokens = [random.Random(0).randrange(1, 50) for _ in range(40)]
    first = seq_of(tokens)
    kv.reuse_prefix(first)
    decode_to(kv, first, 40)
    full, sliding = list(first.block_table), list(first.group_tables[0])
    second = seq_of(tokens[:36] + [99, 98, 97])
    kv.reuse_prefix(second)
    assert second.num_computed == 36
    assert second.block_table == full[:9]  # shared with the first, which still runs
    start = (36 - W + 1) // BS  # the window's blocks before position 36; the first dropped those before 40 - W + 1
    window = second.group_tables[0][start:]
    assert second.group_tables[0][:start] == [kv.null_block] * start and kv.null_block not in window
    assert [kv.pool.block_hash[b] for b in window] == [group_key(h, 1) for h in first.block_hashes[start:9]]
    assert all(kv.pool.ref_count[b] == 2 for b in full[:9] + sliding[start:9] if b != kv.null_block)
    kv.free(first)
    kv.free(second)
    assert kv.pool.num_free == 59
    # The window's blocks evicted (taken by others): the hit falls back to where the sliding
    # group still holds a window, or nothing.
    filler = seq_of(range(1000, 1000 + 4 * 25))
    kv.reuse_prefix(filler)
    assert kv.allocate(filler, len(filler.token_ids))  # 25 blocks a group: the least recently freed 50
    third = seq_of(tokens[:36] + [7])
    kv.reuse_prefix(third)
    n = third.num_computed // BS
    window = third.group_tables[0][(third.num_computed - W + 1) // BS if third.num_computed >= W else 0 : n]
    assert all(kv.pool.block_hash[b] is not None for b in third.block_table + window)
    assert n < 9  # the first's window blocks were freed first, so reused first
    kv.free(third)
    kv.free(filler)
    assert kv.pool.num_free == 59


def test_fork_copies_the_partial_block_in_each_group_and_frees_clean():
    kv = KVCacheManager(num_blocks=40, block_size=BS, windows=[0, W])
    parent = seq_of(range(1, 31), n=2)
    kv.reuse_prefix(parent)
    assert kv.allocate(parent, 30)
    parent.num_computed = 30
    kv.cache_full_blocks([parent])
    assert kv.allocate(parent, 31)  # its first decode: the window moved on
    child = seq_of(range(1, 31))
    assert kv.can_fork(parent)
    copies = kv.fork(parent, child)
    assert copies == [(parent.block_table[7], child.block_table[7]), (parent.group_tables[0][7], child.group_tables[0][7])]
    assert child.group_tables[0][:7] == parent.group_tables[0][:7] and child.num_computed == 30
    decode_to(kv, child, 60)
    decode_to(kv, parent, 60)
    assert held(kv, [parent, child]) == kv.pool.num_used - 1
    kv.free(parent)
    kv.free(child)
    assert kv.pool.num_free == 39


def test_tables_mirror_every_group_through_random_use():
    rng = random.Random(1)
    kv = KVCacheManager(num_blocks=300, block_size=BS, windows=[0, W, 2 * W])
    kv.tables = BlockTables(rows=2, width=2, num_groups=3)
    seqs = []
    for _ in range(400):
        live = [s for s in seqs if s.block_table]
        op = rng.random()
        if op < 0.3 or not live:
            s = seq_of([rng.randrange(1, 4) for _ in range(rng.randrange(1, 30))], n=2)
            kv.reuse_prefix(s)
            if kv.allocate(s, len(s.token_ids)):
                s.num_computed = len(s.token_ids)
                kv.cache_full_blocks([s])
                seqs.append(s)
            else:
                kv.free(s)
        elif op < 0.75:
            s = rng.choice(live)
            s.token_ids += [rng.randrange(1, 4) for _ in range(rng.randrange(1, 30))]
            if kv.allocate(s, len(s.token_ids)):
                s.num_computed = len(s.token_ids)
                kv.cache_full_blocks([s])
        elif op < 0.85:
            parent = rng.choice(live)
            child = seq_of(parent.token_ids[: parent.num_prompt_tokens])
            if parent.num_computed == parent.num_prompt_tokens and kv.can_fork(parent):
                kv.fork(parent, child)
                seqs.append(child)
        else:
            kv.free(rng.choice(live))
        live = [s for s in seqs if s.block_table]
        for s in live:
            assert kv.tables.table[:, s.kv_row, : len(s.block_table)].tolist() == [s.block_table, *s.group_tables]
        # every block is held by exactly its owners' count, and free ones by nobody
        owners = {}
        for s in live:
            for t in (s.block_table, *s.group_tables):
                for b in t:
                    owners[b] = owners.get(b, 0) + 1
        owners.pop(kv.null_block, None)
        assert all(kv.pool.ref_count[b] == c for b, c in owners.items())
        assert kv.pool.num_used == len(owners) + 1
