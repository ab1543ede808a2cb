"""`shoal bench step`: what one steady decode step costs, host and device.

Builds an engine, fills it with `--num-seqs` sequences (short random prompts, long
outputs, EOS ignored), steps until every one of them decodes in every step, then:

1. Times `--steps` decode steps: the whole `engine.step()` (bracketed by
   `torch.cuda.synchronize()` on CUDA) and, by wrapping the executor's public
   `execute`/`execute_async`, the time the thread spends inside the model call.
   `host_ms` = step - model call: scheduling, step inputs, sampling, bookkeeping.
   On CPU the model call is compute; on CUDA it is the kernel launches (the device
   runs behind them), and whatever waits on the device lands where the wait is.
2. Profiles `--profile-steps` more steps with torch.profiler and reads its trace:
   the device's busy share (CUDA kernel time / wall time of the profiled steps), the
   time the thread is blocked in CUDA synchronizing calls, and per-step counts of
   host-to-device copies, stream synchronizations, `aten::copy_`, `index_put_`, `mm`...

Nothing in the engine is changed: measuring is done by wrapping its public methods.
"""

from __future__ import annotations

import bisect
import gzip
import json
import os
import statistics
import tempfile
import time
from contextlib import contextmanager

import numpy as np
import torch

# trace event names counted per step (cpu_op / cuda_runtime / cuda_driver categories)
COUNTED_OPS = ("aten::copy_", "aten::to", "aten::_to_copy", "aten::index_put_", "aten::item",
               "aten::_local_scalar_dense", "aten::nonzero", "aten::mm", "aten::addmm", "aten::bmm",
               "aten::linear", "aten::empty", "aten::zeros", "aten::tensor", "aten::cat", "aten::index_select")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaStreamWaitEvent")
BLOCKING_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                  "cudaMemcpyAsync", "cuMemcpyDtoH_v2", "cuMemcpyHtoD_v2", "cuStreamSynchronize", "cuCtxSynchronize")
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
STEP_MARK = "shoal_bench::step"
WINDOW_MARK = "shoal_bench::window"
MOE_MARK = "shoal_bench::moe"  # each mixture-of-experts block's forward, while profiling
LORA_MARK = "shoal_bench::lora"  # each LoRA hook's delta (a linear layer's adapters), while profiling


def _summary(xs: list[float]) -> dict:
    if not xs:
        return {}
    s = sorted(xs)
    return {"mean": statistics.fmean(s), "median": statistics.median(s), "min": s[0],
            "p90": s[min(len(s) - 1, int(0.9 * len(s)))], "max": s[-1]}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ModelCallTimer:
    """Wraps the executor's public execute / execute_async on the instance; accumulates the
    seconds spent inside them (restored by `close`)."""

    NAMES = ("execute", "execute_async")

    def __init__(self, executor):
        self.executor, self.seconds, self.calls, self._saved = executor, 0.0, 0, {}
        for name in self.NAMES:
            fn = getattr(executor, name, None)
            if fn is None:
                continue
            self._saved[name] = executor.__dict__.get(name)
            setattr(executor, name, self._wrap(fn))

    def _wrap(self, fn):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t
                self.calls += 1

        return timed

    def take(self) -> tuple[float, int]:
        s, c = self.seconds, self.calls
        self.seconds, self.calls = 0.0, 0
        return s, c

    def close(self) -> None:
        for name, old in self._saved.items():
            if old is None:
                delattr(self.executor, name)
            else:
                setattr(self.executor, name, old)


def fill(engine, num_seqs: int, prompt_len: int, max_tokens: int, seed: int = 0, sampling: dict | None = None,
         loras: list[str] | None = None) -> None:
    """`num_seqs` random prompts; greedy unless `sampling` gives temperature/top_p/top_k/min_p.
    `loras`: sequence i runs with adapter loras[i % len(loras)]."""
    from shoal.runtime.sampling_params import SamplingParams

    rng = np.random.default_rng(seed)
    low, high = min(100, engine.vocab_size // 4), engine.vocab_size
    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True,
                            **({"temperature": 0.0} | (sampling or {})))
    for i in range(num_seqs):
        engine.add_request(f"step-bench-{i}", rng.integers(low, high, prompt_len).tolist(), params,
                           lora=loras[i % len(loras)] if loras else None)


