"""A real Prometheus scrapes a real `shoal serve` on loopback.

The server runs the built-in model (the first run converts it into $SHOAL_CACHE, which
can take minutes; later runs reuse the cache). Prometheus uses the `shoal-runtime` job
of manifests/monitoring/prometheus-scrape-configs.yaml, with Kubernetes discovery
replaced by a static target that carries the pod's __meta labels, so the series get
the same namespace/pod/inference_deployment/group labels as in a cluster, and it
evaluates rules.yaml every second.

SHOAL_TEST_SERVE_TIMEOUT (seconds, default 900) bounds the wait for GET /ready.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from monitoring_helpers import (
    DASHBOARDS, REPO, RULES, RUNTIME_METRICS, dashboard_exprs, free_port, grafana_substitute,
    promql_metric_names, scrape_jobs, static_scrape_job,
)

NAMESPACE, DEPLOYMENT, GROUP, POD = "default", "scrape-test", "scrape-test-0", "scrape-test-0-0"
SERVE_TIMEOUT = float(os.environ.get("SHOAL_TEST_SERVE_TIMEOUT", "900"))


def shoal_binary() -> str:
    venv = Path(sys.executable).parent / "shoal"
    found = str(venv) if venv.exists() else shutil.which("shoal")
    assert found, "the `shoal` console script is not installed (pip install -e .)"
    return found


@pytest.fixture(scope="module")
def shoal_server(tmp_path_factory):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path_factory.mktemp("shoal-serve") / "serve.log"
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "2")  # a shared 2-core machine
    log = open(log_path, "wb")
    # the built-in model with a small KV cache and context: cheap on a shared CPU machine
    cmd = [shoal_binary(), "serve", "--port", str(port), "--host", "127.0.0.1",
           "--max-model-len", "1024", "--kv-cache-memory", "256MiB", "--max-num-seqs", "8"]
    proc = subprocess.Popen(cmd,
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)

    def tail() -> str:
        log.flush()
        return log_path.read_text(errors="replace")[-4000:]

    try:
        deadline = time.monotonic() + SERVE_TIMEOUT
        with httpx.Client(base_url=url, timeout=5.0) as client:
            while True:
                if proc.poll() is not None:
                    pytest.fail(f"`shoal serve` exited with {proc.returncode} before it was ready:\n{tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get("/ready").status_code == 200:
                        break
                if time.monotonic() > deadline:
                    pytest.fail(f"`shoal serve` not ready after {SERVE_TIMEOUT:.0f}s:\n{tail()}")
                time.sleep(1.0)
        yield {"url": url, "port": port, "tail": tail}
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        log.close()


@pytest.fixture(scope="module")
def scraping_prometheus(shoal_server, start_prometheus):
    labels = {
        "__meta_kubernetes_pod_annotation_prometheus_io_scrape": "true",
        "__meta_kubernetes_pod_annotation_prometheus_io_port": str(shoal_server["port"]),
        "__meta_kubernetes_pod_annotation_prometheus_io_path": "/metrics",
        "__meta_kubernetes_namespace": NAMESPACE,
        "__meta_kubernetes_pod_name": POD,
        "__meta_kubernetes_pod_label_shoal_dev_deployment": DEPLOYMENT,
        "__meta_kubernetes_pod_label_shoal_dev_group": GROUP,
    }
    job = static_scrape_job(scrape_jobs()["shoal-runtime"], [(f"127.0.0.1:{shoal_server['port']}", labels)])
    job["scrape_interval"] = "250ms"
    job["scrape_timeout"] = "250ms"
    prom = start_prometheus(scrape_configs=[job], rule_files=[RULES], interval="1s")
    prom.wait_for('up{job="shoal-runtime"} == 1', timeout=30, what="the first successful scrape of shoal serve")
    # one scrape before any traffic, so that rate() sees the counters move
    prom.wait_for('shoal_time_to_first_token_seconds_count{job="shoal-runtime"}', timeout=30)
    return prom


@pytest.fixture(scope="module")
def model_name(shoal_server) -> str:
    resp = httpx.get(f"{shoal_server['url']}/v1/models", timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()["data"][0]["id"]


def complete(url: str, model: str, prompt: str, max_tokens: int = 8, **extra) -> dict:
    resp = httpx.post(f"{url}/v1/completions", timeout=300,
                      json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **extra})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["choices"] and isinstance(body["choices"][0]["text"], str)
    return body


def finite(result) -> bool:
    return bool(result) and all(math.isfinite(float(r["value"][1])) for r in result)


@pytest.fixture(scope="module")
def after_traffic(shoal_server, scraping_prometheus, model_name):
    for prompt in ("The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,"):
        complete(shoal_server["url"], model_name, prompt)
    return scraping_prometheus


def test_ttft_p99_and_queue_depth_have_values(after_traffic, model_name):
    prom = after_traffic
    ttft = prom.wait_for(
        'histogram_quantile(0.99, sum by (le) (rate(shoal_time_to_first_token_seconds_bucket{job="shoal-runtime"}[1m])))',
        predicate=finite, timeout=30, what="a finite TTFT p99")
    assert float(ttft[0]["value"][1]) > 0

    depth = prom.query('sum by (namespace, inference_deployment, group) '
                       '(shoal_num_requests_running{job="shoal-runtime"} + shoal_num_requests_waiting{job="shoal-runtime"})')
    assert len(depth) == 1, depth
    assert depth[0]["metric"] == {"namespace": NAMESPACE, "inference_deployment": DEPLOYMENT, "group": GROUP}
    assert float(depth[0]["value"][1]) >= 0

    # every runtime series carries model_name, the name /v1/models reports
    running = prom.query('shoal_num_requests_running{job="shoal-runtime"}')
    assert running and running[0]["metric"]["model_name"] == model_name
    assert running[0]["metric"]["pod"] == POD


def test_recording_rules_work_on_real_series(after_traffic, model_name):
    prom = after_traffic
    depth = prom.wait_for(f'shoal:group_queue_depth{{group="{GROUP}"}}', timeout=30)
    assert depth[0]["metric"]["model_name"] == model_name
    target = prom.wait_for(f'shoal:inferencedeployment_target_queue_depth{{inference_deployment="{DEPLOYMENT}"}}',
                           timeout=30)
    assert float(target[0]["value"][1]) == 32  # no kube-state-metrics here: the CRD default
    prom.wait_for(f'shoal:time_to_first_token_seconds:quantile_5m{{quantile="0.99",inference_deployment="{DEPLOYMENT}"}}',
                  predicate=finite, timeout=30, what="the recorded TTFT p99")
    prom.wait_for(f'shoal:generation_tokens:rate5m{{inference_deployment="{DEPLOYMENT}"}} > 0', timeout=30)


def test_queue_depth_rises_under_load(shoal_server, after_traffic, model_name):
    """Two requests at once: a scrape (every 0.25 s) sees them held, as the autoscaler would."""
    prom = after_traffic
    errors: list[BaseException] = []

    def one(n: int) -> None:
        try:
            # 96 tokens each, no early EOS: seconds of work, so several 1 s rule evaluations
            # see the requests held even when the decode step is fast
            complete(shoal_server["url"], model_name, f"Count to {n}:", 96, ignore_eos=True)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(n,), daemon=True) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "completions still running after 300 s"
    time.sleep(1.5)  # the last scrape
    peak = prom.query(f'max_over_time(shoal:group_queue_depth{{group="{GROUP}"}}[5m])')
    assert peak and float(peak[0]["value"][1]) >= 1, (
        f"queue depth never rose above 0 while 2 requests ran: {peak}\n"
        f"{json.dumps(prom.query('max_over_time(shoal_num_requests_running[5m])'))}")


def test_runtime_panels_of_the_dashboard_show_data(after_traffic):
    """Dashboard panels that read only runtime series return data once requests ran
    (operator and kube-state-metrics panels stay empty here: no cluster)."""
    prom = after_traffic
    empty = []
    for path in DASHBOARDS:
        for where, expr in dashboard_exprs(json.loads(path.read_text())):
            names = promql_metric_names(grafana_substitute(expr))
            if names and names <= RUNTIME_METRICS:
                query = grafana_substitute(expr).replace("[5m]", "[1m]")
                if not prom.query(query):
                    empty.append(f"{path.name} {where}: {expr}")
    assert not empty, "no data for:\n" + "\n".join(empty)
