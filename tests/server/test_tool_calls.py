"""Tool calling end to end: the official `openai` client against real `shoal serve` processes
on a tiny random-weight model started with --enable-auto-tool-choice --tool-call-parser hermes
(one per module), and the session's server (no tool flags) for what "auto" needs.

A random model writes no tool calls, so here the answer must be exactly what the Hermes parser
makes of the raw text the same prompt gives on /v1/completions (the prompt taken from /tokenize
with the same tools): the tools reach the prompt, plain text stays content, streamed and not.
The parse-to-tool_calls path on known text is test_tool_render.py; forcing is
test_tool_choice_forced.py. Every refusal is a 400 in OpenAI's shape and the server goes on."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from engine_helpers import make_tiny_model
from openai.lib.streaming.chat import ChatCompletionStreamState
from server_helpers import served

from shoal.runtime.entrypoints.tool_parsers import get_tool_parser

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a zone", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_ST = st.just(WEATHER)
ROUND_TRIP = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees and sunny"},
]
GREEDY = dict(max_tokens=24, temperature=0)


@pytest.fixture(scope="module")
def tools_server(tmp_path_factory, builtin_dir):
    path = make_tiny_model(tmp_path_factory.mktemp("tiny-tools"), builtin_dir)
    with served([str(path), "--max-num-seqs", "8", "--kv-cache-memory", "64MiB", "--max-model-len", "1024",
                 "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]) as s:
        yield s


@pytest.fixture(scope="module")
def oai(tools_server):
    return tools_server.openai()


@pytest.fixture(scope="module")
def model(oai):
    return oai.models.list().data[0].id


def tokenize(server, messages, tools=None) -> list[int]:
    body = {"messages": messages, **({"tools": tools} if tools else {})}
    r = httpx.post(server.base_url + "/tokenize", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def raw_text(oai, model, ids) -> tuple[str, str]:
    """What the model writes after this prompt: /v1/completions on the token ids, greedy."""
    c = oai.completions.create(model=model, prompt=ids, **GREEDY).choices[0]
    return c.text, c.finish_reason


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def expected(text: str, finish: str):
    got = get_tool_parser("hermes")().extract(text)
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got.tool_calls]
    return got.content, calls, ("tool_calls" if calls and finish == "stop" else finish)


def test_tools_reach_the_prompt_and_plain_text_stays_content(tools_server, oai, model):
    ids = tokenize(tools_server, ASK, TOOLS)
    prompt = oai.completions.create(model=model, prompt=ids, max_tokens=1).usage  # same ids, same count
    assert prompt.prompt_tokens == len(ids)
    text = httpx.post(tools_server.base_url + "/detokenize", json={"tokens": ids}, timeout=60).json()["prompt"]
    for tool in TOOLS:  # the shipped Hermes template lists each tool (the tiny model has SmolLM2's template)
        assert json.dumps(tool) in text
    assert len(tokenize(tools_server, ASK)) < len(ids)

    raw, finish = raw_text(oai, model, ids)
    out = oai.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="auto", **GREEDY)
    assert out.usage.prompt_tokens == len(ids)
    choice = out.choices[0]
    assert (choice.message.content, calls_of(choice.message), choice.finish_reason) == expected(raw, finish)
    if "<tool_call>" not in raw:  # what a random model writes: all of it is content
        assert choice.message.content == raw and not choice.message.tool_calls


def test_stream_adds_up_to_the_whole_answer(oai, model):
    whole = oai.chat.completions.create(model=model, messages=ASK, tools=TOOLS, **GREEDY)  # tool_choice left out: auto
    chunks = list(oai.chat.completions.create(model=model, messages=ASK, tools=TOOLS, stream=True,
                                              stream_options={"include_usage": True}, **GREEDY))
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(chunk)
    a, b = state.current_completion_snapshot.choices[0], whole.choices[0]  # (get_final_completion refuses "length")
    assert (a.message.content, calls_of(a.message), a.finish_reason) == (b.message.content, calls_of(b.message), b.finish_reason)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])
    assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason) == 1


def test_tool_turns_round_trip_into_the_template(tools_server, oai, model):
    ids = tokenize(tools_server, ROUND_TRIP, TOOLS)
    text = httpx.post(tools_server.base_url + "/detokenize", json={"tokens": ids}, timeout=60).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n22 degrees and sunny\n</tool_response>" in text
    raw, finish = raw_text(oai, model, ids)
    out = oai.chat.completions.create(model=model, messages=ROUND_TRIP, tools=TOOLS, **GREEDY)
    assert out.usage.prompt_tokens == len(ids)
    c = out.choices[0]
    assert (c.message.content, calls_of(c.message), c.finish_reason) == expected(raw, finish)


def test_tool_choice_none_offers_no_tools(tools_server, oai, model):
    ids = tokenize(tools_server, ASK)
    raw, finish = raw_text(oai, model, ids)
    out = oai.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="none", **GREEDY)
    assert out.usage.prompt_tokens == len(ids)  # the model's own template, no tools in it
    assert (out.choices[0].message.content, out.choices[0].finish_reason) == (raw, finish)
    assert not out.choices[0].message.tool_calls


BAD = [
    ("no function name", dict(tools=[{"type": "function", "function": {"description": "x"}}]), "tools"),
    ("parameters not an object", dict(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]), "tools"),
    ("duplicate names", dict(tools=[WEATHER, WEATHER]), "tools"),
    ("unsupported tool type", dict(tools=[{"type": "code_interpreter"}]), "tools"),
    ("unknown function", dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    ("required without tools", dict(tool_choice="required"), "tool_choice"),
    ("named without tools", dict(tools=[], tool_choice={"type": "function", "function": {"name": "get_weather"}}), "tool_choice"),
    ("unknown tool_choice", dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
    ("tool_calls on a user turn", dict(messages=[{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}]), "messages"),
]


@pytest.mark.parametrize("what,body,param", BAD, ids=[b[0] for b in BAD])
def test_bad_tool_requests_are_400_and_the_server_goes_on(tools_server, oai, model, what, body, param):
    r = httpx.post(tools_server.v1 + "/chat/completions", json={"model": model, "messages": ASK, "max_tokens": 2, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error" and err["param"] == param
    with pytest.raises(openai.BadRequestError):  # the official client sees the same refusal
        oai.chat.completions.create(model=model, **{"messages": ASK, "max_tokens": 2, **body})
    assert oai.chat.completions.create(model=model, messages=ASK, max_tokens=2).choices[0].message.role == "assistant"


JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 3) | st.text(max_size=6),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)
FUNCTION = st.fixed_dictionaries({}, optional={"name": st.sampled_from(["f", "get_weather", ""]) | JSON, "parameters": JSON,
                                                 "description": JSON})
TOOL = st.fixed_dictionaries({}, optional={"type": st.sampled_from(["function", "x"]) | JSON, "function": FUNCTION | JSON})
CHOICE = st.sampled_from(["none", "auto", "required"]) | JSON | st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries({}, optional={"name": st.sampled_from(["f", "get_weather"]) | JSON})})
CALL = st.fixed_dictionaries({}, optional={"type": JSON, "function": FUNCTION | JSON, "id": JSON})
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool"]), "content": st.text(max_size=8) | st.none()},
                                optional={"tool_calls": st.lists(CALL, max_size=2), "tool_call_id": st.text(max_size=4)})


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(tools=st.none() | st.lists(TOOL | WEATHER_ST, max_size=3), choice=st.none() | CHOICE, parallel=st.none() | st.booleans(),
       messages=st.lists(MESSAGE, min_size=1, max_size=3), stream=st.booleans())
def test_junk_tool_fields_are_400_never_5xx(tools_server, model, tools, choice, parallel, messages, stream):
    body = {"model": model, "messages": messages, "max_tokens": 2, "stream": stream}
    for key, value in (("tools", tools), ("tool_choice", choice), ("parallel_tool_calls", parallel)):
        if value is not None:
            body[key] = value
    r = httpx.post(tools_server.v1 + "/chat/completions", json=body, timeout=60)
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_auto_needs_the_flag(client, model_name):
    """The session's server runs without --enable-auto-tool-choice: "auto" is refused as vLLM does."""
    for kw in (dict(tool_choice="auto"), {}):  # left out with tools, tool_choice is "auto"
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model_name, messages=ASK, tools=TOOLS, max_tokens=2, **kw)
        assert "--enable-auto-tool-choice" in str(e.value)
    out = client.chat.completions.create(model=model_name, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=2)
    assert out.choices[0].message.role == "assistant" and not out.choices[0].message.tool_calls
