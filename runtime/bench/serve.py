"""`shoal bench serve`: load a running server the way users do, and measure it.

    shoal bench serve --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 4
    shoal bench serve --max-concurrency 16 --json out.json
    shoal bench serve --sweep 0.5,1,2,4 --plot latency.png
    shoal bench serve --endpoint /v1/chat/completions --goodput ttft:500 tpot:50 --plot one-rate.png
    shoal bench serve --compare-offline --workload public --engine-args '--max-num-seqs 64'   # HTTP overhead
    shoal bench serve --compare-router --workload multi-tenant --engine-args 'MODEL --kv-cache-memory 64MiB'

Requests arrive as a Poisson process at --request-rate (inf: all at once) or are held at
--max-concurrency in flight. Lengths are ShareGPT-like: prompt and output lengths drawn
log-uniformly (many short, a long tail) from a fixed --seed, prompt token ids uniform in
[1000, 40000); every request is forced to its full output length (min_tokens = max_tokens,
ignore_eos), so runs are comparable. Each request streams from /v1/completions (or, with
--endpoint /v1/chat/completions, from chat, its prompt written as words); we print what
`vllm bench serve` prints: requests, duration, input and output token totals, request,
goodput and token throughput, peak concurrency, and time to first token, time per output
token (TPOT, excluding the first), inter-token latency (gap between streamed chunks) and
end-to-end latency, each as mean, median, p90 and p99. Goodput counts the requests per
second that meet every --goodput SLO (ttft, tpot, e2el in ms), as vLLM's does. A progress
bar shows requests as they finish (--disable-tqdm to turn it off). --plot draws latency
against the rate with --sweep, and each latency's distribution (CDF) for a single rate.

`http_overhead` runs one workload through the offline engine (`LLM.generate`, all prompts
at once) and then through a `shoal serve` subprocess with the same engine flags (all
requests at once), and reports server throughput / offline throughput. The goal
(PERFORMANCE.md) is an overhead under 10%.

`compare_router` starts --groups `shoal serve` groups and two `shoal router`s in front of them
(--policy prefix and --policy round-robin), sends the same multi-tenant workload through
each (fresh prefixes for each: same shapes, other token ids), and reports the prefix-cache
hit rate (the groups' shoal_prefix_cache_hits / queries over the run) and TTFT p50 / p99 of
both; then, one request at a time, TTFT straight to a group against through the router
(the router's added latency). Issue 20's targets: >= 2x the hit rate and >= 1.5x lower
median TTFT than round-robin, <= 2 ms added median TTFT.

Import is cheap (no torch); httpx and numpy load on use.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shoal.runtime.bench.workloads import Item

MODEL_DEFAULT = None  # ask the server's /v1/models


# ------------------------------------------------------------------------------ one request
@dataclass
class Result:
    ok: bool
    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (vLLM's TPOT); None with one token or none."""
        return (self.latency - self.ttft) / (self.output_len - 1) if self.output_len > 1 else None


# a prompt of token ids as words for the chat endpoint (common words: about a token each)
_WORDS = ("the of and to in is it that for on was with as be at by this had not are but from or have an they which one you were all "
          "her she there would their we him been has when who will more no if out so said what up its about into than them can only "
          "other new some could time these two may then do first any my now such like our over man me even most made after also").split()


def chat_text(prompt: list[int]) -> str:
    return " ".join(_WORDS[t % len(_WORDS)] for t in prompt)


async def _one(client, url: str, model: str, item: Item, headers: dict) -> Result:
    import httpx

    body = {"model": model, "max_tokens": item.output_len, "min_tokens": item.output_len, "ignore_eos": True,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    chat = url.endswith("/chat/completions")
    if chat:
        body["messages"] = [{"role": "user", "content": chat_text(item.prompt)}]
    else:
        body["prompt"] = item.prompt
    res = Result(False, len(item.prompt))
    t0 = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"].get("message", "error")
                    return res
                now = time.perf_counter()
                choice = chunk["choices"][0] if chunk.get("choices") else None
                if choice is not None and ((choice.get("delta") or {}).get("content") if chat else choice.get("text") or choice.get("finish_reason")):
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    res.output_len = chunk["usage"]["completion_tokens"]
                    res.prompt_len = chunk["usage"]["prompt_tokens"]
    except (httpx.HTTPError, OSError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.latency = time.perf_counter() - t0
    res.ok = True
    return res


def _stats(values: list[float]) -> dict:
    import numpy as np

    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    a = np.asarray(values)
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99))}


