"""`make gpu-check`: everything issues 17 and 33 measure on a GPU, in one command of under 8.5 minutes.

    python3 tools/nopip.py -m shoal.runtime.bench.gpu_check            # a GPU machine, no pip install
    python3 tools/nopip.py -m shoal.runtime.bench.gpu_check --smoke    # the same parts on CPU, tiny models

Parts, each in its own process, time-boxed (a part that fails or overruns is recorded
and the next one runs):

  models      the random-weight models, made once in the cache (1B-shaped bf16, SmolLM2-shaped fp32)
  parity      greedy parity against transformers on the same GPU: SmolLM2-shaped fp32 model,
              16 prompts x 24 tokens, Triton backend; token-exact count, first-step logprob diff
  throughput  PERFORMANCE.md's GPU workload (256 requests) on the 1B-shaped bf16 model, and
              transformers' static batches of 64 on the same GPU in the same run
  step        a steady decode step at 256 running: ms a step, host ms, and under torch.profiler
              the device's busy share and per-step copies and synchronizations
  streaming   the GPU workload with delta outputs (what the server asks), the engine on this thread
              against the engine-core process (CoreClient), same model, same run
  quant       the 1B-shaped model in bf16, FP8 W8A8 (--quantization fp8, at load), the FP8 KV cache
              and AWQ int4 (the random weights quantized by the repo's reference quantizer), one
              engine after another in one process: the GPU workload's throughput, the linear
              layers at batch 256, KV blocks, and greedy tokens / first-step logprobs against bf16
  kernels     `shoal bench kernels` (checks and times every Triton kernel)

Writes gpu_check.json (every figure, and the end of each part's log), gpu_check.md (a short
table), gpu_check.log (all the output) and step_trace.json.gz (the profiled decode steps, for
chrome://tracing or Perfetto) into $OUT when set, else ./out (or --out): four files, since
the device tool brings back at most eight. Needs torch, triton, transformers and
numpy only; imports nothing of the server or the operator. With no GPU (and no --smoke)
it says so and exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

BUDGET_S = 510.0  # the whole run: 8.5 minutes, inside a 15-minute device session with its start

# (part, seconds reserved for it): a part may use what earlier parts left, never what later ones reserve
# (quant: 4 engines; it also gets what the parts before it left, and kernels what it leaves)
PARTS = [("models", 70), ("parity", 60), ("throughput", 150), ("step", 50), ("streaming", 45), ("quant", 80),
         ("kernels", 55)]

GPU = dict(
    parity=dict(preset="smollm2-135m", dtype="float32", backend="triton", prompts=16, tokens=24, device="cuda"),
    # half the free memory for KV (the workload needs ~26 GB): transformers fits beside it even if
    # something kept the engine's cache alive after its shutdown
    throughput=dict(preset="llama-1b", dtype="bfloat16", device="cuda", num_prompts=None, hf_batch_size=64,
                    kv_cache_memory=0.5),
    step=dict(preset="llama-1b", dtype="bfloat16", device="cuda", num_seqs=256, prompt_len=256, warmup=5, steps=30,
              profile=10),
    streaming=dict(preset="llama-1b", dtype="bfloat16", device="cuda", num_prompts=None, kv_cache_memory=float(16 * 2**30)),
    quant=dict(preset="llama-1b", dtype="bfloat16", device="cuda", num_prompts=None, kv_cache_memory=float(16 * 2**30),
               awq_group=128, prompts=16, tokens=24, gemm_rows=256, gemm_iters=20),
    kernels=["--iters", "50", "--warmup", "5"],
)
SMOKE = dict(
    parity=dict(preset="tiny", dtype="float32", backend="torch", prompts=4, tokens=8, device="cpu"),
    throughput=dict(preset="tiny", dtype="float32", device="cpu", num_prompts=2, hf_batch_size=2,
                    kv_cache_memory=float(2**27)),
    step=dict(preset="tiny-step", dtype="float32", device="cpu", num_seqs=16, prompt_len=8, warmup=1, steps=3,
              profile=2),
    streaming=dict(preset="tiny", dtype="float32", device="cpu", num_prompts=3, max_output_len=6, kv_cache_memory=float(2**26)),
    quant=dict(preset="tiny", dtype="float32", device="cpu", num_prompts=2, max_output_len=4, first_run=False,
               kv_cache_memory=float(2**26), awq_group=32, prompts=3, tokens=4, gemm_rows=16, gemm_iters=1),
    kernels=["--cpu", "--small", "--iters", "1", "--warmup", "0"],
)


# -- the parts (each runs in its own process) ------------------------------------------------


def _model(preset: str, dtype: str, device: str) -> str:
    from shoal.runtime.bench.models import make_random_model

    return str(make_random_model(preset, dtype=dtype, device=device))


def part_models(cfg: dict) -> dict:
    made = {}
    for key in ("parity", "throughput", "step", "quant"):
        c = cfg[key]
        t = time.perf_counter()
        path = _model(c["preset"], c["dtype"], c["device"])
        made[f"{c['preset']}-{c['dtype']}"] = {"path": path, "seconds": time.perf_counter() - t}
    c = cfg["quant"]
    t = time.perf_counter()
    path = make_awq_model(Path(_model(c["preset"], c["dtype"], c["device"])), c["awq_group"], c["device"])
    made[path.name] = {"path": str(path), "seconds": time.perf_counter() - t}
    return made


def _reference_quantizer():
    """tests/quant_checkpoints.py: the repo's reference quantizers (written from AutoAWQ's,
    AutoGPTQ's and compressed-tensors' packing, not from Shoal's unpackers), loaded from the
    checkout by path (tests/ is no package; gpu-check runs from a checkout)."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "tests" / "quant_checkpoints.py"
    if not path.exists():
        raise FileNotFoundError(f"the reference quantizer {path} (gpu-check runs from a checkout)")
    spec = importlib.util.spec_from_file_location("shoal_reference_quantizers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# AutoAWQ's gemm pack order (column order[i] of each eight in nibble i), as quant_checkpoints.quantize_awq packs
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def make_awq_model(src: Path, group: int, device: str = "cpu") -> Path:
    """AWQ (GEMM layout, zero points, `group` inputs a group) of a random-weight model: every
    q/k/v/o/gate/up/down weight quantized as the reference quantizer's quantize_awq does, the
    rest as it is; beside it as <name>-awq-g<group>, made once. The groups are quantized on
    `device` (the reference's loop over groups takes minutes for 1B on a CPU, seconds on a
    GPU) and packed on the CPU in threads."""
    from concurrent.futures import ThreadPoolExecutor

    import torch
    from safetensors.torch import load_file, save_file

    dst = src.with_name(f"{src.name}-awq-g{group}")
    stamp = dst / ".shoal-awq.json"
    spec = {"source": (src / ".shoal-random-model.json").read_text(), "group": group}
    if stamp.exists() and json.loads(stamp.read_text()) == spec:
        return dst
    reference = _reference_quantizer()
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    tensors, to_pack = {}, {}
    for f in sorted(src.glob("*.safetensors")):
        for key, w in load_file(str(f)).items():
            name, kind = key.rsplit(".", 1)
            if kind != "weight" or name.split(".")[-1] not in reference.LINEARS:
                tensors[key] = w
                continue
            w = w.to(device).float()
            g_idx = torch.arange(w.shape[1], device=w.device) // group
            with torch.device(w.device):  # the reference's own tensors on the weight's device
                q, scale, zero = reference._int4_groups(w, group, False, g_idx)
            to_pack[f"{name}.qweight"] = q.t().to(torch.uint8).cpu().numpy()  # [in, out], packed along the outputs
            to_pack[f"{name}.qzeros"] = zero.to(torch.uint8).cpu().numpy()  # [groups, out]
            tensors[f"{name}.scales"] = scale.half().cpu()
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # numpy lets go of the GIL while it packs
        packed = pool.map(lambda item: (item[0], reference._pack_nibbles(item[1], 1, AWQ_ORDER)), to_pack.items())
        tensors.update(packed)
    save_file(tensors, str(dst / "model.safetensors"))
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith(".") and ".safetensors" not in f.name:
            shutil.copy(f, dst / f.name)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = reference.quantization_config("awq", group)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    stamp.write_text(json.dumps(spec))
    return dst


def _parity_prompts(count: int) -> list[list[int]]:
    """The parity part's prompts: `count` random-id prompts of 4-95 tokens (seed 7)."""
    import numpy as np

    rng = np.random.default_rng(7)
    lens = rng.integers(4, 96, count)
    return [rng.integers(100, 40000, n).tolist() for n in lens]


def part_parity(cfg: dict) -> dict:
    """Greedy tokens and first-step logprobs of Shoal against transformers, same device."""
    import torch
    from transformers import AutoModelForCausalLM

    from shoal.runtime.bench.offline import _release as release
    from shoal.runtime.entrypoints.llm import LLM
    from shoal.runtime.sampling_params import SamplingParams

    c = cfg["parity"]
    path = _model(c["preset"], c["dtype"], c["device"])
    prompts = _parity_prompts(c["prompts"])
    n = c["tokens"]
    llm = LLM(model=path, device=c["device"], dtype=c["dtype"], attention_backend=c["backend"],
              kv_cache_memory=float(2**30), max_num_seqs=64)
    params = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True, logprobs=5)
    outs = llm.generate(prompts, params, use_tqdm=False)
    shoal_tokens = [list(o.outputs[0].token_ids) for o in outs]
    shoal_first = [o.outputs[0].logprobs[0] for o in outs]
    llm.engine.shutdown()
    del llm
    release(torch.device(c["device"]))

    dev = torch.device(c["device"])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, c["dtype"])).to(dev).eval()
    exact, first_diff, mismatch_at = 0, 0.0, []
    with torch.inference_mode():
        for p, got, lp in zip(prompts, shoal_tokens, shoal_first):
            ids = torch.tensor([p], device=dev)
            want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=0)[0, len(p):].tolist()
            exact += got == want
            mismatch_at.append(next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None))
            ref = torch.log_softmax(hf(ids).logits[0, -1].float(), -1)
            first_diff = max(first_diff, max(abs(v - float(ref[t])) for t, v in lp.items()))
    return {"model": f"{c['preset']} {c['dtype']} (random weights)", "device": c["device"], "backend": c["backend"],
            "prompts": len(prompts), "tokens": n, "token_exact": exact, "first_mismatch": mismatch_at,
            "first_step_logprob_max_diff": first_diff}


