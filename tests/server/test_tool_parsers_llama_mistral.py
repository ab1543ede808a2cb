"""The llama3_json and mistral tool-call parsers without a server, as test_tool_parsers.py checks
hermes: the text each family writes (written here from the calls, the reference) parses back
to those calls, whole and streamed; every chunking adds up to the whole answer; text that is no
call stays content, nothing lost; parallel_tool_calls: false keeps the first call."""

from __future__ import annotations

import json
import random
import re

import pytest

from shoal.runtime.entrypoints.tool_parsers import get_tool_parser, tool_parser_names
from shoal.runtime.entrypoints.tool_parsers.base import assemble
from shoal.runtime.entrypoints.tool_parsers.choice import ToolChoice

from test_tool_parsers import random_args

Llama, Mistral = get_tool_parser("llama3_json"), get_tool_parser("mistral")
MISTRAL_ID = re.compile(r"^[A-Za-z0-9]{9}$")


def llama_text(calls, rng: random.Random) -> str:
    """Llama 3.x: maybe <|python_tag|>, the call objects ("parameters", or "arguments"), ';' between."""
    key = rng.choice(["parameters", "arguments"])
    objs = [json.dumps({"name": n, key: a}, ensure_ascii=False, separators=rng.choice([(", ", ": "), (",", ":")])) for n, a in calls]
    return rng.choice(["", "<|python_tag|>"]) + rng.choice(["; ", ";", ";\n"]).join(objs)


def mistral_text(prefix: str, calls, rng: random.Random, v11: bool) -> str:
    if v11:  # [TOOL_CALLS]name[ARGS]{...} per call
        body = "".join(f"[TOOL_CALLS]{n}{rng.choice(['', '[ARGS]'])}{json.dumps(a, ensure_ascii=False)}" for n, a in calls)
    else:  # [TOOL_CALLS] [{"name", "arguments"}, ...]
        body = "[TOOL_CALLS] " + json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)
    return prefix + (" " if prefix else "") + body


def calls_of(extracted) -> tuple:
    return extracted.content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in extracted.tool_calls]


def raw(extracted) -> tuple:
    return extracted.content, [(c["function"]["name"], c["function"]["arguments"]) for c in extracted.tool_calls]


def streamed(cls, text: str, sizes, **kw):
    parser, deltas, i = cls(**kw), [], 0
    for size in sizes:
        if i >= len(text):
            break
        deltas += parser.feed(text[i:i + size])
        i += size
    deltas += parser.feed(text[i:]) + parser.finish()
    return deltas, assemble(deltas)


def chunkings(text: str, rng: random.Random):
    return [[1] * len(text), [len(text)]] + [[rng.randint(1, 9) for _ in text] for _ in range(3)]


def test_names_are_vllms():
    assert {"hermes", "llama3_json", "mistral"} <= set(tool_parser_names())


def test_llama_calls_every_chunking_adds_up_to_the_whole():
    rng = random.Random(5)
    for _ in range(80):
        calls = [(rng.choice(["get_weather", "f", "x_y"]), random_args(rng)) for _ in range(rng.randint(1, 3))]
        text = llama_text(calls, rng)
        whole = Llama().extract(text)
        assert calls_of(whole) == (None, calls), text
        for sizes in chunkings(text, rng):
            deltas, got = streamed(Llama, text, sizes)
            assert raw(got) == raw(whole), (text, sizes)
            assert all(set(d) in ({"content"}, {"tool_calls"}) for d in deltas)


@pytest.mark.parametrize("text", [
    "The weather in Paris is sunny.",
    '  {"answer": 42, "why": "}"}',  # a JSON answer that is no call
    'Sure: {"name": "f", "parameters": {}}',  # a call must open the answer (vLLM's streaming rule)
    "<|python_tag|>brave_search.call(query=\"x\")",  # Llama's built-in tools: not JSON
    '{"name": "f", "parameters": "not an object"}',
    '{"name": "f", "parame',  # cut off in the header
    "<|python",
    "   ",
])
def test_llama_text_that_is_no_call_stays_content(text):
    assert raw(Llama().extract(text)) == (text, [])
    rng = random.Random(len(text))
    for sizes in chunkings(text, rng):
        assert raw(streamed(Llama, text, sizes)[1]) == (text, [])


def test_llama_other_shapes_truncation_and_trailing_text():
    got = Llama().extract('<|python_tag|>{"type": "function", "name": "f", "parameters": {"a": 1}}')
    assert calls_of(got) == (None, [("f", {"a": 1})])
    got = Llama().extract('{"name": "f", "parameters": {"a": [1, 2')  # max_tokens: the call keeps what it has
    assert raw(got) == (None, [("f", '{"a": [1, 2')])
    got = Llama().extract('{"name": "f", "parameters": {}}\n\nDone.')
    assert raw(got) == ("Done.", [("f", "{}")])


