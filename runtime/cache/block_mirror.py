"""The API process's copy of the engine-core process's prefix-cache index: the core sends
its pool's changes (block_events.py) with each step, this applies them and answers readers
(the router's GET /kv/blocks) as the pool itself would, with its own epoch and numbering."""

from __future__ import annotations

from shoal.runtime.cache.block_events import BlockEvents


class BlockMirror:
    def __init__(self, enable_prefix_caching: bool, num_blocks: int | None = None):
        self.enable_prefix_caching = enable_prefix_caching
        self.num_blocks = num_blocks
        self.cached: dict[int, None] = {}  # the findable hashes
        self.events = BlockEvents()

    def apply(self, changes: dict) -> None:
        """Apply one changes_since() answer of the core's pool."""
        stored = changes["stored"]
        with self.events.lock:
            if changes["reset"]:  # the core's whole set: what is not in it was removed
                keep = set(stored)
                for h in [h for h in self.cached if h not in keep]:
                    del self.cached[h]
                    self.events.add(h, False)
                removed = ()
            else:
                removed = changes["removed"]
            for h in stored:
                if h not in self.cached:
                    self.cached[h] = None
                    self.events.add(h, True)
            for h in removed:
                if self.cached.pop(h, 0) is None:
                    self.events.add(h, False)

    def changes_since(self, seq: int, epoch: str | None) -> dict:
        return self.events.since(seq, epoch, self.cached)
