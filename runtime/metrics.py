"""Prometheus series of the runtime (docs/design.md, Metrics): names mirror vLLM's, prefix `shoal_`.

One `ServerMetrics` per server, on its own registry (no global state, so tests can build
several). Every series carries `model_name`. The engine thread calls `update_from_stats`
after every step and the `observe_*` methods as requests produce tokens; prometheus_client
is thread-safe, so the HTTP side renders `/metrics` concurrently.
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("PROMETHEUS_DISABLE_CREATED_SERIES", "True")

from prometheus_client import (  # noqa: E402
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

# Buckets as in vLLM (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# engine.stats() counter field -> series name (without _total)
_COUNTERS = {
    "prompt_tokens": ("shoal_prompt_tokens", "Prompt tokens processed (prefill), cumulative"),
    "generation_tokens": ("shoal_generation_tokens", "Generated tokens, cumulative"),
    "num_preemptions": ("shoal_num_preemptions", "Sequences preempted (KV blocks reclaimed), cumulative"),
    "prefix_cache_queries": ("shoal_prefix_cache_queries", "Tokens looked up in the prefix cache, cumulative"),
    "prefix_cache_hits": ("shoal_prefix_cache_hits", "Tokens found in the prefix cache, cumulative"),
}


class ServerMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.model_name = model_name
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r, m = self.registry, ["model_name"]
        try:
            ProcessCollector(registry=r)
        except Exception:  # not on every platform
            pass
        self.running = Gauge("shoal_num_requests_running", "Requests in the running batch", m, registry=r).labels(model_name)
        self.waiting = Gauge("shoal_num_requests_waiting", "Requests waiting to be scheduled (engine queue and not yet admitted)", m, registry=r).labels(model_name)
        self.kv_usage = Gauge("shoal_kv_cache_usage_perc", "KV-cache usage, 0 to 1 (1 = 100%)", m, registry=r).labels(model_name)
        self._counters = {
            field: Counter(name, doc, m, registry=r).labels(model_name) for field, (name, doc) in _COUNTERS.items()
        }
        self._last_counts = {field: 0 for field in _COUNTERS}
        self._success = Counter("shoal_request_success", "Finished requests by finish reason", m + ["finished_reason"], registry=r)
        self._rejected = Counter("shoal_request_rejected", "Requests refused with 503 (queue full, draining, not ready)", m + ["reason"], registry=r)
        self.ttft = Histogram("shoal_time_to_first_token_seconds", "Time to first token", m, buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("shoal_inter_token_latency_seconds", "Time between consecutive output tokens", m, buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("shoal_e2e_request_latency_seconds", "Arrival to finish", m, buckets=E2E_BUCKETS, registry=r).labels(model_name)
        self.queue_time = Histogram("shoal_request_queue_time_seconds", "Arrival to first scheduled", m, buckets=E2E_BUCKETS, registry=r).labels(model_name)
        self._startup = Gauge("shoal_startup_phase_seconds", "Seconds each startup phase took (load, kv_cache, warmup, total)", m + ["phase"], registry=r)
        self.cpu_threads = Gauge("shoal_cpu_threads", "CPU threads the model's process runs (torch, OpenMP, the C decode step)", m, registry=r).labels(model_name)
        self.ready = Gauge("shoal_ready", "1 when the server accepts requests (loaded, group joined, not draining)", m, registry=r).labels(model_name)
        self.ready.set(0)
        self.lora = None  # the engine's last LoraStats (vllm:lora_requests_info)
        self._lora_loads = Counter("shoal_lora_slot_loads", "LoRA adapters written into a device slot (swaps), cumulative", m,
                                   registry=r).labels(model_name)
        self._lora_requests = Counter("shoal_lora_requests", "Requests served with each LoRA adapter", m + ["lora_name"],
                                      registry=r)
        self._lora_counts = {"loads": 0}

    # -- engine thread -----------------------------------------------------------------
    def update_from_stats(self, stats, extra_waiting: int = 0) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting + extra_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        for field, counter in self._counters.items():
            value = int(getattr(stats, field, 0) or 0)
            delta = value - self._last_counts[field]
            if delta > 0:
                counter.inc(delta)
                self._last_counts[field] = value
        lora = getattr(stats, "lora", None)
        if lora is not None:
            self.lora = lora
            self._count(self._lora_loads, "loads", lora.loads)
            for name, n in lora.requests.items():
                self._count(self._lora_requests.labels(self.model_name, name), ("requests", name), n)

    def _count(self, counter, key, value: int) -> None:
        """Raise a counter to the engine's cumulative `value`."""
        delta = value - self._lora_counts.get(key, 0)
        if delta > 0:
            counter.inc(delta)
            self._lora_counts[key] = value

    def request_finished(self, finish_reason: str | None) -> None:
        self._success.labels(self.model_name, finish_reason or "unknown").inc()

    def rejected(self, reason: str) -> None:
        self._rejected.labels(self.model_name, reason).inc()

    def startup_phase(self, phase: str, seconds: float) -> None:
        self._startup.labels(self.model_name, phase).set(seconds)

    # -- HTTP side ---------------------------------------------------------------------
    def render(self) -> tuple[bytes, str]:
        """Every shoal_* series, then the same series under vLLM's names (vllm:*), which the
        Gateway API inference extension's endpoint picker, KEDA recipes and vLLM's dashboards read."""
        text = generate_latest(self.registry)
        return text + vllm_names(text) + self._lora_info(), CONTENT_TYPE_LATEST

    def _lora_info(self) -> bytes:
        """vLLM's vllm:lora_requests_info, which the endpoint picker reads for adapter affinity:
        the adapters running and waiting (comma-separated) and the slots; as vLLM, the value is
        the time it was taken."""
        lora = self.lora
        running, waiting = (",".join(lora.running), ",".join(lora.waiting)) if lora else ("", "")
        labels = {"max_lora": str(lora.max_lora if lora else 0), "model_name": self.model_name,
                  "running_lora_adapters": running, "waiting_lora_adapters": waiting}
        text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
        return (b"# HELP vllm:lora_requests_info Running stats on LoRA requests.\n# TYPE vllm:lora_requests_info gauge\n"
                + f"vllm:lora_requests_info{{{text}}} {time.time()}\n".encode())


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def vllm_names(text: bytes) -> bytes:
    """The shoal_* families of a Prometheus text exposition, renamed vllm:* (same labels, same buckets)."""
    out = []
    for line in text.decode().splitlines():
        if line.startswith(("# HELP shoal_", "# TYPE shoal_")):
            out.append(line[:7] + "vllm:" + line[13:])
        elif line.startswith("shoal_"):
            out.append("vllm:" + line[6:])
    return ("\n".join(out) + "\n").encode() if out else b""


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value}; a small helper for tests and the benchmark."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            out[key] = float(value)
        except ValueError:
            pass
    return out


def metric_value(text: str, name: str, **labels) -> float | None:
    """The first sample of series `name` whose labels include `labels`, from Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None
