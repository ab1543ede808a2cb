"""Many clients at once, and clients that leave: the batch and the KV cache come back empty."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from server_helpers import metric

MODEL = "smollm2-135m-instruct"


def _wait_idle(base_url: str, timeout: float = 120) -> tuple[float, float]:
    deadline = time.monotonic() + timeout
    while True:
        running = metric(base_url, "shoal_num_requests_running", model_name=MODEL)
        waiting = metric(base_url, "shoal_num_requests_waiting", model_name=MODEL)
        kv = metric(base_url, "shoal_kv_cache_usage_perc", model_name=MODEL)
        if (running, waiting, kv) == (0, 0, 0) or time.monotonic() > deadline:
            return running, kv
        time.sleep(0.2)


async def _stream_and_leave(base_url: str, path: str, body: dict, chunks_before_leaving: int) -> int:
    got = 0
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as c:
        async with c.stream("POST", path, json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    got += 1
                    if got >= chunks_before_leaving:
                        break  # closing the stream drops the connection
    return got


def test_disconnect_mid_stream_frees_everything(server):
    long = {"model": MODEL, "max_tokens": 400, "ignore_eos": True, "stream": True}

    async def main():
        return await asyncio.gather(
            _stream_and_leave(server.base_url, "/v1/completions", dict(long, prompt="Tell me a story"), 3),
            _stream_and_leave(server.base_url, "/v1/completions", dict(long, prompt="Write a poem", n=2), 2),
            _stream_and_leave(server.base_url, "/v1/chat/completions", dict(long, messages=[{"role": "user", "content": "Explain gravity"}]), 3),
        )

    got = asyncio.run(main())
    assert all(g >= 2 for g in got)
    running, kv = _wait_idle(server.base_url, timeout=60)
    assert running == 0 and kv == 0, f"running={running} kv={kv} after clients left"
    assert metric(server.base_url, "shoal_request_success_total", model_name=MODEL, finished_reason="abort") >= 3


def test_disconnect_non_streaming_frees_everything(server):
    body = {"model": MODEL, "prompt": "Count to a thousand:", "max_tokens": 1000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=3))
    running, kv = _wait_idle(server.base_url, timeout=60)
    assert running == 0 and kv == 0


def test_200_concurrent_streaming_clients(server):
    clients, max_tokens = 200, 4

    async def one(c: httpx.AsyncClient, i: int):
        body = {"model": MODEL, "prompt": f"Item {i}:", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
                "stream": True, "logprobs": 0, "stream_options": {"include_usage": True}}
        tokens, usage, finish, done = 0, None, None, False
        async with c.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200, await resp.aread()
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for ch in chunk["choices"]:
                    if ch["logprobs"]:
                        tokens += len(ch["logprobs"]["tokens"])
                    finish = ch["finish_reason"] or finish
        return tokens, usage, finish, done

    async def main():
        limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=600, limits=limits) as c:
            return await asyncio.gather(*(one(c, i) for i in range(clients)))

    t0 = time.monotonic()
    results = asyncio.run(main())
    elapsed = time.monotonic() - t0
    assert len(results) == clients
    for tokens, usage, finish, done in results:
        assert done and finish == "length"
        assert tokens == max_tokens and usage["completion_tokens"] == max_tokens
    running, kv = _wait_idle(server.base_url, timeout=30)
    assert running == 0 and kv == 0
    print(f"{clients} streaming clients x {max_tokens} tokens in {elapsed:.1f}s")
