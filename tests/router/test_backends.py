"""The poller and the readiness waiters, in process: httpx's MockTransport plays the backend."""

import asyncio

import httpx

from shoal.runtime.router.backends import Backends


def fake_backend(state: dict):
    """A /kv/blocks that serves state["blocks"] as the delta protocol says (docs/router.md)."""

    def handler(request: httpx.Request) -> httpx.Response:
        if state.get("down"):
            raise httpx.ConnectError("refused", request=request)
        if not state.get("loaded"):
            return httpx.Response(503, json={"error": {"message": "loading"}})
        since, epoch = int(request.url.params["since"]), request.url.params["epoch"]
        log = state["log"]  # [(hash, stored)], event i+1 at index i
        reset = epoch != "e1" or since > len(log)
        changes = {} if reset else dict(log[since:])
        body = {"ready": True, "load": {"running": 2, "waiting": 1, "kv_cache_usage": 0.25}, "block_size": 16, "epoch": "e1",
                "seq": len(log), "reset": reset,
                "stored": sorted(state["blocks"]) if reset else [h for h, s in changes.items() if s],
                "removed": [] if reset else [h for h, s in changes.items() if not s]}
        return httpx.Response(200, json=body)

    return handler


async def test_a_held_waiter_wakes_when_the_poller_sees_a_backend_turn_ready():
    state = {"loaded": False, "blocks": set(), "log": []}
    client = httpx.AsyncClient(transport=httpx.MockTransport(fake_backend(state)))
    backends = Backends(["http://a"], poll_interval=0.01, client=client)
    await backends.start()
    try:
        waiter = asyncio.ensure_future(backends.wait_ready(30))
        await asyncio.sleep(0.1)
        assert not waiter.done() and not backends.ready()
        state["loaded"] = True
        assert await asyncio.wait_for(waiter, 5) is True
        b = backends.by_url["http://a"]
        assert b.ready and (b.running, b.waiting, b.kv_usage) == (2, 1, 0.25)
        assert await backends.wait_ready(0) is True
        state["down"] = True
        await asyncio.sleep(0.1)
        assert not b.ready and "refused" in b.last_error and not backends.any_ready.is_set()
        assert await backends.wait_ready(0.05) is False
    finally:
        await backends.stop()


async def test_deltas_and_resets_keep_the_block_set_equal_to_the_servers():
    state = {"loaded": True, "blocks": {1, 2}, "log": [(1, True), (2, True)]}
    client = httpx.AsyncClient(transport=httpx.MockTransport(fake_backend(state)))
    backends = Backends(["http://a"], poll_interval=10, client=client)
    b = backends.by_url["http://a"]
    await backends.poll_once(b)
    assert b.blocks == {1, 2} and b.seq == 2
    state["blocks"] = {2, 3}
    state["log"] += [(3, True), (1, False), (4, True), (4, False)]
    await backends.poll_once(b)
    assert b.blocks == {2, 3} and b.seq == 6
    state["blocks"], state["log"] = {9}, [(9, True)]  # a restarted server: its log is behind our seq
    await backends.poll_once(b)
    assert b.blocks == {9} and b.seq == 1
    b.expect([5, 9])  # just sent there: counted until a poll says otherwise
    assert b.has(5) and b.has(9) and not b.has(6)
    await client.aclose()


async def test_backends_from_dns_follow_the_names_addresses():
    backends = Backends([], poll_interval=0.01, dns="localhost:9")
    await backends.start()
    try:
        for _ in range(200):
            if backends.by_url:
                break
            await asyncio.sleep(0.01)
        assert "http://127.0.0.1:9" in backends.by_url or "http://[::1]:9" in backends.by_url
        backends.set_urls(["http://127.0.0.2:9"])
        assert list(backends.by_url) == ["http://127.0.0.2:9"]
    finally:
        await backends.stop()