def part_throughput(cfg: dict, out: Path) -> dict:
    from shoal.runtime.bench import offline as bench

    c = cfg["throughput"]
    args = argparse.Namespace(
        model=_model(c["preset"], c["dtype"], c["device"]), random_model=None, device=c["device"], dtype=c["dtype"],
        workload="gpu", num_prompts=c["num_prompts"], workload_seed=0, compare_hf=True,
        hf_batch_size=c["hf_batch_size"], json=str(out / "throughput_raw.json"), repeat=2,
        kv_cache_memory=c["kv_cache_memory"], structured=None)
    bench.throughput(args)
    result = json.loads((out / "throughput_raw.json").read_text())
    result["model"] = f"{c['preset']} {c['dtype']} (random weights)"
    return result


def part_step(cfg: dict, out: Path) -> dict:
    from shoal.runtime.bench import step as bench_step
    from shoal.runtime.entrypoints.llm import LLM

    c = cfg["step"]
    path = _model(c["preset"], c["dtype"], c["device"])
    options = dict(model=path, device=c["device"], dtype=c["dtype"], max_num_seqs=max(256, c["num_seqs"]))
    if c["device"] == "cpu":
        options["kv_cache_memory"] = float(2**26)
    llm = LLM(**options)
    try:
        trace = out / "step_trace.json.gz" if c["device"] == "cuda" else None
        # final_only: what a step costs in the engine-core process (it makes no text) and under LLM.generate
        result = bench_step.run_step_bench(llm.engine, c["num_seqs"], c["prompt_len"], c["warmup"], c["steps"],
                                           c["profile"], str(trace) if trace else None,
                                           sampling={"temperature": 0.0, "output_kind": "final_only"})
        # and, unprofiled, with the server's streams in one process (text and an output every step)
        streaming = bench_step.run_step_bench(llm.engine, c["num_seqs"], c["prompt_len"], c["warmup"], c["steps"], 0,
                                              sampling={"temperature": 0.0, "output_kind": "delta"})
        result["streaming"] = {k: streaming[k] for k in ("step_ms", "model_call_ms", "host_ms", "back_to_back_ms_per_step",
                                                         "decode_only", "sampling")}
    finally:
        llm.engine.shutdown()
    print(bench_step.format_result(result))
    result["model"] = f"{c['preset']} {c['dtype']} (random weights)"
    return result

