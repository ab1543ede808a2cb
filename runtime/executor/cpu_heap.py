"""glibc's heap policy for CPU serving: keep freed activations instead of remapping them."""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h


def keep_freed_heap_memory(limit: int = 1 << 30) -> None:
    """Serve CPU tensors under `limit` bytes from glibc's heap, and keep what they free there.

    By default glibc maps each large block fresh from the kernel and trims the heap on free,
    so every step's activations (megabytes per op) page-fault and get zeroed anew: on the
    public workload's prefill that was ~10^6 faults and ~20% of the time. Steps reuse the
    same sizes, so the heap settles at the peak working set."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(M_MMAP_THRESHOLD, limit)
        libc.mallopt(M_TRIM_THRESHOLD, limit)
    except (OSError, AttributeError):  # not glibc: its allocator has its own policy
        pass
