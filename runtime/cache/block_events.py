"""A bounded log of the prefix cache's changes: which block hashes became findable, which
were forgotten, numbered 1, 2, 3... (docs/router.md, "GET /kv/blocks").

The engine thread appends (under `lock`, together with the change to the pool's `cached`
map, so a snapshot and its sequence number always agree); the server's event loop reads.
A reader that is too far behind (the log dropped events it has not seen), or that saw
another epoch (another process, a restarted server), gets the whole set instead.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from collections import deque

DEFAULT_CAPACITY = 65536  # events kept: a reader polling every 0.2 s never falls this far behind


class BlockEvents:
    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        self.lock = threading.Lock()
        self.epoch = uuid.uuid4().hex[:16]  # one per pool: a new process is a new epoch
        self.seq = 0  # the number of the latest event
        self._log: deque[tuple[int, bool]] = deque(maxlen=capacity)  # (hash, stored?), oldest first

    def add(self, h: int, stored: bool) -> None:
        """Record one change; the caller holds `lock`."""
        self.seq += 1
        self._log.append((h, stored))

    def since(self, seq: int, epoch: str | None, cached: dict) -> dict:
        """{epoch, seq, reset, stored, removed}: the changes after event `seq` of `epoch`.

        Without a reset, applying `stored` then `removed` to the set a reader had at `seq`
        gives the set at the returned seq (each hash appears in one list: its last change)."""
        with self.lock:
            oldest = self.seq - len(self._log)  # the log holds events oldest+1 .. seq
            if epoch != self.epoch or not oldest <= seq <= self.seq:
                return {"epoch": self.epoch, "seq": self.seq, "reset": True, "stored": list(cached), "removed": []}
            last: dict[int, bool] = {}
            for h, stored in itertools.islice(self._log, seq - oldest, None):
                last[h] = stored
            head = self.seq
        return {"epoch": self.epoch, "seq": head, "reset": False,
                "stored": [h for h, s in last.items() if s], "removed": [h for h, s in last.items() if not s]}
