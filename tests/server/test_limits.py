"""Issue 15 on a small server of its own: honest queue bounds, the log (one format, probes
quiet, refusals and a periodic stats line), a second SIGTERM; the ready gauge after the
engine died; `shoal serve --help` and vLLM's flag spellings."""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import threading
import time

import httpx
import pytest

from server_helpers import free_port, metric, served

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def small():
    with served(["--max-num-seqs", "2", "--max-waiting", "4", "--log-stats-interval", "0.5", "--max-model-len", "512"],
                env={"SHOAL_ACCESS_LOG": "1"}, clean_exit=False) as s:
        yield s


def _burst(base_url: str, bodies: list[dict]) -> list[httpx.Response]:
    async def main():
        async with httpx.AsyncClient(base_url=base_url, timeout=300) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies))

    return asyncio.run(main())


def _wait_idle(base_url: str) -> None:
    deadline = time.monotonic() + 60
    while metric(base_url, "shoal_num_requests_running", model_name=MODEL) or metric(base_url, "shoal_num_requests_waiting", model_name=MODEL):
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_an_idle_server_takes_max_num_seqs_plus_max_waiting(small):
    """--max-num-seqs 2 --max-waiting 4: six at once on an idle server all run or wait
    (before: the fifth got 503); the seventh and eighth are refused with 503 + Retry-After."""
    _wait_idle(small.base_url)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 6, "ignore_eos": True}
    codes = sorted(r.status_code for r in _burst(small.base_url, [body] * 6))
    assert codes == [200] * 6, codes
    _wait_idle(small.base_url)
    rs = _burst(small.base_url, [body] * 8)
    assert sorted(r.status_code for r in rs) == [200] * 6 + [503] * 2
    assert all(r.headers["retry-after"] and r.json()["error"]["code"] == "queue_full" for r in rs if r.status_code == 503)


def test_many_prompts_in_one_request(small):
    """One request with five prompts fits an idle server (before: 503 'retry later', which no
    retry could satisfy); one with more than max_num_seqs + max_waiting can never fit: 400."""
    _wait_idle(small.base_url)
    ok = httpx.post(small.base_url + "/v1/completions", json={"prompt": ["a", "b", "c", "d", "e"], "max_tokens": 2}, timeout=300)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 5, ok.text
    never = httpx.post(small.base_url + "/v1/completions", json={"prompt": ["a"] * 7, "max_tokens": 2}, timeout=300)
    assert never.status_code == 400 and "retry-after" not in never.headers, never.text
    assert "at most 6" in never.json()["error"]["message"]


def test_one_log_format_quiet_probes_refusals_and_stats(small):
    for _ in range(3):
        for path in ("/health", "/ready", "/metrics"):
            assert httpx.get(small.base_url + path).status_code == 200
    r = httpx.post(small.base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "temperature": -1}, headers={"X-Request-Id": "limits-7"})
    assert r.status_code == 400
    httpx.post(small.base_url + "/v1/completions", json={"prompt": "Hi there", "max_tokens": 8, "ignore_eos": True}, timeout=300)
    time.sleep(1.2)
    log = small.log()
    line_re = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: ")
    lines = [x for x in log.splitlines() if x.strip() and "Dequantizing" not in x]
    assert any("uvicorn" in x for x in lines) and any("shoal.server" in x for x in lines)
    odd = [x for x in lines if not line_re.match(x)]
    assert not odd, odd[:5]  # uvicorn's lines and Shoal's share one format
    access = [x for x in lines if "uvicorn.access" in x]
    assert any('"POST /v1/completions HTTP/1.1" 200' in x for x in access), access[-5:]
    assert not [x for x in access if re.search(r'"GET /(health|ready|metrics) ', x)], "probes are logged at INFO"
    refusal = [x for x in lines if "request_id=limits-7" in x]
    assert refusal and " 400 POST /v1/completions " in refusal[0] and "temperature" in refusal[0]
    stats = [x for x in lines if "Avg generation throughput" in x]
    assert stats and re.search(r"Running: \d+ reqs, Waiting: \d+ reqs, KV cache usage: [\d.]+%", stats[-1]), stats[-3:]
    assert any(float(re.search(r"generation throughput: ([\d.]+)", x).group(1)) > 0 for x in stats)


