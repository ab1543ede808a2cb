"""The paged KV cache's bookkeeping: blocks, reference counts, prefix hashes, LRU eviction.

A block holds `block_size` tokens' keys and values in every layer. A full block can be
shared: its hash covers its tokens and, through the parent hash, every token before it,
so two sequences with the same prefix map to the same blocks. Blocks nobody references
stay cached (and findable) on the free list until they are the least recently freed and
an allocation needs them.

The hash is a fixed function of the token ids, the same in every process and on every
machine, so a router (runtime/router/) computes from a prompt the very hashes the
servers' pools hold (docs/router.md, "Block hashes"):

    hash_block(parent, tokens) = first 8 bytes, little-endian, of
        SHA-256(parent as 8 bytes little-endian || each token id as 4 bytes little-endian)
        with the top bit cleared (an int64 for any client),   parent of the first block = ROOT_HASH

(Python's hash() would not do: hash(None) is the object's address, a different root in
each process.) Every change to the set of findable hashes goes to `events`
(block_events.py), which `GET /kv/blocks` serves.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict

from shoal.runtime.cache.block_events import BlockEvents

ROOT_HASH = 0  # the parent of a sequence's first block
_MASK = (1 << 63) - 1


def hash_block(parent: int | None, tokens) -> int:
    data = struct.pack(f"<Q{len(tokens)}I", ROOT_HASH if parent is None else parent, *tokens)
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little") & _MASK


def block_hashes(token_ids, block_size: int, known: list[int] | None = None, root: int | None = None) -> list[int]:
    """Chained hashes of every full block of token_ids, extending `known` (a prefix of them).
    `root`: the first block's parent (a LoRA adapter's salt), None: ROOT_HASH."""
    hashes = list(known or [])
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        hashes.append(hash_block(hashes[-1] if hashes else root, token_ids[start : start + block_size]))
    return hashes


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError("the KV cache has room for no block: raise --kv-cache-memory")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # LRU first
        self.cached: dict[int, int] = {}  # hash -> block id
        self.events = BlockEvents()  # what became findable or was forgotten, for routers

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise MemoryError(f"asked for {n} KV blocks, {len(self.free)} free")
        out = []
        for _ in range(n):
            block, _ = self.free.popitem(last=False)  # least recently freed
            self._forget(block)
            self.ref_count[block] = 1
            out.append(block)
        return out

    def release(self, blocks) -> None:
        # Tail blocks first, so a sequence's end is evicted before its (more shareable) start.
        for block in reversed(blocks):
            self.ref_count[block] -= 1
            assert self.ref_count[block] >= 0, f"block {block} released twice"
            if self.ref_count[block] == 0:
                self.free[block] = None

    def share(self, blocks) -> None:
        """Another owner for blocks already in use (n > 1 siblings)."""
        for block in blocks:
            self.ref_count[block] += 1

    def lookup(self, hashes: list[int]) -> list[int]:
        """The longest run of cached blocks for a hash chain, each taken (ref +1)."""
        if not self.enable_prefix_caching:
            return []
        found = []
        for h in hashes:
            block = self.cached.get(h)
            if block is None:
                break
            found.append(block)
        self.take(found)
        return found

    def take(self, blocks) -> None:
        """Another owner for cached blocks, in use or on the free list."""
        for block in blocks:
            if self.ref_count[block] == 0:
                del self.free[block]
            self.ref_count[block] += 1

    def register(self, block: int, h: int) -> None:
        """A block just became full: make it findable by its hash (first writer wins)."""
        if self.enable_prefix_caching and self.block_hash[block] is None and h not in self.cached:
            with self.events.lock:
                self.block_hash[block] = h
                self.cached[h] = block
                self.events.add(h, True)

    def _forget(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            self.block_hash[block] = None
            if self.cached.get(h) == block:
                with self.events.lock:
                    del self.cached[h]
                    self.events.add(h, False)

    def changes_since(self, seq: int, epoch: str | None) -> dict:
        """The findable hashes stored and removed since event `seq` (GET /kv/blocks); any thread."""
        return self.events.since(seq, epoch, self.cached)

    def reset_prefix_cache(self) -> None:
        for block in list(self.free):
            self._forget(block)
