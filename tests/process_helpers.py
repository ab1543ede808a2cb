"""Whether the processes a test started are still running (Linux /proc), for the tests that
kill or end process groups."""

from __future__ import annotations

import os
import time


def alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie does not: it has exited and waits to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def children_of(pid: int) -> list[int]:
    """The processes `pid` started, from any of its threads."""
    found = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(c) for c in f.read().split()]
    except FileNotFoundError:
        pass
    return found


def all_gone(pids, timeout: float) -> bool:
    """Whether every pid has exited within `timeout` s."""
    deadline = time.monotonic() + timeout
    while any(alive(pid) for pid in pids):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)
    return True
