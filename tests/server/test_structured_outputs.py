"""Structured outputs over HTTP: one real `shoal serve` on a tiny random-weight model, the
official `openai` client, and jsonschema / re as the judges. The model writes garbage, so
whatever parses and validates does so because of the grammar."""

from __future__ import annotations

import concurrent.futures
import json
import re

import httpx
import jsonschema
import pytest

from engine_helpers import make_tiny_model
from server_helpers import served

SCHEMAS = [
    {"type": "object", "additionalProperties": False, "required": ["name", "age"],
     "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0, "maximum": 150}}},
    {"type": "object", "additionalProperties": False, "required": ["color", "ok", "none"],
     "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}, "none": {"type": "null"}}},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 4},
    {"type": "object", "additionalProperties": False, "required": ["point", "tags"],
     "properties": {"point": {"type": "object", "additionalProperties": False, "required": ["x", "y"],
                              "properties": {"x": {"type": "number", "minimum": -10, "maximum": 10},
                                             "y": {"type": "number", "minimum": 0, "maximum": 1}}},
                    "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2}}},
    {"type": "object", "additionalProperties": False, "required": ["code", "word"],
     "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}, "word": {"type": "string", "minLength": 2, "maxLength": 5}}},
    {"type": "object", "additionalProperties": False, "required": ["kind", "r"],
     "properties": {"kind": {"const": "circle"}, "r": {"type": "integer", "minimum": 1, "maximum": 99}}},
]
SAMPLING = [dict(temperature=0), dict(temperature=1.0, seed=1), dict(temperature=1.3, seed=7)]
CHAT = [{"role": "user", "content": "Describe a thing as JSON."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, builtin_dir):
    model = make_tiny_model(tmp_path_factory.mktemp("tiny-structured"), builtin_dir)
    with served([str(model), "--kv-cache-memory", "64MiB"]) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


@pytest.fixture
def h(server):
    with server.http() as c:
        yield c


def _valid(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)  # json.loads is strict: no raw control characters


def _all(calls):
    """Run the calls at once (the engine batches them) and return their results in order."""
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda call: call(), calls))


def test_json_schema_outputs_validate(client, model):
    calls, schemas = [], []
    for schema in SCHEMAS:
        for sampling in SAMPLING:
            fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}
            calls.append(lambda s=sampling, f=fmt: client.chat.completions.create(
                model=model, messages=CHAT, max_tokens=300, response_format=f, **s).choices[0])
            calls.append(lambda s=sampling, sc=schema: client.completions.create(
                model=model, prompt="JSON:", max_tokens=300, extra_body={"structured_outputs": {"json": sc}}, **s).choices[0])
            schemas += [schema, schema]
    for choice, schema in zip(_all(calls), schemas):
        assert choice.finish_reason == "stop", choice
        _valid(choice.message.content if hasattr(choice, "message") else choice.text, schema)


def test_streaming_json_schema_and_json_object(client, model):
    schema = SCHEMAS[3]
    for fmt, check in (({"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}, lambda v: jsonschema.validate(v, schema)),
                       ({"type": "json_object"}, lambda v: isinstance(v, dict) or pytest.fail(repr(v)))):
        # json_object: a random model would write keys forever; a bias toward "}" and '"' lets it close (the grammar
        # still rules: "}" is the favourite from the first token, yet the text starts with "{"; and a first token
        # '{"' opens a key, where "}" alone would go on forever and '"' ends it)
        closing = ({str(t): 30 for t in _ids(client, model, "}") + _ids(client, model, '"')}
                   if fmt["type"] == "json_object" else None)
        stream = client.chat.completions.create(model=model, messages=CHAT, max_tokens=300, stream=True, seed=3, temperature=1.0,
                                                response_format=fmt, logit_bias=closing)
        text, finish = "", None
        for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        assert finish == "stop", text
        check(json.loads(text))
        plain = client.chat.completions.create(model=model, messages=CHAT, max_tokens=300, seed=3, temperature=1.0,
                                               response_format=fmt, logit_bias=closing)
        assert plain.choices[0].message.content == text  # the same seed, streamed or not


def _ids(client, model, text: str) -> list[int]:
    r = httpx.post(str(client.base_url).replace("/v1/", "/tokenize"), json={"prompt": text, "add_special_tokens": False})
    return r.json()["tokens"]


def test_regex_choice_grammar_and_guided_spellings(client, model):
    regex, choices = r"[a-z]{3}-\d{2,4}", ["alpha", "beta", "gamma delta"]
    grammar = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x"'
    cases = [({"structured_outputs": {"regex": regex}}, lambda t: re.fullmatch(regex, t)),
             ({"guided_regex": regex, "guided_decoding_backend": "xgrammar"}, lambda t: re.fullmatch(regex, t)),
             ({"structured_outputs": {"choice": choices}}, lambda t: t in choices),
             ({"guided_choice": choices, "guided_decoding_backend": "auto"}, lambda t: t in choices),
             ({"guided_grammar": grammar}, lambda t: re.fullmatch(r"\((?:[0-9x])(?:,[0-9x])*\)", t)),
             ({"guided_json": SCHEMAS[5]}, lambda t: jsonschema.validate(json.loads(t), SCHEMAS[5]) or True)]
    calls = [lambda b=body, s=sampling: client.completions.create(model=model, prompt="Answer:", max_tokens=200, extra_body=b, **s).choices[0]
             for body, _ in cases for sampling in SAMPLING]
    checks = [(body, ok) for body, ok in cases for _ in SAMPLING]
    for choice, (body, ok) in zip(_all(calls), checks):
        assert choice.finish_reason == "stop" and ok(choice.text), (body, choice.text)


def test_n_sequences_each_follow_the_grammar(client, model):
    r = client.completions.create(model=model, prompt="x", max_tokens=300, n=3, temperature=1.0, seed=11,
                                  extra_body={"structured_outputs": {"json": SCHEMAS[0]}})
    assert len(r.choices) == 3
    for c in r.choices:
        _valid(c.text, SCHEMAS[0])


def _detok(client, ids: list[int]) -> str:
    return httpx.post(str(client.base_url).replace("/v1/", "/detokenize"), json={"tokens": ids}).json()["prompt"]


def _tokens(client, model, **kw) -> list[str]:
    """The completion's tokens, as the server's logprobs name them."""
    c = client.completions.create(model=model, prompt="hi", logprobs=0, **kw)
    return c.choices[0].logprobs.tokens


def test_logit_bias_allowed_token_ids_and_bad_words(client, model):
    forced = 4321
    got = _tokens(client, model, max_tokens=6, temperature=1.0, seed=0, logit_bias={str(forced): 100})
    assert got == [_detok(client, [forced])] * 6
    free = _tokens(client, model, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    first = _ids(client, model, free[0])
    assert len(first) == 1 and _detok(client, first) == free[0]
    banned = _tokens(client, model, max_tokens=8, temperature=0, logit_bias={str(first[0]): -100}, extra_body={"ignore_eos": True})
    assert free[0] not in banned and banned != free
    allowed = [300, 301, 302, 5000, 6000]
    names = {_detok(client, [t]) for t in allowed}
    got = _tokens(client, model, max_tokens=20, temperature=1.0, seed=5, extra_body={"allowed_token_ids": allowed})
    assert len(got) == 20 and set(got) <= names, got
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=20, temperature=1.0, seed=5, logprobs=True,
                                       extra_body={"allowed_token_ids": allowed})
    assert {t.token for t in r.choices[0].logprobs.content} <= names
    word = free[0].strip()
    assert word
    got = _tokens(client, model, max_tokens=8, temperature=0, extra_body={"ignore_eos": True, "bad_words": [word]})
    assert got != free
    for text in (word, " " + word):
        bad = [_detok(client, [t]) for t in _ids(client, model, text)]
        assert not any(got[i:i + len(bad)] == bad for i in range(len(got))), (word, got)


@pytest.mark.parametrize("body, param", [
    ({"guided_json": {"type": "object", "properties": 5}}, "guided_json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}}, "response_format"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs"),
    ({"guided_choice": ["a"], "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, None),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"logit_bias": {"49152": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"five": 1}}, "logit_bias"),
    ({"allowed_token_ids": [1, 10**6]}, "allowed_token_ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
])
def test_bad_requests_are_400_and_the_server_goes_on(h, body, param):
    for endpoint, base in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": CHAT})):
        r = h.post(endpoint, json={**base, "max_tokens": 4, **body})
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"]
        if param is not None:
            assert err["param"] == param, err
        assert "Traceback" not in err["message"]
    ok = h.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "guided_choice": ["fine"]})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "fine"
