"""Issue 34: streams measured as vLLM's are measured, over real HTTP.

guidellm's exact request (stream_options.continuous_usage_stats) is served, with a running
usage on every chunk; a chat stream's first chunk leaves only once the first token exists;
one SSE event per token, or per --stream-interval tokens; GET /tokenizer_info in vLLM's shape."""

from __future__ import annotations

import json

import httpx
import pytest

from server_helpers import metric, served, start_server

CHAT = [{"role": "user", "content": "Tell me about the sea."}]


def events(c: httpx.Client, path: str, body: dict) -> list[dict]:
    """The stream's JSON events, in order (the [DONE] line checked and dropped)."""
    with c.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


# ------------------------------------------------------------------ guidellm 0.8.1's request
def guidellm_body(endpoint: str, model: str, tokens: int) -> dict:
    """What guidellm 0.8.1's OpenAI backend sends (backends/openai/request_handlers.py, format)
    for a streamed request with a fixed output length."""
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if endpoint == "chat":
        body.update(max_completion_tokens=tokens, stop=None, ignore_eos=True, messages=CHAT)
    else:
        body.update(max_tokens=tokens, stop=None, ignore_eos=True, prompt="The harbour at dawn")
    return body


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_guidellm_request_gets_a_running_usage_on_every_chunk(http, model_name, endpoint):
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    got = events(http, path, guidellm_body(endpoint, model_name, 9))
    *chunks, last = got
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 9
    prompt = last["usage"]["prompt_tokens"]
    counts = []
    for c in chunks:
        u = c["usage"]
        assert u["prompt_tokens"] == prompt and u["total_tokens"] == prompt + u["completion_tokens"]
        counts.append(u["completion_tokens"])
    assert counts == sorted(counts) and counts[-1] == 9
    # the same prompt counted the way /tokenize counts it (an independent path through the server)
    if endpoint == "completions":
        assert prompt == http.post("/tokenize", json={"prompt": "The harbour at dawn"}).json()["count"]
    else:
        assert prompt == http.post("/tokenize", json={"messages": CHAT}).json()["count"]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and counts[0] == 0


def test_continuous_usage_stats_alone_adds_nothing(http):
    """vLLM reads continuous_usage_stats only together with include_usage."""
    got = events(http, "/v1/completions", {"prompt": "Hi", "max_tokens": 3, "stream": True,
                                           "stream_options": {"continuous_usage_stats": True}})
    assert all("usage" not in c for c in got)


# ------------------------------------------------------------------ the first chunk waits for the first token
def test_the_chat_role_chunk_comes_with_the_first_token(server, http, model_name):
    """A long prompt takes a while to prefill. When the client reads the stream's first chunk
    with `choices`, the first token must already exist: the server's own TTFT histogram (it
    counts a request when its first token is sampled) has counted this request by then.
    Before, the role chunk left at admission, before the prefill had begun."""
    before = metric(server.base_url, "shoal_time_to_first_token_seconds_count", model_name=model_name) or 0
    long_prompt = [{"role": "user", "content": "The tide turns twice a day along the harbour wall. " * 90}]
    body = {"messages": long_prompt, "max_tokens": 2, "stream": True, "temperature": 0}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                first = json.loads(line[len("data: "):])
                counted = metric(server.base_url, "shoal_time_to_first_token_seconds_count", model_name=model_name)
                break
        rest = [line for line in lines if line.startswith("data: ")]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert counted == before + 1, "the role chunk arrived before the first token was sampled"
    assert rest[-1] == "data: [DONE]"


# ------------------------------------------------------------------ one event per token, or per interval
def token_events(c: httpx.Client, endpoint: str, tokens: int) -> tuple[list[list[int]], str, list[int]]:
    """Per content event its token ids (return_token_ids), the streamed text, and the whole
    answer's token ids from the same request unstreamed."""
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    body = {"max_tokens": tokens, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    body.update(messages=CHAT) if endpoint == "chat" else body.update(prompt="Once upon a time")
    got = events(c, path, dict(body, stream=True))
    per_event, text = [], ""
    for e in got:
        choice = e["choices"][0]
        piece = choice["delta"].get("content", "") if endpoint == "chat" else choice["text"]
        if endpoint == "chat" and "role" in choice["delta"]:
            assert choice["token_ids"] == []  # the role chunk carries no token
            continue
        per_event.append(choice["token_ids"])
        text += piece
    whole = c.post(path, json=body).json()["choices"][0]
    return per_event, text, whole["token_ids"]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_one_event_per_token_by_default(http, endpoint):
    per_event, text, ids = token_events(http, endpoint, 12)
    assert [t for e in per_event for t in e] == ids and len(ids) == 12
    assert [len(e) for e in per_event] == [1] * 12
    assert text == http.post("/detokenize", json={"tokens": ids}).json()["prompt"]


@pytest.fixture(scope="module")
def interval_server():
    with served(["--stream-interval", "4"]) as s:
        yield s


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_stream_interval_4_sends_four_tokens_an_event(interval_server, endpoint):
    with httpx.Client(base_url=interval_server.base_url, timeout=300) as c:
        per_event, text, ids = token_events(c, endpoint, 14)
        assert [t for e in per_event for t in e] == ids and len(ids) == 14
        # the first token at once, then 4 at a time, the rest with the last
        assert [len(e) for e in per_event] == [1, 4, 4, 4, 1]
        assert text == c.post("/detokenize", json={"tokens": ids}).json()["prompt"]


def test_stream_interval_must_be_positive():
    s = start_server(["--stream-interval", "0"], wait_ready=False)
    assert s.proc.wait(120) != 0 and "--stream-interval" in s.log()


# ------------------------------------------------------------------ /tokenizer_info
def test_tokenizer_info_in_vllms_shape(http, builtin_dir):
    from transformers import AutoTokenizer

    info = http.get("/tokenizer_info")
    assert info.status_code == 200
    got = info.json()
    tok = AutoTokenizer.from_pretrained(builtin_dir)
    assert got["tokenizer_class"] == type(tok).__name__
    assert got["chat_template"] == tok.chat_template
    for name in ("eos_token", "bos_token", "model_max_length"):
        if getattr(tok, name, None) is not None and name in tok.init_kwargs:
            assert got[name] == (getattr(tok, name)), name
    assert not any(k.endswith("_file") for k in got)
