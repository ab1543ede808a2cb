"""Issue 35: `shoal router` under real clients, over real HTTP with real groups.

Clients that leave (held, or before the first byte), prompts too long for any group, chats
with tools, and a group killed with streamed chats queued on it. The tests run in file
order and share the module's groups."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import socket
import time

import httpx
import pytest

from shoal.runtime.router.backends import EXPECT_S

from router_helpers import backends_state, start_group, start_router, wait_for
from server_helpers import free_port, wait_until_ready


def metric(base_url: str, name: str, **labels) -> float:
    from shoal.runtime.metrics import metric_value

    return metric_value(httpx.get(base_url + "/metrics", timeout=30).text, name, **labels) or 0.0


def finished(group: str, reason: str) -> float:
    return metric(group, "shoal_request_success_total", finished_reason=reason)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, builtin_dir):
    from engine_helpers import make_tiny_model

    # wider than the other router tests' model: a long answer takes long enough to watch it run
    return make_tiny_model(tmp_path_factory.mktemp("tiny-router-clients"), builtin_dir, hidden_size=256, intermediate_size=512)


def chat_body(user: str, max_tokens: int = 4, **extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": user}], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **extra}


# ------------------------------------------------------------------ 1: a held client that leaves
@pytest.fixture(scope="module")
def late(model_dir):
    """A router whose one group is not there yet (--max-pending 1), then the group."""
    port = free_port()
    router = start_router([f"http://127.0.0.1:{port}"], "--tokenizer", str(model_dir), "--max-pending", "1", "--pending-timeout", "300")
    state = {"router": router, "port": port, "group": None}
    yield state
    assert router.stop() == 0, router.log()[-3000:]
    if state["group"] is not None:
        state["group"].stop()


def test_a_held_request_whose_client_left_is_dropped_at_once_and_never_sent(late, model_dir):
    router = late["router"]
    with pytest.raises(httpx.TimeoutException):  # the client gives up while held, and closes its connection
        httpx.post(router.base_url + "/v1/chat/completions", json=chat_body("gone"), timeout=1.5)
    wait_for(lambda: metric(router.base_url, "shoal_router_pending_requests") == 0, timeout=10, what="the held slot freed")
    assert metric(router.base_url, "shoal_router_abandoned_total") == 1
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        live = pool.submit(httpx.post, router.base_url + "/v1/chat/completions", json=chat_body("here"), timeout=300)
        wait_for(lambda: metric(router.base_url, "shoal_router_pending_requests") == 1, what="the live client held, not refused")
        assert not live.done()
        group = late["group"] = start_group(model_dir, port=late["port"])
        r = live.result()
    assert r.status_code == 200, r.text
    assert metric(router.base_url, "shoal_router_rejected_total", reason="pending_full") == 0
    # the group ran the live request only: the abandoned one was never forwarded
    assert finished(group.base_url, "length") == 1 and finished(group.base_url, "abort") == 0


# ------------------------------------------------------------------ 2: a client that leaves before the first byte
def test_a_client_gone_before_the_first_byte_is_aborted_at_the_group(late):
    router, group = late["router"], late["group"]
    body = json.dumps({"model": "m", "prompt": "A long answer:", "max_tokens": 480, "n": 8, "ignore_eos": True}).encode()
    host, port = router.base_url.rsplit("/", 1)[1].split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    wait_for(lambda: metric(group.base_url, "shoal_num_requests_running") > 0, what="the request running on the group")
    sock.close()  # non-streamed: nothing was sent back yet
    wait_for(lambda: metric(group.base_url, "shoal_num_requests_running") == 0, timeout=10, what="the group idle again")
    assert finished(group.base_url, "abort") == 1  # aborted, not finished: 480 tokens x 8 were far from done
    assert finished(group.base_url, "length") == 1  # still only test 1's request
    assert metric(router.base_url, "shoal_router_abandoned_total") == 2
    wait_for(lambda: all(b["in_flight"] == 0 for b in backends_state(router).values()), timeout=10, what="no request in flight")


# ------------------------------------------------------------------ 3: prompts too long for any group
def test_a_prompt_too_long_for_the_groups_is_not_tokenized_by_the_router(late):
    router, group = late["router"], late["group"]
    huge = "tide " * (7 * 2**20 // 5)  # 7 MiB: under --max-body-bytes, far past the context in characters
    bodies = [("/v1/completions", {"model": "m", "prompt": huge, "max_tokens": 1}),
              ("/v1/chat/completions", chat_body(huge))]
    normal = ("/v1/chat/completions", chat_body("Short and sweet. " * 60))
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(httpx.post, router.base_url + path, json=body, timeout=300) for path, body in bodies + [normal]]
        results = [f.result() for f in futures]
    for r, (path, body) in zip(results[:2], bodies):
        direct = httpx.post(group.base_url + path, json=body, timeout=300)
        assert r.status_code == direct.status_code == 400
        assert r.json()["error"] == direct.json()["error"] and "without tokenizing" in r.json()["error"]["message"]
    assert results[2].status_code == 200, results[2].text
    assert metric(router.base_url, "shoal_router_unhashed_total", reason="too_long") == 2


# ------------------------------------------------------------------ 4, 5: two groups, session affinity
TOOLS = [{"type": "function", "function": {
    "name": f"harbour_{name}", "description": f"Look up the harbour's {name} for a given day and berth, with every detail the master keeps.",
    "parameters": {"type": "object", "properties": {"day": {"type": "string"}, "berth": {"type": "integer"}}, "required": ["day"]}}}
    for name in ("tides", "moorings", "fuel")]


@pytest.fixture(scope="module")
def pair(model_dir):
    groups = [start_group(model_dir, wait=False, extra=("--max-num-seqs", "2")) for _ in range(2)]
    router = start_router([g.base_url for g in groups], "--tokenizer", str(model_dir), "--session-header", "x-session-id",
                          "--pending-timeout", "120")
    try:
        for g in groups:
            wait_until_ready(g)
        wait_for(lambda: all(b["ready"] for b in backends_state(router).values()), what="both groups ready at the router")
        yield groups, router
    finally:
        rc = router.stop()
        for g in groups:
            g.stop()
    assert rc == 0, router.log()[-3000:]


def test_a_chat_with_tools_goes_to_the_group_holding_its_prefix(pair):
    """The router renders the tools as the server does (its tool template), so the blocks it
    hashes are the ones the group cached."""
    groups, router = pair
    body = chat_body("Which berth is free?", tools=TOOLS, tool_choice="required")
    first = httpx.post(router.base_url + "/v1/chat/completions", json=body, timeout=300)
    assert first.status_code == 200, first.text
    home = first.headers["x-shoal-backend"]
    wait_for(lambda: backends_state(router)[home]["blocks"] > 0, what="the home's blocks polled")
    picks = metric(router.base_url, "shoal_router_picks_total", reason="prefix")
    hits = metric(home, "shoal_prefix_cache_hits_total")
    for i in range(2):
        # past the while the router counts what it just sent as held (EXPECT_S): only the
        # blocks the group's polls report can match, which the router must have rendered alike
        time.sleep(EXPECT_S + 0.5)
        r = httpx.post(router.base_url + "/v1/chat/completions", json=dict(body, messages=[{"role": "user", "content": f"And berth {i}?"}]),
                       timeout=300)
        assert r.status_code == 200 and r.headers["x-shoal-backend"] == home
    assert metric(router.base_url, "shoal_router_picks_total", reason="prefix") - picks == 2
    assert metric(home, "shoal_prefix_cache_hits_total") - hits >= 2 * 16 * 4  # the tools' blocks, reused


def test_a_group_killed_with_streamed_chats_queued_loses_none(pair):
    groups, router = pair
    session = {"x-session-id": "harbour-night-shift"}
    first = httpx.post(router.base_url + "/v1/chat/completions", json=chat_body("Start the watch."), headers=session, timeout=300)
    home = first.headers["x-shoal-backend"]
    victim = next(g for g in groups if g.base_url == home)
    other = next(g for g in groups if g.base_url != home)

    def stream(body: dict) -> tuple[str, str, str | None]:
        text, finish = "", None
        try:
            with httpx.stream("POST", router.base_url + "/v1/chat/completions", json=dict(body, stream=True), headers=session, timeout=300) as r:
                backend = r.headers.get("x-shoal-backend")
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        choice = json.loads(line[6:])["choices"][0]
                        text += choice["delta"].get("content") or ""
                        finish = choice["finish_reason"] or finish
        except httpx.HTTPError:
            return "", "cut", None
        return text, backend, finish

    queued = [chat_body(f"Log entry {i}: a ship passed.", max_tokens=8) for i in range(3)]
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        # two long answers fill the home's batch (--max-num-seqs 2); the chats queue behind them
        busy = [pool.submit(stream, chat_body(f"Tell a long tale {i}.", max_tokens=400)) for i in range(2)]
        wait_for(lambda: metric(home, "shoal_num_requests_running") == 2, what="the home's batch full")
        futures = [pool.submit(stream, body) for body in queued]
        wait_for(lambda: metric(home, "shoal_num_requests_waiting") == 3, what="three chats queued on the home")
        victim.proc.send_signal(signal.SIGKILL)
        results = [f.result() for f in futures]
        [f.result() for f in busy]  # they had started: cut off, as from a server
    for body, (text, backend, finish) in zip(queued, results):
        assert backend == other.base_url and finish == "length", (backend, finish)
        direct = httpx.post(other.base_url + "/v1/chat/completions", json=body, timeout=300).json()
        assert text == direct["choices"][0]["message"]["content"]  # the whole answer, nothing lost
    assert metric(router.base_url, "shoal_router_retries_total") >= 3
