"""Offline benchmarks: engine throughput on named workloads (optionally against
transformers' static batching in the same run) and batch-1 latency."""

from __future__ import annotations

import json
import statistics
import time

import numpy as np
import torch

from shoal.runtime.bench import workloads
from shoal.runtime.config import EngineConfig
from shoal.runtime.sampling_params import SamplingParams, StructuredOutputsParams

# --structured json: records of a few typed fields, more of them than any output holds, so
# the grammar never ends a request early and both runs generate the very same token counts.
BENCH_SCHEMA = {"type": "array", "minItems": 100000, "items": {
    "type": "object", "additionalProperties": False, "required": ["id", "name", "ok"],
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999}, "name": {"type": "string", "maxLength": 12},
                   "ok": {"type": "boolean"}}}}


def _engine(args):
    from shoal.runtime.entrypoints.llm import LLM

    if getattr(args, "random_model", None):  # a random-weight HF directory, made once and reused
        from shoal.runtime.bench.models import make_random_model

        dtype = args.dtype if args.dtype not in (None, "auto") else "float32"
        args.model = str(make_random_model(args.random_model, dtype=dtype, device=args.device or "cpu"))
    cfg = EngineConfig.from_args(args)
    return LLM(**{k: v for k, v in vars(cfg).items() if k != "extra"})


def run_engine(llm, items, structured: StructuredOutputsParams | None = None, loras: list[str] | None = None,
               tokens: dict | None = None, output_kind: str = "final_only") -> dict:
    """Submit every item at once and step until all finish; returns figures. `loras`: request i
    runs with adapter loras[i % len(loras)]; `tokens`: filled with each request's output token ids.
    `output_kind` final_only, as LLM.generate asks (and vLLM's `bench throughput` through it): the
    text is made once at the end, not detokenized and wrapped in an output every step."""
    engine = llm.engine
    engine.kv.reset_prefix_cache()  # a second run of the same prompts starts as cold as the first
    if structured is not None:
        engine.structured.compile(structured)  # once, before the clock (the server compiles off the engine thread)
    _sync(torch.device(engine.config.device))
    start = time.perf_counter()
    for i, item in enumerate(items):
        params = SamplingParams(max_tokens=item.output_len, min_tokens=item.output_len, ignore_eos=True, temperature=0.0,
                                structured_outputs=structured, output_kind=output_kind)
        engine.add_request(f"bench-{i}", item.prompt, params, lora=loras[i % len(loras)] if loras else None)
    peak_usage, allocated, wasted, steps = 0.0, 0, 0, 0
    outputs = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs += len(out.outputs[0].token_ids)
                if tokens is not None:
                    tokens[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
        peak_usage = max(peak_usage, engine.pool.usage())
        a, w = engine.scheduler.fragmentation()
        allocated += a
        wasted += w
    _sync(torch.device(engine.config.device))
    elapsed = time.perf_counter() - start
    stats = engine.stats()
    return {
        "seconds": elapsed,
        "steps": steps,
        "output_tokens": outputs,
        "output_tokens_per_s": outputs / elapsed,
        "total_tokens_per_s": (outputs + sum(len(i.prompt) for i in items)) / elapsed,
        "kv_cache_peak_usage": peak_usage,
        "kv_fragmentation": wasted / allocated if allocated else 0.0,
        "num_preemptions": stats.num_preemptions,
        "prefix_cache_hit_rate": stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0,
    }


def hf_dtype(dtype: str | None):
    """The engine's --dtype for transformers ("auto": the checkpoint's own)."""
    return "auto" if dtype == "auto" else getattr(torch, dtype or "float32")


def run_hf(model_dir, items, batch_size: int, device: str = "cpu", dtype: str = "float32") -> dict:
    """transformers' static batching: left-padded batches in workload order, each run to its
    longest output; only the requested tokens count as useful. On the engine's device and dtype."""
    from transformers import AutoModelForCausalLM

    dev = torch.device(device)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=hf_dtype(dtype)).to(dev).eval()
    if dev.type == "cuda":  # CUDA's first calls (cuBLAS handles, kernel choice) are not the batches' cost
        with torch.inference_mode():
            model.generate(torch.tensor([items[0].prompt[:16]], device=dev), max_new_tokens=2, do_sample=False,
                           pad_token_id=0)
    _sync(dev)
    start = time.perf_counter()
    useful = 0
    for b in range(0, len(items), batch_size):
        chunk = items[b : b + batch_size]
        width = max(len(i.prompt) for i in chunk)
        ids = torch.tensor([[0] * (width - len(i.prompt)) + i.prompt for i in chunk], device=dev)
        mask = torch.tensor([[0] * (width - len(i.prompt)) + [1] * len(i.prompt) for i in chunk], device=dev)
        longest = max(i.output_len for i in chunk)
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest, do_sample=False, pad_token_id=0)
        useful += sum(i.output_len for i in chunk)
    _sync(dev)
    elapsed = time.perf_counter() - start
    del model
    _release(dev)
    return {"seconds": elapsed, "output_tokens": useful, "output_tokens_per_s": useful / elapsed,
            "batch_size": batch_size, "device": str(dev), "dtype": str(dtype)}


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _release(dev: torch.device) -> None:
    """Give the device's cached memory back (the engine's KV cache, before transformers runs)."""
    if dev.type == "cuda":
        import gc

        gc.collect()
        torch.cuda.empty_cache()