def reach_steady_decode(engine, num_seqs: int, prompt_len: int, max_steps: int) -> tuple[int, int]:
    """Step until every sequence runs and every prompt is done (each has sampled its first
    token), so that the next step is decode-only. Counted from the engine's public stats, not
    from what step() returns (which depends on each request's output kind).
    Returns (steps taken, sequences running)."""
    base = engine.stats().prompt_tokens
    for n in range(1, max_steps + 1):
        engine.step()
        stats = engine.stats()
        if stats.num_running >= num_seqs and stats.num_waiting == 0 and stats.prompt_tokens - base >= num_seqs * prompt_len:
            return n, stats.num_running
    return max_steps, engine.stats().num_running


def analyze_trace(trace: dict, num_steps: int) -> dict:
    """Figures from a torch.profiler chrome trace of `num_steps` annotated steps inside one
    annotated window (see `profile_steps`). Times in ms; counts are per step."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]
    for e in events:
        e["ts"], e["dur"] = float(e["ts"]), float(e.get("dur", 0.0))
    def marks(name):  # host-side marks, each once (a mark could show under two categories)
        found = {(e["ts"], e["dur"]): e for e in events if e.get("name") == name and e.get("cat") != "gpu_user_annotation"}
        return sorted(found.values(), key=lambda e: e["ts"])

    windows, steps = marks(WINDOW_MARK), marks(STEP_MARK)
    if not windows or not steps:
        raise ValueError("the trace holds no annotated steps")
    w0 = windows[0]["ts"]
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATS), key=lambda e: e["ts"])
    device = [e for e in device if e["ts"] + e["dur"] >= w0]
    w1 = max([windows[0]["ts"] + windows[0]["dur"]] + [e["ts"] + e["dur"] for e in device])
    wall_us = w1 - w0
    kernels = [e for e in device if e["cat"] == "kernel"]
    kernel_us = sum(e["dur"] for e in kernels)
    busy_us, end = 0.0, w0
    for e in device:  # union of device intervals (kernels, copies, memsets)
        s, f = max(e["ts"], end), e["ts"] + e["dur"]
        if f > s:
            busy_us += f - s
            end = f
    # host: per step, the time blocked in synchronizing CUDA calls inside it
    host_calls = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    blocked, step_us = [], []
    for s in steps:
        a, b = s["ts"], s["ts"] + s["dur"]
        blocked.append(sum(e["dur"] for e in host_calls if e["name"] in BLOCKING_CALLS and a <= e["ts"] < b))
        step_us.append(s["dur"])

    bounds = sorted((s["ts"], s["ts"] + s["dur"]) for s in steps)
    starts = [a for a, _ in bounds]

    def inside(e) -> bool:
        i = bisect.bisect_right(starts, e["ts"]) - 1
        return i >= 0 and e["ts"] < bounds[i][1]

    host_in_steps = [e for e in events if e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver") and inside(e)]

    def count(pred) -> float:
        return sum(1 for e in host_in_steps if pred(e)) / num_steps

    memcpy = [e for e in device if e["cat"] == "gpu_memcpy"]
    per_step = {
        "h2d_copies": sum("HtoD" in e["name"] for e in memcpy) / num_steps,
        "h2d_pageable_copies": sum("HtoD" in e["name"] and "Pageable" in e["name"] for e in memcpy) / num_steps,
        "d2h_copies": sum("DtoH" in e["name"] for e in memcpy) / num_steps,
        "d2d_copies": sum("DtoD" in e["name"] for e in memcpy) / num_steps,
        "kernels": len(kernels) / num_steps,
        "kernel_launches": count(lambda e: e.get("cat") in ("cuda_runtime", "cuda_driver") and "LaunchKernel" in e["name"]),
        "graph_launches": count(lambda e: e.get("cat") in ("cuda_runtime", "cuda_driver") and "GraphLaunch" in e["name"]),
        "cudaMemcpyAsync": count(lambda e: e.get("cat") == "cuda_runtime" and e["name"] in ("cudaMemcpyAsync", "cudaMemcpy")),
        **{name: count(lambda e, n=name: e.get("cat") == "cuda_runtime" and e["name"] == n) for name in SYNC_CALLS},
        **{name: count(lambda e, n=name: e.get("cat") == "cpu_op" and e["name"] == n) for name in COUNTED_OPS},
    }
    per_step["stream_syncs"] = per_step["cudaStreamSynchronize"]
    step_ms = [u / 1e3 for u in step_us]
    moe = _marked_figures("moe", "blocks", [e for e in marks(MOE_MARK) if inside(e)], host_calls, kernels, sum(step_us),
                          kernel_us, num_steps)
    lora = _marked_figures("lora", "calls", [e for e in marks(LORA_MARK) if inside(e)], host_calls, kernels, sum(step_us),
                           kernel_us, num_steps)
    return {
        "steps": num_steps,
        "marked_steps": len(steps),
        "wall_ms_per_step": wall_us / 1e3 / num_steps,
        "step_ms": _summary(step_ms),
        "device_kernel_ms_per_step": kernel_us / 1e3 / num_steps,
        "device_busy_ms_per_step": busy_us / 1e3 / num_steps,
        "device_busy_share": kernel_us / wall_us if wall_us else None,  # sum of kernel time / wall time
        "device_busy_share_union": busy_us / wall_us if wall_us else None,  # kernels, copies, memsets, overlap counted once
        "host_blocked_ms_per_step": statistics.fmean(blocked) / 1e3,
        "host_busy_ms_per_step": statistics.fmean(s - b for s, b in zip(step_us, blocked)) / 1e3,
        "per_step": per_step,
        **moe,
        **lora,
    }


def _marked_figures(name: str, unit: str, marks, host_calls, kernels, step_us, kernel_us, num_steps) -> dict:
    """A marked part's share of a step (`name`: moe, the mixture-of-experts blocks; lora, the
    LoRA hooks): host time inside its marks (on CPU, the compute) and, on CUDA, the time of the
    kernels launched inside them (CUDA graphs hide those)."""
    if not marks:
        return {}
    part_us = sum(e["dur"] for e in marks)
    out = {f"{name}_{unit}_per_step": len(marks) / num_steps, f"{name}_host_ms_per_step": part_us / 1e3 / num_steps,
           f"{name}_share_of_step_time": part_us / step_us if step_us else None}
    if kernels:
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in marks)
        starts = [a for a, _ in spans]

        def in_part(e) -> bool:
            i = bisect.bisect_right(starts, e["ts"]) - 1
            return i >= 0 and e["ts"] < spans[i][1]

        launched = {e.get("args", {}).get("correlation") for e in host_calls if "Launch" in e["name"] and in_part(e)}
        part_kernel_us = sum(e["dur"] for e in kernels if e.get("args", {}).get("correlation") in launched - {None})
        out[f"{name}_kernel_ms_per_step"] = part_kernel_us / 1e3 / num_steps
        out[f"{name}_share_of_kernel_time"] = part_kernel_us / kernel_us if kernel_us else None
    return out


@contextmanager
def marked_moe_blocks(executor):
    """Wrap the forward of each mixture-of-experts block of a one-process runner in a profiler
    mark (nothing to wrap for a model without experts, or ranks in other processes)."""
    from torch.profiler import record_function

    from shoal.runtime.layers.moe import SparseMoeBlock

    model = getattr(executor, "model", None)
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)] if isinstance(model, torch.nn.Module) else []
    for block in blocks:
        def marked(*args, _forward=block.forward, **kwargs):
            with record_function(MOE_MARK):
                return _forward(*args, **kwargs)

        block.forward = marked
    try:
        yield len(blocks)
    finally:
        for block in blocks:
            del block.forward  # the class's forward again


@contextmanager
def marked_lora_hooks():
    """Wrap every LoRA hook's call in a profiler mark (the class's call, for every instance: a
    step's hooks run only for steps with adapter rows)."""
    from torch.profiler import record_function

    from shoal.runtime.layers.lora import LoraLayer

    call = LoraLayer.__call__

    def marked(self, *args, **kwargs):
        with record_function(LORA_MARK):
            return call(self, *args, **kwargs)

    LoraLayer.__call__ = marked
    try:
        yield
    finally:
        LoraLayer.__call__ = call


