"""The KV-cache manager owns block tables: grow, prefix reuse and registration, fork, free."""

from shoal.runtime.cache.block_tables import BlockTables
from shoal.runtime.cache.kv_cache_manager import KVCacheManager
from shoal.runtime.engine.request import Request
from shoal.runtime.sampling_params import SamplingParams


def seq_of(ids, n=1):
    return Request("r", None, list(ids), SamplingParams(n=n)).seqs[0]


def test_allocate_takes_nothing_when_it_cannot_hold():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a, b = seq_of(range(1, 11)), seq_of(range(1, 11))
    assert kv.allocate(a, 10) and len(a.block_table) == 3
    assert not kv.allocate(b, 10) and b.block_table == [] and kv.pool.num_free == 1
    assert kv.allocate(a, 12) and len(a.block_table) == 3  # still fits the third block
    kv.free(a)
    assert kv.pool.num_free == 4 and a.block_table == [] and a.num_computed == 0


def test_prefix_blocks_are_found_once_registered_and_counted():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    first = seq_of(range(1, 11))
    kv.reuse_prefix(first)
    assert first.num_computed == 0 and kv.allocate(first, 10)
    first.num_computed = 10
    kv.cache_full_blocks([first])
    assert first.num_registered == 2
    second = seq_of(list(range(1, 9)) + [99, 98, 97])
    kv.reuse_prefix(second)
    assert second.block_table == first.block_table[:2] and second.num_computed == 8
    assert (kv.prefix_queries, kv.prefix_hits) == (21, 8)
    # the whole prompt cached still leaves one token to compute
    third = seq_of(range(1, 9))
    kv.reuse_prefix(third)
    assert third.num_computed == 4


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    parent = seq_of(range(1, 7), n=2)
    assert kv.allocate(parent, 6)
    parent.num_computed = 6
    child = Request("c", None, list(range(1, 7)), SamplingParams()).seqs[0]
    assert kv.can_fork(parent)
    [(src, dst)] = kv.fork(parent, child)
    assert child.block_table[0] == parent.block_table[0] and kv.pool.ref_count[parent.block_table[0]] == 2
    assert (src, dst) == (parent.block_table[1], child.block_table[1]) and src != dst
    assert child.num_computed == 6
    kv.free(parent)
    kv.free(child)
    assert kv.pool.num_free == 8


def test_no_fork_without_a_block_for_the_partial_one():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    parent = seq_of(range(1, 7), n=2)
    assert kv.allocate(parent, 6) and not kv.can_fork(parent)
    whole = seq_of(range(1, 9), n=2)
    kv.free(parent)
    assert kv.allocate(whole, 8) and kv.can_fork(whole)  # no partial block: nothing to copy
    assert kv.fork(whole, seq_of(range(1, 9))) == []


def _assert_mirrored(kv, seqs):
    """Each sequence holding blocks has a row equal to its list, zero-padded; free rows are all zero."""
    t = kv.tables
    held = {s.kv_row for s in seqs if s.block_table}
    assert len(held) == sum(1 for s in seqs if s.block_table)  # no two share a row
    for s in seqs:
        if s.block_table:
            assert t.table[0, s.kv_row, : len(s.block_table)].tolist() == s.block_table
            assert not t.table[0, s.kv_row, len(s.block_table) :].any()
        else:
            assert s.kv_row is None
    for row in set(range(len(t.lengths))) - held:
        assert not t.table[:, row].any() and t.lengths[row] == 0


def test_block_tables_mirror_every_change_and_gather_pads_with_zero():
    import random

    rng = random.Random(0)
    kv = KVCacheManager(num_blocks=400, block_size=4)
    kv.tables = BlockTables(rows=4, width=4)  # small, so that both dimensions grow
    seqs = []
    for step in range(600):
        op = rng.random()
        live = [s for s in seqs if s.block_table]
        if op < 0.35 or not live:  # a new sequence, maybe on cached blocks
            s = seq_of([rng.randrange(1, 5) for _ in range(rng.randrange(1, 40))], n=2)
            kv.reuse_prefix(s)
            if kv.allocate(s, len(s.token_ids)):
                s.num_computed = len(s.token_ids)
                kv.cache_full_blocks([s])
                seqs.append(s)
            else:
                kv.free(s)
        elif op < 0.75:  # grow one by many tokens
            s = rng.choice(live)
            s.token_ids += [rng.randrange(1, 5) for _ in range(rng.randrange(1, 90))]
            if kv.allocate(s, len(s.token_ids)):
                s.num_computed = len(s.token_ids)
                kv.cache_full_blocks([s])
        elif op < 0.85:
            parent = rng.choice(live)
            child = seq_of(parent.token_ids[: parent.num_prompt_tokens])
            if kv.can_fork(parent):
                kv.fork(parent, child)
                seqs.append(child)
        else:
            kv.free(rng.choice(live))
        _assert_mirrored(kv, seqs)
    live = [s for s in seqs if s.block_table]
    assert len(kv.tables.lengths) > 4 and kv.tables.table.shape[2] > 4
    gathered = kv.tables.gather(live)
    width = max(len(s.block_table) for s in live)
    assert gathered.shape == (len(live), width)
    assert gathered.tolist() == [s.block_table + [0] * (width - len(s.block_table)) for s in live]
