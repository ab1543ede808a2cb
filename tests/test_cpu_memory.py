"""The KV pool's memory on CPU: zeroed, huge-page aligned, and backed by huge pages where
the kernel offers them (what the decode step's scattered block reads rely on)."""

import gc
from pathlib import Path

import pytest
import torch

from shoal.runtime.cpu_memory import HUGE_PAGE, huge_page_zeros


def _mapping_stats(address: int) -> dict[str, str]:
    """/proc/self/smaps fields of the mapping that holds `address`."""
    fields, inside = {}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def test_huge_page_zeros_is_zeroed_aligned_and_outlives_its_buffer():
    t = huge_page_zeros(3 * HUGE_PAGE // 4 + 5, torch.float32)
    gc.collect()
    assert t.dtype == torch.float32 and t.numel() == 3 * HUGE_PAGE // 4 + 5
    assert t.data_ptr() % HUGE_PAGE == 0
    assert not t.any()
    t.fill_(2.5)
    assert float(t.sum()) == 2.5 * t.numel()


def test_huge_page_zeros_gets_huge_pages_where_the_kernel_offers_them():
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[never]" in mode.read_text():
        pytest.skip("transparent huge pages are off on this kernel")
    t = huge_page_zeros(64 * HUGE_PAGE // 4, torch.float32)
    huge_kb = int(_mapping_stats(t.data_ptr())["AnonHugePages"].split()[0])
    assert huge_kb >= 32 * HUGE_PAGE // 1024  # most of its 64 huge pages (the kernel may split a few)


def test_release_freed_heap_returns_what_the_loader_freed():
    """Under keep_freed_heap_memory freed tensors stay in glibc's heap (the steps reuse them);
    release_freed_heap, called once the model is loaded, gives the loader's back to the kernel.
    In a fresh process, so the allocator's state is this test's alone."""
    import subprocess
    import sys

    script = """
import torch
from pathlib import Path
from shoal.runtime.cpu_memory import keep_freed_heap_memory, release_freed_heap

def anonymous_kib():
    line = next(l for l in Path("/proc/self/smaps_rollup").read_text().splitlines() if l.startswith("Anonymous:"))
    return int(line.split()[1])

keep_freed_heap_memory()
temporaries = [torch.ones(2**20) for _ in range(48)]  # 48 x 4 MiB, touched
keep = torch.ones(16)  # allocated after them: the heap cannot just shrink from its top
del temporaries
held = anonymous_kib()
release_freed_heap()
print(held - anonymous_kib())
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    released_mib = int(out.stdout.strip().splitlines()[-1]) / 1024
    assert released_mib > 150, out.stdout  # of the 192 MiB freed
