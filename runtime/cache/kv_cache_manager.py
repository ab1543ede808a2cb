"""KVCacheManager: every sequence's block table, kept by one owner (vLLM V1's KV-cache
manager, nano-vllm's block manager).

The scheduler asks it yes/no questions ("can this sequence hold N more tokens?") and
never sees a block id; the engine asks it to fork a sequence for n > 1. Block tables
live on the sequences, mirrored row by row in `tables` (block_tables.py), which a step's
inputs gather; only this file writes either.
"""

from __future__ import annotations

from shoal.runtime.cache.block_pool import BlockPool, block_hashes
from shoal.runtime.cache.block_tables import BlockTables


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.block_size = block_size
        self.tables = BlockTables()
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found

    def usage(self) -> float:
        return self.pool.usage()

    def allocate(self, seq, num_tokens: int) -> bool:
        """Grow the sequence's table to hold `num_tokens` tokens; False (nothing taken) if it cannot."""
        need = -(-num_tokens // self.block_size) - len(seq.block_table)
        if need <= 0:  # most decode steps: the last block has room
            return True
        if need > self.pool.num_free:
            return False
        start = len(seq.block_table)
        seq.block_table += self.pool.allocate(need)
        self.tables.write(seq, start)
        return True

    def reuse_prefix(self, seq) -> None:
        """Start a sequence on the cached blocks of its longest cached prefix."""
        seq.block_hashes = block_hashes(seq.token_ids, self.block_size, seq.block_hashes, seq.request.cache_salt)
        # at least one token must be computed to have something to sample from
        usable = seq.block_hashes[: (len(seq.token_ids) - 1) // self.block_size]
        hits = self.pool.lookup(usable)
        seq.block_table = hits
        if hits:
            self.tables.write(seq)
        seq.num_computed = len(hits) * self.block_size
        seq.num_registered = len(hits)
        if self.pool.enable_prefix_caching:
            self.prefix_queries += len(seq.token_ids)
            self.prefix_hits += seq.num_computed

    def cache_full_blocks(self, seqs) -> None:
        """Offer the sequences' newly filled blocks to the prefix cache (one call a step: at 256
        sequences a call each cost more than the check, which finds a new block once in block_size)."""
        if not self.pool.enable_prefix_caching:
            return
        size = self.block_size
        for seq in seqs:
            full = min(seq.num_computed, len(seq.token_ids)) // size  # hashes need the tokens, not only their KV
            if full > seq.num_registered:
                seq.block_hashes = block_hashes(seq.token_ids[: full * size], size, seq.block_hashes[:full], seq.request.cache_salt)
                for b in range(seq.num_registered, full):
                    self.pool.register(seq.block_table[b], seq.block_hashes[b])
                seq.num_registered = full

    def free(self, seq) -> None:
        """Give back the sequence's blocks (they stay findable by hash until reused)."""
        self.pool.release(seq.block_table)
        self.tables.release(seq)
        seq.block_table = []
        seq.num_computed = 0
        seq.num_registered = 0

    def can_fork(self, parent) -> bool:
        """Whether a sibling can start on the parent's prompt blocks now."""
        return parent.num_prompt_tokens % self.block_size == 0 or self.pool.num_free > 0

    def fork(self, parent, child) -> tuple[int, int] | None:
        """Let `child` start where `parent`'s prompt ends: share the prompt's full blocks and
        give it a fresh block for the partial last one. Returns the (src, dst) block copy
        the device must make, or None. Ask can_fork first."""
        full, partial = divmod(parent.num_prompt_tokens, self.block_size)
        shared = parent.block_table[:full]
        self.pool.share(shared)
        child.block_table = shared + (self.pool.allocate(1) if partial else [])
        self.tables.write(child)
        child.block_hashes = parent.block_hashes[:full]
        child.num_registered = min(parent.num_registered, full)
        child.num_computed = parent.num_prompt_tokens
        return (parent.block_table[full], child.block_table[-1]) if partial else None

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
        self.prefix_queries = self.prefix_hits = 0

    def fragmentation(self, seqs) -> tuple[int, int]:
        """(slots allocated to these sequences, slots of them holding no token)."""
        allocated = sum(len(s.block_table) for s in seqs) * self.block_size
        used = sum(min(len(s.token_ids), len(s.block_table) * self.block_size) for s in seqs)
        return allocated, allocated - used