def part_streaming(cfg: dict) -> dict:
    """The GPU workload streamed as the server asks (delta outputs: text every step) from the
    engine stepped on this thread, then from the engine-core process (CoreClient: the core
    schedules, runs and samples; this process detokenizes) stepped the same way. Each runs
    the workload with other prompt ids first (what start-up left to compile), then timed."""
    import torch

    from shoal.runtime.bench import workloads
    from shoal.runtime.bench.offline import _release as release
    from shoal.runtime.config import EngineConfig
    from shoal.runtime.engine.core_client import CoreClient
    from shoal.runtime.engine.engine import LLMEngine

    c = cfg["streaming"]
    config = EngineConfig(model=_model(c["preset"], c["dtype"], c["device"]), device=c["device"], dtype=c["dtype"],
                          kv_cache_memory=c["kv_cache_memory"])
    items = workloads.load("gpu", c["num_prompts"], 0, None)
    if c.get("max_output_len"):  # smoke runs: a few tokens each
        items = [dataclasses.replace(i, output_len=min(i.output_len, c["max_output_len"])) for i in items]
    warm = [dataclasses.replace(i, prompt=[t + 1 for t in i.prompt]) for i in items]  # no prefix hits for the timed run
    result = {"model": f"{c['preset']} {c['dtype']} (random weights)", "device": c["device"], "requests": len(items),
              "output_tokens": sum(i.output_len for i in items), "runs": {}}
    for name, make in (("thread", LLMEngine), ("core_process", CoreClient)):
        engine = make(config)
        try:
            _stream(engine, warm, "warm")
            result["runs"][name] = _stream(engine, items, "timed")
        finally:
            engine.shutdown()
            del engine
            release(torch.device(c["device"]))
        print(f"streaming: {name}: {result['runs'][name]['output_tokens_per_s']:,.0f} output tok/s", flush=True)
    runs = result["runs"]
    result["core_process_vs_thread"] = runs["core_process"]["output_tokens_per_s"] / runs["thread"]["output_tokens_per_s"]
    return result


def _stream(engine, items, tag: str) -> dict:
    from shoal.runtime.sampling_params import SamplingParams

    start = time.perf_counter()
    for i, item in enumerate(items):
        engine.add_request(f"{tag}-{i}", item.prompt, SamplingParams(
            max_tokens=item.output_len, min_tokens=item.output_len, ignore_eos=True, temperature=0.0, output_kind="delta"))
    tokens = chars = steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            for o in out.outputs:
                tokens += len(o.token_ids)
                chars += len(o.text)
        steps += 1
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "output_tokens": tokens, "output_tokens_per_s": tokens / elapsed, "text_chars": chars,
            "steps": steps}


