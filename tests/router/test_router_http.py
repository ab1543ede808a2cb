"""`shoal router` in front of three real `shoal serve` groups on loopback (a tiny random-weight
model, a small KV cache), over real HTTP.

The tests run in file order and share the groups: the first ones route with all three up,
then one group is killed mid-run, then every group is gone and one comes back.
"""

from __future__ import annotations

import concurrent.futures
import signal
import subprocess
import sys
import time

import httpx
import pytest

from router_helpers import backends_state, start_group, start_router, wait_for, wait_router
from server_helpers import wait_until_ready

SYSTEM = ("You are the harbour master's assistant. Answer questions about tides, moorings, fuel, "
          "the chandlery's opening hours and the weather, briefly and politely. ") * 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, builtin_dir):
    from engine_helpers import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-router"), builtin_dir)


@pytest.fixture(scope="module")
def cluster(model_dir):
    """Three groups and the router, all started at once (the router polls groups still loading)."""
    groups = [start_group(model_dir, wait=False) for _ in range(3)]
    router = start_router([g.base_url for g in groups], "--tokenizer", str(model_dir), "--pending-timeout", "120", wait=False)
    try:
        for g in groups:
            wait_until_ready(g)
        wait_router(router)
        wait_for(lambda: all(b["ready"] for b in backends_state(router).values()), what="every backend ready at the router")
        yield groups, router
    finally:
        rc = router.stop()
        for g in groups:
            if g.proc.poll() is None:
                g.proc.send_signal(signal.SIGTERM)  # all drain at once
        for g in groups:
            g.stop()
    assert rc == 0, router.log()[-3000:]


@pytest.fixture(scope="module")
def groups(cluster):
    return cluster[0]


@pytest.fixture(scope="module")
def router(cluster):
    return cluster[1]


def chat(base_url: str, user: str, system: str = SYSTEM, max_tokens: int = 4, **extra) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}
    return httpx.post(base_url + "/v1/chat/completions", json=body, timeout=300)


def metric(base_url: str, name: str, **labels) -> float:
    from shoal.runtime.metrics import metric_value

    return metric_value(httpx.get(base_url + "/metrics", timeout=30).text, name, **labels) or 0.0


def test_the_router_imports_no_engine():
    code = ("import sys; import shoal.runtime.router.app, shoal.runtime.router.args, shoal.runtime.router.hashing; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('shoal.runtime.engine', 'shoal.runtime.executor', "
            "'shoal.runtime.layers', 'shoal.runtime.models.decoder'))]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_servers_publish_the_hashes_the_router_computes(groups, model_dir):
    """GET /kv/blocks lists, after a request, the block hashes of its prompt as this process
    computes them from transformers' own chat template and tokenizer."""
    from transformers import AutoTokenizer

    from shoal.runtime.cache.block_pool import block_hashes

    g = groups[0]
    first = httpx.get(g.base_url + "/kv/blocks", timeout=30).json()
    assert first["reset"] and first["ready"] and first["block_size"] == 16
    r = chat(g.base_url, "When is high tide?")
    assert r.status_code == 200, r.text
    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When is high tide?"}],
                                   tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    expect = block_hashes(ids, 16)
    delta = httpx.get(g.base_url + "/kv/blocks", params={"since": first["seq"], "epoch": first["epoch"]}, timeout=30).json()
    assert not delta["reset"] and set(expect) <= set(delta["stored"])
    again = httpx.get(g.base_url + "/kv/blocks", params={"since": delta["seq"], "epoch": delta["epoch"]}, timeout=30).json()
    assert again["stored"] == [] and again["seq"] == delta["seq"]
    assert httpx.get(g.base_url + "/kv/blocks", params={"since": 0, "epoch": "another"}, timeout=30).json()["reset"]
    bad = httpx.get(g.base_url + "/kv/blocks", params={"since": "soon"}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "since"


def test_requests_sharing_a_prefix_go_to_the_group_that_holds_it(router, groups):
    import openai

    system = "You keep the lighthouse log: record every ship that passes, its flag, its heading and the hour. " * 6
    first = chat(router.base_url, "A trawler passed at dawn.", system=system)
    assert first.status_code == 200, first.text
    home = first.headers["x-shoal-backend"]
    hits_before = metric(home, "shoal_prefix_cache_hits_total")
    client = openai.OpenAI(base_url=router.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    for i in range(4):
        raw = client.chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "system", "content": system}, {"role": "user", "content": f"Ferry number {i} at noon."}],
            max_tokens=3, temperature=0, stream=True)
        assert raw.headers["x-shoal-backend"] == home
        chunks = list(raw.parse())
        assert chunks[-1].choices[0].finish_reason == "length"
    assert metric(home, "shoal_prefix_cache_hits_total") - hits_before >= 4 * 100  # the shared system prompt, reused
    assert metric(router.base_url, "shoal_router_picks_total", reason="prefix") >= 4
    # the other groups saw none of these
    others = [g.base_url for g in groups if g.base_url != home]
    assert all(metric(o, "shoal_prefix_cache_hits_total") < 100 for o in others)
    # every relayed response gave its backend slot back, once
    wait_for(lambda: all(b["in_flight"] == 0 for b in backends_state(router).values()), timeout=10, what="no request in flight")