def parse_goodput(specs: list[str] | None) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 0.5, 'tpot': 0.05} (seconds); vLLM's --goodput."""
    slos = {}
    for spec in specs or []:
        key, _, ms = spec.partition(":")
        if key not in ("ttft", "tpot", "e2el") or not ms:
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2el:MS, not {spec!r}")
        slos[key] = float(ms) / 1000
    return slos


def _meets(r: Result, slos: dict[str, float]) -> bool:
    got = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.latency}
    return all(got[k] <= v for k, v in slos.items())


async def run_load(base_url: str, items: list[Item], *, request_rate: float = math.inf, max_concurrency: int | None = None,
                   model: str | None = None, api_key: str | None = None, seed: int = 0, endpoint: str = "/v1/completions",
                   goodput: dict[str, float] | None = None, progress: bool = False) -> dict:
    """Send `items` to the server; returns the summary dict (see `format_summary`)."""
    import httpx
    import numpy as np

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_concurrency or len(items) or 1, max_keepalive_connections=max_concurrency or len(items) or 1)
    async with httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=httpx.Timeout(3600, connect=30), limits=limits) as client:
        if model is None:
            r = await client.get("/v1/models", headers=headers)
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        rng = np.random.Generator(np.random.PCG64(seed + 1))
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(items), desc="requests", unit="req", file=sys.stderr)
        in_flight = peak = 0

        async def measured(item):
            nonlocal in_flight, peak
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                return await _one(client, endpoint, model, item, headers)
            finally:
                in_flight -= 1
                if bar is not None:
                    bar.update(1)

        async def guarded(item):
            if sem is None:
                return await measured(item)
            async with sem:
                return await measured(item)

        tasks = []
        t0 = time.perf_counter()
        for item in items:
            tasks.append(asyncio.ensure_future(guarded(item)))
            if math.isfinite(request_rate) and request_rate > 0:
                await asyncio.sleep(float(rng.exponential(1.0 / request_rate)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        if bar is not None:
            bar.close()
    good = [r for r in results if r.ok]
    met = [r for r in good if _meets(r, goodput)] if goodput else None
    out_tokens = sum(r.output_len for r in good)
    in_tokens = sum(r.prompt_len for r in good)
    return {
        "model": model,
        "request_rate": request_rate if math.isfinite(request_rate) else "inf",
        "max_concurrency": max_concurrency,
        "peak_concurrency": peak,
        "endpoint": endpoint,
        "num_requests": len(items),
        "completed": len(good),
        "failed": len(results) - len(good),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "request_throughput": len(good) / duration if duration else 0.0,
        "goodput_slos_ms": {k: v * 1000 for k, v in goodput.items()} if goodput else None,
        "request_goodput": (len(met) / duration if duration else 0.0) if met is not None else None,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
        "ttft_s": _stats([r.ttft for r in good]),
        "tpot_s": _stats([r.tpot for r in good if r.tpot is not None]),
        "itl_s": _stats([x for r in good for x in r.itl]),
        "e2e_s": _stats([r.latency for r in good]),
        # per request, for the single-rate plot (not written to --json)
        "samples": {"ttft_s": [r.ttft for r in good], "tpot_s": [r.tpot for r in good if r.tpot is not None], "e2e_s": [r.latency for r in good]},
    }


_SECTIONS = (("ttft_s", "Time to First Token", "TTFT"), ("tpot_s", "Time per Output Token (excl. 1st token)", "TPOT"),
             ("itl_s", "Inter-token Latency", "ITL"), ("e2e_s", "End-to-end Latency", "E2EL"))


def format_summary(s: dict) -> str:
    """The summary as `vllm bench serve` prints it."""
    def row(name, value):
        return f"{name + ':':<40}{value:<10}"

    def num(x, fmt=".2f"):
        return "-" if x is None else format(x, fmt)

    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
             row("Endpoint", s.get("endpoint", "/v1/completions")),
             row("Request rate (req/s)", s["request_rate"]),
             row("Successful requests", s["completed"]),
             row("Failed requests", s["failed"]),
             row("Maximum request concurrency", s["max_concurrency"] or "-"),
             row("Benchmark duration (s)", num(s["duration_s"])),
             row("Total input tokens", s["input_tokens"]),
             row("Total generated tokens", s["output_tokens"]),
             row("Request throughput (req/s)", num(s["request_throughput"]))]
    if s.get("request_goodput") is not None:
        slos = ", ".join(f"{k} <= {v:g} ms" for k, v in s["goodput_slos_ms"].items())
        lines.append(row("Request goodput (req/s)", num(s["request_goodput"])) + f"({slos})")
    lines += [row("Output token throughput (tok/s)", num(s["output_throughput"])),
              row("Peak concurrent requests", s.get("peak_concurrency", "-")),
              row("Total token throughput (tok/s)", num(s["total_token_throughput"]))]
    for key, title, short in _SECTIONS:
        st = s[key]
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        for q, label in (("mean", "Mean"), ("p50", "Median"), ("p90", "P90"), ("p99", "P99")):
            lines.append(row(f"{label} {short} (ms)", num(None if st[q] is None else st[q] * 1000)))
    lines.append("=" * 50)
    for err in s["errors"]:
        lines.append(f"error: {err}")
    return "\n".join(lines)


def plot_sweep(summaries: list[dict], path: str) -> bool:
    """Latency against the request rate (several runs), or each latency's distribution (one run)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed; no plot", file=sys.stderr)
        return False
    panels = (("ttft_s", "time to first token"), ("tpot_s", "time per output token"), ("e2e_s", "end-to-end latency"))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    if len(summaries) == 1:
        s = summaries[0]
        for ax, (key, title) in zip(axes, panels):
            values = sorted(v * 1000 for v in s.get("samples", {}).get(key, []))
            if values:
                ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post")
                for q in ("p50", "p90", "p99"):
                    ax.axvline(s[key][q] * 1000, linestyle=":", alpha=0.6, label=f"{q} {s[key][q] * 1000:.0f} ms")
                ax.legend()
            ax.set_title(title)
            ax.set_xlabel("ms")
            ax.set_ylabel("fraction of requests")
            ax.grid(True, alpha=0.3)
        fig.suptitle(f"shoal bench serve: {s['model']}, rate {s['request_rate']} req/s, {s['completed']} requests")
    else:
        rates = [s["request_rate"] if s["request_rate"] != "inf" else float("nan") for s in summaries]
        for ax, (key, title) in zip(axes, panels):
            for q in ("p50", "p90", "p99"):
                ax.plot(rates, [(s[key][q] or float("nan")) * 1000 for s in summaries], marker="o", label=q)
            ax.set_title(title)
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel("ms")
            ax.grid(True, alpha=0.3)
            ax.legend()
        fig.suptitle(f"shoal bench serve: {summaries[0]['model']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ------------------------------------------------------------------------------ HTTP overhead
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(base_url: str, proc: subprocess.Popen, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"shoal serve exited with {proc.returncode}")
        try:
            if httpx.get(base_url + "/ready", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"shoal serve not ready after {timeout:.0f}s")


def offline_throughput(items: list[Item], engine_kwargs: dict) -> dict:
    from shoal import LLM, SamplingParams

    llm = LLM(**engine_kwargs)
    params = [SamplingParams(max_tokens=it.output_len, min_tokens=it.output_len, ignore_eos=True, temperature=0.0) for it in items]
    t0 = time.perf_counter()
    outs = llm.generate([it.prompt for it in items], params, use_tqdm=False)
    duration = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    llm.engine.shutdown()
    return {"duration_s": duration, "output_tokens": tokens, "output_throughput": tokens / duration}


def http_overhead(items: list[Item], engine_args: list[str], engine_kwargs: dict, startup_timeout: float = 900) -> dict:
    """Same workload, offline then through `shoal serve ENGINE_ARGS`; prints and returns the ratio."""
    import gc

    offline = offline_throughput(items, engine_kwargs)
    print(f"offline: {offline['output_tokens']} tokens in {offline['duration_s']:.1f} s = {offline['output_throughput']:.1f} tok/s", flush=True)
    gc.collect()
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    env = dict(os.environ, SHOAL_ACCESS_LOG="0")
    cmd = [sys.executable, "-m", "shoal.runtime.cli", "serve", "--host", "127.0.0.1", "--port", str(port), "--max-waiting", str(max(512, len(items))), *engine_args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_ready(base, proc, startup_timeout)
        served = asyncio.run(run_load(base, items))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    ratio = served["output_throughput"] / offline["output_throughput"]
    report = {"offline": offline, "server": served, "server_over_offline": ratio, "http_overhead": 1 - ratio}
    print(f"offline {offline['output_throughput']:.1f} tok/s ({offline['duration_s']:.1f} s); "
          f"server {served['output_throughput']:.1f} tok/s ({served['duration_s']:.1f} s); "
          f"server/offline {ratio:.3f} -> HTTP overhead {100 * (1 - ratio):.1f}% (goal < 10%)")
    return report


# ------------------------------------------------------------------------------ router vs round-robin
def _start(cmd: list[str]) -> subprocess.Popen:
    env = dict(os.environ, SHOAL_ACCESS_LOG="0")
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()


def _prefix_counts(urls: list[str]) -> tuple[float, float]:
    """(hits, queries) of the prefix cache, summed over the groups."""
    import httpx

    from shoal.runtime.metrics import metric_value

    hits = queries = 0.0
    for url in urls:
        text = httpx.get(url + "/metrics", timeout=30).text
        hits += metric_value(text, "shoal_prefix_cache_hits_total") or 0.0
        queries += metric_value(text, "shoal_prefix_cache_queries_total") or 0.0
    return hits, queries


def _wait_router(base_url: str, proc: subprocess.Popen, backends: int, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"shoal router exited with {proc.returncode}")
        try:
            r = httpx.get(base_url + "/ready", timeout=5)
            if r.status_code == 200 and r.json().get("backends_ready") == backends:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"shoal router not ready with {backends} backends after {timeout:.0f}s")


def _router_overhead_ms(router: str) -> float:
    """Mean of shoal_router_overhead_seconds over the router's life (body, tokenize, hash, pick)."""
    import httpx

    from shoal.runtime.metrics import metric_value

    text = httpx.get(router + "/metrics", timeout=30).text
    total, count = metric_value(text, "shoal_router_overhead_seconds_sum"), metric_value(text, "shoal_router_overhead_seconds_count")
    return 1000 * total / count if count else float("nan")


async def _direct_vs_router(direct: str, router: str, n: int, seed: int) -> dict:
    """Median TTFT of one request at a time, alternating straight to a group and through the
    router, the same prompts both ways (so the same first token, with the same model): 16
    tokens, too short for a reusable block, so neither gains from the other's cache."""
    import httpx
    import numpy as np

    from shoal.runtime.bench import workloads

    a = b = workloads.sharegpt_like(n, seed + 11, (16, 16), (4, 4))
    ttft: dict[str, list[float]] = {"direct": [], "via_router": []}
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600, connect=30)) as client:
        model = (await client.get(direct + "/v1/models")).json()["data"][0]["id"]
        for x, y in zip(a, b):
            for name, url, item in (("direct", direct, x), ("via_router", router, y)):
                r = await _one(client, url + "/v1/completions", model, item, {})
                if r.ok:
                    ttft[name].append(r.ttft)
    out = {k: float(np.median(v)) if v else None for k, v in ttft.items()}
    out["added_ms"] = 1000 * (out["via_router"] - out["direct"]) if None not in out.values() else None
    return out