# (name, engine options, whether its weights are the AWQ checkpoint), in the order they run:
# if the part's time runs short, the last ones are skipped
QUANT_RUNS = [("bf16", {}, False), ("fp8", {"quantization": "fp8"}, False), ("fp8-kv", {"kv_cache_dtype": "fp8"}, False),
              ("awq", {}, True)]


def part_quant(cfg: dict, out: Path, budget: float) -> dict:
    """The quantized formats against the model's dtype on the 1B-shaped workload, one engine
    after another in this process (each runs the workload twice: once to compile what is left
    to compile, once timed). A run starts only while the time left holds the longest so far."""
    c = cfg["quant"]
    start = time.perf_counter()
    base = Path(_model(c["preset"], c["dtype"], c["device"]))
    from shoal.runtime.bench import workloads

    items = workloads.load("gpu", c["num_prompts"], 0, None)
    if c.get("max_output_len"):  # smoke runs: a few tokens each
        items = [dataclasses.replace(i, output_len=min(i.output_len, c["max_output_len"])) for i in items]
    prompts = _parity_prompts(c["prompts"])
    result = {"model": f"{c['preset']} {c['dtype']} (random weights)", "device": c["device"],
              "dtype": c["dtype"], "fp8_gemm": _fp8_gemm_path(c["device"], c["dtype"]), "awq_group": c["awq_group"], "gemm_rows": c["gemm_rows"], "workload": "gpu",
              "requests": len(items), "output_tokens": sum(i.output_len for i in items),
              "parity_prompts": len(prompts), "parity_tokens": c["tokens"], "kv_cache_memory": c["kv_cache_memory"],
              "runs": {}, "skipped": []}
    greedy, spent = {}, []
    for name, options, awq in QUANT_RUNS:
        left = budget - (time.perf_counter() - start)
        if spent and left < 1.2 * max(spent) + 10:
            result["skipped"].append(name)
            print(f"quant: {name} skipped ({left:.0f} s left, a run took up to {max(spent):.0f} s)", flush=True)
            continue
        t = time.perf_counter()
        try:
            path = make_awq_model(base, c["awq_group"], c["device"]) if awq else base
            run, greedy[name] = _quant_run(c, path, options, items, prompts)
        except Exception as exc:  # one format failing costs its run, not the others'
            traceback.print_exc()
            run = {"options": options, "error": f"{type(exc).__name__}: {exc}"}
        run["seconds"] = time.perf_counter() - t
        spent.append(run["seconds"])
        result["runs"][name] = run
        if "error" not in run:
            print(f"quant: {name}: {run['timed']['output_tokens_per_s']:,.0f} output tok/s, linear layers at "
                  f"{c['gemm_rows']} rows {run['linears_ms']:.3f} ms, {run['num_blocks']} KV blocks "
                  f"({run['seconds']:.0f} s)", flush=True)
        _write_partial(out, result)
    _compare_runs(result, greedy)
    return result


def _compare_runs(result: dict, greedy: dict) -> None:
    """Each run's throughput, linear-layer time, KV blocks and greedy tokens against bf16's."""
    base = result["runs"].get("bf16")
    if base is None or "error" in base:
        return
    for name, run in result["runs"].items():
        if name == "bf16" or "error" in run:
            continue
        run["throughput_vs_bf16"] = run["timed"]["output_tokens_per_s"] / base["timed"]["output_tokens_per_s"]
        run["linears_speedup_vs_bf16"] = base["linears_ms"] / run["linears_ms"]
        run["kv_blocks_vs_bf16"] = run["num_blocks"] / base["num_blocks"]
        run["accuracy_vs_bf16"] = compare_greedy(*greedy["bf16"], *greedy[name])


def compare_greedy(base_tokens, base_first, tokens, first) -> dict:
    """Greedy outputs of one run against another's on the same prompts: whole sequences equal,
    first tokens equal, the share of tokens generated before each sequence's first difference,
    and the largest first-step logprob difference over the tokens both runs ranked (top k)."""
    same = sum(a == b for a, b in zip(base_tokens, tokens))
    firsts = sum(a[:1] == b[:1] for a, b in zip(base_tokens, tokens))
    agreed = sum(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                 for a, b in zip(base_tokens, tokens))
    diff = max((abs(a[t] - b[t]) for a, b in zip(base_first, first) for t in a.keys() & b.keys()), default=None)
    return {"prompts": len(tokens), "sequences_equal": same, "first_tokens_equal": firsts,
            "tokens_before_first_difference": agreed / max(1, sum(len(a) for a in base_tokens)),
            "first_step_logprob_max_diff": diff}


def _fp8_gemm_path(device: str, dtype: str) -> str:
    """Which GEMM an FP8 linear layer runs here (runtime/layers/quantization/fp8.py's rule)."""
    import torch

    if device != "cuda":
        return "torch reference (CPU)"
    if torch.cuda.get_device_capability() >= (8, 9) and dtype == "bfloat16":
        return "torch._scaled_mm"
    return "Triton fp8_scaled_mm"


