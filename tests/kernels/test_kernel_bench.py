"""kernels/bench.py runs end to end: without CUDA it says so; with --cpu it checks and prints its table."""

import pytest
import torch

from shoal.kernels import bench


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_without_cuda_it_says_so_and_exits_0(capsys):
    assert bench.main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out


def test_cpu_table_checks_every_kernel_in_the_interpreter(capsys):
    pytest.importorskip("triton")
    assert bench.main(["--cpu", "--iters", "1", "--warmup", "0", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("write_kv_cache", "paged_", "rms_norm", "rotary", "silu", "fused_moe"))]
    assert {r.split()[0] for r in rows} == {
        "write_kv_cache", "paged_attention_decode", "paged_attention_prefill", "rms_norm", "rms_norm+residual",
        "rotary_embedding", "silu_and_mul", "fused_moe"}
    assert all("  ok  " in r for r in rows), out


def test_peak_bandwidth_table_prefers_the_specific_name():
    names = [k for k, _ in bench.PEAK_GBPS]
    assert names.index("H100 PCIe") < names.index("H100") and names.index("GH200") < names.index("H200") < names.index("H20")
    assert names.index("H200") < names.index("H20") and names.index("A10G") < names.index("A10")