def profile_steps(engine, device: torch.device, num_steps: int, trace_path: str | None = None) -> dict:
    """Run `num_steps` steps under torch.profiler; analyse (and optionally keep) its trace."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _sync(device)
    with profile(activities=activities) as prof, marked_moe_blocks(engine.executor), marked_lora_hooks():
        with record_function(WINDOW_MARK):
            for _ in range(num_steps):
                with record_function(STEP_MARK):
                    engine.step()
            _sync(device)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            raw = f.read()
    if trace_path:
        opener = gzip.open if trace_path.endswith(".gz") else open
        with opener(trace_path, "wt") as f:
            f.write(raw)
    return analyze_trace(json.loads(raw), num_steps)


def _max_tokens(warmup_steps: int, steps: int, profile: int, prompt_len: int) -> int:
    """Enough that nobody finishes while we measure: warm-up, timed, back to back twice, profiled."""
    return warmup_steps + 3 * steps + profile + 64 + prompt_len


def _back_to_back(engine, device, steps: int) -> float:
    """ms a step over `steps` steps run back to back, one sync at the end: what a step costs
    when the host may run ahead of the device (async scheduling hides host time only here)."""
    _sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync(device)
    return (time.perf_counter() - t) * 1e3 / steps


def _back_to_back_by_mode(engine, device, steps: int) -> dict[str, float]:
    """Back-to-back ms a step with async scheduling as configured and, where the engine can
    overlap, the other way too, on the same engine. Rounds of steps/2 in the order A B B A:
    contexts grow every step, and so does a step's cost, a drift this order cancels."""
    configured = engine.overlap
    modes = [configured, not configured] if engine.can_overlap else [configured]
    times: dict[bool, list[float]] = {m: [] for m in modes}
    for m in modes + modes[::-1]:
        engine.set_async_scheduling(m)
        times[m].append(_back_to_back(engine, device, max(1, steps // 2)))
    engine.set_async_scheduling(configured)
    return {"async" if m else "serial": statistics.fmean(t) for m, t in times.items()}


def run_step_bench(engine, num_seqs: int = 256, prompt_len: int = 32, warmup_steps: int = 3, steps: int = 20,
                   profile: int = 10, trace_path: str | None = None, seed: int = 0, sampling: dict | None = None,
                   loras: list[str] | None = None) -> dict:
    device = torch.device(engine.config.device)
    max_tokens = _max_tokens(warmup_steps, steps, profile, prompt_len)
    fill(engine, num_seqs, prompt_len, max_tokens, seed, sampling, loras)
    t = time.perf_counter()
    reached, running = reach_steady_decode(engine, num_seqs, prompt_len, max_steps=4 * num_seqs * max(1, prompt_len) + 64)
    fill_s = time.perf_counter() - t
    for _ in range(warmup_steps):
        engine.step()
    timer = ModelCallTimer(engine.executor)
    step_ms, model_ms, tokens = [], [], []
    try:
        for _ in range(steps):
            _sync(device)
            timer.take()
            generated = engine.stats().generation_tokens
            t = time.perf_counter()
            engine.step()
            _sync(device)
            elapsed = time.perf_counter() - t
            inside, _ = timer.take()
            step_ms.append(elapsed * 1e3)
            model_ms.append(inside * 1e3)
            tokens.append(engine.stats().generation_tokens - generated)
        by_mode = _back_to_back_by_mode(engine, device, steps)
        back_to_back_ms = by_mode["async" if engine.overlap else "serial"]
        running_after = engine.stats().num_running
    finally:
        timer.close()
    result = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "num_seqs": num_seqs,
        "num_running": running,
        "num_running_after": running_after,
        "prompt_len": prompt_len,
        "fill_steps": reached,
        "fill_s": fill_s,
        "steps": steps,
        "tokens_per_step": _summary(tokens),
        "decode_only": all(n == num_seqs for n in tokens),
        "step_ms": _summary(step_ms),
        "back_to_back_ms_per_step": back_to_back_ms,
        "async_scheduling": engine.overlap,
        "back_to_back_ms_per_step_by_mode": by_mode,  # async scheduling on and off
        "model_call_ms": _summary(model_ms),
        "host_ms": _summary([s - m for s, m in zip(step_ms, model_ms)]),
        "torch_threads": torch.get_num_threads(),
        "sampling": sampling or {"temperature": 0.0},
        "lora_adapters": len(loras or []),
    }
    if profile:
        try:
            prof = profile_steps(engine, device, profile, trace_path)
        except Exception as exc:  # the timings above stand without it
            result["profile_error"] = f"{type(exc).__name__}: {exc}"
        else:
            if device.type == "cuda" and result["step_ms"]:
                # the kernels barely slow down under the profiler; the host does (2-3x)
                prof["device_busy_share_vs_unprofiled_step"] = (prof["device_kernel_ms_per_step"]
                                                                / result["step_ms"]["median"])
            result["profile"] = prof
    for rid in list(getattr(engine, "requests", {})):  # done: abort the rest rather than run them out
        engine.abort_request(rid)
    return result


def _kv_bytes_needed(model_dir, dtype: str, tokens: int) -> int:
    from shoal.runtime.models.loader import load_config

    c = load_config(model_dir)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}.get(dtype, 4)
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * itemsize * tokens


def step(args) -> int:
    """The CLI entry: `shoal bench step`."""
    from shoal.runtime.bench import models as bench_models
    from shoal.runtime.config import EngineConfig
    from shoal.runtime.entrypoints.llm import LLM

    preset = "tiny-step" if args.tiny else args.random_model
    if preset:
        dtype = args.dtype if args.dtype not in (None, "auto") else "float32"
        args.model = str(bench_models.make_random_model(preset, dtype=dtype, device=args.device or "cpu"))
    if args.max_num_seqs is None:
        args.max_num_seqs = max(args.num_seqs, 256)
    if args.lora_adapters:  # the sequences spread over N random adapters, every one in a device slot
        args.enable_lora = True
        args.max_loras = max(args.max_loras or 0, args.lora_adapters)
    max_tokens = _max_tokens(args.warmup_steps, args.steps, args.profile_steps, args.prompt_len)
    if args.kv_cache_memory is None and (args.device or "cpu") == "cpu":
        from shoal.runtime.models.loader import resolve_model

        tokens = args.num_seqs * (2 * args.prompt_len + max_tokens + 32) + 4096
        args.kv_cache_memory = _kv_bytes_needed(resolve_model(args.model), args.dtype or "float32", tokens)
    cfg = EngineConfig.from_args(args)
    llm = LLM(**{k: v for k, v in vars(cfg).items() if k != "extra"})
    try:
        loras = None
        if args.lora_adapters:
            adapters = bench_models.make_random_adapters(llm.engine.model_dir, args.lora_adapters, llm.engine.config.max_lora_rank)
            for name, path in adapters.items():
                llm.engine.add_lora(name, str(path))
            loras = list(adapters)
        result = run_step_bench(llm.engine, args.num_seqs, args.prompt_len, args.warmup_steps, args.steps,
                                args.profile_steps, args.trace, args.seed or 0, sampling_of(args), loras)
    finally:
        llm.engine.shutdown()
    result["model"] = args.model
    result["dtype"] = cfg.dtype
    result["attention_backend"] = cfg.attention_backend
    print(format_result(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def sampling_of(args) -> dict:
    """The bench's --temperature/--top-p/--top-k/--min-p/--output-kind that were given."""
    names = ("temperature", "top_p", "top_k", "min_p", "output_kind")
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def format_result(r: dict) -> str:
    s, m, h = r["step_ms"], r["model_call_ms"], r["host_ms"]
    lines = [
        f"step bench: {r['num_running']} running of {r['num_seqs']} ({r['device_name']}), decode-only: {r['decode_only']}, "
        f"{r['steps']} steps, sampling {r.get('sampling')}, {r.get('torch_threads')} threads",
        f"  step        {s['median']:8.2f} ms median ({s['mean']:.2f} mean, {s['min']:.2f} min); "
        f"{r['back_to_back_ms_per_step']:.2f} ms a step back to back",
        f"  model call  {m['median']:8.2f} ms median (inside the executor's execute)",
        f"  host        {h['median']:8.2f} ms median (step - model call)",
    ]
    modes = r.get("back_to_back_ms_per_step_by_mode") or {}
    if len(modes) == 2:
        lines.append(f"  back to back: async scheduling {modes['async']:.2f} ms a step, serial {modes['serial']:.2f} ms "
                     f"({modes['serial'] / modes['async']:.2f}x); this run's engine: "
                     f"{'async' if r.get('async_scheduling') else 'serial'}")
    p = r.get("profile")
    if "profile_error" in r:
        lines.append(f"  profile failed: {r['profile_error']}")
    if p:
        c = p["per_step"]
        lines.append(f"  profiled ({p['steps']} steps): {p['wall_ms_per_step']:.2f} ms a step wall, host busy "
                     f"{p['host_busy_ms_per_step']:.2f} ms, blocked {p['host_blocked_ms_per_step']:.2f} ms")
        if p["device_kernel_ms_per_step"]:
            lines.append(f"  device: kernels {p['device_kernel_ms_per_step']:.3f} ms a step, busy "
                         f"{p['device_busy_share']:.1%} of the profiled wall (union {p['device_busy_share_union']:.1%})"
                         + (f", {p['device_busy_share_vs_unprofiled_step']:.1%} of an unprofiled step"
                            if "device_busy_share_vs_unprofiled_step" in p else ""))
        lines.append(f"  per step: {c['h2d_copies']:.0f} H2D copies ({c['h2d_pageable_copies']:.0f} pageable), "
                     f"{c['d2h_copies']:.0f} D2H, {c['stream_syncs']:.0f} stream syncs, {c['kernels']:.0f} kernels, "
                     f"{c['aten::copy_']:.0f} aten::copy_, {c['aten::index_put_']:.0f} index_put_, "
                     f"{c['aten::mm'] + c['aten::addmm']:.0f} mm/addmm, {c['aten::item'] :.0f} item")
        if "moe_host_ms_per_step" in p:
            lines.append(f"  experts: {p['moe_blocks_per_step']:.0f} MoE blocks a step, {p['moe_host_ms_per_step']:.2f} ms "
                         f"({p['moe_share_of_step_time']:.1%} of the profiled step time)"
                         + (f"; their kernels {p['moe_kernel_ms_per_step']:.3f} ms, {p['moe_share_of_kernel_time']:.1%} "
                            "of kernel time" if p.get("moe_share_of_kernel_time") is not None else ""))
        if "lora_host_ms_per_step" in p:
            lines.append(f"  LoRA: {r.get('lora_adapters')} adapters, {p['lora_calls_per_step']:.0f} hook calls a step, "
                         f"{p['lora_host_ms_per_step']:.2f} ms ({p['lora_share_of_step_time']:.1%} of the profiled step time)"
                         + (f"; their kernels {p['lora_kernel_ms_per_step']:.3f} ms, {p['lora_share_of_kernel_time']:.1%} "
                            "of kernel time" if p.get("lora_share_of_kernel_time") is not None else ""))
    return "\n".join(lines)