def _quant_run(c: dict, path: Path, options: dict, items, prompts) -> tuple[dict, tuple]:
    import torch

    from shoal.runtime.bench import offline as bench
    from shoal.runtime.entrypoints.llm import LLM
    from shoal.runtime.sampling_params import SamplingParams

    n = c["tokens"]
    llm = LLM(model=str(path), device=c["device"], dtype=c["dtype"], kv_cache_memory=c["kv_cache_memory"],
              max_num_seqs=256, **options)
    try:
        engine = llm.engine
        run = {"options": options, "checkpoint": path.name, "num_blocks": engine.pool.num_blocks,
               "kv_bytes_per_block": engine.executor.kv_bytes_per_block()}
        params = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True, logprobs=5)
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        first = [{t: float(getattr(v, "logprob", v)) for t, v in o.outputs[0].logprobs[0].items()} for o in outs]
        if c.get("first_run", True):  # what start-up's warm-up left to compile, compiled before the timed run
            run["first_run"] = bench.run_engine(llm, items)
        run["timed"] = bench.run_engine(llm, items)
        run["linears_ms"], run["linears_timing"] = time_linears(engine.executor.model, c["gemm_rows"], c["gemm_iters"],
                                                               torch.device(c["device"]), getattr(torch, c["dtype"]))
    finally:
        llm.engine.shutdown()
        del llm
        bench._release(torch.device(c["device"]))
    return run, (tokens, first)


def time_linears(model, rows: int, iters: int, device, dtype) -> tuple[float, str]:
    """Milliseconds for every linear layer of the model (fused QKV, o, gate/up, down; not the LM
    head) applied once to `rows` rows: the GEMMs of a decode step at that batch. On CUDA one
    CUDA graph of them all (as decode steps replay), eager where capture fails."""
    import torch

    from shoal.runtime.layers.linear import MergedColumnLinear, RowLinear

    linears = [m for m in model.modules() if isinstance(m, (MergedColumnLinear, RowLinear))]
    gen = torch.Generator(device=device).manual_seed(0)
    inputs = {size: torch.randn(rows, size, generator=gen, device=device).to(dtype)
              for size in {m.input_size for m in linears}}

    def once():
        for m in linears:
            m(inputs[m.input_size])

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    with torch.inference_mode():
        once()  # compiles, picks GEMM algorithms
        call, how = once, "eager"
        if device.type == "cuda":
            try:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    once()
                call, how = graph.replay, "CUDA graph"
            except Exception as exc:  # noqa: BLE001 - timed eagerly instead, and said so
                how = f"eager (capture failed: {type(exc).__name__})"
        call()
        sync()
        t = time.perf_counter()
        for _ in range(iters):
            call()
        sync()
    return (time.perf_counter() - t) / iters * 1e3, how


def _write_partial(out: Path, result: dict) -> None:
    """The runs done so far, as the part's record: what the orchestrator finds if it must end
    the part (run_part overwrites it when the part returns)."""
    record = {"part": "quant", "status": "partial", "error": "ended before every run finished",
              "result": result}
    (out / "quant.json").write_text(json.dumps(record, indent=2, default=str))


def part_kernels(cfg: dict, budget: float) -> dict:
    import contextlib
    import io

    from shoal.kernels import bench as kbench

    kbench.BUDGET_S = min(kbench.BUDGET_S, max(10.0, budget - 25.0))  # leave room to print the table
    buf = io.StringIO()

    class Tee(io.TextIOBase):
        def write(self, s):
            sys.__stdout__.write(s)
            return buf.write(s)

    with contextlib.redirect_stdout(Tee()):
        rc = kbench.main(cfg["kernels"])
    text = buf.getvalue()
    return {"rc": rc, "args": cfg["kernels"], "budget_s": kbench.BUDGET_S, "rows": _parse_table(text), "text": text}


def _parse_table(text: str) -> list[dict]:
    """The kernel bench's table (columns split on two or more spaces) as dicts."""
    import re

    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("kernel") and i + 1 < len(lines) and set(lines[i + 1]) <= {"-", " "}:
            headers = re.split(r"\s{2,}", line.strip())
            rows = []
            for row in lines[i + 2:]:
                cells = re.split(r"\s{2,}", row.strip())
                if len(cells) != len(headers):
                    break
                rows.append(dict(zip(headers, cells)))
            return rows
    return []