def throughput(args) -> int:
    if getattr(args, "lora_adapters", None):
        args.enable_lora = True
        args.max_loras = args.max_loras or args.lora_adapters
    llm = _engine(args)
    items = workloads.load(args.workload, args.num_prompts, args.workload_seed, llm.tokenizer)
    print(f"workload {args.workload}: {len(items)} requests, {sum(len(i.prompt) for i in items)} prompt tokens, "
          f"{sum(i.output_len for i in items)} output tokens")
    if getattr(args, "lora_adapters", None) or getattr(args, "compare_gguf", False):
        if args.lora_adapters:
            result = lora_cost(llm, items, args.lora_adapters)
        else:
            llms = gguf_engines(args, llm)
            result = gguf_cost(llms, items, args.rounds)
            llms["gguf" if llms["float32"] is llm else "float32"].engine.shutdown()
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
        llm.engine.shutdown()
        return 0
    runs = [run_engine(llm, items) for _ in range(max(1, getattr(args, "repeat", 1) or 1))]
    result = {"workload": args.workload, "engine": runs[0]}
    e = result["engine"]
    print(f"shoal:        {e['output_tokens_per_s']:7.1f} output tok/s  ({e['total_tokens_per_s']:.1f} total tok/s, "
          f"{e['seconds']:.1f} s, {e['steps']} steps, {e['num_preemptions']} preemptions)")
    if len(runs) > 1:  # the first run is the cold one (what start-up's warm-up left to compile, it compiles)
        result["engine_repeats"] = runs[1:]
        best = max(r["output_tokens_per_s"] for r in runs[1:])
        result["first_vs_best_repeat"] = e["output_tokens_per_s"] / best
        later = ", ".join(f"{r['output_tokens_per_s']:.1f}" for r in runs[1:])
        print(f"repeats:      {later} output tok/s; "
              f"the first run is {result['first_vs_best_repeat']:.3f}x the best of them")
    print(f"KV cache:     peak use {e['kv_cache_peak_usage']:.1%} of {llm.engine.pool.num_blocks} blocks; "
          f"lost to fragmentation {e['kv_fragmentation']:.2%} of allocated; prefix hit rate {e['prefix_cache_hit_rate']:.1%}")
    result["engine"].update(device=llm.engine.config.device, dtype=llm.engine.config.dtype)
    if args.structured:
        s = result["structured"] = run_engine(llm, items, StructuredOutputsParams(json=BENCH_SCHEMA))
        result["structured_ratio"] = s["output_tokens_per_s"] / e["output_tokens_per_s"]
        print(f"JSON schema:  {s['output_tokens_per_s']:7.1f} output tok/s  ({s['output_tokens']} tokens, {s['seconds']:.1f} s, {s['steps']} steps); "
              f"{result['structured_ratio']:.3f}x the unconstrained run ({(1 - result['structured_ratio']) * 100:+.1f}% slower)")
    if args.compare_hf:
        model_dir, device, dtype = llm.engine.model_dir, llm.engine.config.device, llm.engine.config.dtype
        dtype = "float32" if dtype == "auto" else dtype  # what the engine computes in for "auto"
        if torch.device(device).type == "cuda":  # the engine's KV cache holds most of the GPU: free it first
            llm.engine.shutdown()
            llm = None
            _release(torch.device(device))
        hf = run_hf(model_dir, items, args.hf_batch_size, device, dtype)
        result["hf"] = hf
        result["ratio"] = e["output_tokens_per_s"] / hf["output_tokens_per_s"]
        print(f"transformers: {hf['output_tokens_per_s']:7.1f} output tok/s  (static batches of {args.hf_batch_size}, {hf['seconds']:.1f} s)")
        print(f"ratio:        {result['ratio']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if llm is not None:
        llm.engine.shutdown()
    return 0


def lora_cost(llm, items, count: int, rounds: int = 2) -> dict:
    """The workload on the base model and spread over `count` random adapters, alternated
    `rounds` times in this run; the best of each and their ratio."""
    from shoal.runtime.bench.models import make_random_adapters

    engine = llm.engine
    adapters = make_random_adapters(engine.model_dir, count, engine.config.max_lora_rank)
    for name, path in adapters.items():
        engine.add_lora(name, str(path))
    names = list(adapters)
    # base-torch: the base model with every step in torch (no C decode step, which adapter rows
    # cannot use), so the adapters' own cost shows apart from the decode path's
    runs = {"base": [], "base-torch": [], "lora": []}
    c_seqs = engine.config.cpu_decode_max_seqs
    for _ in range(rounds):
        for kind in runs:
            engine.executor.config.cpu_decode_max_seqs = 0 if kind == "base-torch" else c_seqs
            runs[kind].append(run_engine(llm, items, loras=names if kind == "lora" else None))
            r = runs[kind][-1]
            print(f"{kind:10} {r['output_tokens_per_s']:8.1f} output tok/s ({r['seconds']:.1f} s, {r['steps']} steps)", flush=True)
    engine.executor.config.cpu_decode_max_seqs = c_seqs
    best = {kind: max(r["output_tokens_per_s"] for r in rs) for kind, rs in runs.items()}
    ratio, ratio_torch = best["lora"] / best["base"], best["lora"] / best["base-torch"]
    print(f"{count} adapters of rank {engine.config.max_lora_rank}: {ratio:.3f}x the base model's throughput "
          f"({(1 - ratio) * 100:+.1f}% slower), {ratio_torch:.3f}x the base model's in torch; "
          f"{engine.lora.num_loads} slot loads")
    return {"runs": runs, "best": best, "ratio": ratio, "ratio_torch": ratio_torch, "adapters": count,
            "rank": engine.config.max_lora_rank}


def gguf_engines(args, llm) -> dict:
    """{"float32": an engine whose C decode step reads float32 panels, "gguf": one reading the
    GGUF file's quantized blocks (--quantization gguf)}: `llm` and a second engine on the same
    model (the float32 torch model prefills for both). Two engines, since the plain weights a
    decoder is built from are dropped once oneDNN packs them."""
    from shoal.runtime.models.gguf_convert import gguf_source

    if getattr(llm.engine.executor, "cpu_decoder", None) is None:
        raise SystemExit("--compare-gguf: this engine runs no C decode step (CPU, single process, float32)")
    if gguf_source(llm.engine.model_dir) is None:
        raise SystemExit("--compare-gguf needs a GGUF model (a .gguf file or builtin://NAME)")
    mine = "gguf" if llm.engine.config.quantization == "gguf" else "float32"
    args.quantization, args.dtype = (None, "float32") if mine == "gguf" else ("gguf", None)
    other = _engine(args)
    return {mine: llm, ("float32" if mine == "gguf" else "gguf"): other}


def gguf_cost(llms: dict, items, rounds: int = 2) -> dict:
    """The workload on the C decode step's float32 panels and on the GGUF's quantized blocks,
    alternated `rounds` times in this run: the best of each, their ratio, and how many greedy
    tokens of the quantized run equal the float32 run's, position by position."""
    runs, tokens = {"float32": [], "gguf": []}, {"float32": {}, "gguf": {}}
    for _ in range(rounds):
        for kind in runs:
            runs[kind].append(run_engine(llms[kind], items, tokens=tokens[kind]))
            r = runs[kind][-1]
            print(f"{kind:8} {r['output_tokens_per_s']:8.1f} output tok/s ({r['seconds']:.1f} s, {r['steps']} steps)", flush=True)
    best = {kind: max(r["output_tokens_per_s"] for r in rs) for kind, rs in runs.items()}
    ref, quant = tokens["float32"], tokens["gguf"]
    pairs = [(a, b) for rid in ref for a, b in zip(ref[rid], quant[rid])]
    prefix = [next((i for i, (a, b) in enumerate(zip(ref[r], quant[r])) if a != b), len(ref[r])) for r in ref]
    result = {"runs": runs, "best": best, "ratio": best["gguf"] / best["float32"],
              "greedy_match_rate": sum(a == b for a, b in pairs) / len(pairs),
              "identical_requests": sum(n == len(ref[r]) for n, r in zip(prefix, ref)),
              "mean_identical_prefix": statistics.mean(prefix), "requests": len(items),
              "quantized_types": sorted(set(llms["gguf"].engine.executor.cpu_decoder.quantized_types))}
    print(f"gguf blocks (types {result['quantized_types']}): {result['ratio']:.3f}x the float32 path's throughput; greedy tokens "
          f"equal position by position {result['greedy_match_rate']:.1%}, {result['identical_requests']}/{len(items)} "
          f"requests identical, first {result['mean_identical_prefix']:.1f} tokens identical on average")
    return result


def gguf_latency(llms: dict, fresh, args) -> dict:
    """Batch-1 TTFT and decode tok/s on the float32 panels and on the GGUF's quantized blocks,
    alternated request by request (`iters` each, same prompts): medians and their ratio."""
    runs = {"float32": [], "gguf": []}
    for _ in range(args.iters):
        prompt = fresh(args.input_len)
        for kind in runs:
            runs[kind].append(_one(llms[kind].engine, prompt, args.output_len))
    result = {kind: {"ttft_s": statistics.median(r[0] for r in rs), "decode_tokens_per_s": statistics.median(r[1] for r in rs)}
              for kind, rs in runs.items()}
    result["decode_ratio"] = result["gguf"]["decode_tokens_per_s"] / result["float32"]["decode_tokens_per_s"]
    for kind in runs:
        r = result[kind]
        print(f"{kind:8} TTFT {r['ttft_s'] * 1000:.0f} ms ({args.input_len}-token prompt), decode {r['decode_tokens_per_s']:.1f} tok/s")
    print(f"gguf blocks: {result['decode_ratio']:.2f}x the float32 path's batch-1 decode tok/s (alternated, {args.iters} each)")
    return result


def _one(engine, prompt, output_len) -> tuple[float, float]:
    """(time to first token, decode tokens/s after it) for one request alone."""
    params = SamplingParams(max_tokens=output_len, min_tokens=output_len, ignore_eos=True, temperature=0.0)
    start = time.perf_counter()
    engine.add_request(f"lat-{start}", prompt, params)
    first = last = None
    while engine.has_unfinished_requests():
        engine.step()
        now = time.perf_counter()
        first = first or now
        last = now
    decode = (output_len - 1) / (last - first) if output_len > 1 else float("nan")
    return first - start, decode


def latency(args) -> int:
    llm = _engine(args)
    engine = llm.engine
    rng = np.random.default_rng(0)
    fresh = lambda n: rng.integers(1000, 40000, n).tolist()  # noqa: E731  (no prefix-cache hits)
    if getattr(args, "compare_gguf", False):
        llms = gguf_engines(args, llm)
        result = gguf_latency(llms, fresh, args)
        llms["gguf" if llms["float32"] is llm else "float32"].engine.shutdown()
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
        engine.shutdown()
        return 0
    # --compare-llama-cpp: llama.cpp's request after each of ours (the same prompts), so load drifts hit both
    lc = LlamaCpp(engine, max(args.input_len + args.output_len, args.prefill_len)) if getattr(args, "compare_llama_cpp", False) else None
    if lc is not None:
        lc.request(fresh(16), 4)  # warm-up
    runs, prefill, lc_runs, lc_prefill = [], [], [], []
    for _ in range(args.iters):
        prompt = fresh(args.input_len)
        runs.append(_one(engine, prompt, args.output_len))
        if lc is not None:
            lc_runs.append(lc.request(prompt, args.output_len))
    for _ in range(args.iters):
        prompt = fresh(args.prefill_len)
        prefill.append(_one(engine, prompt, 1)[0])
        if lc is not None:
            lc_prefill.append(lc.request(prompt, 1)[0])
    result = {
        "ttft_s": statistics.median(r[0] for r in runs),
        "decode_tokens_per_s": statistics.median(r[1] for r in runs),
        "prefill_tokens_per_s": args.prefill_len / statistics.median(prefill),
    }
    print(f"shoal:        TTFT {result['ttft_s'] * 1000:.0f} ms ({args.input_len}-token prompt), "
          f"decode {result['decode_tokens_per_s']:.1f} tok/s, prefill {result['prefill_tokens_per_s']:.0f} tok/s "
          f"({args.prefill_len} tokens)")
    if lc is not None:
        theirs = result["llama_cpp"] = {
            "ttft_s": statistics.median(r[0] for r in lc_runs), "decode_tokens_per_s": statistics.median(r[1] for r in lc_runs),
            "prefill_tokens_per_s": args.prefill_len / statistics.median(lc_prefill), "threads": lc.threads, "gguf": str(lc.path)}
        print(f"llama.cpp:    TTFT {theirs['ttft_s'] * 1000:.0f} ms, decode {theirs['decode_tokens_per_s']:.1f} tok/s, "
              f"prefill {theirs['prefill_tokens_per_s']:.0f} tok/s ({lc.threads} threads, {lc.path.name})")
        print(f"shoal / llama.cpp: decode {result['decode_tokens_per_s'] / theirs['decode_tokens_per_s']:.2f}x, "
              f"prefill {result['prefill_tokens_per_s'] / theirs['prefill_tokens_per_s']:.2f}x, "
              f"TTFT {result['ttft_s'] / theirs['ttft_s']:.2f}x")
    if args.compare_hf:
        result["hf"] = _hf_latency(engine.model_dir, fresh(args.input_len), args.output_len)
        h = result["hf"]
        print(f"transformers: TTFT {h['ttft_s'] * 1000:.0f} ms, decode {h['decode_tokens_per_s']:.1f} tok/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    engine.shutdown()
    return 0


class LlamaCpp:
    """llama.cpp (llama-cpp-python, not a dependency: `pip install llama-cpp-python` builds it from
    source) on the GGUF file an engine's model was converted from, at the engine's thread count."""

    def __init__(self, engine, max_len: int):
        try:
            from llama_cpp import Llama
        except ImportError:
            raise SystemExit("--compare-llama-cpp needs llama-cpp-python (pip install llama-cpp-python)") from None
        from shoal.runtime.models.gguf_convert import gguf_source

        self.path = gguf_source(engine.model_dir)
        if self.path is None:
            raise SystemExit("--compare-llama-cpp needs a GGUF model (a .gguf file or builtin://NAME)")
        self.threads = torch.get_num_threads()  # what the engine set from --num-threads or the CPUs it may use
        self.model = Llama(str(self.path), n_threads=self.threads, n_threads_batch=self.threads, n_ctx=max_len + 16,
                           n_batch=512, verbose=False)

    def request(self, prompt, output_len) -> tuple[float, float]:
        """(time to first token, decode tokens/s after it) for one greedy request, as _one."""
        self.model.reset()  # with fresh ids, nothing of the last prompt is reused
        start = time.perf_counter()
        first = last = None
        for i, _ in enumerate(self.model.generate(prompt, temp=0.0, top_k=1, reset=True)):
            last = time.perf_counter()
            first = first or last
            if i + 1 == output_len:
                break
        return first - start, (output_len - 1) / (last - first) if output_len > 1 else float("nan")


def _hf_latency(model_dir, prompt, output_len) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=0)
        ttft = time.perf_counter() - t
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=0)
        total = time.perf_counter() - t
    return {"ttft_s": ttft, "decode_tokens_per_s": (output_len - 1) / max(total - ttft, 1e-9)}