def test_mistral_calls_every_chunking_adds_up_to_the_whole():
    rng = random.Random(9)
    for trial in range(80):
        calls = [(rng.choice(["get_weather", "f", "x_y"]), random_args(rng)) for _ in range(rng.randint(1, 3))]
        prefix = rng.choice(["", "Sure.", "Let me [check] that", "a [TOOL_CALL b"])
        text = mistral_text(prefix, calls, rng, v11=trial % 2 == 0)
        whole = Mistral().extract(text)
        assert calls_of(whole) == (prefix or None, calls), text
        assert all(MISTRAL_ID.match(c["id"]) for c in whole.tool_calls)
        for sizes in chunkings(text, rng):
            deltas, got = streamed(Mistral, text, sizes)
            assert raw(got) == raw(whole), (text, sizes)


@pytest.mark.parametrize("text", [
    "No tools needed: [1, 2] and {x}.",
    "[TOOL_CALL] is not the tag",
    '[TOOL_CALLS] [{"name": 3, "arguments": {}}]',
    '[TOOL_CALLS] ["f"]',
    "Cut off here [TOOL_CALLS] [ ",
    "[TOOL_CALLS]get_wea",  # a v11 name cut off before its arguments
    "[TOOL_CALLS]",
])
def test_mistral_text_that_is_no_call_stays_content(text):
    assert raw(Mistral().extract(text)) == (text, [])
    rng = random.Random(len(text))
    for sizes in chunkings(text, rng):
        assert raw(streamed(Mistral, text, sizes)[1]) == (text, [])


def test_mistral_truncation_and_text_after_calls():
    got = Mistral().extract('[TOOL_CALLS]f[ARGS]{"a": "x", "b": [')
    assert raw(got) == (None, [("f", '{"a": "x", "b": [')])
    got = Mistral().extract('[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]\nAnything else?')
    assert calls_of(got) == ("Anything else?", [("f", {"a": 1})])


@pytest.mark.parametrize("cls,text", [
    (Llama, '{"name": "a", "parameters": {"i": 1}}; {"name": "b", "parameters": {}}; {"name": "c", "parameters": {}}'),
    (Mistral, '[TOOL_CALLS]a{"i": 1}[TOOL_CALLS]b{}[TOOL_CALLS]c{}'),
    (Mistral, '[TOOL_CALLS] [{"name": "a", "arguments": {"i": 1}}, {"name": "b", "arguments": {}}]'),
])
def test_max_calls_keeps_the_first(cls, text):
    assert calls_of(cls(max_calls=1).extract(text)) == (None, [("a", {"i": 1})])
    assert calls_of(streamed(cls, text, [3] * len(text), max_calls=1)[1]) == (None, [("a", {"i": 1})])


def test_mistral_requests_keep_special_tokens():
    tools = [{"type": "function", "function": {"name": "f"}}]
    for name, keeps in (("mistral", True), ("hermes", False), ("llama3_json", False)):
        assert ToolChoice("auto", tools, parser=get_tool_parser(name)).keeps_special_tokens() is keeps
    assert ToolChoice("none", tools).keeps_special_tokens() is False


FUZZ_PIECES = ["[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "{", "}", "[", "]", ",", ";", " ", "\n", '"', '\\"', "f", "x y",
               '{"name": "f", "arguments": {', '{"name": "g", "parameters": {"a": 1}}', '"name"', ":", "get_weather"]


@pytest.mark.parametrize("cls", [Llama, Mistral])
def test_any_text_streams_as_it_parses_whole(cls):
    """Fuzz: whatever the model writes, the stream adds up to the whole answer, for any chunking."""
    rng = random.Random(21)
    for _ in range(300):
        text = "".join(rng.choice(FUZZ_PIECES) for _ in range(rng.randint(0, 14)))
        whole = raw(cls().extract(text))
        for sizes in ([1] * len(text), [rng.randint(1, 6) for _ in text]):
            assert raw(streamed(cls, text, sizes)[1]) == whole, (text, sizes)


@pytest.mark.parametrize("name,text", [
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'),
    ("mistral", 'Checking. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time{}'),
])
async def test_the_renderer_streams_them_as_openai_reads_them(name, text):
    """The real Renderer on a fake engine's output: the `openai` client's own stream accumulator
    adds the chunks up to the calls, finish_reason "tool_calls"."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk
    from test_tool_render import make_job

    from shoal.runtime.entrypoints.openai_render import Renderer
    from shoal.runtime.entrypoints.tool_parsers.output import ToolOutput

    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("get_weather", "get_time")]
    for seed in range(3):
        job = make_job({0: text}, seed)
        response = Renderer(job.state, job, 0, chat=True, logprobs=None, tools=ToolOutput(ToolChoice("auto", tools, parser=get_tool_parser(name)))).stream([])
        events = [e[len("data: "):] for e in "".join([p async for p in response.body_iterator]).split("\n\n") if e]
        acc = ChatCompletionStreamState()
        for e in events[:-1]:
            acc.handle_chunk(ChatCompletionChunk.model_validate(json.loads(e)))
        choice = acc.current_completion_snapshot.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
        assert (choice.message.content or None) == ("Checking." if name == "mistral" else None)  # the role chunk carries ""
        assert all(MISTRAL_ID.match(c.id) for c in choice.message.tool_calls) == (name == "mistral")