def run_part(name: str, smoke: bool, out: Path, budget: float) -> int:
    import signal

    signal.alarm(int(budget) + 15)  # outlive the orchestrator's time box by no more than this, whatever happens to it
    cfg = SMOKE if smoke else GPU
    t = time.perf_counter()
    record: dict = {"part": name}
    try:
        if name == "models":
            result = part_models(cfg)
        elif name == "parity":
            result = part_parity(cfg)
        elif name == "throughput":
            result = part_throughput(cfg, out)
        elif name == "step":
            result = part_step(cfg, out)
        elif name == "streaming":
            result = part_streaming(cfg)
        elif name == "quant":
            result = part_quant(cfg, out, budget)
        elif name == "kernels":
            result = part_kernels(cfg, budget)
        else:
            raise ValueError(f"unknown part {name!r}")
        record.update(status="ok", result=result)
    except Exception as exc:  # recorded, so the orchestrator reports it beside the others
        traceback.print_exc()
        record.update(status="error", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
    record["seconds"] = time.perf_counter() - t
    (out / f"{name}.json").write_text(json.dumps(record, indent=2, default=str))
    return 0 if record["status"] == "ok" else 1


# -- the orchestrator ---------------------------------------------------------------------


def _child_command(name: str, smoke: bool, out: Path, budget: float) -> list[str]:
    launcher = os.environ.get("SHOAL_NOPIP")  # tools/nopip.py set it: the children need the alias too
    head = [sys.executable, launcher] if launcher and os.path.exists(launcher) else [sys.executable]
    cmd = head + ["-m", "shoal.runtime.bench.gpu_check", "--part", name, "--out", str(out), "--budget", f"{budget:.0f}"]
    return cmd + (["--smoke"] if smoke else [])


def _run_child(name: str, cmd: list[str], timeout: float, log) -> tuple[int | None, bool, list[str]]:
    """Run one part in its own process group, echoing its output (and into `log`); kill it
    (only it) past `timeout`."""
    lines: list[str] = []
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' loading bars: noise in a short log
    # its own process group (so that a timeout ends it and its helpers), in this session (so
    # that whoever ends this command's session ends it too)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            process_group=0)

    def pump():
        for line in proc.stdout:
            log.write(f"[{name}] {line}")
            log.flush()
            lines.append(line.rstrip("\n"))
            print(f"[{name}] {line}", end="", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        try:
            os.killpg(proc.pid, 9)  # the part's own process group (its compile workers too)
        except ProcessLookupError:
            pass
        proc.wait()
    reader.join(timeout=5)
    return proc.returncode, timed_out, lines


def environment() -> dict:
    info = {"python": platform.python_version(), "machine": platform.node()}
    for mod in ("torch", "triton", "transformers", "numpy"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            info[mod] = f"unavailable ({type(exc).__name__})"
    try:
        import torch

        info["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["gpu_count"] = torch.cuda.device_count()
    except Exception:  # noqa: BLE001
        pass
    try:
        here = Path(__file__).resolve().parents[1]
        info["commit"] = subprocess.run(["git", "-C", str(here), "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True, timeout=10).stdout.strip() or None
    except Exception:  # noqa: BLE001 - no git on the machine
        info["commit"] = None
    return info


def orchestrate(smoke: bool, out: Path, parts: list[str], budget: float) -> int:
    start = time.perf_counter()
    deadline = start + budget
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="shoal-gpu-check-"))  # the parts' own files; $OUT gets four
    try:
        return _orchestrate(smoke, out, work, parts, start, deadline, budget)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _orchestrate(smoke: bool, out: Path, work: Path, parts: list[str], start: float, deadline: float,
                 budget: float) -> int:
    log = open(out / "gpu_check.log", "w")
    plan = [(n, s) for n, s in PARTS if n in parts]
    summary = {"mode": "smoke (CPU, tiny models)" if smoke else "gpu", "environment": environment(),
               "budget_s": budget, "parts": {}}
    def say(text: str) -> None:
        print(text, flush=True)
        log.write(text + "\n")
        log.flush()

    say(f"gpu-check: {summary['mode']}, parts {', '.join(n for n, _ in plan)}, budget {budget:.0f} s, out {out}")
    for i, (name, _) in enumerate(plan):
        reserved_later = sum(s for _, s in plan[i + 1:])
        timeout = deadline - time.perf_counter() - reserved_later
        if timeout < 5:
            summary["parts"][name] = {"part": name, "status": "skipped", "error": "no time left in the budget"}
            say(f"gpu-check: {name}: skipped (no time left)")
            continue
        t = time.perf_counter()
        say(f"gpu-check: {name} (up to {timeout:.0f} s)")
        rc, timed_out, lines = _run_child(name, _child_command(name, smoke, work, timeout), timeout, log)
        record_path = work / f"{name}.json"
        if record_path.exists():
            record = json.loads(record_path.read_text())
        else:
            record = {"part": name, "status": "timeout" if timed_out else "error",
                      "error": f"timed out after {timeout:.0f} s" if timed_out else f"exited {rc} without a result"}
        record["log_tail"] = [ln for ln in lines if "it/s]" not in ln][-60:]  # progress bars dropped
        record["wall_s"] = time.perf_counter() - t
        summary["parts"][name] = record
        say(f"gpu-check: {name}: {record['status']} in {record['wall_s']:.0f} s"
            + (f" ({record.get('error')})" if record["status"] != "ok" else ""))
    trace = work / "step_trace.json.gz"
    if trace.exists() and trace.stat().st_size < 15 * 2**20:  # the device tool brings back files up to 16 MiB
        shutil.move(str(trace), out / trace.name)
    summary["seconds"] = time.perf_counter() - start
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=2, default=str))
    table = markdown(summary)
    (out / "gpu_check.md").write_text(table)
    say(table)
    say(f"gpu-check: {summary['seconds']:.0f} s in all; wrote gpu_check.json, gpu_check.md, gpu_check.log"
        + (", step_trace.json.gz" if (out / trace.name).exists() else "") + f" to {out}")
    log.close()
    return 0


def _get(d, *keys):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _fmt(x, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def markdown(summary: dict) -> str:
    """The short table of docs/gpu.md, filled in."""
    p = summary["parts"]
    env = summary["environment"]
    rows = []

    def status(name):
        r = p.get(name)
        if r is None:
            return "not run"
        return "" if r["status"] == "ok" else f"{r['status']}: {r.get('error', '')}"[:200]

    def section_parity():
        par = _get(p, "parity", "result")
        if par:
            rows.append(("parity: greedy tokens vs transformers, same device",
                         f"{par['token_exact']}/{par['prompts']} token-exact ({par['tokens']} tokens, {par['model']}, "
                         f"{par['backend']}); first-step logprobs within {par['first_step_logprob_max_diff']:.1e}",
                         "all exact; ≤1e-4"))
        else:
            rows.append(("parity", status("parity"), ""))
    def section_throughput():
        thr = _get(p, "throughput", "result")
        if thr:
            e, h = thr["engine"], thr.get("hf") or {}
            rows.append(("throughput: Shoal, GPU workload", f"{e['output_tokens_per_s']:,.0f} output tok/s "
                         f"({e['output_tokens']:,} tokens, {e['seconds']:.1f} s, {e['steps']} steps)", "≥25,000 tok/s"))
            rows.append((f"throughput: transformers, static batches of {h.get('batch_size', '?')}",
                         f"{_fmt(h.get('output_tokens_per_s'), ',.0f')} output tok/s ({_fmt(h.get('seconds'), '.1f')} s)", ""))
            rows.append(("ratio", f"{_fmt(thr.get('ratio'), '.1f')}x", "≥25x"))
            if thr.get("engine_repeats"):
                rows.append(("the first (cold) run against the second, same engine",
                             f"{_fmt(thr['engine_repeats'][0].get('output_tokens_per_s'), ',.0f')} tok/s the second; "
                             f"the first {_fmt(thr.get('first_vs_best_repeat'), '.3f')}x it", "≥0.9x"))
        else:
            rows.append(("throughput", status("throughput"), ""))
    def section_step():
        st = _get(p, "step", "result")
        if st:
            prof = st.get("profile") or {}
            c = prof.get("per_step") or {}
            rows.append((f"steady decode step, {st['num_running']} running (prompt {st['prompt_len']})",
                         f"{st['step_ms']['median']:.2f} ms synchronized, {st['back_to_back_ms_per_step']:.2f} ms back to "
                         f"back (model call {st['model_call_ms']['median']:.2f} ms, outside it "
                         f"{st['host_ms']['median']:.2f} ms)", "≤4 ms"))
            if st.get("streaming"):
                sm = st["streaming"]
                rows.append(("the same step streaming text every step (delta outputs, one process)",
                             f"{sm['step_ms']['median']:.2f} ms synchronized, {sm['back_to_back_ms_per_step']:.2f} ms back to "
                             f"back (outside the model call {sm['host_ms']['median']:.2f} ms)", ""))
            modes = st.get("back_to_back_ms_per_step_by_mode") or {}
            if len(modes) == 2:
                rows.append(("back to back: async scheduling / serial (same engine, same run)",
                             f"{modes['async']:.2f} / {modes['serial']:.2f} ms a step ({modes['serial'] / modes['async']:.2f}x)", ""))
            if "profile_error" in st:
                rows.append(("profile", f"failed: {st['profile_error']}"[:200], ""))
            if prof:
                rows.append(("under torch.profiler: wall / host busy / device kernels a step",
                             f"{prof['wall_ms_per_step']:.2f} / {prof['host_busy_ms_per_step']:.2f} / "
                             f"{prof['device_kernel_ms_per_step']:.2f} ms", ""))
                rows.append(("device busy share (kernel time / profiled wall)",
                             f"{_fmt(prof.get('device_busy_share'), '.1%')} (vs an unprofiled step: "
                             f"{_fmt(prof.get('device_busy_share_vs_unprofiled_step'), '.1%')})", "≥80%"))
                rows.append(("per step: H2D copies (pageable) / D2H / stream syncs / kernels",
                             f"{c.get('h2d_copies', 0):.0f} ({c.get('h2d_pageable_copies', 0):.0f}) / "
                             f"{c.get('d2h_copies', 0):.0f} / {c.get('stream_syncs', 0):.0f} / {c.get('kernels', 0):.0f}",
                             "1 / 1 / ≤1 / –"))
                rows.append(("per step: aten::copy_ / index_put_ / mm+addmm / item",
                             f"{c.get('aten::copy_', 0):.0f} / {c.get('aten::index_put_', 0):.0f} / "
                             f"{c.get('aten::mm', 0) + c.get('aten::addmm', 0):.0f} / {c.get('aten::item', 0):.0f}", ""))
        else:
            rows.append(("decode step profile", status("step"), ""))
    def section_streaming():
        sm = _get(p, "streaming", "result")
        if sm:
            t, cp = sm["runs"]["thread"], sm["runs"]["core_process"]
            rows.append(("streamed (delta outputs): engine on the server's thread / engine-core process",
                         f"{t['output_tokens_per_s']:,.0f} / {cp['output_tokens_per_s']:,.0f} output tok/s "
                         f"({sm['core_process_vs_thread']:.2f}x)", "decides the default"))
        else:
            rows.append(("streaming", status("streaming"), ""))
    def section_kernels():
        k = _get(p, "kernels", "result")
        if k:
            checks = [r.get("check") for r in k["rows"]]
            rows.append(("kernels (`shoal bench kernels`)", f"{checks.count('ok')} ok, {checks.count('FAIL')} failed of "
                         f"{len(checks)} rows; exit {k['rc']}", "all ok"))
            decode = [f"{r.get('% peak BW', '?')} ({r.get('shape', '?')})" for r in k["rows"]
                      if r.get("kernel") == "paged_attention_decode"]
            prefill = [f"{r.get('TFLOP/s', '?')} ({r.get('shape', '?')})" for r in k["rows"]
                       if r.get("kernel") == "paged_attention_prefill"]
            if decode:
                rows.append(("decode attention, % of peak bandwidth", "; ".join(decode), "≥70%"))
            if prefill:
                rows.append(("prefill attention, TFLOP/s", "; ".join(prefill), "≥400"))
        else:
            rows.append(("kernels", status("kernels"), ""))

    def section_quant():
        q = _get(p, "quant", "result")
        if not q:
            rows.append(("quantized formats", status("quant"), ""))
            return
        runs = q["runs"]
        targets = {"fp8": "≥1.3x", "fp8-kv": "blocks 2x"}
        dtype = q.get("dtype", "bfloat16")
        labels = {"bf16": f"{dtype}, unquantized", "fp8": "FP8 W8A8 (at load)", "fp8-kv": f"{dtype} weights, FP8 KV cache",
                  "awq": f"AWQ int4, group {q['awq_group']}"}
        for name, run in runs.items():
            label = f"{labels.get(name, name)}, {q['model']}"
            if "error" in run:
                rows.append((label, f"error: {run['error']}"[:200], ""))
                continue
            text = (f"{run['timed']['output_tokens_per_s']:,.0f} output tok/s; linear layers at {q['gemm_rows']} rows "
                    f"{run['linears_ms']:.3f} ms; {run['num_blocks']:,} KV blocks")
            if "throughput_vs_bf16" in run:
                a = run["accuracy_vs_bf16"]
                text += (f"; vs bf16: {run['throughput_vs_bf16']:.2f}x tok/s, {run['linears_speedup_vs_bf16']:.2f}x "
                         f"linears, {run['kv_blocks_vs_bf16']:.2f}x blocks; greedy {a['sequences_equal']}/{a['prompts']} "
                         f"sequences, {a['first_tokens_equal']}/{a['prompts']} first tokens, first-step logprobs within "
                         f"{_fmt(a['first_step_logprob_max_diff'], '.2g')}")
            rows.append((label, text, targets.get(name, "")))
        if q.get("skipped"):
            rows.append(("quantized formats skipped (time)", ", ".join(q["skipped"]), ""))
        rows.append(("FP8 GEMM path", q["fp8_gemm"], "torch._scaled_mm"))

    k = _get(p, "kernels", "result")
    for name, section in (("parity", section_parity), ("throughput", section_throughput), ("step", section_step), ("streaming", section_streaming),
                          ("quant", section_quant), ("kernels", section_kernels)):
        try:
            section()
        except Exception as exc:  # a figure missing from a part's result costs its rows, not the table
            rows.append((name, f"could not format: {type(exc).__name__}: {exc}"[:200], ""))
    head = (f"gpu-check ({summary['mode']}): {env.get('gpu', 'no GPU')}, torch {env.get('torch')}, "
            f"triton {env.get('triton')}, transformers {env.get('transformers')}, commit {env.get('commit')}, "
            f"{summary.get('seconds', 0):.0f} s\n\n")
    lines = ["| figure | measured | target |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    text = head + "\n".join(lines) + "\n"
    if k and k.get("text"):
        text += "\n```\n" + k["text"].strip() + "\n```\n"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu-check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="no GPU needed: every part on CPU with tiny models")
    parser.add_argument("--out", help="where to write (default: $OUT, else ./out)")
    parser.add_argument("--parts", default=",".join(n for n, _ in PARTS), help="comma-separated subset of the parts")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the whole run")
    parser.add_argument("--part", help=argparse.SUPPRESS)  # internal: run one part in this process
    args = parser.parse_args(argv)
    out = Path(args.out or os.environ.get("OUT") or "out").resolve()
    if args.part:
        return run_part(args.part, args.smoke, out, args.budget)
    if not args.smoke:
        try:
            import torch
        except ImportError:
            print("gpu-check: torch is not installed here, nothing measured (a GPU machine needs torch, triton, "
                  "transformers and numpy)")
            return 0
        if not torch.cuda.is_available():
            print("gpu-check: no CUDA GPU here, nothing measured (this needs a GPU machine; "
                  "--smoke runs the same parts on CPU with tiny models)")
            return 0
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(parts) - {n for n, _ in PARTS}
    if unknown:
        parser.error(f"unknown part(s): {', '.join(sorted(unknown))}")
    return orchestrate(args.smoke, out, parts, args.budget)


if __name__ == "__main__":
    sys.exit(main())
