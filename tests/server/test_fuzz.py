"""Property-based fuzz of request bodies: whatever a client sends, the server answers with a
status below 500 (errors in OpenAI's shape) and keeps serving."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# Values of every JSON type, including ones no field wants.
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12), st.sampled_from(["", "\x00", "\ud7ff", "😀", "<|im_end|>", "0", "-1"]),
)
junk = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=6)
small_int = st.one_of(st.integers(-3, 4), junk)
prob = st.one_of(st.floats(-1.5, 2.5, allow_nan=False), st.sampled_from([0, 1, 1e-9, 1e9, -1e9]), junk)
# max_tokens stays small when it is a valid number, so each example costs a few decode steps.
max_tokens = st.one_of(st.integers(-2, 3), st.sampled_from(["4", 1.0, 2.5, None, True]), junk.filter(lambda v: not (isinstance(v, int) and v > 3)))
prompt = st.one_of(
    st.text(max_size=20), st.lists(st.text(max_size=8), max_size=3), st.lists(st.integers(-5, 60000), max_size=6),
    st.lists(st.lists(st.integers(0, 50000), max_size=4), max_size=2), junk,
)
message = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "developer"]), junk)},
    optional={"content": st.one_of(st.text(max_size=20), st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=8)}), max_size=2), junk), "name": junk},
)
common = {
    "model": st.one_of(st.just("smollm2-135m-instruct"), junk),
    "n": small_int, "temperature": prob, "top_p": prob, "top_k": small_int, "min_p": prob,
    "presence_penalty": prob, "frequency_penalty": prob, "repetition_penalty": prob,
    "seed": st.one_of(st.integers(-(2**65), 2**65), junk), "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3), junk),
    "stop_token_ids": st.one_of(st.lists(st.integers(-3, 60000), max_size=3), junk), "ignore_eos": st.one_of(st.booleans(), junk),
    "min_tokens": small_int, "priority": st.one_of(st.integers(-(2**65), 2**65), junk), "stream": st.one_of(st.booleans(), junk),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.one_of(st.booleans(), junk)}), junk),
    "logit_bias": junk, "user": junk, "skip_special_tokens": junk,
    "structured_outputs": junk, "guided_json": junk, "guided_regex": junk, "guided_choice": junk, "guided_decoding_backend": junk,
    "allowed_token_ids": st.one_of(st.lists(st.integers(-3, 60000), max_size=3), junk), "bad_words": junk,
}
completion_body = st.fixed_dictionaries({}, optional={**common, "prompt": prompt, "max_tokens": max_tokens, "response_format": junk, "logprobs": small_int, "echo": junk, "best_of": small_int, "suffix": junk})
chat_body = st.fixed_dictionaries(
    {"max_tokens": max_tokens},
    optional={**common, "messages": st.one_of(st.lists(message, max_size=3), junk), "max_completion_tokens": max_tokens, "logprobs": st.one_of(st.booleans(), junk),
              "top_logprobs": small_int, "tools": junk, "response_format": junk},
)
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


def _check(resp: httpx.Response, body) -> None:
    assert resp.status_code < 500, f"{resp.status_code} for {json.dumps(body)[:400]}: {resp.text[:400]}"
    if resp.status_code >= 400:
        err = resp.json()["error"]
        assert isinstance(err["message"], str) and err["message"] and "type" in err, resp.text
    elif resp.headers.get("content-type", "").startswith("text/event-stream"):
        assert resp.text.rstrip().endswith("data: [DONE]"), resp.text[-300:]
    else:
        assert "choices" in resp.json()


@pytest.fixture(scope="module")
def fuzz_http(server):
    with server.http() as c:
        yield c


@FUZZ
@given(body=completion_body)
def test_fuzz_completions(fuzz_http, body):
    _check(fuzz_http.post("/v1/completions", json=body), body)


@FUZZ
@given(body=chat_body)
def test_fuzz_chat(fuzz_http, body):
    _check(fuzz_http.post("/v1/chat/completions", json=body), body)


@FUZZ
@given(body=junk)
def test_fuzz_any_json(fuzz_http, body):
    for path in ("/v1/completions", "/v1/chat/completions"):
        _check(fuzz_http.post(path, json=body), body)


RAW_BODIES = [
    b"", b"{", b"null", b"[]", b"\xff\xfe", b'{"prompt": "x", "max_tokens": 1,}', b'{"prompt": NaN, "max_tokens": 1}',
    b'{"prompt": "x", "max_tokens": 1, "temperature": Infinity}', b'{"prompt": "x", "max_tokens": 1e400}',
    b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "n": 100000}',
    b'{"prompt": "x", "max_tokens": 1, "n": "many", "messages": "x"}', b'{"prompt": {"$ref": "x"}}',
]


@pytest.mark.parametrize("raw", RAW_BODIES, ids=range(len(RAW_BODIES)))
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_raw_bodies(fuzz_http, path, raw):
    resp = fuzz_http.post(path, content=raw, headers={"content-type": "application/json"})
    assert 400 <= resp.status_code < 500, resp.text
    assert resp.json()["error"]["message"]


def test_body_size_cap_and_unknown_paths(fuzz_http):
    big = b'{"prompt": "' + b"a" * (9 * 2**20) + b'"}'
    resp = fuzz_http.post("/v1/completions", content=big, headers={"content-type": "application/json"})
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the cap applies while reading
        for _ in range(10):
            yield b"a" * 2**20

    resp = fuzz_http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert resp.status_code == 413
    assert fuzz_http.get("/v1/nothing").status_code == 404
    assert fuzz_http.get("/v1/nothing").json()["error"]["message"]
    assert fuzz_http.get("/v1/completions").status_code == 405
    assert fuzz_http.get("/health").status_code == 200