def test_second_sigterm_exits_at_once(small):
    """Last in this module: it ends the server. The first SIGTERM drains (streams go on),
    the second exits at once with 128 + 15."""
    started = threading.Event()

    def stream():
        try:
            with httpx.stream("POST", small.base_url + "/v1/completions", timeout=300,
                              json={"prompt": "Once", "max_tokens": 400, "ignore_eos": True, "stream": True}) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        started.set()
        except httpx.HTTPError:
            pass

    threads = [threading.Thread(target=stream) for _ in range(2)]
    for t in threads:
        t.start()
    assert started.wait(120)
    small.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while httpx.get(small.base_url + "/ready").status_code != 503:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    small.proc.send_signal(signal.SIGTERM)
    rc = small.proc.wait(30)
    for t in threads:
        t.join(30)
    assert rc == 128 + signal.SIGTERM, rc  # killed by the signal, not exited 0 after the drain
    assert "second SIGTERM while draining: exiting now" in small.log()


# ------------------------------------------------------------------ the ready gauge after the engine died
class _DyingEngine:
    """An engine whose first step raises (as a device that went away): the loop dies."""

    def __init__(self, config):
        from shoal.runtime.models.loader import load_tokenizer, resolve_model

        self.tokenizer = load_tokenizer(resolve_model(config.model))
        self.max_model_len, self.vocab_size, self.requests = 256, 49152, {}

    def stats(self):
        from shoal.runtime.engine.engine import EngineStats

        return EngineStats(len(self.requests), 0, 0.0, 0, 0, 0, 0, 0)

    def add_request(self, rid, prompt, params, arrival_time=None, lora=None):
        self.requests[rid] = prompt

    def abort_request(self, rid):
        self.requests.pop(rid, None)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def group_ready(self):
        return True

    def step(self):
        raise RuntimeError("injected: the device went away")


