"""`shoal bench serve` against the session's server: a tiny sweep, JSON and PNG out."""

from __future__ import annotations

import argparse
import json

from shoal.runtime.bench import serve as bench_serve
from shoal.runtime.bench import workloads


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
        assert r["output_tokens"] == sum(it.output_len for it in workloads.sharegpt_like(6, 1, (8, 32), (2, 4)))
        for key in ("ttft_s", "e2e_s"):
            assert 0 < r[key]["p50"] <= r[key]["p99"]
        assert r["output_throughput"] > 0
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    text = capsys.readouterr().out
    assert "TTFT" in text and "ITL" in text and "E2E" in text


def test_workloads_are_fixed():
    a, b = workloads.sharegpt_like(20, 0), workloads.sharegpt_like(20, 0)
    assert [(x.prompt, x.output_len) for x in a] == [(x.prompt, x.output_len) for x in b]
    pub = workloads.public_workload()
    assert len(pub) == 32
    assert sum(len(x.prompt) for x in pub) == 8879 and sum(x.output_len for x in pub) == 4295  # PERFORMANCE.md's totals


def test_bench_serve_chat_single_rate_goodput_and_plot(server, tmp_path, capsys):
    """vllm bench serve's summary (TPOT, token totals, concurrency, goodput), a progress bar,
    the chat endpoint, and a PNG from a single rate (latency distributions)."""
    p = argparse.ArgumentParser()
    bench_serve.add_arguments(p)
    out, png = tmp_path / "one.json", tmp_path / "one.png"
    args = p.parse_args(["--base-url", server.base_url, "--num-prompts", "5", "--input-len", "8:24", "--output-len", "3:5", "--max-concurrency", "2",
                         "--endpoint", "/v1/chat/completions", "--goodput", "ttft:600000", "tpot:1", "--json", str(out), "--plot", str(png), "--seed", "2"])
    assert args.func(args) == 0
    run = json.loads(out.read_text())["runs"][0]
    items = workloads.sharegpt_like(5, 2, (8, 24), (3, 5))
    assert run["completed"] == 5 and run["endpoint"] == "/v1/chat/completions"
    assert run["output_tokens"] == sum(it.output_len for it in items)
    assert run["input_tokens"] > sum(len(it.prompt) for it in items)  # the chat template's tokens too
    assert run["peak_concurrency"] == 2 and run["max_concurrency"] == 2
    assert 0 < run["tpot_s"]["p50"] <= run["tpot_s"]["p99"]
    assert run["request_goodput"] == 0.0  # nobody makes a 1 ms TPOT on this machine
    assert "samples" not in run
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    captured = capsys.readouterr()
    for needle in ("Serving Benchmark Result", "Total input tokens:", "Total generated tokens:", "Maximum request concurrency:",
                   "Peak concurrent requests:", "Request goodput (req/s):", "Mean TPOT (ms):", "P99 ITL (ms):", "Median E2EL (ms):"):
        assert needle in captured.out, needle
    assert "5/5" in captured.err  # the progress bar
    assert bench_serve.parse_goodput(["ttft:500", "e2el:2000"]) == {"ttft": 0.5, "e2el": 2.0}
