"""`shoal serve --engine-core-process` against the session's server (the engine on a thread,
the same flags otherwise), both real servers talked to over HTTP with the `openai` client:
the same streams; a disconnect frees the core's blocks; /metrics and /kv/blocks report from
the core's messages as the thread backend reports from its engine; LoRA adapters load and
unload over HTTP; a killed core fails the in-flight request and /health."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from engine_helpers import lora_prompts, make_lora_models, peft_greedy
from server_helpers import metric, served

PROMPT = "The three most important inventions in history are"


@pytest.fixture(scope="module")
def core_server():
    with served(["--engine-core-process"]) as s:
        yield s


def stream_completion(client, **body) -> dict:
    """{index: (text, finish_reason, logprob tokens)} of a streamed completion."""
    got: dict[int, list] = {}
    for chunk in client.completions.create(stream=True, **body):
        for c in chunk.choices:
            text, finish, tokens = got.get(c.index, ("", None, []))
            got[c.index] = (text + c.text, c.finish_reason or finish, tokens + (c.logprobs.tokens if c.logprobs else []))
    return got


def stream_chat(client, **body) -> tuple[str, str]:
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **body):
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, finish


def read_events(lines, count: int) -> None:
    """Read a stream's lines until `count` data events have come."""
    for line in lines:
        count -= line.startswith("data: ")
        if not count:
            return
    raise AssertionError("the stream ended early")


def test_streams_equal_the_thread_backend(server, core_server, model_name):
    thread, core = server.openai(timeout=300), core_server.openai(timeout=300)
    text = thread.completions.create(model=model_name, prompt=PROMPT, max_tokens=40, temperature=0, extra_body={"ignore_eos": True}).choices[0].text
    assert len(text) > 30
    bodies = [
        dict(max_tokens=40, temperature=0, logprobs=2),
        dict(max_tokens=40, temperature=0, stop=[text[12:15]], extra_body={"ignore_eos": True}),
        dict(max_tokens=40, temperature=0, stop=[text[20:26]], extra_body={"ignore_eos": True, "include_stop_str_in_output": True}),
        dict(max_tokens=30, temperature=0.9, seed=5, extra_body={"ignore_eos": True}),
        dict(max_tokens=30, temperature=0.9, seed=6, n=2, stop=[" the", "."], extra_body={"ignore_eos": True}),
    ]
    stopped = 0
    for body in bodies:
        want = stream_completion(thread, model=model_name, prompt=PROMPT, **body)
        assert stream_completion(core, model=model_name, prompt=PROMPT, **body) == want, body
        stopped += sum(finish == "stop" for _, finish, _ in want.values())
    assert stopped >= 3  # the stop strings were met, not just max_tokens
    chat = dict(model=model_name, messages=[{"role": "user", "content": "Name a large animal."}], max_tokens=30, temperature=0)
    assert stream_chat(core, **chat) == stream_chat(thread, **chat)


def test_a_disconnect_mid_stream_frees_the_cores_blocks(core_server):
    url = core_server.base_url
    body = {"prompt": PROMPT * 5, "max_tokens": 700, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=url, timeout=120) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            lines = r.iter_lines()
            read_events(lines, 2)
            load = c.get("/kv/blocks").json()["load"]
            assert load["running"] == 1 and load["kv_cache_usage"] > 0
        deadline = time.monotonic() + 60  # the disconnect is seen, the abort reaches the core, its next message tells
        while (load := c.get("/kv/blocks").json()["load"])["kv_cache_usage"] > 0 or load["running"]:
            assert time.monotonic() < deadline, load
            time.sleep(0.2)
    assert metric(url, "shoal_num_requests_running") == 0 and metric(url, "shoal_kv_cache_usage_perc") == 0


