"""The block pool's reference counts, prefix hashing and LRU eviction."""

from shoal.runtime.cache.block_pool import BlockPool, block_hashes


def test_prefix_hits_share_blocks_and_count_references():
    pool = BlockPool(8)
    tokens = list(range(40))
    hashes = block_hashes(tokens, 16)
    assert len(hashes) == 2
    blocks = pool.allocate(3)
    for b, h in zip(blocks, hashes):
        pool.register(b, h)
    hits = pool.lookup(hashes)
    assert hits == blocks[:2] and [pool.ref_count[b] for b in blocks] == [2, 2, 1]
    # same tokens after a different first block: a different chain, no hit
    assert pool.lookup(block_hashes([99] + tokens[1:], 16)) == []


def test_freed_cached_blocks_stay_findable_until_evicted_lru():
    pool = BlockPool(3)
    a = block_hashes(list(range(16)), 16)
    b = block_hashes(list(range(100, 116)), 16)
    [x] = pool.allocate(1)
    pool.register(x, a[0])
    [y] = pool.allocate(1)
    pool.register(y, b[0])
    pool.release([x])
    pool.release([y])
    assert pool.num_free == 3
    assert pool.lookup(a) == [x]  # revived from the free list
    pool.release([x])
    # the never-used block goes first, then y (freed before x's second release)
    first, second = pool.allocate(2)
    assert second == y and pool.lookup(b) == [] and pool.lookup(a) == [x]


def test_chained_hashes_extend_a_known_prefix():
    tokens = list(range(50))
    assert block_hashes(tokens, 16, block_hashes(tokens[:20], 16)) == block_hashes(tokens, 16)