def compare_router(make_items, engine_args: list[str], *, groups: int = 3, router_args: list[str] = (), request_rate: float = math.inf,
                   max_concurrency: int | None = None, low_load_prompts: int = 20, seed: int = 0, startup_timeout: float = 900) -> dict:
    """`make_items(salt)` -> the workload; see the module docstring. Returns the report."""
    model = _engine_kwargs(engine_args).get("model")
    group_urls, procs = [], []
    try:
        for _ in range(groups):
            port = _free_port()
            group_urls.append(f"http://127.0.0.1:{port}")
            procs.append(_start([sys.executable, "-m", "shoal.runtime.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                                 "--disable-log-stats", *engine_args]))
        routers = {}
        for policy in ("round-robin", "prefix"):
            port = _free_port()
            cmd = [sys.executable, "-m", "shoal.runtime.cli", "router", "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
                   *(["--model", model] if model else []), *router_args]
            for url in group_urls:
                cmd += ["--backend", url]
            routers[policy] = (f"http://127.0.0.1:{port}", _start(cmd))
            procs.append(routers[policy][1])
        for url, proc in zip(group_urls, procs):
            _wait_ready(url, proc, startup_timeout)
        for url, proc in routers.values():
            _wait_router(url, proc, groups, startup_timeout)
        report: dict = {"groups": groups}
        for name, policy, salt in (("round_robin", "round-robin", 1), ("router", "prefix", 2)):
            h0, q0 = _prefix_counts(group_urls)
            s = asyncio.run(run_load(routers[policy][0], make_items(salt), request_rate=request_rate, max_concurrency=max_concurrency, seed=seed))
            h1, q1 = _prefix_counts(group_urls)
            s.pop("samples", None)
            report[name] = {"hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0, "ttft_p50_s": s["ttft_s"]["p50"], "ttft_p99_s": s["ttft_s"]["p99"],
                            "failed": s["failed"], "summary": s}
            print(f"{name:12s} prefix-cache hit rate {report[name]['hit_rate']:.3f}  TTFT p50 {1000 * (s['ttft_s']['p50'] or 0):.1f} ms  "
                  f"p99 {1000 * (s['ttft_s']['p99'] or 0):.1f} ms  ({s['completed']} ok, {s['failed']} failed, {s['duration_s']:.1f} s)", flush=True)
        rr, rt = report["round_robin"], report["router"]
        report["hit_rate_ratio"] = rt["hit_rate"] / rr["hit_rate"] if rr["hit_rate"] else math.inf
        report["ttft_p50_speedup"] = (rr["ttft_p50_s"] / rt["ttft_p50_s"]) if rt["ttft_p50_s"] else None
        low = asyncio.run(_direct_vs_router(group_urls[0], routers["prefix"][0], low_load_prompts, seed))
        low["router_own_mean_ms"] = _router_overhead_ms(routers["prefix"][0])
        report["low_load_ttft_p50_s"] = low
        print(f"hit rate router / round-robin {report['hit_rate_ratio']:.2f}x (target >= 2x); median TTFT round-robin / router "
              f"{report['ttft_p50_speedup'] or 0:.2f}x (target >= 1.5x); low load: median TTFT direct {1000 * low['direct']:.1f} ms, "
              f"via router {1000 * low['via_router']:.1f} ms, added {low['added_ms']:.1f} ms (target <= 2 ms); the router's own time "
              f"before sending a request: {low['router_own_mean_ms']:.2f} ms mean", flush=True)
        return report
    finally:
        _stop(procs)


# ------------------------------------------------------------------------------ CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server to load (not with --compare-offline)")
    parser.add_argument("--model", default=None, help="model name in the requests (default: the server's)")
    parser.add_argument("--api-key", default=os.environ.get("SHOAL_API_KEY"))
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (default inf: all at once)")
    parser.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    parser.add_argument("--sweep", default=None, help="comma-separated request rates to run one after another (for --plot)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--input-len", default="16:1024", help="MIN:MAX prompt tokens (log-uniform)")
    parser.add_argument("--output-len", default="16:512", help="MIN:MAX output tokens (log-uniform)")
    parser.add_argument("--workload", choices=["sharegpt", "public", "multi-tenant"], default="sharegpt",
                        help="public: PERFORMANCE.md's 32-request workload; multi-tenant: --tenants x --conversations x --turns requests")
    mt = parser.add_argument_group("multi-tenant workload")
    mt.add_argument("--tenants", type=int, default=8, help="tenants, each with its own system prompt")
    mt.add_argument("--conversations", type=int, default=2, help="conversations per tenant")
    mt.add_argument("--turns", type=int, default=3, help="turns per conversation (each repeats the previous ones)")
    mt.add_argument("--system-len", type=int, default=256, help="tokens of each tenant's system prompt")
    mt.add_argument("--turn-len", default="32:64", help="MIN:MAX tokens of each user message")
    mt.add_argument("--answer-len", type=int, default=16, help="tokens generated per turn (and repeated in the next)")
    parser.add_argument("--compare-router", action="store_true",
                        help="start --groups `shoal serve` groups (--engine-args) and `shoal router` --policy prefix and round-robin; compare")
    parser.add_argument("--groups", type=int, default=3, help="with --compare-router: how many groups")
    parser.add_argument("--router-args", default="", help="with --compare-router: more `shoal router` flags, one string")
    parser.add_argument("--low-load-prompts", type=int, default=20, help="with --compare-router: requests of the direct vs router TTFT check")
    parser.add_argument("--json", dest="json_out", default=None, help="write the results here")
    parser.add_argument("--plot", default=None, help="PNG: latency against request rate (with --sweep), or its distribution (one rate)")
    parser.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"], help="the API to load")
    parser.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLOs for goodput: ttft:MS tpot:MS e2el:MS (as vLLM's)")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    parser.add_argument("--compare-offline", action="store_true", help="measure HTTP overhead: offline LLM vs a `shoal serve` subprocess")
    parser.add_argument("--engine-args", default="", help="with --compare-offline / --compare-router: engine flags, one string (e.g. '--max-num-seqs 64')")
    parser.set_defaults(func=run)


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def workload_from_args(args, salt: int = 0) -> list[Item]:
    from shoal.runtime.bench import workloads

    if args.workload == "multi-tenant":
        return workloads.multi_tenant(args.tenants, args.conversations, args.turns, args.system_len, _range(args.turn_len),
                                      args.answer_len, args.seed, salt)
    if args.workload == "public":
        return workloads.public_workload(args.num_prompts if args.num_prompts != 100 else 32, args.seed)
    return workloads.sharegpt_like(args.num_prompts, args.seed, _range(args.input_len), _range(args.output_len))


def _engine_kwargs(engine_args: list[str]) -> dict:
    from shoal.runtime.config import EngineConfig, add_engine_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    ns = p.parse_args(engine_args)
    known = {f for f in EngineConfig.__dataclass_fields__}
    return {k: v for k, v in vars(ns).items() if k in known and v is not None}


def run(args: argparse.Namespace) -> int:
    if args.compare_router:
        import shlex

        report = compare_router(lambda salt: workload_from_args(args, salt), shlex.split(args.engine_args or ""), groups=args.groups,
                                router_args=shlex.split(args.router_args or ""), request_rate=args.request_rate,
                                max_concurrency=args.max_concurrency, low_load_prompts=args.low_load_prompts, seed=args.seed)
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(report, f, indent=2, default=str)
        return 0 if report["router"]["failed"] == report["round_robin"]["failed"] == 0 else 1
    items = workload_from_args(args)
    if args.compare_offline:
        import shlex

        engine_args = shlex.split(args.engine_args or "")
        report = http_overhead(items, engine_args, _engine_kwargs(engine_args))
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(report, f, indent=2, default=str)
        return 0
    rates = [float(x) for x in args.sweep.split(",")] if args.sweep else [args.request_rate]
    try:
        slos = parse_goodput(args.goodput)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    summaries = []
    for rate in rates:
        s = asyncio.run(run_load(args.base_url, items, request_rate=rate, max_concurrency=args.max_concurrency, model=args.model, api_key=args.api_key, seed=args.seed,
                                 endpoint=args.endpoint, goodput=slos, progress=not args.disable_tqdm))
        summaries.append(s)
        print(format_summary(s))
        print()
    if args.json_out:
        with open(args.json_out, "w") as f:
            runs = [{k: v for k, v in s.items() if k != "samples"} for s in summaries]
            json.dump({"workload": {"kind": args.workload, "num_prompts": len(items), "seed": args.seed}, "runs": runs}, f, indent=2)
    if args.plot:
        if plot_sweep(summaries, args.plot):
            print(f"plot written to {args.plot}")
    return 0 if all(s["failed"] == 0 for s in summaries) else 1


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="shoal bench serve")
    add_arguments(p)
    a = p.parse_args()
    sys.exit(a.func(a))
