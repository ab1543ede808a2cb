"""The CPU thread count follows what the process may use: its affinity mask and its cgroup
CPU quota (v2 cpu.max, v1 cfs quota, the tightest along the path), not the node's cores."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from shoal.runtime import cpu_threads


def _tree(tmp_path, files: dict[str, str], own: str):
    for rel, text in files.items():
        path = tmp_path / "cg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (tmp_path / "proc_cgroup").write_text(own)
    return str(tmp_path / "cg"), str(tmp_path / "proc_cgroup")


def test_cgroup_v2_quota_is_the_tightest_along_the_path(tmp_path):
    root, proc = _tree(tmp_path, {
        "cgroup.controllers": "cpu memory\n",
        "kubepods/cpu.max": "max 100000\n",
        "kubepods/pod1/cpu.max": "250000 100000\n",  # 2.5 CPUs for the pod
        "kubepods/pod1/ctr/cpu.max": "300000 100000\n",  # the container's own is looser
    }, "0::/kubepods/pod1/ctr\n")
    assert cpu_threads.cgroup_cpu_quota(root, proc) == 2.5
    assert cpu_threads.usable_cpus(root, proc) == min(2, cpu_threads.affinity_cpus())


def test_cgroup_v2_without_a_quota_and_a_namespaced_mount(tmp_path):
    # inside a container the mount is the process's own cgroup: /proc/self/cgroup's path is absent
    root, proc = _tree(tmp_path, {"cgroup.controllers": "cpu\n", "cpu.max": "max 100000\n"}, "0::/kubepods/x\n")
    assert cpu_threads.cgroup_cpu_quota(root, proc) is None
    assert cpu_threads.usable_cpus(root, proc) == cpu_threads.affinity_cpus()
    root, proc = _tree(tmp_path / "b", {"cgroup.controllers": "cpu\n", "cpu.max": "50000 100000\n"}, "0::/kubepods/x\n")
    assert cpu_threads.cgroup_cpu_quota(root, proc) == 0.5
    assert cpu_threads.usable_cpus(root, proc) == 1  # a fraction of a CPU still runs one thread


def test_cgroup_v1_cfs_quota(tmp_path):
    root, proc = _tree(tmp_path, {
        "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "100000\n",
        "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
        "cpu,cpuacct/docker/cpu.cfs_quota_us": "-1\n",
        "cpu,cpuacct/docker/cpu.cfs_period_us": "100000\n",
    }, "5:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n")
    assert cpu_threads.cgroup_cpu_quota(root, proc) == 1.0
    assert cpu_threads.usable_cpus(root, proc) == 1


def _in_child(code: str, env: dict | None = None) -> str:
    env = {**{k: v for k, v in os.environ.items() if k not in ("SHOAL_NUM_THREADS", "OMP_NUM_THREADS")}, **(env or {})}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env, timeout=120).stdout.split()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs and Linux")
def test_threads_follow_a_restricted_affinity_mask_into_torch_and_openmp():
    code = ("import os, torch; from shoal.runtime import cpu_threads; os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]}); "
            "n = cpu_threads.set_threads(cpu_threads.num_threads()); print(n, torch.get_num_threads(), os.environ['OMP_NUM_THREADS'])")
    assert _in_child(code) == ["1", "1", "1"]
    # the override wins over the mask; without a mask every allowed CPU
    assert _in_child(code, {"SHOAL_NUM_THREADS": "3"}) == ["3", "3", "3"]
    full = ("import os, torch; from shoal.runtime import cpu_threads; print(cpu_threads.num_threads(), cpu_threads.num_threads(5), "
            "cpu_threads.num_threads(processes=2))")
    n = len(os.sched_getaffinity(0))
    quota = cpu_threads.cgroup_cpu_quota()
    usable = n if quota is None else min(n, max(1, int(quota)))
    assert _in_child(full) == [str(usable), "5", str(max(1, usable // 2))]
