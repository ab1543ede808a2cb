"""KVCacheManager: every sequence's block table, kept by one owner (vLLM V1's KV-cache
manager, nano-vllm's block manager).

The scheduler asks it yes/no questions ("can this sequence hold N more tokens?") and
never sees a block id; the engine asks it to fork a sequence for n > 1. Block tables
live on the sequences, mirrored row by row in `tables` (block_tables.py), which a step's
inputs gather; only this file writes either.

A model with sliding-window layers has several KV-cache groups (models/kv_groups.py), each
with its own table per sequence (seq.block_table is the first's, seq.group_tables the
others'), all of one length and grown together. In a sliding group, the blocks every query
from now on is past (wholly before num_computed - window + 1) become the null block and go
back to the pool at each allocate: a sequence holds about a window of them, however long it
grows. A prefix hit is taken only for what every group holds: the full groups the whole
prefix, a sliding group the blocks of the window before the hit's end (vLLM's
find_longest_cache_hit). Groups after the first key their blocks' hashes by the group.
"""

from __future__ import annotations

from shoal.runtime.cache.block_pool import BlockPool, block_hashes, hash_block
from shoal.runtime.cache.block_tables import BlockTables


def group_key(h: int, group: int) -> int:
    """A block's prefix-cache key in a group: the first group's is the block hash itself
    (what routers compute), the others' that hash chained with the group's number."""
    return h if group == 0 else hash_block(h, (group,))


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 windows: list[int] | None = None):
        """windows: each KV-cache group's sliding window (0: full attention); None: one full group."""
        self.windows = list(windows or [0])
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.block_size = block_size
        self.tables = BlockTables(num_groups=len(self.windows))
        self.sliding = [g for g, w in enumerate(self.windows) if w]
        # what a sliding group's dropped entries point at: taken once, never written, never freed
        self.null_block = self.pool.allocate(1)[0] if self.sliding else None
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found

    def usage(self) -> float:
        return self.pool.usage()

    def max_tokens(self) -> int | None:
        """The longest sequence the pool can hold alone (None: no bound, every group slides).
        A sliding group holds at most a window of blocks plus the one being filled (a prefill
        chunk may take more for a step)."""
        full = len(self.windows) - len(self.sliding)
        if not full:
            return None
        bs = self.block_size
        left = self.pool.num_blocks - (1 if self.sliding else 0) - sum(-(-self.windows[g] // bs) + 1 for g in self.sliding)
        return max(0, left) // full * bs

    def _tables(self, seq) -> list[list[int]]:
        return [seq.block_table, *seq.group_tables]

    def allocate(self, seq, num_tokens: int) -> bool:
        """Grow the sequence's tables to hold `num_tokens` tokens; False (nothing taken) if it cannot.
        Sliding groups first give back what fell out of their windows."""
        if self.sliding and seq.block_table:
            self._drop(seq)
        need = -(-num_tokens // self.block_size) - len(seq.block_table)
        if need <= 0:  # most decode steps: the last block has room
            return True
        groups = len(self.windows)
        if need * groups > self.pool.num_free:
            return False
        start = len(seq.block_table)
        seq.block_table += self.pool.allocate(need)
        if groups > 1:
            if not seq.group_tables:
                seq.group_tables = [[] for _ in range(groups - 1)]
            for table in seq.group_tables:
                table += self.pool.allocate(need)
        self.tables.write(seq, start)
        return True

    def _drop(self, seq) -> None:
        """Turn the sliding groups' blocks wholly before num_computed - window + 1 (a query at p
        sees keys p - window < k <= p) into the null block, and give them back."""
        if not seq.num_dropped:
            seq.num_dropped = [0] * len(self.windows)
        tables = self._tables(seq)
        for g in self.sliding:
            table, start = tables[g], seq.num_dropped[g]
            dead = min(max(0, seq.num_computed - self.windows[g] + 1) // self.block_size, len(table))
            if dead > start:
                self.pool.release([b for b in table[start:dead] if b != self.null_block])
                table[start:dead] = [self.null_block] * (dead - start)
                self.tables.drop(seq, g, start, dead, self.null_block)
                seq.num_dropped[g] = dead

    def _window_start(self, group: int, num_blocks: int) -> int:
        """The first block a sliding group needs once `num_blocks` blocks are computed."""
        return max(0, num_blocks * self.block_size - self.windows[group] + 1) // self.block_size

    def _longest_hit(self, usable: list[int]) -> int:
        """How many leading blocks every group holds: a full group all of them, a sliding group
        those of the window before the end. Shrunk until every group agrees."""
        cached = self.pool.cached
        keys = [usable] + [[group_key(h, g) for h in usable] for g in range(1, len(self.windows))]
        n, agreed = len(usable), False
        while not agreed:
            agreed = True
            for g, window in enumerate(self.windows):
                if window == 0:
                    held = next((i for i, k in enumerate(keys[g][:n]) if k not in cached), n)
                else:
                    held = next((m for m in range(n, 0, -1)
                                 if all(k in cached for k in keys[g][self._window_start(g, m) : m])), 0)
                if held < n:
                    n, agreed = held, False
        return n

    def reuse_prefix(self, seq) -> None:
        """Start a sequence on the cached blocks of its longest cached prefix."""
        seq.block_hashes = block_hashes(seq.token_ids, self.block_size, seq.block_hashes, seq.request.cache_salt)
        # at least one token must be computed to have something to sample from
        usable = seq.block_hashes[: (len(seq.token_ids) - 1) // self.block_size]
        if len(self.windows) == 1 and not self.sliding:  # one full group: the plain lookup
            hits = self.pool.lookup(usable)
            seq.block_table = hits
        else:
            hits = usable[: self._longest_hit(usable)] if self.pool.enable_prefix_caching else []
            tables = []
            seq.num_dropped = [0] * len(self.windows)
            for g, window in enumerate(self.windows):
                first = self._window_start(g, len(hits)) if window else 0
                blocks = [self.pool.cached[group_key(h, g)] for h in hits[first:]]
                self.pool.take(blocks)
                tables.append([self.null_block] * first + blocks)
                seq.num_dropped[g] = first
            seq.block_table, seq.group_tables = tables[0], tables[1:]
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
                for g, table in enumerate(seq.group_tables, 1):
                    for b in range(seq.num_registered, full):
                        if table[b] != self.null_block:  # dropped before it was offered: not kept
                            self.pool.register(table[b], group_key(seq.block_hashes[b], g))
                seq.num_registered = full

    def free(self, seq) -> None:
        """Give back the sequence's blocks (they stay findable by hash until reused)."""
        for table in self._tables(seq):
            self.pool.release([b for b in table if b != self.null_block] if self.sliding else table)
        self.tables.release(seq)
        seq.block_table, seq.group_tables, seq.num_dropped = [], [], []
        seq.num_computed = 0
        seq.num_registered = 0

    def can_fork(self, parent) -> bool:
        """Whether a sibling can start on the parent's prompt blocks now."""
        return parent.num_prompt_tokens % self.block_size == 0 or self.pool.num_free >= len(self.windows)

    def fork(self, parent, child) -> list[tuple[int, int]]:
        """Let `child` start where `parent`'s prompt ends: share the prompt's full blocks and
        give it a fresh block for the partial last one, in every group. Returns the (src, dst)
        block copies the device must make. Ask can_fork first."""
        full, partial = divmod(parent.num_prompt_tokens, self.block_size)
        tables, copies = [], []
        for table in self._tables(parent):
            shared = table[:full]
            self.pool.share([b for b in shared if b != self.null_block] if self.sliding else shared)
            tables.append(shared + (self.pool.allocate(1) if partial else []))
            if partial:
                copies.append((table[full], tables[-1][-1]))
        child.block_table, child.group_tables = tables[0], tables[1:]
        child.num_dropped = [min(d, full) for d in parent.num_dropped]
        self.tables.write(child)
        child.block_hashes = parent.block_hashes[:full]
        child.num_registered = min(parent.num_registered, full)
        child.num_computed = parent.num_prompt_tokens
        return copies

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
        self.prefix_queries = self.prefix_hits = 0

    def fragmentation(self, seqs) -> tuple[int, int]:
        """(slots allocated to these sequences, slots of them holding no token)."""
        allocated = sum(len(s.block_table) for s in seqs) * self.block_size
        used = sum(min(len(s.token_ids), len(s.block_table) * self.block_size) for s in seqs)
        return allocated, allocated - used
