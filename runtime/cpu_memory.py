"""How CPU serving uses memory: glibc keeps freed activations, and the KV pool sits in huge pages."""

from __future__ import annotations

import ctypes
import mmap

import torch

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


def release_freed_heap() -> None:
    """Give the heap's free pages back to the kernel (glibc's malloc_trim), once the model is
    loaded and warmed up. The loader's temporaries (tensors read, converted and packed, then
    dropped) stay in the heap under keep_freed_heap_memory's threshold: on the built-in model
    ~400 MB of a 2 GB process. Steps re-fault what they use once, then keep it."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


HUGE_PAGE = 2 * 2**20


def huge_page_zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed 1-D tensor in fresh memory backed by transparent huge pages where the kernel
    allows (THP "madvise" mode; elsewhere plain pages), all of it touched now. Scattered reads
    over a large buffer (a decode step's KV blocks) otherwise miss the TLB on every 4 KiB page,
    and pages first touched mid-step fault there (a prefill's cache writes ran 15x slower)."""
    nbytes = numel * dtype.itemsize
    # private anonymous memory (mmap's default for -1 is shared memory, which THP skips),
    # a huge page longer so that the tensor can start on a huge-page boundary
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = -ctypes.addressof(ctypes.c_char.from_buffer(buf)) % HUGE_PAGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE, start, nbytes)  # before the first touch
    tensor = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=start).view(dtype)  # keeps buf alive
    return tensor.zero_()
