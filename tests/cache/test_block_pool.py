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


# -- the hash is a fixed function (a router computes it too) --------------------------------
def _reference_hash(parent: int, tokens) -> int:
    """docs/router.md's definition, written out independently."""
    import hashlib

    data = parent.to_bytes(8, "little") + b"".join(t.to_bytes(4, "little") for t in tokens)
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little") & (2**63 - 1)


def test_block_hash_is_the_documented_function_and_the_same_in_another_process():
    import subprocess
    import sys

    from shoal.runtime.cache.block_pool import ROOT_HASH

    tokens = list(range(5, 53))
    expect, parent = [], ROOT_HASH
    for i in range(3):
        parent = _reference_hash(parent, tokens[16 * i : 16 * i + 16])
        expect.append(parent)
    assert block_hashes(tokens + [7], 16) == expect
    code = "from shoal.runtime.cache.block_pool import block_hashes; print(block_hashes(list(range(5, 53)), 16))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": "123"}).stdout
    assert eval(out) == expect


# -- the event log behind GET /kv/blocks ----------------------------------------------------
def _apply(view: set, reply: dict) -> set:
    if reply["reset"]:
        view = set()
    return (view | set(reply["stored"])) - set(reply["removed"])


def test_changes_since_follow_register_and_eviction():
    pool = BlockPool(2)
    first = pool.changes_since(0, None)
    assert first["reset"] and first["stored"] == [] and first["seq"] == 0
    epoch, view = first["epoch"], set()
    a, b, c = (block_hashes(list(range(s, s + 16)), 16)[0] for s in (0, 100, 200))
    x, y = pool.allocate(2)
    pool.register(x, a)
    pool.register(y, b)
    pool.register(y, c)  # the block already has a hash: nothing changes
    r = pool.changes_since(0, epoch)
    assert not r["reset"] and sorted(r["stored"]) == sorted([a, b]) and r["removed"] == [] and r["seq"] == 2
    view = _apply(view, r)
    pool.release([x, y])
    [z] = pool.allocate(1)  # y is evicted (a table's tail is freed first): b is forgotten
    pool.register(z, c)
    r = pool.changes_since(2, epoch)
    assert r["stored"] == [c] and r["removed"] == [b]
    view = _apply(view, r)
    assert view == set(pool.cached) == {a, c}
    assert pool.changes_since(r["seq"], epoch)["stored"] == []


def test_changes_since_resets_on_another_epoch_or_a_dropped_log():
    from shoal.runtime.cache.block_events import BlockEvents

    pool = BlockPool(4)
    pool.events = BlockEvents(capacity=3)
    epoch = pool.events.epoch
    hashes = block_hashes(list(range(64)), 16)
    blocks = pool.allocate(4)
    for blk, h in zip(blocks, hashes):
        pool.register(blk, h)
    assert pool.events.seq == 4
    r = pool.changes_since(0, epoch)  # event 1 was dropped
    assert r["reset"] and sorted(r["stored"]) == sorted(hashes)
    r = pool.changes_since(1, epoch)  # events 2..4 are all kept
    assert not r["reset"] and r["stored"] == hashes[1:]
    assert pool.changes_since(4, "another")["reset"]
    assert pool.changes_since(9, epoch)["reset"]  # a reader ahead of the log: another life of the server
    pool.release(blocks)
    pool.reset_prefix_cache()
    r = pool.changes_since(4, epoch)
    assert r["reset"] and r["stored"] == []  # four removals overflowed the 3-event log