def test_metrics_and_kv_blocks_from_messages_equal_the_thread_backend(server, core_server, model_name):
    """The same new prompt on both servers: the prefix cache's new block hashes (the core's
    reach /kv/blocks through its messages) and the token counters' increments are equal."""
    prompt = "A fresh prompt for the block events test: " + " ".join(f"w{i}" for i in range(120))
    seen = {}
    for s in (server, core_server):
        with s.http() as c:
            before = c.get("/kv/blocks").json()
            counters = [metric(s.base_url, "shoal_prompt_tokens_total"), metric(s.base_url, "shoal_generation_tokens_total")]
            out = c.post("/v1/completions", json={"model": model_name, "prompt": prompt, "max_tokens": 40, "temperature": 0,
                                                  "ignore_eos": True}).json()
            after = c.get("/kv/blocks", params={"since": before["seq"], "epoch": before["epoch"]}).json()
            assert not after["reset"] and not after["removed"]
            grew = [metric(s.base_url, "shoal_prompt_tokens_total") - counters[0], metric(s.base_url, "shoal_generation_tokens_total") - counters[1]]
            assert grew == [out["usage"]["prompt_tokens"], out["usage"]["completion_tokens"]]
            seen[s.base_url] = (sorted(after["stored"]), grew, out["choices"][0]["text"])
    (thread_blocks, *thread_rest), (core_blocks, *core_rest) = seen.values()
    assert len(core_blocks) >= 160 // 16 and core_blocks == thread_blocks and core_rest == thread_rest


# -- a server of its own: LoRA adapters over HTTP, then the core killed under a request --------

@pytest.fixture(scope="module")
def lora_server(tmp_path_factory, builtin_dir):
    root = tmp_path_factory.mktemp("core-lora")
    base, adapters = make_lora_models(root, builtin_dir, count=2)
    with served([str(base), "--served-model-name", "tiny", "--enable-lora", "--max-loras", "2", "--engine-core-process"],
                clean_exit=False) as s:
        yield s, base, adapters


def complete(client, model, prompt, max_tokens=8):
    out = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                    extra_body={"min_tokens": max_tokens, "return_token_ids": True})
    return out.choices[0].token_ids


def test_lora_adapters_load_and_unload_over_http(lora_server):
    import openai

    server, base, adapters = lora_server
    client, prompt = server.openai(timeout=300), lora_prompts()[1]
    with server.http(timeout=300) as http:
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(adapters["a0"])})
        assert r.status_code == 200, r.text
        cards = {m.id: m for m in client.models.list().data}
        assert cards["a"].root == str(adapters["a0"]) and cards["a"].parent == "tiny"
        assert complete(client, "a", prompt) == peft_greedy(base, adapters["a0"], [prompt], 8)[0]
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(adapters["a1"])})
        assert r.status_code == 400 and "already loaded" in r.json()["error"]["message"]
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(adapters["a1"]), "load_inplace": True})
        assert r.status_code == 200, r.text
        assert complete(client, "a", prompt) == peft_greedy(base, adapters["a1"], [prompt], 8)[0]
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(base / "missing")})
        assert r.status_code == 404 and "no PEFT adapter" in r.json()["error"]["message"]
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 200
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 404
        with pytest.raises(openai.NotFoundError):
            complete(client, "a", prompt)
        assert complete(client, "tiny", prompt) == peft_greedy(base, None, [prompt], 8)[0]


def core_pid(server_pid: int) -> int:
    """The server's engine-core child (multiprocessing's spawn runs it as `spawn_main`)."""
    for task in os.listdir(f"/proc/{server_pid}/task"):
        with open(f"/proc/{server_pid}/task/{task}/children") as f:
            for pid in map(int, f.read().split()):
                with open(f"/proc/{pid}/cmdline", "rb") as c:
                    if b"spawn_main" in c.read():
                        return pid
    raise AssertionError("no engine-core process under the server")


def test_a_killed_core_fails_the_request_in_flight_and_health(lora_server):
    server = lora_server[0]
    pid = core_pid(server.proc.pid)
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with server.http(timeout=120) as c:
        assert c.get("/health").status_code == 200
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            lines = r.iter_lines()
            read_events(lines, 2)
            os.kill(pid, signal.SIGKILL)
            rest = list(lines)
        assert any('"error"' in line and "engine core process exited" in line for line in rest), rest[-3:]
        assert not any('"finish_reason":' in line and '"finish_reason":null' not in line for line in rest)  # it did not end well
        health = c.get("/health")
        assert health.status_code == 503 and "engine core process exited" in health.text
        assert c.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2}).status_code == 503
