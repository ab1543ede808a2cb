"""The KV-cache manager owns block tables: grow, prefix reuse and registration, fork, free."""

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
    kv.cache_full_blocks(first)
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
    src, dst = kv.fork(parent, child)
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
    assert kv.fork(whole, seq_of(range(1, 9))) is None