def test_plain_endpoints_pass_through(router):
    models = httpx.get(router.base_url + "/v1/models", timeout=30)
    assert models.status_code == 200 and models.json()["data"][0]["object"] == "model"
    tok = httpx.post(router.base_url + "/tokenize", json={"prompt": "hello there"}, timeout=30)
    assert tok.status_code == 200 and tok.json()["count"] >= 2
    bad = httpx.post(router.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": -1}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    assert httpx.get(router.base_url + "/nope", timeout=30).status_code == 404
    text = httpx.get(router.base_url + "/metrics", timeout=30).text
    for name in ("shoal_router_picks_total", "shoal_router_retries_total", "shoal_router_pending_requests",
                 "shoal_router_backend_score", "shoal_router_backend_blocks", "shoal_router_rejected_total",
                 "shoal_router_overhead_seconds_count"):
        assert name in text, name


def test_a_group_killed_mid_run_loses_no_request_that_had_not_started(router, groups):
    victim = groups[2]
    n, tokens = 12, 256  # long enough to be seen in flight: 32 of the tiny model's tokens could end between two polls

    def one(i):
        body = {"model": "m", "prompt": f"Request {i}: " + "tide " * (20 + i), "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
        r = httpx.post(router.base_url + "/v1/completions", json=body, timeout=300)
        return r, time.monotonic()

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(one, i) for i in range(n)]
        wait_for(lambda: backends_state(router)[victim.base_url]["in_flight"] > 0, what="requests on the victim")
        killed_at = time.monotonic()
        victim.proc.send_signal(signal.SIGKILL)
        answered = [f.result() for f in futures]
    results = [r for r, _ in answered]
    assert [r.status_code for r in results] == [200] * n, [r.text[:200] for r in results if r.status_code != 200]
    assert all(r.json()["usage"]["completion_tokens"] == tokens for r in results)
    # the victim answered only what it had finished as it was killed (on a loaded machine one may end
    # between the check above and the kill); everything else went elsewhere
    assert all(t < killed_at + 1.0 for r, t in answered if r.headers["x-shoal-backend"] == victim.base_url)
    assert metric(router.base_url, "shoal_router_retries_total") >= 1
    wait_for(lambda: not backends_state(router)[victim.base_url]["ready"], what="the victim marked down")


def test_with_every_group_gone_requests_are_held_then_answered(router, groups, model_dir):
    for g in groups[:2]:
        g.proc.send_signal(signal.SIGKILL)
    for g in groups:
        g.proc.wait(30)
    wait_for(lambda: not any(b["ready"] for b in backends_state(router).values()), what="no backend ready")
    n = 3
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(chat, router.base_url, f"Anyone there? {i}") for i in range(n)]
        wait_for(lambda: metric(router.base_url, "shoal_router_pending_requests") == n, what="three held requests")
        assert not any(f.done() for f in futures)
        back = start_group(model_dir, port=groups[0].extra["port"], wait=False)  # the same address comes back
        groups[0] = back  # stopped by the fixture
        results = [f.result() for f in futures]
    assert [r.status_code for r in results] == [200] * n, [r.text[:300] for r in results]
    assert {r.headers["x-shoal-backend"] for r in results} == {back.base_url}
    assert metric(router.base_url, "shoal_router_pending_requests") == 0


def test_held_requests_are_refused_past_the_bounds(groups):
    """A second router whose one backend never answers: --max-pending 1, --pending-timeout 1."""
    dead = "http://127.0.0.1:9"  # discard port: nothing listens
    r = start_router([dead], "--policy", "round-robin", "--max-pending", "1", "--pending-timeout", "1")
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            held = pool.submit(chat, r.base_url, "first")
            wait_for(lambda: metric(r.base_url, "shoal_router_pending_requests") == 1, what="one held request")
            t0 = time.monotonic()
            full = chat(r.base_url, "second")
            assert full.status_code == 503 and full.headers["retry-after"] == "1"
            assert full.json()["error"]["code"] == "pending_full"
            late = held.result()
        assert late.status_code == 503 and late.json()["error"]["code"] == "no_backend" and late.headers["retry-after"]
        assert time.monotonic() - t0 < 60
        assert metric(r.base_url, "shoal_router_rejected_total", reason="pending_full") == 1
        assert metric(r.base_url, "shoal_router_rejected_total", reason="no_backend") == 1
    finally:
        assert r.stop() == 0, r.log()[-3000:]
