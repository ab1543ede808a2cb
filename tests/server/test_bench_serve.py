"""`shoal bench serve` against the session's server: a tiny sweep, JSON and PNG out."""

from __future__ import annotations

import argparse
import json

from shoal.runtime import bench_serve


def test_bench_serve_sweep(server, tmp_path, capsys):
    p = argparse.ArgumentParser()
    bench_serve.add_arguments(p)
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    args = p.parse_args(["--base-url", server.base_url, "--num-prompts", "6", "--input-len", "8:32", "--output-len", "2:4",
                         "--sweep", "4,inf", "--json", str(out), "--plot", str(png), "--seed", "1"])
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    assert [r["request_rate"] for r in report["runs"]] == [4.0, "inf"]
    for r in report["runs"]:
        assert r["completed"] == 6 and r["failed"] == 0
        assert r["output_tokens"] == sum(it.output_len for it in bench_serve.sharegpt_like(6, 1, (8, 32), (2, 4)))
        for key in ("ttft_s", "e2e_s"):
            assert 0 < r[key]["p50"] <= r[key]["p99"]
        assert r["output_throughput"] > 0
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    text = capsys.readouterr().out
    assert "TTFT" in text and "ITL" in text and "E2E" in text


def test_workloads_are_fixed():
    a, b = bench_serve.sharegpt_like(20, 0), bench_serve.sharegpt_like(20, 0)
    assert [(x.prompt, x.output_len) for x in a] == [(x.prompt, x.output_len) for x in b]
    pub = bench_serve.public_workload()
    assert len(pub) == 32
    assert sum(len(x.prompt) for x in pub) == 8879 and sum(x.output_len for x in pub) == 4295  # PERFORMANCE.md's totals
