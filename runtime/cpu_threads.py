"""How many threads a CPU process runs: the CPUs it may use, not the node's cores.

os.cpu_count() counts the node. A pod with `limits.cpu: 2` on a 64-core node may still see
64 cores, and 64 threads under a 2-CPU quota spend most of each period throttled; a process
pinned with taskset (or a Guaranteed pod under the static CPU manager) has an affinity mask.
The count is the smaller of the affinity mask and the cgroup CPU quota (v2 `cpu.max`, v1
`cpu.cfs_quota_us / cpu.cfs_period_us`, the tightest along the cgroup's path), rounded
down; `--num-threads` or SHOAL_NUM_THREADS override it. torch, OpenMP and the C decode step
all take this count.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

log = logging.getLogger(__name__)

CGROUP_ROOT = "/sys/fs/cgroup"


def affinity_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _own_cgroups(proc_cgroup: str) -> dict[str, str]:
    """/proc/self/cgroup → {controller: path}; cgroup v2's single line has controller ''."""
    out = {}
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(","):
                out[controller] = parts[2]
    return out


def _up_the_path(base: Path, path: str) -> list[Path]:
    """base/path, its parents up to base. Inside a container the cgroup filesystem is usually
    mounted at the process's own cgroup, so /proc/self/cgroup's path may not exist under it:
    then base itself is the cgroup."""
    folders = []
    here = base / path.lstrip("/")
    while True:
        if here.is_dir():
            folders.append(here)
        if here == base or base not in here.parents:
            break
        here = here.parent
    return folders or [base]


def _quota_v2(folder: Path) -> float | None:
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _quota_v1(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


def cgroup_cpu_quota(root: str = CGROUP_ROOT, proc_cgroup: str = "/proc/self/cgroup") -> float | None:
    """CPUs per period the cgroup allows this process (e.g. 1.5), or None without a quota."""
    base = Path(root)
    groups = _own_cgroups(proc_cgroup)
    quotas = []
    if (base / "cgroup.controllers").exists():  # v2: one unified hierarchy
        quotas = [_quota_v2(f) for f in _up_the_path(base, groups.get("", "/"))]
    else:  # v1: the cpu controller's own hierarchy
        for name in ("cpu,cpuacct", "cpu", "cpuacct,cpu"):
            if (base / name).is_dir():
                quotas = [_quota_v1(f) for f in _up_the_path(base / name, groups.get("cpu", "/"))]
                break
    quotas = [q for q in quotas if q is not None]
    return min(quotas) if quotas else None


def usable_cpus(root: str = CGROUP_ROOT, proc_cgroup: str = "/proc/self/cgroup") -> int:
    """The smaller of the affinity mask and the cgroup quota (rounded down), at least 1."""
    n = affinity_cpus()
    quota = cgroup_cpu_quota(root, proc_cgroup)
    if quota is not None:
        n = min(n, max(1, math.floor(quota)))
    return max(1, n)


def num_threads(requested: int | None = None, processes: int = 1) -> int:
    """Threads for each of `processes` ranks on this machine: `requested` (--num-threads),
    else SHOAL_NUM_THREADS, else the usable CPUs shared among the processes."""
    if requested:
        return max(1, int(requested))
    if os.environ.get("SHOAL_NUM_THREADS"):
        return max(1, int(os.environ["SHOAL_NUM_THREADS"]))
    return max(1, usable_cpus() // max(1, processes))


def set_threads(n: int) -> int:
    """torch's intra-op pool and OpenMP (the C decode step, child processes) run `n` threads."""
    import torch

    torch.set_num_threads(n)
    os.environ["OMP_NUM_THREADS"] = str(n)
    quota = cgroup_cpu_quota()
    log.info("CPU threads: %d (affinity %d CPUs, cgroup quota %s, node %s cores)", n, affinity_cpus(),
             "none" if quota is None else f"{quota:g} CPUs", os.cpu_count())
    return n
