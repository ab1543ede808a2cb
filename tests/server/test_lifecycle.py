"""A second `shoal serve` of its own: API key, backpressure, the stall watchdog, startup
metrics, and SIGTERM draining (in-flight request completes, new ones get 503, exit 0)."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import openai
import pytest

from server_helpers import metric, served
from shoal.runtime import cpu_threads

MODEL = "smollm2-135m-instruct"
KEY = "sk-test-not-a-real-secret-0123456789"


@pytest.fixture(scope="module")
def guarded():
    # A tiny batch and queue (backpressure is reachable), a short stall timeout (a long
    # prefill step trips the watchdog), a key from the environment.
    with served(["--max-num-seqs", "2", "--max-waiting", "2", "--stall-timeout", "0.4", "--max-num-batched-tokens", "1024", "--drain-timeout", "120"],
                env={"SHOAL_API_KEY": KEY}, clean_exit=False) as s:
        yield s


def test_startup_phases_logged_and_exported(server):
    assert server.saw_unready_while_alive, "/ready should be 503 (and /health 200) while the model loads"
    for phase in ("load", "kv_cache", "warmup", "total"):
        value = metric(server.base_url, "shoal_startup_phase_seconds", model_name=MODEL, phase=phase)
        assert value is not None and value > 0, phase
        assert f"startup phase {phase}" in server.log()
    assert metric(server.base_url, "shoal_ready", model_name=MODEL) == 1
    # threads from the CPUs the process may use (affinity, cgroup quota), logged and exported
    assert metric(server.base_url, "shoal_cpu_threads", model_name=MODEL) == cpu_threads.num_threads()
    assert f"CPU threads: {cpu_threads.num_threads()} (affinity" in server.log()


def test_api_key(guarded):
    url = guarded.base_url
    assert httpx.post(url + "/v1/completions", json={"prompt": "x"}).status_code == 401
    wrong = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url + "/v1/models", headers={"Authorization": f"Basic {KEY}"}).status_code == 401
    for open_path in ("/health", "/ready", "/metrics"):
        assert httpx.get(url + open_path).status_code == 200, open_path
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=guarded.v1, api_key="wrong", max_retries=0).models.list()
    ok = openai.OpenAI(base_url=guarded.v1, api_key=KEY, max_retries=0)
    assert ok.completions.create(model=MODEL, prompt="Hi", max_tokens=1).usage.completion_tokens == 1
    assert KEY not in guarded.log()


def test_queue_full_gets_503_with_retry_after(guarded):
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(base_url=guarded.base_url, headers=auth, timeout=300) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(12)))

    responses = asyncio.run(main())
    codes = sorted(r.status_code for r in responses)
    assert set(codes) <= {200, 503} and 503 in codes and 200 in codes, codes
    full = next(r for r in responses if r.status_code == 503)
    assert full.headers["retry-after"] and full.json()["error"]["code"] == "queue_full"
    assert metric(guarded.base_url, "shoal_request_rejected_total", model_name=MODEL, reason="queue_full") >= 1


def test_stall_watchdog(guarded):
    """/health is 503 while the engine has work and no step has finished for --stall-timeout
    (here a single 600-token prefill step), and 200 again once steps complete."""
    auth = {"Authorization": f"Bearer {KEY}"}
    seen: list[int] = []
    stop = threading.Event()

    def poll():
        with httpx.Client(timeout=10) as c:
            while not stop.is_set():
                seen.append(c.get(guarded.base_url + "/health").status_code)
                time.sleep(0.05)

    t = threading.Thread(target=poll)
    t.start()
    try:
        r = httpx.post(guarded.base_url + "/v1/completions", headers=auth, timeout=300,
                       json={"model": MODEL, "prompt": [1000 + i for i in range(600)], "max_tokens": 1})
        assert r.status_code == 200
    finally:
        stop.set()
        t.join()
    assert 503 in seen, seen
    body = httpx.get(guarded.base_url + "/health").json()
    assert httpx.get(guarded.base_url + "/health").status_code == 200, body


def test_sigterm_drains(guarded):
    """Last in this module: it stops the guarded server."""
    auth = {"Authorization": f"Bearer {KEY}"}
    url = guarded.base_url
    max_tokens = 24
    result: dict = {}
    first_token = threading.Event()

    def long_request():
        tokens, finish = 0, None
        with httpx.Client(timeout=600, headers=auth) as c:
            with c.stream("POST", url + "/v1/completions", json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens,
                                                               "ignore_eos": True, "stream": True, "logprobs": 0}) as resp:
                result["status"] = resp.status_code
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        ch = json.loads(line[6:])["choices"][0]
                        tokens += len((ch["logprobs"] or {}).get("tokens", []))
                        finish = ch["finish_reason"] or finish
                        if tokens:
                            first_token.set()
                    elif line == "data: [DONE]":
                        result["done"] = True
        result["tokens"], result["finish"] = tokens, finish

    t = threading.Thread(target=long_request)
    t.start()
    assert first_token.wait(300), "the long request never started streaming"
    guarded.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while httpx.get(url + "/ready").status_code != 503:
        assert time.monotonic() < deadline, "/ready did not turn 503 after SIGTERM"
        time.sleep(0.02)
    refused = httpx.post(url + "/v1/completions", headers=auth, json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    assert refused.status_code == 503 and refused.headers["retry-after"], refused.text
    assert refused.json()["error"]["code"] == "draining"
    assert httpx.get(url + "/health").json()["status"] in ("ok", "unhealthy")  # answers while draining (0.4 s stall timeout here)
    t.join(600)
    assert result == {"status": 200, "done": True, "tokens": max_tokens, "finish": "length"}, result
    assert guarded.proc.wait(60) == 0, guarded.log()[-3000:]
    assert "drained" in guarded.log()