@contextlib.contextmanager
def in_process_server(state, ready_within: float):
    """uvicorn serving build_asgi(state) on a free port in a thread; yields the base URL once /ready is 200."""
    import uvicorn

    from shoal.runtime.entrypoints.server import build_asgi

    _, asgi = build_asgi(state)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(asgi, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_within
        while True:
            try:
                if httpx.get(url + "/ready").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "never ready"
            time.sleep(0.1)
        yield url
    finally:
        server.should_exit = True
        thread.join(30)


def test_ready_gauge_turns_0_when_the_engine_dies():
    from shoal.runtime.config import EngineConfig
    from shoal.runtime.entrypoints.server import ServerState

    state = ServerState(EngineConfig(), engine_factory=_DyingEngine, log_stats_interval=0)
    with in_process_server(state, ready_within=120) as url:
        assert metric(url, "shoal_ready", model_name=MODEL) == 1
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed", r.text
        assert httpx.get(url + "/ready").status_code == 503 and httpx.get(url + "/health").status_code == 503
        assert metric(url, "shoal_ready", model_name=MODEL) == 0  # before: stayed 1


# ------------------------------------------------------------------ shoal serve --help, vLLM spellings
def _serve_parser():
    import argparse

    from shoal.runtime.entrypoints import serve_args

    p = argparse.ArgumentParser(prog="shoal serve", formatter_class=serve_args.HelpFormatter)
    serve_args.add_arguments(p)
    return p


def test_every_serve_flag_has_help_and_a_default():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "shoal.runtime.cli", "serve", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    from shoal.runtime.entrypoints.serve_args import HelpFormatter

    for action in _serve_parser()._actions:
        if action.dest in ("help",):
            continue
        assert action.help, f"{action.option_strings or action.dest} has no help text"
        if action.nargs != 0:  # every flag that takes a value (and MODEL) says what it defaults to
            assert "default" in HelpFormatter("shoal")._get_help_string(action), action.option_strings or action.dest
    text = " ".join(out.stdout.split())
    for needle in ("--max-num-seqs MAX_NUM_SEQS most sequences in the running batch (default: 256)", "--port PORT", "(default: 8000)",
                   "--dtype", "(default: auto)", "-tp", "--gpu-memory-utilization", "--chat-template", "--allowed-origins"):
        assert needle in text, needle


def test_vllm_spellings_parse():
    from shoal.runtime.entrypoints import serve_args

    args = _serve_parser().parse_args(["--gpu-memory-utilization", "0.8", "--device", "cuda", "--max-logprobs", "5", "--root-path", "/api",
                                       "--allowed-origins", '["https://a.example"]', "--chat-template", "{{ messages[0]['content'] }}"])
    serve_args._resolve_vllm_spellings(args)
    assert args.kv_cache_memory == 0.8 and args.max_logprobs == 5 and args.root_path == "/api"
    assert args.allowed_origins == ["https://a.example"] and args.chat_template_text.startswith("{{")
    cpu = _serve_parser().parse_args(["--gpu-memory-utilization", "0.8"])
    serve_args._resolve_vllm_spellings(cpu)
    assert cpu.kv_cache_memory is None  # on CPU it is ignored (with a warning)
    with pytest.raises(SystemExit):
        serve_args._resolve_vllm_spellings(_serve_parser().parse_args(["--gpu-memory-utilization", "1.5"]))
    assert _serve_parser().parse_args(["--allowed-origins", "https://a,https://b"]).allowed_origins == ["https://a", "https://b"]


def test_a_request_failing_inside_the_engine_is_a_500_and_the_engine_lives(monkeypatch):
    """Sampling that raises for one request (an injected bug) fails that request with a 500;
    a request beside it in the batch and the next ones are served."""
    import asyncio as aio

    from shoal.runtime.config import EngineConfig
    from shoal.runtime.entrypoints.server import ServerState
    from shoal.runtime.layers import sampler

    real = sampler.sample_tokens

    def sample_tokens(logits, m, native=None):  # the request with seed 424242
        if m.seeds is not None and bool((m.seeds == 424242).any()):
            raise RuntimeError("injected sampling bug")
        return real(logits, m)

    monkeypatch.setattr(sampler, "sample_tokens", sample_tokens)
    state = ServerState(EngineConfig(max_model_len=256, kv_cache_memory=2**26, max_num_seqs=4), log_stats_interval=0)
    with in_process_server(state, ready_within=300) as url:
        async def both():
            async with httpx.AsyncClient(base_url=url, timeout=120) as c:
                return await aio.gather(
                    c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 8, "ignore_eos": True, "temperature": 0.5, "seed": 424242}),
                    c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 8, "ignore_eos": True, "temperature": 0.5, "seed": 1}))

        bad, good = asyncio.run(both())
        assert bad.status_code == 500 and bad.json()["error"]["code"] == "request_failed", bad.text
        assert "injected sampling bug" in bad.json()["error"]["message"]
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 8
        assert httpx.get(url + "/health").status_code == 200 and httpx.get(url + "/ready").status_code == 200
        again = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=120)
        assert again.status_code == 200
        assert metric(url, "shoal_request_success_total", model_name=MODEL, finished_reason="error") == 1


def test_not_accepting_between_engine_ready_and_on_loaded():
    """The engine thread marks itself ready before on_loaded runs on the event loop (which
    builds the tokenizer pool): in between, requests get 503 model_loading, not a 500."""
    from shoal.runtime.config import EngineConfig
    from shoal.runtime.entrypoints.errors import APIError
    from shoal.runtime.entrypoints.state import ServerState

    state = ServerState(EngineConfig(), log_stats_interval=0)
    state.engine.state, state.engine._thread = "ready", threading.current_thread()
    with pytest.raises(APIError) as e:
        state.check_accepting()
    assert e.value.status == 503 and e.value.code == "model_loading"
    assert state.ready() == (False, "loading the model")
